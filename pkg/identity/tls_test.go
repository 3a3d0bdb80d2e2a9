package identity

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
)

func pemCert(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

type handshakeResult struct {
	client, server       *tls.Conn
	clientErr, serverErr error
}

// handshake runs a TLS handshake over loopback TCP (kernel buffers, so a
// side that fails early never blocks the other) and returns both ends.
func handshake(t *testing.T, clientCfg, serverCfg *tls.Config) handshakeResult {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	type accepted struct {
		conn *tls.Conn
		err  error
	}
	done := make(chan accepted, 1)
	go func() {
		raw, err := ln.Accept()
		if err != nil {
			done <- accepted{err: err}
			return
		}
		raw.SetDeadline(time.Now().Add(10 * time.Second))
		conn := tls.Server(raw, serverCfg)
		done <- accepted{conn: conn, err: conn.HandshakeContext(ctx)}
	}()

	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	client := tls.Client(raw, clientCfg)
	clientErr := client.HandshakeContext(ctx)
	srv := <-done
	t.Cleanup(func() {
		client.Close()
		if srv.conn != nil {
			srv.conn.Close()
		}
	})
	return handshakeResult{client: client, server: srv.conn, clientErr: clientErr, serverErr: srv.err}
}

// exchange sends one message each way and fails the test if either is lost.
func exchange(t *testing.T, a, b *tls.Conn) {
	t.Helper()
	for _, pair := range [][2]*tls.Conn{{a, b}, {b, a}} {
		errc := make(chan error, 1)
		go func() {
			_, err := pair[0].Write([]byte("ping"))
			errc <- err
		}()
		buf := make([]byte, 4)
		if _, err := io.ReadFull(pair[1], buf); err != nil || string(buf) != "ping" {
			t.Fatalf("read %q: %v", buf, err)
		}
		if err := <-errc; err != nil {
			t.Fatalf("write: %v", err)
		}
	}
}

func TestHandshake(t *testing.T) {
	m := newManager(t, newCA(t, "cluster.local"), time.Hour)
	r := handshake(t, ClientConfig(m, idWeb, idCart), ServerConfig(m, idCart))
	if r.clientErr != nil || r.serverErr != nil {
		t.Fatalf("handshake: client %v, server %v", r.clientErr, r.serverErr)
	}
	exchange(t, r.client, r.server)

	cs := r.client.ConnectionState()
	if cs.Version != tls.VersionTLS13 || cs.NegotiatedProtocol != "h2" {
		t.Errorf("version %x alpn %q, want TLS 1.3 and h2", cs.Version, cs.NegotiatedProtocol)
	}
	if got, err := PeerID(cs); err != nil || got != idCart {
		t.Errorf("client sees server %v (%v), want %v", got, err, idCart)
	}
	if got, err := PeerID(r.server.ConnectionState()); err != nil || got != idWeb {
		t.Errorf("server sees client %v (%v), want %v", got, err, idWeb)
	}
}

func TestPeerIDNeedsHandshake(t *testing.T) {
	if _, err := PeerID(tls.ConnectionState{}); err == nil {
		t.Error("PeerID of an incomplete handshake succeeded")
	}
	if _, err := PeerID(tls.ConnectionState{HandshakeComplete: true}); !errors.Is(err, ErrNoPeerCertificate) {
		t.Errorf("PeerID without certificates: err = %v", err)
	}
}

func TestServerRefusesForeignClient(t *testing.T) {
	mesh := newManager(t, newCA(t, "cluster.local"), time.Hour)
	// Same trust domain, different root: only the root tells them apart.
	foreign := newManager(t, newCA(t, "cluster.local"), time.Hour)

	// The intruder does not check the server, so the server's own check is
	// what is under test.
	intruder := ClientConfig(foreign, idWeb, idCart)
	intruder.VerifyConnection = nil
	r := handshake(t, intruder, ServerConfig(mesh, idCart))
	if !errors.Is(r.serverErr, ErrUntrustedPeer) {
		t.Fatalf("server err = %v, want ErrUntrustedPeer", r.serverErr)
	}
	// In TLS 1.3 the client learns of the refusal on its first read.
	if r.clientErr == nil {
		if _, err := r.client.Read(make([]byte, 1)); err == nil {
			t.Error("refused client could read")
		}
	}
}

func TestServerRequiresClientCertificate(t *testing.T) {
	m := newManager(t, newCA(t, "cluster.local"), time.Hour)
	anon := ClientConfig(m, idWeb, idCart)
	anon.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
		return &tls.Certificate{}, nil
	}
	r := handshake(t, anon, ServerConfig(m, idCart))
	if r.serverErr == nil {
		t.Fatal("server accepted a client without a certificate")
	}
}

