package identity

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// newCA makes a CA in a fresh directory and loads it.
func newCA(t *testing.T, td string) *CA {
	t.Helper()
	dir := t.TempDir()
	if err := InitCA(dir, td); err != nil {
		t.Fatalf("InitCA: %v", err)
	}
	ca, err := LoadCA(dir)
	if err != nil {
		t.Fatalf("LoadCA: %v", err)
	}
	return ca
}

func TestInitCAFiles(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ca") // InitCA creates missing dirs
	if err := InitCA(dir, "cluster.local"); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(dir, RootKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	if perm := st.Mode().Perm(); perm != 0o600 {
		t.Errorf("%s mode = %o, want 600", RootKeyFile, perm)
	}
	ca, err := LoadCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	if ca.TrustDomain() != "cluster.local" {
		t.Errorf("TrustDomain() = %q", ca.TrustDomain())
	}
	root := ca.Certificate()
	if !root.IsCA || root.Subject.Organization[0] != "cluster.local" {
		t.Errorf("root: IsCA=%v subject=%s", root.IsCA, root.Subject)
	}
	if len(root.URIs) != 1 || root.URIs[0].String() != "spiffe://cluster.local" {
		t.Errorf("root URIs = %v", root.URIs)
	}
	if life := root.NotAfter.Sub(root.NotBefore); life < 10*365*24*time.Hour {
		t.Errorf("root lifetime %s, want 10 years", life)
	}
	if pub, ok := root.PublicKey.(*ecdsa.PublicKey); !ok || pub.Curve != elliptic.P256() {
		t.Errorf("root key is %T, want ECDSA P-256", root.PublicKey)
	}
}

func TestInitCARefusesOverwrite(t *testing.T) {
	dir := t.TempDir()
	if err := InitCA(dir, "cluster.local"); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadFile(filepath.Join(dir, RootKeyFile))
	err := InitCA(dir, "cluster.local")
	if !errors.Is(err, ErrCAExists) {
		t.Fatalf("second InitCA: err = %v, want ErrCAExists", err)
	}
	if !strings.Contains(err.Error(), RootKeyFile) {
		t.Errorf("error %q does not name the file", err)
	}
	after, _ := os.ReadFile(filepath.Join(dir, RootKeyFile))
	if !bytes.Equal(before, after) {
		t.Error("second InitCA changed the key")
	}

	// A lone certificate (half a CA) is refused as well.
	dir2 := t.TempDir()
	os.WriteFile(filepath.Join(dir2, RootCertFile), []byte("x"), 0o644)
	if err := InitCA(dir2, "cluster.local"); !errors.Is(err, ErrCAExists) {
		t.Errorf("InitCA over a lone cert: err = %v, want ErrCAExists", err)
	}
}

func TestInitCABadTrustDomain(t *testing.T) {
	err := InitCA(t.TempDir(), "Bad_Domain")
	if err == nil || !strings.Contains(err.Error(), `"Bad_Domain"`) {
		t.Errorf("err = %v, want one naming the trust domain", err)
	}
}

func TestLoadCAErrors(t *testing.T) {
	good := t.TempDir()
	if err := InitCA(good, "cluster.local"); err != nil {
		t.Fatal(err)
	}
	other := t.TempDir()
	if err := InitCA(other, "cluster.local"); err != nil {
		t.Fatal(err)
	}
	goodKey, _ := os.ReadFile(filepath.Join(good, RootKeyFile))
	goodCert, _ := os.ReadFile(filepath.Join(good, RootCertFile))
	otherKey, _ := os.ReadFile(filepath.Join(other, RootKeyFile))

	// A leaf certificate is not a CA.
	ca, err := LoadCA(good)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.signAt(ID{"cluster.local", "a", "b"}, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	leafPEM := pemCert(leaf.Certificate[0])

	for _, tc := range []struct {
		name       string
		key, cert  []byte // nil: file absent
		wantFile   string
		wantSubstr string
	}{
		{"no files", nil, nil, RootCertFile, "no such file"},
		{"no key", nil, goodCert, RootKeyFile, "no such file"},
		{"garbage cert", goodKey, []byte("not pem"), RootCertFile, "no PEM block"},
		{"truncated cert", goodKey, goodCert[:len(goodCert)/2], RootCertFile, "no PEM block"},
		{"wrong block type", goodKey, goodKey, RootCertFile, `"PRIVATE KEY"`},
		{"corrupt cert der", goodKey, []byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"), RootCertFile, "parse certificate"},
		{"garbage key", []byte("junk"), goodCert, RootKeyFile, "no PEM block"},
		{"corrupt key der", []byte("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"), goodCert, RootKeyFile, "parse key"},
		{"mismatched key", otherKey, goodCert, RootKeyFile, "does not match"},
		{"leaf as root", goodKey, leafPEM, RootCertFile, "not a CA"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if tc.key != nil {
				os.WriteFile(filepath.Join(dir, RootKeyFile), tc.key, 0o600)
			}
			if tc.cert != nil {
				os.WriteFile(filepath.Join(dir, RootCertFile), tc.cert, 0o644)
			}
			_, err := LoadCA(dir)
			if err == nil {
				t.Fatal("LoadCA succeeded, want error")
			}
			if !strings.Contains(err.Error(), filepath.Join(dir, tc.wantFile)) {
				t.Errorf("error %q does not name %s", err, tc.wantFile)
			}
			if !strings.Contains(err.Error(), tc.wantSubstr) {
				t.Errorf("error %q does not say %q", err, tc.wantSubstr)
			}
		})
	}
}

func TestSign(t *testing.T) {
	ca := newCA(t, "cluster.local")
	id := ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "cart"}
	before := time.Now()
	cert, err := ca.signAt(id, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	leaf := cert.Leaf
	if leaf == nil || len(cert.Certificate) != 1 {
		t.Fatalf("Leaf = %v, chain length %d; want leaf set and chain [leaf]", leaf, len(cert.Certificate))
	}
	if !bytes.Equal(cert.Certificate[0], leaf.Raw) {
		t.Error("chain[0] is not the leaf")
	}
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != id.String() {
		t.Errorf("URIs = %v, want [%s]", leaf.URIs, id)
	}
	if leaf.IsCA {
		t.Error("leaf is a CA")
	}
	if pub, ok := leaf.PublicKey.(*ecdsa.PublicKey); !ok || pub.Curve != elliptic.P256() {
		t.Errorf("leaf key is %T, want ECDSA P-256", leaf.PublicKey)
	}
	if _, ok := cert.PrivateKey.(*ecdsa.PrivateKey); !ok {
		t.Errorf("PrivateKey is %T", cert.PrivateKey)
	}
	if !leaf.NotBefore.Before(before) {
		t.Errorf("NotBefore %s is not backdated before %s", leaf.NotBefore, before)
	}
	if d := leaf.NotAfter.Sub(before); d < 59*time.Minute || d > 61*time.Minute {
		t.Errorf("NotAfter is %s after issue, want ~1h", d)
	}
	if leaf.SerialNumber.Sign() <= 0 || leaf.SerialNumber.BitLen() > 128 {
		t.Errorf("serial %x is not a positive 128-bit number", leaf.SerialNumber)
	}
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth} {
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: ca.Roots(), KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			t.Errorf("verify for usage %v: %v", usage, err)
		}
	}
	// A different root does not verify it.
	other := newCA(t, "cluster.local")
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: other.Roots()}); err == nil {
		t.Error("leaf verified against a foreign root")
	}

	again, err := ca.signAt(id, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if again.Leaf.SerialNumber.Cmp(leaf.SerialNumber) == 0 {
		t.Error("two certificates share a serial")
	}
}

func TestSignRefuses(t *testing.T) {
	ca := newCA(t, "cluster.local")
	if _, err := ca.signAt(ID{"other.domain", "a", "b"}, time.Now(), time.Hour); err == nil || !strings.Contains(err.Error(), "other.domain") {
		t.Errorf("foreign trust domain: err = %v", err)
	}
	if _, err := ca.signAt(ID{"cluster.local", "", "b"}, time.Now(), time.Hour); !errors.Is(err, ErrInvalidID) {
		t.Errorf("empty namespace: err = %v, want ErrInvalidID", err)
	}
	if _, err := ca.signAt(ID{"cluster.local", "a", "b"}, time.Now(), 0); err == nil {
		t.Error("zero ttl accepted")
	}
	// A lifetime past the root's end is cut to it.
	cert, err := ca.signAt(ID{"cluster.local", "a", "b"}, time.Now(), 20*365*24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if !cert.Leaf.NotAfter.Equal(ca.Certificate().NotAfter) {
		t.Errorf("NotAfter %s, want the root's %s", cert.Leaf.NotAfter, ca.Certificate().NotAfter)
	}
}
