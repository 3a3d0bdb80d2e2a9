package identity

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
)

// TestVerifyPeerRejectsAnyExtendedKeyUsage: crypto/x509 takes the
// anyExtendedKeyUsage purpose (2.5.29.37.0) for every usage asked, in the
// leaf and in the intermediates; rustls (webpki, ztunnel) looks for the
// clientAuth or serverAuth purpose itself in every certificate of the path
// that has the extension, and refuses a chain with only "any". A peer
// whose chain says "any" would then be admitted by this agent and by no
// ztunnel, and a CA answer with it would be presented to peers that all
// refuse it. Both are refused here; the same chains with the purpose
// written out, or with no extended key usage at all, pass.
func TestVerifyPeerRejectsAnyExtendedKeyUsage(t *testing.T) {
	m, root, rootKey := trustingManager(t)
	want := ID{TrustDomain: "cluster.local", Namespace: "a", ServiceAccount: "b"}
	both := []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth}
	anyEKU := []x509.ExtKeyUsage{x509.ExtKeyUsageAny}

	// chain is a leaf with leafEKU under an intermediate with interEKU
	// (nil: no extension) under root.
	chain := func(interEKU, leafEKU []x509.ExtKeyUsage) (*tls.Certificate, []*x509.Certificate) {
		t.Helper()
		interKey := identitytest.NewKey(t, "ecdsa")
		inter := identitytest.Sign(t, &x509.Certificate{
			SerialNumber:          big.NewInt(time.Now().UnixNano()),
			Subject:               pkix.Name{CommonName: "intermediate"},
			NotBefore:             time.Now().Add(-time.Hour),
			NotAfter:              time.Now().Add(24 * time.Hour),
			KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
			ExtKeyUsage:           interEKU,
			BasicConstraintsValid: true,
			IsCA:                  true,
		}, interKey, root, rootKey)
		leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		leaf := identitytest.Sign(t, abLeafTemplate(leafEKU), leafKey, inter, interKey)
		own := &tls.Certificate{Certificate: [][]byte{leaf.Raw, inter.Raw}, PrivateKey: leafKey, Leaf: leaf}
		return own, []*x509.Certificate{leaf, inter}
	}

	for name, c := range map[string]struct{ inter, leaf []x509.ExtKeyUsage }{
		"istiod's usages":                          {nil, both},
		"no extended key usage anywhere":           {nil, nil},
		"intermediate limited to both usages":      {both, both},
		"intermediate limited, leaf with no usage": {both, nil},
		"any beside the usages":                    {append([]x509.ExtKeyUsage{x509.ExtKeyUsageAny}, both...), append([]x509.ExtKeyUsage{x509.ExtKeyUsageAny}, both...)},
	} {
		own, peer := chain(c.inter, c.leaf)
		for _, usage := range both {
			if id, err := verifyPeer(m, peer, usage); err != nil || id != want {
				t.Errorf("%s (usage %v): %v %v, want %v", name, usage, id, err, want)
			}
		}
		if _, err := m.check(want, own); err != nil {
			t.Errorf("%s: own certificate refused: %v", name, err)
		}
	}

	for name, c := range map[string]struct{ inter, leaf []x509.ExtKeyUsage }{
		"leaf with only any":         {nil, anyEKU},
		"intermediate with only any": {anyEKU, both},
		"both with only any":         {anyEKU, anyEKU},
	} {
		own, peer := chain(c.inter, c.leaf)
		for _, usage := range both {
			_, err := verifyPeer(m, peer, usage)
			if !errors.Is(err, ErrUntrustedPeer) || !strings.Contains(err.Error(), "extended key usage") {
				t.Errorf("%s (usage %v): err = %v, want ErrUntrustedPeer naming the extended key usage", name, usage, err)
			}
			if end := m.PeerChainEnd(tls.ConnectionState{PeerCertificates: peer}, usage); end.After(time.Now()) {
				t.Errorf("%s (usage %v): PeerChainEnd = %v, want now: the chain does not verify", name, usage, end)
			}
		}
		var ce *CAError
		if _, err := m.check(want, own); !errors.As(err, &ce) || ce.Reason != ReasonUntrustedChain {
			t.Errorf("%s: own certificate: err = %v, want %s", name, err, ReasonUntrustedChain)
		}
	}
}

