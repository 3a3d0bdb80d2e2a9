package istioca

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
)

// TestRootRemovalClosesIstiodConnection: the connection to istiod's CA was
// verified once, at its handshake; after the root of istiod's serving
// certificate was removed from the bundle, requests went on over it to
// whoever stood as istiod under that root (a rotation away from a leaked
// key), which could answer with certificates under the roots kept. The
// connection is now closed when the roots change and istiod no longer
// verifies, and the next one fails its handshake.
func TestRootRemovalClosesIstiodConnection(t *testing.T) {
	old, kept := newPKI(t), newPKI(t)
	f, addr := startIstiod(t, old, DefaultServerName)
	f.pki = kept // signs workloads under the root that stays
	path := filepath.Join(t.TempDir(), "roots.pem")
	write := func(pems ...string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(strings.Join(pems, "")), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(pemOf(old.root), pemOf(kept.root))
	bundle, err := identity.LoadBundle(path, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(t, Config{Addr: addr, TokenFile: writeToken(t, "tok"), Trust: bundle})
	if _, err := sign(c); err != nil {
		t.Fatal(err)
	}
	// Reordered, istiod's root kept: the connection stays.
	write(pemOf(kept.root), pemOf(old.root))
	if _, err := bundle.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := sign(c); err != nil {
		t.Fatalf("after a change keeping istiod's root: %v", err)
	}
	write(pemOf(kept.root))
	if _, err := bundle.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := sign(c); err == nil {
		t.Fatal("a certificate came over the connection to an istiod whose root was removed")
	}
}

// TestExpiredIstiodConnectionClosed: istiod's serving certificate was
// checked at the handshake only, so a connection (an xDS stream lives for
// days) stayed trusted after the certificate expired, and whoever held its
// key went on speaking as istiod. The connection is now verified again when
// the chain expires and closed; the next handshake must present a valid
// certificate, which this istiod has not.
func TestExpiredIstiodConnectionClosed(t *testing.T) {
	pki := newPKI(t)
	// x509 times have a second's resolution: the certificate ends within
	// two seconds from now.
	_, addr := startIstiodUntil(t, pki, time.Now().Add(2*time.Second), DefaultServerName)
	c := newClient(t, Config{Addr: addr, TokenFile: writeToken(t, "tok"), Trust: trustOf(pki.root)})
	if _, err := sign(c); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2*time.Second + expiryGrace + 500*time.Millisecond)
	if _, err := sign(c); err == nil {
		t.Fatal("a certificate came over a connection whose istiod's serving certificate has expired")
	}
}