func TestClientRefusesForeignServer(t *testing.T) {
	mesh := newManager(t, newCA(t, "cluster.local"), time.Hour)
	foreign := newManager(t, newCA(t, "cluster.local"), time.Hour)
	r := handshake(t, ClientConfig(mesh, idWeb, idCart), ServerConfig(foreign, idCart))
	if !errors.Is(r.clientErr, ErrUntrustedPeer) {
		t.Fatalf("client err = %v, want ErrUntrustedPeer", r.clientErr)
	}
	if r.serverErr == nil {
		t.Error("server handshake succeeded with a client that refused it")
	}
}

func TestClientRefusesWrongServerIdentity(t *testing.T) {
	m := newManager(t, newCA(t, "cluster.local"), time.Hour)
	impostor := ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "impostor"}
	r := handshake(t, ClientConfig(m, idWeb, idCart), ServerConfig(m, impostor))
	if !errors.Is(r.clientErr, ErrUnexpectedIdentity) {
		t.Fatalf("client err = %v, want ErrUnexpectedIdentity", r.clientErr)
	}
	msg := r.clientErr.Error()
	if !strings.Contains(msg, "expected server "+idCart.String()) || !strings.Contains(msg, "got "+impostor.String()) {
		t.Errorf("error %q does not say expected vs got", msg)
	}
}

// TestRefusesNonH2: a client refuses a server that does not speak h2. A
// server lets a client of the mesh that offers no h2 finish the handshake
// (the HBONE server tells it in HTTP/1.1 why it is refused, see
// ServerConfig), but not one whose certificate does not verify.
func TestRefusesNonH2(t *testing.T) {
	m := newManager(t, newCA(t, "cluster.local"), time.Hour)
	plain := ClientConfig(m, idWeb, idCart)
	plain.NextProtos = nil       // offers no ALPN: not an HBONE client
	plain.VerifyConnection = nil // so the server's check is the one under test
	r := handshake(t, plain, ServerConfig(m, idCart))
	if r.serverErr != nil || r.server.ConnectionState().NegotiatedProtocol != "" {
		t.Errorf("server err = %v, want the handshake done without ALPN", r.serverErr)
	}
	other := newManager(t, newCA(t, "cluster.local"), time.Hour)
	stranger := ClientConfig(other, idWeb, idCart)
	stranger.NextProtos, stranger.VerifyConnection = nil, nil
	if r := handshake(t, stranger, ServerConfig(m, idCart)); !errors.Is(r.serverErr, ErrUntrustedPeer) {
		t.Errorf("server err = %v for a client of another root offering no ALPN, want ErrUntrustedPeer", r.serverErr)
	}

	plainServer := ServerConfig(m, idCart)
	plainServer.NextProtos = nil
	r = handshake(t, ClientConfig(m, idWeb, idCart), plainServer)
	if r.clientErr == nil || !strings.Contains(r.clientErr.Error(), "alpn") {
		t.Errorf("client err = %v, want an alpn refusal", r.clientErr)
	}
}

func TestRotationKeepsOpenConnections(t *testing.T) {
	// A short lifetime, so the background refresh (about half-life) comes
	// within the test.
	m := newManager(t, newCA(t, "cluster.local"), 4*time.Second)
	serial := func(r handshakeResult) (server, client *big.Int) {
		t.Helper()
		if r.clientErr != nil || r.serverErr != nil {
			t.Fatalf("handshake: client %v, server %v", r.clientErr, r.serverErr)
		}
		return r.client.ConnectionState().PeerCertificates[0].SerialNumber,
			r.server.ConnectionState().PeerCertificates[0].SerialNumber
	}

	old := handshake(t, ClientConfig(m, idWeb, idCart), ServerConfig(m, idCart))
	srv1, cli1 := serial(old)

	deadline := time.Now().Add(15 * time.Second)
	for {
		srv, cli := serial(handshake(t, ClientConfig(m, idWeb, idCart), ServerConfig(m, idCart)))
		if srv.Cmp(srv1) != 0 && cli.Cmp(cli1) != 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("certificates not refreshed in the background within 15s of a 4s lifetime")
		}
		time.Sleep(100 * time.Millisecond)
	}
	exchange(t, old.client, old.server)
}

