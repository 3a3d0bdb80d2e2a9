package identity

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"errors"
	"math/big"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
)

// signWithP224 issues tmpl for pub under issuer, whose key is the P-224
// key issuerKey. crypto/x509 cannot sign with P-224 (it verifies such
// signatures all the same), so the certificate is made with a stand-in
// P-256 key and its to-be-signed part signed again with issuerKey, as any
// other toolkit would sign it (ecdsa-with-SHA256).
func signWithP224(t *testing.T, tmpl *x509.Certificate, pub any, issuer *x509.Certificate, issuerKey *ecdsa.PrivateKey) *x509.Certificate {
	t.Helper()
	standIn, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	parent := *issuer
	parent.PublicKey = standIn.Public()
	der, err := x509.CreateCertificate(rand.Reader, tmpl, &parent, pub, standIn)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	digest := sha256.Sum256(c.RawTBSCertificate)
	sig, err := ecdsa.SignASN1(rand.Reader, issuerKey, digest[:])
	if err != nil {
		t.Fatal(err)
	}
	der, err = asn1.Marshal(struct {
		TBS asn1.RawValue
		Alg pkix.AlgorithmIdentifier
		Sig asn1.BitString
	}{asn1.RawValue{FullBytes: c.RawTBSCertificate}, pkix.AlgorithmIdentifier{Algorithm: asn1.ObjectIdentifier{1, 2, 840, 10045, 4, 3, 2}}, asn1.BitString{Bytes: sig, BitLength: 8 * len(sig)}})
	if err != nil {
		t.Fatal(err)
	}
	if c, err = x509.ParseCertificate(der); err != nil {
		t.Fatal(err)
	}
	if err := c.CheckSignatureFrom(issuer); err != nil {
		t.Fatalf("re-signed certificate does not verify under its P-224 issuer: %v", err)
	}
	return c
}

// TestVerifyPeerRejectsOddCurves: crypto/x509 verifies signatures of P-224
// keys anywhere in a chain; rustls (ztunnel, with ring or aws-lc-rs)
// verifies only P-256, P-384 (and P-521 with aws-lc-rs), Ed25519 and RSA of
// 2048 to 8192 bits. A chain through a P-224 intermediate was accepted
// from a peer and from the CA, and would work only between agents like
// this one. Keys outside what rustls verifies are refused in a peer's
// chain and in the CA's answer, naming the key; the same chain through a
// P-256 intermediate passes.
func TestVerifyPeerRejectsOddCurves(t *testing.T) {
	m, root, rootKey := trustingManager(t)
	want := ID{TrustDomain: "cluster.local", Namespace: "a", ServiceAccount: "b"}

	interKey, err := ecdsa.GenerateKey(elliptic.P224(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	inter := identitytest.Sign(t, &x509.Certificate{
		SerialNumber: big.NewInt(20), Subject: pkix.Name{CommonName: "p224 intermediate"}, SubjectKeyId: []byte{1, 2, 3, 4},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
	}, interKey, root, rootKey)
	leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leaf := signWithP224(t, &x509.Certificate{
		SerialNumber: big.NewInt(21), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
		URIs: []*url.URL{{Scheme: "spiffe", Host: "cluster.local", Path: "/ns/a/sa/b"}},
	}, &leafKey.PublicKey, inter, interKey)
	// The premise: crypto/x509 takes the chain.
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: poolOf(root), Intermediates: poolOf(inter), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Fatalf("crypto/x509 refuses the P-224 chain itself (%v): the test's premise is gone", err)
	}

	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth} {
		id, err := verifyPeer(m, []*x509.Certificate{leaf, inter}, usage)
		if !errors.Is(err, ErrUntrustedPeer) || !strings.Contains(err.Error(), "P-224") {
			t.Errorf("peer chain through a P-224 intermediate (usage %v): got %v, err = %v, want ErrUntrustedPeer naming P-224", usage, id, err)
		}
	}
	own := &tls.Certificate{Certificate: [][]byte{leaf.Raw, inter.Raw}, PrivateKey: leafKey, Leaf: leaf}
	var ce *CAError
	if _, err := m.check(want, own); !errors.As(err, &ce) || ce.Reason != ReasonUntrustedChain || !strings.Contains(err.Error(), "P-224") {
		t.Errorf("own chain through a P-224 intermediate: err = %v, want %s naming P-224", err, ReasonUntrustedChain)
	}

	// The control: P-256 intermediate, same shape.
	goodKey := identitytest.NewKey(t, "ecdsa")
	good := identitytest.MakeCACert(t, pkix.Name{CommonName: "p256 intermediate"}, goodKey, root, rootKey)
	goodLeaf := identitytest.Sign(t, &x509.Certificate{
		SerialNumber: big.NewInt(22), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
		URIs: []*url.URL{{Scheme: "spiffe", Host: "cluster.local", Path: "/ns/a/sa/b"}},
	}, leafKey, good, goodKey)
	if id, err := verifyPeer(m, []*x509.Certificate{goodLeaf, good}, x509.ExtKeyUsageClientAuth); err != nil || id != want {
		t.Errorf("peer chain through a P-256 intermediate: %v %v, want %v", id, err, want)
	}
	if _, err := m.check(want, &tls.Certificate{Certificate: [][]byte{goodLeaf.Raw, good.Raw}, PrivateKey: leafKey, Leaf: goodLeaf}); err != nil {
		t.Errorf("own chain through a P-256 intermediate: %v", err)
	}
}

