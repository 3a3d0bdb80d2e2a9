package identity

import (
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
)

func TestLoadIstioCacerts(t *testing.T) {
	for _, alg := range []string{"rsa", "ecdsa"} {
		t.Run(alg, func(t *testing.T) {
			p := identitytest.NewPKI(t, alg)
			other := identitytest.NewPKI(t, alg) // a second root, as during a rotation
			dir := identitytest.WriteCacerts(t, p, other.Root)

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
			otherDir := identitytest.WriteCacerts(t, other, p.Root)
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
	p := identitytest.NewPKI(t, "ecdsa")
	stranger := identitytest.NewPKI(t, "ecdsa")
	cases := map[string]struct {
		file string
		data []byte
		want string
	}{
		"key of another ca":  {IstioCAKeyFile, identitytest.KeyPEM(t, stranger.InterKey), "does not match"},
		"chain to nowhere":   {IstioRootCertFile, identitytest.CertPEM(stranger.Root), "does not chain"},
		"chain not starting": {IstioCertChainFile, identitytest.CertPEM(p.Root), "is not"},
		"leaf as ca":         {IstioCACertFile, []byte("garbage"), "no PEM certificate"},
		"small rsa key": {IstioCAKeyFile, func() []byte {
			k, _ := rsa.GenerateKey(rand.Reader, 1024)
			return pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k)})
		}(), "1024 bits"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			dir := identitytest.WriteCacerts(t, p)
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
	dir := identitytest.WriteCacerts(t, p)
	os.Remove(filepath.Join(dir, IstioCertChainFile))
	if _, err := LoadCAFor(dir, "cluster.local"); err != nil {
		t.Errorf("without cert-chain.pem: %v", err)
	}
}