func TestVerifyPeerRejectsBadLeaves(t *testing.T) {
	ca := newCA(t, "cluster.local")
	m := newManager(t, ca, time.Hour)
	mint := func(mod func(*x509.Certificate)) *x509.Certificate {
		t.Helper()
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{
			SerialNumber:          big.NewInt(42),
			NotBefore:             time.Now().Add(-time.Minute),
			NotAfter:              time.Now().Add(time.Hour),
			KeyUsage:              x509.KeyUsageDigitalSignature,
			ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
			BasicConstraintsValid: true,
			URIs:                  []*url.URL{{Scheme: "spiffe", Host: "cluster.local", Path: "/ns/a/sa/b"}},
		}
		mod(tmpl)
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
		if err != nil {
			t.Fatal(err)
		}
		c, _ := x509.ParseCertificate(der)
		return c
	}

	ok := mint(func(*x509.Certificate) {})
	if id, err := verifyPeer(m, []*x509.Certificate{ok}, x509.ExtKeyUsageClientAuth); err != nil || id != (ID{"cluster.local", "a", "b"}) {
		t.Fatalf("control leaf: %v %v", id, err)
	}
	for name, leaf := range map[string]*x509.Certificate{
		"server-only usage": mint(func(c *x509.Certificate) { c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth} }),
		"two uris": mint(func(c *x509.Certificate) {
			c.URIs = append(c.URIs, &url.URL{Scheme: "spiffe", Host: "cluster.local", Path: "/ns/a/sa/c"})
		}),
		"no uri":         mint(func(c *x509.Certificate) { c.URIs = nil }),
		"other domain":   mint(func(c *x509.Certificate) { c.URIs[0].Host = "evil.example" }),
		"not a k8s id":   mint(func(c *x509.Certificate) { c.URIs[0].Path = "/workload/x" }),
		"expired":        mint(func(c *x509.Certificate) { c.NotAfter = time.Now().Add(-time.Second) }),
		"ca as workload": mint(func(c *x509.Certificate) { c.IsCA = true }),
	} {
		if _, err := verifyPeer(m, []*x509.Certificate{leaf}, x509.ExtKeyUsageClientAuth); !errors.Is(err, ErrUntrustedPeer) {
			t.Errorf("%s: err = %v, want ErrUntrustedPeer", name, err)
		}
	}
	if _, err := verifyPeer(m, nil, x509.ExtKeyUsageClientAuth); !errors.Is(err, ErrNoPeerCertificate) {
		t.Errorf("no chain: err = %v", err)
	}
}

// sanURIs is a subjectAltName extension holding exactly these URI names,
// as a CA could encode them, net/url never touching them.
func sanURIs(t *testing.T, uris ...string) pkix.Extension {
	t.Helper()
	var names []asn1.RawValue
	for _, u := range uris {
		names = append(names, asn1.RawValue{Class: asn1.ClassContextSpecific, Tag: 6, Bytes: []byte(u)})
	}
	der, err := asn1.Marshal(names)
	if err != nil {
		t.Fatal(err)
	}
	return pkix.Extension{Id: oidSubjectAltName, Critical: true, Value: der}
}

