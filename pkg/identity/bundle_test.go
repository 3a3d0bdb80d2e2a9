package identity

import (
	"context"
	"crypto/x509"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
)

// A root rotation: the bundle file gains the new root (both trusted), then
// loses the old one; Watch follows without a restart, and a broken write in
// between keeps the last good roots.
func TestBundleWatchFollowsRootRotation(t *testing.T) {
	oldCA, newCA := newCA(t, "cluster.local"), newCA(t, "cluster.local")
	path := filepath.Join(t.TempDir(), "root-cert.pem")
	write := func(data []byte) {
		t.Helper()
		// Replace, as a ConfigMap volume update does.
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, data, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	write(identitytest.CertPEM(oldCA.cert))
	b, err := LoadBundle(path, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go b.Watch(ctx, 10*time.Millisecond, slog.New(slog.DiscardHandler))

	trusts := func(ca *CA) bool {
		_, err := ca.cert.Verify(x509.VerifyOptions{Roots: b.Roots()})
		return err == nil
	}
	write(identitytest.CertPEM(oldCA.cert, newCA.cert))
	waitfor.Until(t, "both roots", func() bool { return trusts(oldCA) && trusts(newCA) })

	write([]byte("-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n"))
	time.Sleep(50 * time.Millisecond)
	if !trusts(oldCA) || !trusts(newCA) {
		t.Error("a broken bundle file replaced the roots")
	}

	write(identitytest.CertPEM(newCA.cert))
	waitfor.Until(t, "the old root dropped", func() bool { return !trusts(oldCA) && trusts(newCA) })
}

func TestLoadBundleErrors(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t, "cluster.local")
	leaf, err := ca.signAt(idWeb, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		data []byte
		want string
	}{
		"empty":  {nil, "no PEM certificate"},
		"a leaf": {pemCert(leaf.Certificate[0]), "not a CA certificate"},
		"a key":  {[]byte("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"), `"PRIVATE KEY"`},
	} {
		p := filepath.Join(dir, name)
		os.WriteFile(p, tc.data, 0o644)
		if _, err := LoadBundle(p, "cluster.local"); err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), p) {
			t.Errorf("%s: err = %v, want it to name %s and contain %q", name, err, p, tc.want)
		}
	}
	if _, err := LoadBundle(filepath.Join(dir, "missing"), "cluster.local"); err == nil {
		t.Error("missing file accepted")
	}
}
