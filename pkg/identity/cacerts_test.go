package identity

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io/fs"
	"math/big"
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

// TestLoadIstioCacertsThatIssueNothingAccepted: a plug-in CA whose every
// certificate the manager (and peers) would refuse is refused at load,
// naming why. Before, it loaded and the agent started; then every
// identity's certificate failed at each request, and every meshed pod's
// handshakes with it: an intermediate whose extended key usage allows
// server authentication only (common for an enterprise PKI's issuing CA;
// the load checked the chain for any usage), a chain longer than peers
// take, a root with an RSA key rustls refuses.
func TestLoadIstioCacertsThatIssueNothingAccepted(t *testing.T) {
	rootKey := identitytest.NewKey(t, "ecdsa")
	root := identitytest.MakeCACert(t, pkix.Name{CommonName: "Root CA"}, rootKey, nil, nil)
	caTmpl := func(cn string) *x509.Certificate {
		return &x509.Certificate{
			SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
			BasicConstraintsValid: true, IsCA: true,
		}
	}

	// Server authentication only.
	serverOnly := caTmpl("Server-only issuing CA")
	serverOnly.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	serverOnlyKey := identitytest.NewKey(t, "ecdsa")
	serverOnlyCA := identitytest.PKI{Root: root, RootKey: rootKey, Inter: identitytest.Sign(t, serverOnly, serverOnlyKey, root, rootKey), InterKey: serverOnlyKey}

	// anyExtendedKeyUsage only, which crypto/x509 takes for every usage and
	// rustls for none.
	anyOnly := caTmpl("Any-usage issuing CA")
	anyOnly.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageAny}
	anyOnlyKey := identitytest.NewKey(t, "ecdsa")
	anyOnlyCA := identitytest.PKI{Root: root, RootKey: rootKey, Inter: identitytest.Sign(t, anyOnly, anyOnlyKey, root, rootKey), InterKey: anyOnlyKey}

	// Nine intermediates: with the leaf, ten certificates presented.
	longChain := []*x509.Certificate{}
	parent, parentKey := root, crypto.Signer(rootKey)
	for i := range 9 {
		k := identitytest.NewKey(t, "ecdsa")
		c := identitytest.Sign(t, caTmpl(fmt.Sprintf("Intermediate %d", i)), k, parent, parentKey)
		longChain = append([]*x509.Certificate{c}, longChain...)
		parent, parentKey = c, k
	}

	// A root with a 1024-bit RSA key.
	weakKey, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	weakRoot := identitytest.MakeCACert(t, pkix.Name{CommonName: "Weak root"}, weakKey, nil, nil)
	interKey := identitytest.NewKey(t, "ecdsa")
	weakRootCA := identitytest.PKI{Root: weakRoot, RootKey: weakKey, Inter: identitytest.Sign(t, caTmpl("Intermediate"), interKey, weakRoot, weakKey), InterKey: interKey}

	for name, tc := range map[string]struct {
		dir  func() string
		want string
	}{
		"server-only intermediate": {func() string { return identitytest.WriteCacerts(t, serverOnlyCA) }, "incompatible key usage"},
		"chain too long": {func() string {
			dir := identitytest.WriteCacerts(t, identitytest.PKI{Root: root, RootKey: rootKey, Inter: longChain[0], InterKey: parentKey})
			if err := os.WriteFile(filepath.Join(dir, IstioCertChainFile), identitytest.CertPEM(append(longChain, root)...), 0o600); err != nil {
				t.Fatal(err)
			}
			return dir
		}, "chain of 10 certificates, at most 8"},
		"weak rsa root":          {func() string { return identitytest.WriteCacerts(t, weakRootCA) }, "rsa key of 1024 bits"},
		"any-usage intermediate": {func() string { return identitytest.WriteCacerts(t, anyOnlyCA) }, "extended key usage does not name"},
	} {
		t.Run(name, func(t *testing.T) {
			dir := tc.dir()
			_, err := LoadCAFor(dir, "cluster.local")
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "cannot issue a certificate") {
				t.Fatalf("LoadCAFor = %v, want an error saying it cannot issue a certificate: %q", err, tc.want)
			}
		})
	}
	// The usual layout still loads.
	if _, err := LoadCAFor(identitytest.WriteCacerts(t, identitytest.NewPKI(t, "rsa")), "cluster.local"); err != nil {
		t.Errorf("LoadCAFor(NewPKI) = %v", err)
	}
}

// TestCAKeyExposedByMode: both layouts report a signing key whose file
// group or others may read or write (a Secret volume's default 0644), the
// file a symlink names included, as a Secret volume presents its keys, and
// report none for 0600 and 0400.
func TestCAKeyExposedByMode(t *testing.T) {
	fileDir := t.TempDir()
	if err := InitCA(fileDir, "cluster.local"); err != nil {
		t.Fatal(err)
	}
	istioDir := identitytest.WriteCacerts(t, identitytest.NewPKI(t, "ecdsa"))
	for _, layout := range []struct{ name, dir, key string }{
		{"file", fileDir, RootKeyFile},
		{"istio", istioDir, IstioCAKeyFile},
	} {
		for _, mode := range []fs.FileMode{0o600, 0o400, 0o640, 0o644, 0o604, 0o620} {
			t.Run(fmt.Sprintf("%s/%04o", layout.name, mode), func(t *testing.T) {
				key := filepath.Join(layout.dir, layout.key)
				if err := os.Chmod(key, mode); err != nil {
					t.Fatal(err)
				}
				ca, err := LoadCAFor(layout.dir, "cluster.local")
				if err != nil {
					t.Fatal(err)
				}
				path, got, exposed := ca.ExposedKey()
				if want := mode&0o066 != 0; exposed != want || got != mode || path != key {
					t.Errorf("ExposedKey() = %s, %04o, %v; want %s, %04o, %v", path, got, exposed, key, mode, want)
				}
			})
		}
	}
	// A Secret volume: the key's name is a symlink to the real file.
	real := filepath.Join(istioDir, "..data-key")
	link := filepath.Join(istioDir, IstioCAKeyFile)
	if err := os.Rename(link, real); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(real, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	ca, err := LoadCAFor(istioDir, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	if _, mode, exposed := ca.ExposedKey(); !exposed || mode != 0o644 {
		t.Errorf("a 0644 key behind a symlink: ExposedKey() = %04o, %v; want 0644, true", mode, exposed)
	}
}