// TestVerifyPeerRejectsPathsRustlsDoesNotBuild: rustls (webpki) puts at
// most six intermediates between a leaf and its trust anchor; crypto/x509
// has no bound, and MaxChainLen counts what is presented, so a leaf and
// seven intermediates (eight certificates, the root left out) verified
// here, for a peer and for this node's own certificate, and would be
// refused by every ztunnel. Six still pass.
func TestVerifyPeerRejectsPathsRustlsDoesNotBuild(t *testing.T) {
	m, root, rootKey := trustingManager(t)
	want := ID{TrustDomain: "cluster.local", Namespace: "a", ServiceAccount: "b"}

	// chain is a leaf under n intermediates under root, as presented.
	chain := func(n int) (*tls.Certificate, []*x509.Certificate) {
		t.Helper()
		issuer, issuerKey := root, rootKey
		var inters []*x509.Certificate
		for i := range n {
			key := identitytest.NewKey(t, "ecdsa")
			issuer = identitytest.MakeCACert(t, pkix.Name{CommonName: "intermediate " + string(rune('a'+i))}, key, issuer, issuerKey)
			issuerKey = key
			inters = append([]*x509.Certificate{issuer}, inters...)
		}
		leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		leaf := identitytest.Sign(t, abLeafTemplate(bothUsages), leafKey, issuer, issuerKey)
		peer := append([]*x509.Certificate{leaf}, inters...)
		own := &tls.Certificate{PrivateKey: leafKey, Leaf: leaf}
		for _, c := range peer {
			own.Certificate = append(own.Certificate, c.Raw)
		}
		return own, peer
	}

	own, peer := chain(maxIntermediates)
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth} {
		if id, err := verifyPeer(m, peer, usage); err != nil || id != want {
			t.Errorf("%d intermediates (usage %v): %v %v, want %v", maxIntermediates, usage, id, err, want)
		}
	}
	if _, err := m.check(want, own); err != nil {
		t.Errorf("%d intermediates: own certificate refused: %v", maxIntermediates, err)
	}

	own, peer = chain(maxIntermediates + 1)
	if len(peer) > MaxChainLen {
		t.Fatalf("test chain of %d certificates is over MaxChainLen, which would refuse it anyway", len(peer))
	}
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth} {
		if _, err := verifyPeer(m, peer, usage); !errors.Is(err, ErrUntrustedPeer) || !strings.Contains(err.Error(), "intermediates") {
			t.Errorf("%d intermediates (usage %v): err = %v, want ErrUntrustedPeer naming the intermediates", maxIntermediates+1, usage, err)
		}
	}
	var ce *CAError
	if _, err := m.check(want, own); !errors.As(err, &ce) || ce.Reason != ReasonUntrustedChain {
		t.Errorf("%d intermediates: own certificate: err = %v, want %s", maxIntermediates+1, err, ReasonUntrustedChain)
	}
}

// TestHandshakeRefusesAnyExtendedKeyUsage: over a real handshake, a leaf
// of the mesh's own CA whose extended key usage says only "any" is
// refused by the server (as a client's) and by the client (as a
// server's), as a ztunnel refuses it.
func TestHandshakeRefusesAnyExtendedKeyUsage(t *testing.T) {
	ca := newCA(t, "cluster.local")
	m := newManager(t, ca, time.Hour)
	anyOnly := func(c *x509.Certificate) { c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageAny} }

	client := &tls.Config{
		MinVersion: tls.VersionTLS13, NextProtos: []string{ALPN}, InsecureSkipVerify: true,
		Certificates: []tls.Certificate{*mint(t, ca, idWeb, anyOnly)},
	}
	r := handshake(t, client, ServerConfig(m, idCart))
	if !errors.Is(r.serverErr, ErrUntrustedPeer) {
		t.Errorf("server: err = %v, want ErrUntrustedPeer for a client whose usage is only any", r.serverErr)
	}

	server := &tls.Config{
		MinVersion: tls.VersionTLS13, NextProtos: []string{ALPN}, ClientAuth: tls.RequireAnyClientCert,
		Certificates: []tls.Certificate{*mint(t, ca, idCart, anyOnly)},
	}
	r = handshake(t, ClientConfig(m, idWeb, idCart), server)
	if !errors.Is(r.clientErr, ErrUntrustedPeer) {
		t.Errorf("client: err = %v, want ErrUntrustedPeer for a server whose usage is only any", r.clientErr)
	}

	// The same leaves with the usages written out pass both ways.
	client.Certificates = []tls.Certificate{*mint(t, ca, idWeb, nil)}
	if r := handshake(t, client, ServerConfig(m, idCart)); r.serverErr != nil {
		t.Errorf("server refused a control client: %v", r.serverErr)
	}
	server.Certificates = []tls.Certificate{*mint(t, ca, idCart, nil)}
	if r := handshake(t, ClientConfig(m, idWeb, idCart), server); r.clientErr != nil {
		t.Errorf("client refused a control server: %v", r.clientErr)
	}
}

