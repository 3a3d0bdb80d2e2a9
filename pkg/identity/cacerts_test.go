package identity

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// pki is a root and an intermediate, as Istio's tools/certs make them for
// the plug-in CA (cacerts).
type pki struct {
	root, inter       *x509.Certificate
	rootKey, interKey crypto.Signer
}

func newKey(t *testing.T, alg string) crypto.Signer {
	t.Helper()
	var k crypto.Signer
	var err error
	switch alg {
	case "rsa":
		k, err = rsa.GenerateKey(rand.Reader, 2048)
	case "ecdsa":
		k, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	}
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func makeCACert(t *testing.T, subject pkix.Name, key crypto.Signer, parent *x509.Certificate, parentKey crypto.Signer) *x509.Certificate {
	t.Helper()
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               subject,
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, key.Public(), parentKey)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func newPKI(t *testing.T, alg string) pki {
	rootKey := newKey(t, alg)
	root := makeCACert(t, pkix.Name{Organization: []string{"Istio"}, CommonName: "Root CA"}, rootKey, nil, nil)
	interKey := newKey(t, alg)
	inter := makeCACert(t, pkix.Name{Organization: []string{"Istio"}, CommonName: "Intermediate CA"}, interKey, root, rootKey)
	return pki{root: root, inter: inter, rootKey: rootKey, interKey: interKey}
}

func certPEM(cs ...*x509.Certificate) []byte {
	var out []byte
	for _, c := range cs {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
	}
	return out
}

// keyPEM encodes a key the way openssl writes it for Istio's cacerts:
// PKCS#1 for RSA, SEC 1 for EC.
func keyPEM(t *testing.T, k crypto.Signer) []byte {
	t.Helper()
	switch k := k.(type) {
	case *rsa.PrivateKey:
		return pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k)})
	case *ecdsa.PrivateKey:
		der, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
	}
	t.Fatalf("key %T", k)
	return nil
}

// writeCacerts writes Istio's plug-in CA files; extraRoots go into
// root-cert.pem after the root, as during a root rotation.
func writeCacerts(t *testing.T, p pki, extraRoots ...*x509.Certificate) string {
	t.Helper()
	dir := t.TempDir()
	files := map[string][]byte{
		IstioCACertFile:    certPEM(p.inter),
		IstioCAKeyFile:     keyPEM(t, p.interKey),
		IstioCertChainFile: certPEM(p.inter, p.root),
		IstioRootCertFile:  certPEM(append([]*x509.Certificate{p.root}, extraRoots...)...),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestLoadIstioCacerts(t *testing.T) {
	for _, alg := range []string{"rsa", "ecdsa"} {
		t.Run(alg, func(t *testing.T) {
			p := newPKI(t, alg)
			other := newPKI(t, alg) // a second root, as during a rotation
			dir := writeCacerts(t, p, other.root)

			// The sample roots say O=Istio: the trust domain must be given.
			if _, err := LoadCA(dir); err == nil || !strings.Contains(err.Error(), "trust domain") {
				t.Errorf("LoadCA without a trust domain: err = %v", err)
			}
			ca, err := LoadCAFor(dir, "cluster.local")
			if err != nil {
				t.Fatal(err)
			}
			if len(ca.RootCertificates()) != 2 || !strings.HasPrefix(ca.Name(), "file:") {
				t.Errorf("roots %d, name %q", len(ca.RootCertificates()), ca.Name())
			}
			cert, err := ca.Sign(context.Background(), idWeb, time.Hour)
			if err != nil {
				t.Fatal(err)
			}
			// Leaf, then the intermediate; the root stays out (peers hold it).
			if len(cert.Certificate) != 2 {
				t.Fatalf("chain of %d certificates, want leaf + intermediate", len(cert.Certificate))
			}
			if cert.Leaf.Issuer.CommonName != "Intermediate CA" {
				t.Errorf("leaf issued by %s", cert.Leaf.Issuer)
			}
			if _, ok := cert.PrivateKey.(*ecdsa.PrivateKey); !ok {
				t.Errorf("leaf key %T, want ECDSA", cert.PrivateKey)
			}

			// Two managers on the same cacerts: a full mTLS handshake, each
			// side verifying the other through the intermediate.
			m := newManager(t, ca, time.Hour)
			r := handshake(t, ClientConfig(m, idWeb, idCart), ServerConfig(m, idCart))
			if r.clientErr != nil || r.serverErr != nil {
				t.Fatalf("handshake: client %v, server %v", r.clientErr, r.serverErr)
			}
			exchange(t, r.client, r.server)

			// A peer whose certificate chains to the second root is trusted.
			otherDir := writeCacerts(t, other, p.root)
			otherCA, err := LoadCAFor(otherDir, "cluster.local")
			if err != nil {
				t.Fatal(err)
			}
			peer := newManager(t, otherCA, time.Hour)
			r = handshake(t, ClientConfig(peer, idWeb, idCart), ServerConfig(m, idCart))
			if r.clientErr != nil || r.serverErr != nil {
				t.Fatalf("handshake across the two roots: client %v, server %v", r.clientErr, r.serverErr)
			}
		})
	}
}

func TestLoadIstioCacertsErrors(t *testing.T) {
	p := newPKI(t, "ecdsa")
	stranger := newPKI(t, "ecdsa")
	cases := map[string]struct {
		file string
		data []byte
		want string
	}{
		"key of another ca":  {IstioCAKeyFile, keyPEM(t, stranger.interKey), "does not match"},
		"chain to nowhere":   {IstioRootCertFile, certPEM(stranger.root), "does not chain"},
		"chain not starting": {IstioCertChainFile, certPEM(p.root), "is not"},
		"leaf as ca":         {IstioCACertFile, []byte("garbage"), "no PEM certificate"},
		"small rsa key": {IstioCAKeyFile, func() []byte {
			k, _ := rsa.GenerateKey(rand.Reader, 1024)
			return pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k)})
		}(), "1024 bits"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			dir := writeCacerts(t, p)
			if err := os.WriteFile(filepath.Join(dir, tc.file), tc.data, 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := LoadCAFor(dir, "cluster.local")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.want)
			}
		})
	}
	// Without cert-chain.pem the intermediate must chain to a root itself.
	dir := writeCacerts(t, p)
	os.Remove(filepath.Join(dir, IstioCertChainFile))
	if _, err := LoadCAFor(dir, "cluster.local"); err != nil {
		t.Errorf("without cert-chain.pem: %v", err)
	}
}
