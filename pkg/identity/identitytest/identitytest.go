// Package identitytest makes certificate authorities for tests: a root and an
// intermediate in Istio's plug-in CA layout (cacerts), RSA or ECDSA.
package identitytest

import (
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
	"testing"
	"time"
)

// PKI is a root and an intermediate, as Istio's tools/certs make them for
// the plug-in CA (cacerts).
type PKI struct {
	Root, Inter       *x509.Certificate
	RootKey, InterKey crypto.Signer
}

// NewKey makes an RSA 2048 (alg "rsa") or ECDSA P-256 (alg "ecdsa") key.
func NewKey(t testing.TB, alg string) crypto.Signer {
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

// MakeCACert signs a CA certificate for key with parent (nil: self-signed).
func MakeCACert(t testing.TB, subject pkix.Name, key crypto.Signer, parent *x509.Certificate, parentKey crypto.Signer) *x509.Certificate {
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
	return Sign(t, tmpl, key, parent, parentKey)
}

// Sign makes the certificate tmpl describes for key, signed by parent's key.
func Sign(t testing.TB, tmpl *x509.Certificate, key crypto.Signer, parent *x509.Certificate, parentKey crypto.Signer) *x509.Certificate {
	t.Helper()
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

// NewPKI makes a root and an intermediate with alg keys.
func NewPKI(t testing.TB, alg string) PKI {
	t.Helper()
	rootKey := NewKey(t, alg)
	root := MakeCACert(t, pkix.Name{Organization: []string{"Istio"}, CommonName: "Root CA"}, rootKey, nil, nil)
	interKey := NewKey(t, alg)
	inter := MakeCACert(t, pkix.Name{Organization: []string{"Istio"}, CommonName: "Intermediate CA"}, interKey, root, rootKey)
	return PKI{Root: root, Inter: inter, RootKey: rootKey, InterKey: interKey}
}

// CertPEM encodes certificates as PEM blocks, in order.
func CertPEM(cs ...*x509.Certificate) []byte {
	var out []byte
	for _, c := range cs {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
	}
	return out
}

// KeyPEM encodes a key the way openssl writes it for Istio's cacerts:
// PKCS#1 for RSA, SEC 1 for EC.
func KeyPEM(t testing.TB, k crypto.Signer) []byte {
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

// WriteCacerts writes Istio's plug-in CA files (ca-cert.pem, ca-key.pem,
// cert-chain.pem, root-cert.pem) in a fresh directory; extraRoots go into
// root-cert.pem after the root, as during a root rotation.
func WriteCacerts(t testing.TB, p PKI, extraRoots ...*x509.Certificate) string {
	t.Helper()
	dir := t.TempDir()
	files := map[string][]byte{
		"ca-cert.pem":    CertPEM(p.Inter),
		"ca-key.pem":     KeyPEM(t, p.InterKey),
		"cert-chain.pem": CertPEM(p.Inter, p.Root),
		"root-cert.pem":  CertPEM(append([]*x509.Certificate{p.Root}, extraRoots...)...),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}