// TestVerifyPeerRejectsHostileLeaves: leaves a trusted but careless or
// hostile CA could issue that crypto/x509 and crypto/tls accept. The
// identity is read from the URI exactly as encoded (net/url would
// lowercase "SPIFFE" and drop an empty fragment); the key usage must allow
// signing the TLS 1.3 handshake and must not allow signing certificates;
// an RSA key has 2048 bits at least; a chain is at most MaxChainLen long.
// What istiod issues still passes.
func TestVerifyPeerRejectsHostileLeaves(t *testing.T) {
	ca := newCA(t, "cluster.local")
	m := newManager(t, ca, time.Hour)
	want := ID{TrustDomain: "cluster.local", Namespace: "a", ServiceAccount: "b"}
	leaf := func(edit func(*x509.Certificate)) *x509.Certificate { return mint(t, ca, want, edit).Leaf }

	for name, l := range map[string]*x509.Certificate{
		"istiod's key usage": leaf(func(c *x509.Certificate) {
			c.KeyUsage = x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment
		}),
		"no key usage extension": leaf(func(c *x509.Certificate) { c.KeyUsage = 0 }),
		"uri encoded by hand":    leaf(func(c *x509.Certificate) { c.ExtraExtensions = []pkix.Extension{sanURIs(t, want.String())} }),
	} {
		if id, err := verifyPeer(m, []*x509.Certificate{l}, x509.ExtKeyUsageClientAuth); err != nil || id != want {
			t.Errorf("%s: %v %v, want %v", name, id, err, want)
		}
	}

	rsaKey, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	weak := mint(t, ca, want, nil).Leaf
	weakDER, err := x509.CreateCertificate(rand.Reader, weak, ca.cert, &rsaKey.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	if weak, err = x509.ParseCertificate(weakDER); err != nil {
		t.Fatal(err)
	}
	long := []*x509.Certificate{leaf(nil)}
	for len(long) <= MaxChainLen {
		long = append(long, ca.cert)
	}
	for name, chain := range map[string][]*x509.Certificate{
		"uppercase scheme": {leaf(func(c *x509.Certificate) {
			c.ExtraExtensions = []pkix.Extension{sanURIs(t, "SPIFFE://cluster.local/ns/a/sa/b")}
		})},
		"mixed-case scheme": {leaf(func(c *x509.Certificate) {
			c.ExtraExtensions = []pkix.Extension{sanURIs(t, "Spiffe://cluster.local/ns/a/sa/b")}
		})},
		"empty fragment": {leaf(func(c *x509.Certificate) {
			c.ExtraExtensions = []pkix.Extension{sanURIs(t, "spiffe://cluster.local/ns/a/sa/b#")}
		})},
		"key usage without digitalSignature": {leaf(func(c *x509.Certificate) { c.KeyUsage = x509.KeyUsageKeyEncipherment })},
		"leaf may sign certificates": {leaf(func(c *x509.Certificate) {
			c.KeyUsage = x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign
		})},
		"leaf may sign CRLs": {leaf(func(c *x509.Certificate) {
			c.KeyUsage = x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign
		})},
		"rsa key of 1024 bits":   {weak},
		"chain over MaxChainLen": long,
	} {
		for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth} {
			if id, err := verifyPeer(m, chain, usage); !errors.Is(err, ErrUntrustedPeer) {
				t.Errorf("%s (usage %v): got %v, err = %v, want ErrUntrustedPeer", name, usage, id, err)
			}
		}
		// The tunnel reads the identity it authorizes with PeerID: it
		// must not read one out of what the handshake refused.
		if id, err := PeerID(tls.ConnectionState{HandshakeComplete: true, PeerCertificates: chain}); err == nil && name != "chain over MaxChainLen" {
			t.Errorf("%s: PeerID = %v, want an error", name, id)
		}
	}
}

// nilRootsTrust is a Trust whose pool is nil, as a broken or not yet
// loaded Trust implementation might return.
type nilRootsTrust struct{}

func (nilRootsTrust) TrustDomain() string   { return "cluster.local" }
func (nilRootsTrust) Roots() *x509.CertPool { return nil }

