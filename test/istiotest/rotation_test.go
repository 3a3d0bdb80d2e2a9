package istiotest

import (
	"bytes"
	"context"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
	"github.com/redirector-mesh/redirector/pkg/identity/istioca"
	"github.com/redirector-mesh/redirector/test/kubetest"
)

// pluginCA is what istiod's plug-in CA directory (ROOT_CA_DIR, the cacerts Secret) holds:
// the certificate and key that sign, the chain above it, and the mesh's roots.
type pluginCA struct {
	cert  *x509.Certificate
	key   crypto.Signer
	chain []*x509.Certificate // above cert, its root included (cert-chain.pem is cert and these)
	roots []*x509.Certificate // root-cert.pem
}

// write puts the files in dir, each renamed into place: istiod watches the directory and
// reloads 100 ms after the last event.
func (p pluginCA) write(t *testing.T, dir string) {
	t.Helper()
	stage := t.TempDir()
	files := []struct {
		name string
		data []byte
	}{
		{"root-cert.pem", identitytest.CertPEM(p.roots...)},
		{"cert-chain.pem", identitytest.CertPEM(append([]*x509.Certificate{p.cert}, p.chain...)...)},
		{"ca-cert.pem", identitytest.CertPEM(p.cert)},
		{"ca-key.pem", identitytest.KeyPEM(t, p.key)},
	}
	for _, f := range files {
		tmp := filepath.Join(stage, f.name)
		if err := os.WriteFile(tmp, f.data, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, f.name)); err != nil {
			t.Fatal(err)
		}
	}
}

// newRoot makes a self-signed root named name.
func newRoot(t *testing.T, name string) (*x509.Certificate, crypto.Signer) {
	key := identitytest.NewKey(t, "ecdsa")
	return identitytest.MakeCACert(t, pkix.Name{Organization: []string{"cluster.local"}, CommonName: name}, key, nil, nil), key
}

// startPluginIstiod runs istiod on the plug-in CA in dir with multi-root support
// (ISTIO_MULTIROOT_MESH), as a root rotation needs, and a pod of service account web on
// node1; it returns istiod and a token of node1's agent.
func startPluginIstiod(t *testing.T, dir string) (*Istiod, kubernetes.Interface, string) {
	t.Setenv("ROOT_CA_DIR", dir)
	t.Setenv("ISTIO_MULTIROOT_MESH", "true")
	cluster := kubetest.Start(t)
	cs := cluster.Client(t)
	istiod := Start(t, cluster, Options{TrustedNodeAccounts: []string{agentAccount}})
	if _, err := cs.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	CreatePod(t, cs, "shop", "web", "web", "node1", "10.1.1.2")
	return istiod, cs, AgentToken(t, cs, agentAccount, "node1", Audience)
}

// newRootAndIntermediate makes root name and an intermediate it signed, for a plug-in CA.
func newRootAndIntermediate(t *testing.T, name string) (root, inter *x509.Certificate, interKey crypto.Signer) {
	root, rootKey := newRoot(t, "Root "+name)
	interKey = identitytest.NewKey(t, "ecdsa")
	inter = identitytest.MakeCACert(t, pkix.Name{Organization: []string{"cluster.local"}, CommonName: "Intermediate " + name}, interKey, root, rootKey)
	return root, inter, interKey
}

// pluginMesh is istiod on a plug-in CA, the node's bundle file as istiod
// published it, and an identity manager asking istiod through client.
type pluginMesh struct {
	cs         kubernetes.Interface
	bundlePath string
	bundle     *identity.Bundle
	client     *istioca.Client
	m          *identity.Manager
}