// TestUnusableKeys pins which keys a chain may hold: what rustls verifies.
// RSA keys over 8192 bits are refused too (crypto/tls refuses them from a
// peer, and rustls too, so a CA answer with one in its chain would be
// refused by every peer); making one here would take minutes, so the
// predicate is checked on a public key alone.
func TestUnusableKeys(t *testing.T) {
	big8193 := new(big.Int).Lsh(big.NewInt(1), 8192)
	big8193.Add(big8193, big.NewInt(1))
	big2048 := new(big.Int).Lsh(big.NewInt(1), 2047)
	big2048.Add(big2048, big.NewInt(1))
	p := func(c elliptic.Curve) *ecdsa.PublicKey {
		k, _ := ecdsa.GenerateKey(c, rand.Reader)
		return &k.PublicKey
	}
	for name, tc := range map[string]struct {
		key any
		ok  bool
	}{
		"rsa 2048":  {&rsa.PublicKey{N: big2048, E: 65537}, true},
		"rsa 8193":  {&rsa.PublicKey{N: big8193, E: 65537}, false},
		"rsa 1024":  {&rsa.PublicKey{N: new(big.Int).Lsh(big.NewInt(1), 1023), E: 65537}, false},
		"ecdsa 224": {p(elliptic.P224()), false},
		"ecdsa 256": {p(elliptic.P256()), true},
		"ecdsa 384": {p(elliptic.P384()), true},
		"ecdsa 521": {p(elliptic.P521()), true},
	} {
		err := checkKey(tc.key)
		if (err == nil) != tc.ok {
			t.Errorf("%s: checkKey = %v, want ok=%v", name, err, tc.ok)
		}
	}
}

func poolOf(cs ...*x509.Certificate) *x509.CertPool {
	p := x509.NewCertPool()
	for _, c := range cs {
		p.AddCert(c)
	}
	return p
}

// TestPeerChainEnd: the end of a peer's chain is that of the chains that
// verify, the root's end included, whatever else the peer presented.
func TestPeerChainEnd(t *testing.T) {
	now := time.Now().Truncate(time.Second)
	rootKey := identitytest.NewKey(t, "ecdsa")
	rootTmpl := &x509.Certificate{SerialNumber: big.NewInt(40), Subject: pkix.Name{CommonName: "root"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(3 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true}
	root := identitytest.Sign(t, rootTmpl, rootKey, rootTmpl, rootKey)
	m := New(ManagerOptions{Signer: newCA(t, "cluster.local"), Trust: poolTrust{poolOf(root)}})
	t.Cleanup(m.Close)
	interKey := identitytest.NewKey(t, "ecdsa")
	interTmpl := &x509.Certificate{SerialNumber: big.NewInt(41), Subject: pkix.Name{CommonName: "inter"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(2 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true}
	inter := identitytest.Sign(t, interTmpl, interKey, root, rootKey)
	forgedKey := identitytest.NewKey(t, "ecdsa")
	forgedTmpl := *interTmpl
	forgedTmpl.NotAfter = now.Add(10 * time.Hour)
	forged := identitytest.Sign(t, &forgedTmpl, forgedKey, &forgedTmpl, forgedKey)
	leafKey := identitytest.NewKey(t, "ecdsa")
	leaf := identitytest.Sign(t, &x509.Certificate{SerialNumber: big.NewInt(42), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(5 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
		URIs: []*url.URL{{Scheme: "spiffe", Host: "cluster.local", Path: "/ns/a/sa/b"}}}, leafKey, inter, interKey)

	if got := m.PeerChainEnd(tls.ConnectionState{PeerCertificates: []*x509.Certificate{leaf, inter, forged}}, x509.ExtKeyUsageClientAuth); !got.Equal(inter.NotAfter) {
		t.Errorf("with a forged issuer: end %s, want the intermediate's %s", got, inter.NotAfter)
	}
	// An intermediate outliving the root: the root's end.
	interTmpl.NotAfter = now.Add(4 * time.Hour)
	long := identitytest.Sign(t, interTmpl, interKey, root, rootKey)
	if got := m.PeerChainEnd(tls.ConnectionState{PeerCertificates: []*x509.Certificate{leaf, long}}, x509.ExtKeyUsageClientAuth); !got.Equal(root.NotAfter) {
		t.Errorf("under a root ending first: end %s, want the root's %s", got, root.NotAfter)
	}
	if got := m.PeerChainEnd(tls.ConnectionState{PeerCertificates: []*x509.Certificate{leaf}}, x509.ExtKeyUsageClientAuth); got.After(time.Now()) {
		t.Errorf("a chain that does not verify ends at %s, want now", got)
	}
}
