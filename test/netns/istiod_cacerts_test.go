package netnstest

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
	"strings"
	"testing"
	"time"
)

// TestFileCAIstioCacerts runs the agents standalone on Istio's plug-in CA layout (cacerts:
// an intermediate under a root, as Istio's tools/certs make them), RSA and ECDSA: meshed
// traffic works and the presented chain is the leaf and the intermediate.
func TestFileCAIstioCacerts(t *testing.T) {
	for _, alg := range []string{"rsa", "ecdsa"} {
		t.Run(alg, func(t *testing.T) {
			dir := writeIstioCacerts(t, alg)
			tp := New(t, 2)
			client, server := tp.Nodes[0].AddPod("client"), tp.Nodes[1].AddPod("server")
			manifest := filepath.Join(t.TempDir(), "cluster.yaml")
			m := (&Manifest{}).Namespace("mesh", "istio.io/dataplane-mode=ambient").Pod(client, "mesh", "client-sa").Pod(server, "mesh", "server-sa")
			if err := m.Write(manifest); err != nil {
				t.Fatal(err)
			}
			var agents []*Agent
			for _, n := range tp.Nodes {
				agents = append(agents, StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: dir}))
			}
			HTTPApp(t, server, 8080, "server")
			Eventually(t, 15*time.Second, func() error {
				out, err := Curl(client, URL(server.IPv4, 8080))
				if err == nil && !strings.Contains(out, "server peer="+client.IPv4.String()) {
					t.Fatalf("answer %q", out)
				}
				return err
			})
			c := waitCert(t, agents[0], "spiffe://cluster.local/ns/mesh/sa/client-sa", "valid", 5*time.Second)
			if c.Issuer != "CN=Intermediate CA,O=Istio" || len(c.Chain) != 2 || c.Chain[1].Subject != "CN=Intermediate CA,O=Istio" {
				t.Errorf("certificate issued by %q with chain %+v, want leaf + the intermediate", c.Issuer, c.Chain)
			}
		})
	}
}

// writeIstioCacerts writes ca-cert.pem, ca-key.pem (PKCS#1 or SEC 1, as openssl writes
// them), cert-chain.pem and root-cert.pem in a fresh directory.
func writeIstioCacerts(t *testing.T, alg string) string {
	t.Helper()
	newKey := func() crypto.Signer {
		if alg == "rsa" {
			k, err := rsa.GenerateKey(rand.Reader, 2048)
			if err != nil {
				t.Fatal(err)
			}
			return k
		}
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	mk := func(cn string, key crypto.Signer, parent *x509.Certificate, parentKey crypto.Signer) *x509.Certificate {
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{Organization: []string{"Istio"}, CommonName: cn},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
			KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature}
		if parent == nil {
			parent, parentKey = tmpl, key
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, key.Public(), parentKey)
		if err != nil {
			t.Fatal(err)
		}
		c, _ := x509.ParseCertificate(der)
		return c
	}
	rootKey, interKey := newKey(), newKey()
	root := mk("Root CA", rootKey, nil, nil)
	inter := mk("Intermediate CA", interKey, root, rootKey)
	certs := func(cs ...*x509.Certificate) []byte {
		var out []byte
		for _, c := range cs {
			out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
		}
		return out
	}
	var keyPEM []byte
	switch k := interKey.(type) {
	case *rsa.PrivateKey:
		keyPEM = pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k)})
	case *ecdsa.PrivateKey:
		der, _ := x509.MarshalECPrivateKey(k)
		keyPEM = pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
	}
	dir := t.TempDir()
	for name, data := range map[string][]byte{
		"ca-cert.pem": certs(inter), "ca-key.pem": keyPEM, "cert-chain.pem": certs(inter, root), "root-cert.pem": certs(root),
	} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}