// TestVerifyPeerRejectsSignaturesRustlsDoesNotVerify: crypto/x509
// verifies an ECDSA signature with SHA-512 by a P-256 or P-384 key;
// rustls (aws-lc-rs, ztunnel) verifies SHA-512 signatures by P-521 keys
// only. A leaf or an intermediate so signed is refused, from a peer and
// from the CA; P-521 with SHA-512 and P-256 with SHA-256 pass.
func TestVerifyPeerRejectsSignaturesRustlsDoesNotVerify(t *testing.T) {
	want := ID{TrustDomain: "cluster.local", Namespace: "a", ServiceAccount: "b"}
	usages := []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth}
	key := func(c elliptic.Curve) *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(c, rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	// chain: root (rootCurve) signs the intermediate with interAlg; the
	// intermediate (interCurve) signs the leaf with leafAlg.
	type shape struct {
		rootCurve, interCurve elliptic.Curve
		interAlg, leafAlg     x509.SignatureAlgorithm
	}
	build := func(s shape) (*Manager, *tls.Certificate, []*x509.Certificate) {
		t.Helper()
		rootKey, interKey, leafKey := key(s.rootCurve), key(s.interCurve), key(elliptic.P256())
		root := identitytest.MakeCACert(t, pkix.Name{CommonName: "root"}, rootKey, nil, nil)
		inter := identitytest.Sign(t, &x509.Certificate{
			SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: "intermediate"},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
			SignatureAlgorithm: s.interAlg,
		}, interKey, root, rootKey)
		leafTmpl := abLeafTemplate(usages)
		leafTmpl.SignatureAlgorithm = s.leafAlg
		leaf := identitytest.Sign(t, leafTmpl, leafKey, inter, interKey)
		m := managerTrusting(t, root)
		own := &tls.Certificate{Certificate: [][]byte{leaf.Raw, inter.Raw}, PrivateKey: leafKey, Leaf: leaf}
		return m, own, []*x509.Certificate{leaf, inter}
	}
	p256, p384, p521 := elliptic.P256(), elliptic.P384(), elliptic.P521()
	for name, s := range map[string]shape{
		"p-256 with sha-256":                 {p256, p256, x509.ECDSAWithSHA256, x509.ECDSAWithSHA256},
		"p-521 with sha-512":                 {p521, p521, x509.ECDSAWithSHA512, x509.ECDSAWithSHA512},
		"p-384 with sha-384, p-256 with 256": {p384, p256, x509.ECDSAWithSHA384, x509.ECDSAWithSHA256},
	} {
		m, own, peer := build(s)
		for _, usage := range usages {
			if id, err := verifyPeer(m, peer, usage); err != nil || id != want {
				t.Errorf("%s (usage %v): %v %v, want %v", name, usage, id, err, want)
			}
		}
		if _, err := m.check(want, own); err != nil {
			t.Errorf("%s: own certificate refused: %v", name, err)
		}
	}
	for name, s := range map[string]shape{
		"leaf signed by p-256 with sha-512":         {p256, p256, x509.ECDSAWithSHA256, x509.ECDSAWithSHA512},
		"intermediate signed by p-384 with sha-512": {p384, p256, x509.ECDSAWithSHA512, x509.ECDSAWithSHA256},
	} {
		m, own, peer := build(s)
		for _, usage := range usages {
			if _, err := verifyPeer(m, peer, usage); !errors.Is(err, ErrUntrustedPeer) || !strings.Contains(err.Error(), "SHA-512") {
				t.Errorf("%s (usage %v): err = %v, want ErrUntrustedPeer naming SHA-512", name, usage, err)
			}
		}
		var ce *CAError
		if _, err := m.check(want, own); !errors.As(err, &ce) || ce.Reason != ReasonUntrustedChain {
			t.Errorf("%s: own certificate: err = %v, want %s", name, err, ReasonUntrustedChain)
		}
	}
}