// TestNilRootsTrustNothing: crypto/x509 verifies against the host's system
// roots when VerifyOptions.Roots is nil. A Trust without roots must trust
// no one, not every CA the host trusts; here the "system" store holds the
// CA that signed the peer.
func TestNilRootsTrustNothing(t *testing.T) {
	ca := newCA(t, "cluster.local")
	system := filepath.Join(t.TempDir(), "system-roots.pem")
	if err := os.WriteFile(system, pemCert(ca.cert.Raw), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SSL_CERT_FILE", system)
	t.Setenv("SSL_CERT_DIR", t.TempDir())
	peer := mint(t, ca, idWeb, nil)
	if _, err := peer.Leaf.Verify(x509.VerifyOptions{KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		// The system roots were loaded earlier in this process; the
		// premise (nil means the host's roots) cannot be shown here.
		t.Logf("leaf does not verify against the system roots: %v", err)
	}

	m := New(ManagerOptions{Signer: ca, Trust: nilRootsTrust{}})
	t.Cleanup(m.Close)
	if id, err := verifyPeer(m, []*x509.Certificate{peer.Leaf}, x509.ExtKeyUsageClientAuth); !errors.Is(err, ErrUntrustedPeer) || !strings.Contains(err.Error(), "no trust roots") {
		t.Errorf("peer verified against a nil pool: got %v, err = %v, want ErrUntrustedPeer (no trust roots)", id, err)
	}
	var ce *CAError
	if _, err := m.check(idWeb, peer); !errors.As(err, &ce) || ce.Reason != ReasonUntrustedChain {
		t.Errorf("own certificate checked against a nil pool: err = %v, want %s", err, ReasonUntrustedChain)
	}
}

// TestNoSessionResumption: a resumed session would skip the certificate
// exchange and carry the identity, and the roots, of an earlier handshake.
// The server issues no tickets, so even a client that keeps a session
// cache does a full handshake every time.
func TestNoSessionResumption(t *testing.T) {
	m := newManager(t, newCA(t, "cluster.local"), time.Hour)
	cache := tls.NewLRUClientSessionCache(4)
	for i := range 3 {
		client := ClientConfig(m, idWeb, idCart)
		client.ClientSessionCache = cache
		r := handshake(t, client, ServerConfig(m, idCart))
		if r.clientErr != nil || r.serverErr != nil {
			t.Fatalf("handshake %d: client %v, server %v", i+1, r.clientErr, r.serverErr)
		}
		// Reading after the handshake is what stores a ticket, if any.
		exchange(t, r.client, r.server)
		if r.client.ConnectionState().DidResume || r.server.ConnectionState().DidResume {
			t.Fatalf("handshake %d resumed a session", i+1)
		}
	}
}

// poolTrust trusts the roots of one pool, in trust domain cluster.local.
type poolTrust struct{ pool *x509.CertPool }

func (poolTrust) TrustDomain() string     { return "cluster.local" }
func (p poolTrust) Roots() *x509.CertPool { return p.pool }

// trustingManager is a Manager, with its own CA for cluster.local, whose
// peers' root is a fresh ECDSA root; it returns the root and its key too,
// to sign the chains a test presents to it.
func trustingManager(t *testing.T) (*Manager, *x509.Certificate, crypto.Signer) {
	t.Helper()
	rootKey := identitytest.NewKey(t, "ecdsa")
	root := identitytest.MakeCACert(t, pkix.Name{CommonName: "root"}, rootKey, nil, nil)
	return managerTrusting(t, root), root, rootKey
}

// managerTrusting is a Manager, with its own CA for cluster.local, whose
// peers' root is root.
func managerTrusting(t *testing.T, root *x509.Certificate) *Manager {
	t.Helper()
	m := New(ManagerOptions{Signer: newCA(t, "cluster.local"), Trust: poolTrust{poolOf(root)}})
	t.Cleanup(m.Close)
	return m
}

// bothUsages are the extended key usages istiod's workload certificates carry.
var bothUsages = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth}

// abLeafTemplate is a leaf of spiffe://cluster.local/ns/a/sa/b, valid for
// the next hour, with usages.
func abLeafTemplate(usages []x509.ExtKeyUsage) *x509.Certificate {
	return &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		NotBefore:    time.Now().Add(-time.Minute),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  usages,
		URIs:         []*url.URL{{Scheme: "spiffe", Host: "cluster.local", Path: "/ns/a/sa/b"}},
	}
}

// TestVerifyPeerRejectsWeakIntermediate: crypto/x509 verifies a chain
// through an intermediate whose RSA key has 1024 bits; rustls (ztunnel)
// does not, and neither may this agent, for a peer's chain or for what
// its own CA answered. The same chain through a 2048-bit intermediate
// passes, so the key size is what is refused.
func TestVerifyPeerRejectsWeakIntermediate(t *testing.T) {
	m, root, rootKey := trustingManager(t)

	want := ID{TrustDomain: "cluster.local", Namespace: "a", ServiceAccount: "b"}
	chainVia := func(bits int) (*tls.Certificate, []*x509.Certificate) {
		t.Helper()
		interKey, err := rsa.GenerateKey(rand.Reader, bits)
		if err != nil {
			t.Fatal(err)
		}
		inter := identitytest.MakeCACert(t, pkix.Name{CommonName: fmt.Sprintf("intermediate-%d", bits)}, interKey, root, rootKey)
		leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		leaf := identitytest.Sign(t, abLeafTemplate(bothUsages), leafKey, inter, interKey)
		own := &tls.Certificate{Certificate: [][]byte{leaf.Raw, inter.Raw}, PrivateKey: leafKey, Leaf: leaf}
		return own, []*x509.Certificate{leaf, inter}
	}

	strongOwn, strong := chainVia(2048)
	if id, err := verifyPeer(m, strong, x509.ExtKeyUsageClientAuth); err != nil || id != want {
		t.Fatalf("peer chain through a 2048-bit intermediate: %v %v, want %v", id, err, want)
	}
	if _, err := m.check(want, strongOwn); err != nil {
		t.Fatalf("own chain through a 2048-bit intermediate: %v", err)
	}
	weakOwn, weak := chainVia(1024)
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth} {
		_, err := verifyPeer(m, weak, usage)
		if !errors.Is(err, ErrUntrustedPeer) || !strings.Contains(err.Error(), "1024 bits") {
			t.Errorf("peer chain through a 1024-bit intermediate (usage %v): err = %v, want ErrUntrustedPeer naming the key size", usage, err)
		}
	}
	var ce *CAError
	if _, err := m.check(want, weakOwn); !errors.As(err, &ce) || ce.Reason != ReasonUntrustedChain || !strings.Contains(err.Error(), "1024 bits") {
		t.Errorf("own chain through a 1024-bit intermediate: err = %v, want %s naming the key size", err, ReasonUntrustedChain)
	}
}