// startPluginMesh starts istiod on the plug-in CA in dir (startPluginIstiod),
// waits for it to publish exactly roots, and starts a manager with opts
// (its signer, trust and, if unset, a TTL of an hour filled in), all ended
// with the test.
func startPluginMesh(t *testing.T, dir string, opts identity.ManagerOptions, roots ...*x509.Certificate) pluginMesh {
	t.Helper()
	istiod, cs, token := startPluginIstiod(t, dir)
	bundlePath := filepath.Join(t.TempDir(), "root-cert.pem")
	publishedRoots(t, cs, bundlePath, roots...)
	bundle, err := identity.LoadBundle(bundlePath, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	client, err := istioca.New(istioca.Config{Addr: istiod.Addr, TokenFile: token, ClusterID: ClusterID, Trust: bundle})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	opts.Signer, opts.Trust = client, bundle
	if opts.TTL == 0 {
		opts.TTL = time.Hour
	}
	m := identity.New(opts)
	t.Cleanup(m.Close)
	return pluginMesh{cs: cs, bundlePath: bundlePath, bundle: bundle, client: client, m: m}
}

// waitIssued adds id to m and waits (30 s at most) for its first certificate.
func waitIssued(t *testing.T, m *identity.Manager, id identity.ID) {
	t.Helper()
	m.Add(id)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := m.Wait(ctx, id); err != nil {
		t.Fatal(err)
	}
}

// publishedRoots waits until istiod's istio-ca-root-cert holds exactly want, and writes it to
// path, as the kubelet updates the agent's mount of that ConfigMap.
func publishedRoots(t *testing.T, cs kubernetes.Interface, path string, want ...*x509.Certificate) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var last string
	err := poll(ctx, func() error {
		cm, err := cs.CoreV1().ConfigMaps(Namespace).Get(ctx, "istio-ca-root-cert", metav1.GetOptions{})
		if err != nil {
			return err
		}
		last = cm.Data["root-cert.pem"]
		got, err := identity.ParseCertificates([]byte(last))
		if err != nil {
			return err
		}
		if len(got) != len(want) {
			return fmt.Errorf("%d roots published, want %d", len(got), len(want))
		}
		for i := range got {
			if !got[i].Equal(want[i]) {
				return fmt.Errorf("root %d is %s, want %s", i, got[i].Subject, want[i].Subject)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("istiod's published roots: %v", err)
	}
	if err := os.WriteFile(path, []byte(last), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestIstiodRootRotation rotates istiod's plug-in CA to a new root as Istio's multi-root
// rotation does: first root-cert.pem holds the old and the new root while a new
// intermediate under the new root signs, then the old root is removed. The agent's
// certificate and its connection to istiod follow: peers' certificates under either root verify
// during the overlap and the kept one is not renewed for it; once the old root is gone, the
// certificate issued under it is renewed at once (not at half its lifetime), through a new
// connection to istiod, whose serving certificate under the old root no longer verifies, and a
// peer under the old root is refused.
func TestIstiodRootRotation(t *testing.T) {
	dir := t.TempDir()
	rootA, interA, interAKey := newRootAndIntermediate(t, "A")
	rootB, interB, interBKey := newRootAndIntermediate(t, "B")
	pluginCA{cert: interA, key: interAKey, chain: []*x509.Certificate{rootA}, roots: []*x509.Certificate{rootA}}.write(t, dir)

	mesh := startPluginMesh(t, dir, identity.ManagerOptions{}, rootA)
	cs, bundlePath, bundle, client, m := mesh.cs, mesh.bundlePath, mesh.bundle, mesh.client, mesh.m
	web := identity.ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "web"}
	waitIssued(t, m, web)
	issuer := func() (string, string) {
		for _, c := range m.Snapshot() {
			if c.ID == web {
				return c.Issuer, c.Serial
			}
		}
		return "", ""
	}
	if is, _ := issuer(); is != interA.Subject.String() {
		t.Fatalf("first certificate issued by %q, want %q", is, interA.Subject)
	}

	// The overlap: both roots, the new intermediate signs.
	pluginCA{cert: interB, key: interBKey, chain: []*x509.Certificate{rootB}, roots: []*x509.Certificate{rootA, rootB}}.write(t, dir)
	publishedRoots(t, cs, bundlePath, rootA, rootB)
	if _, err := bundle.Reload(); err != nil {
		t.Fatal(err)
	}
	_, serialA := issuer()
	certA, err := m.Certificate(web)
	if err != nil {
		t.Fatal(err)
	}
	var underB *tls.Certificate
	deadline := time.Now().Add(30 * time.Second)
	for underB == nil {
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		cert, err := client.Sign(sctx, web, time.Hour)
		scancel()
		switch {
		case err != nil:
			t.Logf("during the overlap: %v", err)
		case bytes.Equal(cert.Leaf.RawIssuer, interB.RawSubject):
			underB = cert
		}
		if underB == nil && time.Now().After(deadline) {
			t.Fatalf("istiod issued no certificate under the new intermediate during the overlap (last: %v)", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if _, s := issuer(); s != serialA {
		t.Errorf("the kept certificate under the old root, still trusted, was renewed for the overlap")
	}
	// A peer presenting either is taken during the overlap.
	for name, c := range map[string]*tls.Certificate{"old root": certA, "new root": underB} {
		if err := m.Reverify(presented(t, c), x509.ExtKeyUsageClientAuth); err != nil {
			t.Errorf("peer under the %s during the overlap: %v", name, err)
		}
	}

	// The old root leaves: the certificate under it is renewed at once.
	pluginCA{cert: interB, key: interBKey, chain: []*x509.Certificate{rootB}, roots: []*x509.Certificate{rootB}}.write(t, dir)
	publishedRoots(t, cs, bundlePath, rootB)
	if _, err := bundle.Reload(); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(30 * time.Second)
	for {
		is, _ := issuer()
		if is == interB.Subject.String() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("certificate still issued by %q 30s after its root was removed: %+v", is, m.Snapshot())
		}
		time.Sleep(200 * time.Millisecond)
	}
	if _, err := m.Certificate(web); err != nil {
		t.Errorf("after the rotation: %v", err)
	}
	// And a peer under the old root is refused from then on.
	if err := m.Reverify(presented(t, certA), x509.ExtKeyUsageClientAuth); err == nil {
		t.Error("peer under the removed root still verifies")
	}
	if err := m.Reverify(presented(t, underB), x509.ExtKeyUsageClientAuth); err != nil {
		t.Errorf("peer under the new root: %v", err)
	}
}

// presented is what a handshake with a peer presenting c gives to verify.
func presented(t *testing.T, c *tls.Certificate) tls.ConnectionState {
	t.Helper()
	cs := tls.ConnectionState{HandshakeComplete: true}
	for _, der := range c.Certificate {
		x, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatal(err)
		}
		cs.PeerCertificates = append(cs.PeerCertificates, x)
	}
	return cs
}

// TestIstiodAnswerWithTheMeshRoots: istiod's answer ends with its whole root-cert.pem, every
// trust anchor of a multi-root mesh (ISTIO_MULTIROOT_MESH; here six, the clusters of a mesh
// that did not share a root), after the chain that its cert-chain.pem flattens, its root
// included. The agent presents the leaf and the intermediate only, well within
// identity.MaxChainLen; the roots it drops must not count against that bound. Before, the
// answer's nine certificates were refused as a chain over eight, and the pod had no
// certificate at all.
func TestIstiodAnswerWithTheMeshRoots(t *testing.T) {
	dir := t.TempDir()
	root, rootKey := newRoot(t, "Root")
	interKey := identitytest.NewKey(t, "ecdsa")
	inter := identitytest.MakeCACert(t, pkix.Name{Organization: []string{"cluster.local"}, CommonName: "Intermediate"}, interKey, root, rootKey)
	roots := []*x509.Certificate{root}
	for i := range 5 {
		r, _ := newRoot(t, fmt.Sprintf("Root of cluster %d", i+2))
		roots = append(roots, r)
	}
	pluginCA{cert: inter, key: interKey, chain: []*x509.Certificate{root}, roots: roots}.write(t, dir)

	m := startPluginMesh(t, dir, identity.ManagerOptions{}, roots...).m
	web := identity.ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "web"}
	waitIssued(t, m, web)
	for _, c := range m.Snapshot() {
		if c.ID == web && (len(c.Chain) != 2 || c.Chain[1].Subject != inter.Subject.String()) {
			t.Errorf("presented chain %+v, want the leaf and the intermediate", c.Chain)
		}
	}
}

// TestIstiodOutageThroughExpiry: istiod stops while a certificate of 20 s is in use. The
// certificate is served until its chain ends, never past it (the handshake then fails
// closed, naming the expiry and the CA's error), and once istiod is back the identity has a
// certificate again on its own, within its backoff.
func TestIstiodOutageThroughExpiry(t *testing.T) {
	cluster := kubetest.Start(t)
	cs := cluster.Client(t)
	istiod := Start(t, cluster, Options{TrustedNodeAccounts: []string{agentAccount}})
	if _, err := cs.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	CreatePod(t, cs, "shop", "web", "web", "node1", "10.1.1.2")
	bundle, err := identity.LoadBundle(istiod.RootCertFile, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	client, err := istioca.New(istioca.Config{Addr: istiod.Addr, TokenFile: AgentToken(t, cs, agentAccount, "node1", Audience), ClusterID: ClusterID, Trust: bundle})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	const ttl = 20 * time.Second
	m := identity.New(identity.ManagerOptions{Signer: client, Trust: bundle, TTL: ttl})
	defer m.Close()
	web := identity.ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "web"}
	m.Add(web)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := m.Wait(ctx, web); err != nil {
		t.Fatal(err)
	}
	istiod.Stop()
	cert, err := m.Certificate(web)
	if err != nil {
		t.Fatalf("right after istiod stopped: %v", err)
	}
	end := cert.Leaf.NotAfter
	// Served while it lasts (renewals failing meanwhile), refused once it ended.
	for time.Now().Before(end.Add(-2 * time.Second)) {
		if _, err := m.Certificate(web); err != nil {
			t.Fatalf("%s before its end, istiod down: %v", time.Until(end).Round(time.Second), err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	time.Sleep(time.Until(end) + time.Second)
	_, err = m.Certificate(web)
	if err == nil || !strings.Contains(err.Error(), "expired") || !strings.Contains(err.Error(), "renewal failing") {
		t.Fatalf("after its end, istiod down: err = %v, want an expiry naming the failing renewal", err)
	}
	t.Logf("refused as expected: %v", err)

	istiod.Restart(t)
	deadline := time.Now().Add(45 * time.Second) // the backoff (at most 30 s) and gRPC's reconnect
	for {
		if _, err := m.Certificate(web); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("no certificate 45 s after istiod came back: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestIstiodRotationAheadOfTheBundle: istiod's plug-in CA switches to an intermediate under a
// new root (root-cert.pem with both) before the node's copy of istio-ca-root-cert has the new
// root, as when the kubelet is still to update the ConfigMap's volume. A new pod's identity is
// refused meanwhile (its chain ends at a root the node does not trust yet); once the bundle
// brings the root, it is asked for again at once, not when its backoff (30 s at most; an hour
// here) ends.
func TestIstiodRotationAheadOfTheBundle(t *testing.T) {
	dir := t.TempDir()
	rootA, interA, interAKey := newRootAndIntermediate(t, "A")
	rootB, interB, interBKey := newRootAndIntermediate(t, "B")
	pluginCA{cert: interA, key: interAKey, chain: []*x509.Certificate{rootA}, roots: []*x509.Certificate{rootA}}.write(t, dir)

	mesh := startPluginMesh(t, dir, identity.ManagerOptions{BackoffMin: time.Hour}, rootA)
	cs, bundlePath, bundle, m := mesh.cs, mesh.bundlePath, mesh.bundle, mesh.m
	CreatePod(t, cs, "shop", "cart", "cart", "node1", "10.1.1.3")
	web := identity.ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "web"}
	cart := identity.ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "cart"}
	waitIssued(t, m, web)

	// istiod rotates; the node's bundle still holds the old root only.
	pluginCA{cert: interB, key: interBKey, chain: []*x509.Certificate{rootB}, roots: []*x509.Certificate{rootA, rootB}}.write(t, dir)
	publishedRoots(t, cs, filepath.Join(t.TempDir(), "later.pem"), rootA, rootB)
	m.Add(cart)
	deadline := time.Now().Add(30 * time.Second)
	for {
		var st identity.CertInfo
		for _, c := range m.Snapshot() {
			if c.ID == cart {
				st = c
			}
		}
		if st.State == identity.StateFailing {
			if !strings.Contains(st.LastError, "does not verify to the trust bundle") {
				t.Fatalf("refused for another reason: %s", st.LastError)
			}
			break
		}
		if st.State == identity.StateValid {
			t.Fatal("issued under the new root before the node trusts it")
		}
		if time.Now().After(deadline) {
			t.Fatalf("cart is %s", st.State)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := m.Ready(web); err != nil {
		t.Errorf("the kept certificate meanwhile: %v", err)
	}

	// The kubelet catches up.
	publishedRoots(t, cs, bundlePath, rootA, rootB)
	if _, err := bundle.Reload(); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(15 * time.Second)
	for {
		c, err := m.Certificate(cart)
		if err == nil {
			if !bytes.Equal(c.Leaf.RawIssuer, interB.RawSubject) {
				t.Errorf("cart's certificate issued by %s, want %s", c.Leaf.Issuer, interB.Subject)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no certificate 15 s after the bundle brought the new root: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