// TestVerifyPeerRejectsURINameConstraints: an issuer constraining URI
// names to the trust domain (permitted cluster.local, as a SPIFFE-aware
// PKI may set) passes crypto/x509, which evaluates the constraint; rustls
// (webpki, ztunnel) does not evaluate URI constraints and refuses every
// URI under one, permitted or excluded. A peer or CA chain through such an
// issuer, intermediate or root, is refused; a constraint on DNS names
// only still passes (rustls skips it for a URI).
func TestVerifyPeerRejectsURINameConstraints(t *testing.T) {
	want := ID{TrustDomain: "cluster.local", Namespace: "a", ServiceAccount: "b"}
	usages := []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth}
	// build: a root edited by rootEdit signs an intermediate edited by
	// interEdit, which signs the leaf.
	build := func(rootEdit, interEdit func(*x509.Certificate)) (*Manager, *tls.Certificate, []*x509.Certificate) {
		t.Helper()
		caTmpl := func(cn string, edit func(*x509.Certificate)) *x509.Certificate {
			c := &x509.Certificate{
				SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
				NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
				KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
			}
			if edit != nil {
				edit(c)
			}
			return c
		}
		rootKey, interKey := identitytest.NewKey(t, "ecdsa"), identitytest.NewKey(t, "ecdsa")
		rootTmpl := caTmpl("root", rootEdit)
		root := identitytest.Sign(t, rootTmpl, rootKey, rootTmpl, rootKey)
		inter := identitytest.Sign(t, caTmpl("intermediate", interEdit), interKey, root, rootKey)
		leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		leaf := identitytest.Sign(t, abLeafTemplate(usages), leafKey, inter, interKey)
		m := managerTrusting(t, root)
		own := &tls.Certificate{Certificate: [][]byte{leaf.Raw, inter.Raw}, PrivateKey: leafKey, Leaf: leaf}
		return m, own, []*x509.Certificate{leaf, inter}
	}
	permitTD := func(c *x509.Certificate) { c.PermittedURIDomains = []string{"cluster.local"} }
	excludeOther := func(c *x509.Certificate) { c.ExcludedURIDomains = []string{"other.example"} }
	dnsOnly := func(c *x509.Certificate) { c.PermittedDNSDomains = []string{"svc.cluster.local"} }

	for name, edits := range map[string][2]func(*x509.Certificate){
		"no constraints":                 {nil, nil},
		"intermediate constrains dns":    {nil, dnsOnly},
		"root and intermediate with dns": {dnsOnly, dnsOnly},
	} {
		m, own, peer := build(edits[0], edits[1])
		for _, usage := range usages {
			if id, err := verifyPeer(m, peer, usage); err != nil || id != want {
				t.Errorf("%s (usage %v): %v %v, want %v", name, usage, id, err, want)
			}
		}
		if _, err := m.check(want, own); err != nil {
			t.Errorf("%s: own certificate refused: %v", name, err)
		}
	}
	for name, edits := range map[string][2]func(*x509.Certificate){
		"intermediate permits the trust domain": {nil, permitTD},
		"intermediate excludes another domain":  {nil, excludeOther},
		"root permits the trust domain":         {permitTD, nil},
	} {
		m, own, peer := build(edits[0], edits[1])
		for _, usage := range usages {
			if _, err := verifyPeer(m, peer, usage); !errors.Is(err, ErrUntrustedPeer) || !strings.Contains(err.Error(), "name constraints on URI") {
				t.Errorf("%s (usage %v): err = %v, want ErrUntrustedPeer naming the URI name constraints", name, usage, err)
			}
		}
		var ce *CAError
		if _, err := m.check(want, own); !errors.As(err, &ce) || ce.Reason != ReasonUntrustedChain {
			t.Errorf("%s: own certificate: err = %v, want %s", name, err, ReasonUntrustedChain)
		}
	}
}