// TestVerifyPeerKeepsX509Refusals pins what verifyPeer relies on
// crypto/x509 for, so a change of verifier cannot drop it silently: an
// unknown critical extension (in the leaf or an intermediate), an
// intermediate whose name constraints exclude the trust domain, a leaf
// not yet valid, a leaf presented as an intermediate. A leaf with DNS
// SANs beside its one SPIFFE URI is accepted (an X.509-SVID may carry
// them; ztunnel accepts them too).
func TestVerifyPeerKeepsX509Refusals(t *testing.T) {
	m, root, rootKey := trustingManager(t)
	want := ID{TrustDomain: "cluster.local", Namespace: "a", ServiceAccount: "b"}
	critical := pkix.Extension{Id: asn1.ObjectIdentifier{1, 3, 6, 1, 4, 1, 99999, 1}, Critical: true, Value: []byte{5, 0}}

	issue := func(tmpl, parent *x509.Certificate, pub any, parentKey any) *x509.Certificate {
		t.Helper()
		der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, parentKey)
		if err != nil {
			t.Fatal(err)
		}
		c, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	inter := func(edit func(*x509.Certificate)) (*x509.Certificate, *ecdsa.PrivateKey) {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(10), Subject: pkix.Name{CommonName: "intermediate"},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true}
		if edit != nil {
			edit(tmpl)
		}
		return issue(tmpl, root, &key.PublicKey, rootKey), key
	}
	leaf := func(parent *x509.Certificate, parentKey *ecdsa.PrivateKey, edit func(*x509.Certificate)) *x509.Certificate {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(11), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
			BasicConstraintsValid: true, URIs: []*url.URL{{Scheme: "spiffe", Host: "cluster.local", Path: "/ns/a/sa/b"}}}
		if edit != nil {
			edit(tmpl)
		}
		return issue(tmpl, parent, &key.PublicKey, parentKey)
	}

	good, goodKey := inter(nil)
	withDNS := leaf(good, goodKey, func(c *x509.Certificate) { c.DNSNames = []string{"b.a.svc"} })
	if id, err := verifyPeer(m, []*x509.Certificate{withDNS, good}, x509.ExtKeyUsageClientAuth); err != nil || id != want {
		t.Fatalf("leaf with a DNS SAN beside its SPIFFE ID: %v %v, want %v", id, err, want)
	}
	critInter, critKey := inter(func(c *x509.Certificate) { c.ExtraExtensions = []pkix.Extension{critical} })
	constrained, constrainedKey := inter(func(c *x509.Certificate) { c.ExcludedURIDomains = []string{"cluster.local"} })
	// An end-entity certificate (CA:FALSE) used as an issuer.
	notCA, notCAKey := inter(func(c *x509.Certificate) { c.IsCA = false })
	for name, chain := range map[string][]*x509.Certificate{
		"unknown critical extension in the leaf":         {leaf(good, goodKey, func(c *x509.Certificate) { c.ExtraExtensions = []pkix.Extension{critical} }), good},
		"unknown critical extension in the intermediate": {leaf(critInter, critKey, nil), critInter},
		"name constraints exclude the trust domain":      {leaf(constrained, constrainedKey, nil), constrained},
		"not yet valid": {leaf(good, goodKey, func(c *x509.Certificate) {
			c.NotBefore, c.NotAfter = time.Now().Add(time.Hour), time.Now().Add(2*time.Hour)
		}), good},
		"issued by a certificate that is no CA": {leaf(notCA, notCAKey, nil), notCA},
	} {
		id, err := verifyPeer(m, chain, x509.ExtKeyUsageClientAuth)
		t.Logf("%s: %v", name, err)
		if !errors.Is(err, ErrUntrustedPeer) {
			t.Errorf("%s: got %v, err = %v, want ErrUntrustedPeer", name, id, err)
		}
	}
}
