package xds

import (
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
)

// writeRoots writes roots as a PEM bundle at path.
func writeRoots(t *testing.T, path string, roots ...*x509.Certificate) {
	t.Helper()
	var b []byte
	for _, r := range roots {
		b = append(b, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: r.Raw})...)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestRootRemovalEndsIstiodStream: a stream to istiod opened while its
// serving certificate's root was trusted stayed open after that root left
// the bundle (a rotation away from a root whose key leaked): TLS verifies
// a peer at the handshake only, and istiod's stream lives for days, so
// whoever held the removed root's key and stood as istiod went on sending
// the node its workloads and policies. The connection is now verified
// again when the roots change and closed when it no longer verifies; the
// client's reconnect then fails the handshake.
func TestRootRemovalEndsIstiodStream(t *testing.T) {
	ads, addr, pki := startTLSADSPKI(t)
	next := identitytest.NewPKI(t, "ecdsa")
	path := filepath.Join(t.TempDir(), "roots.pem")
	writeRoots(t, path, pki.Root, next.Root)
	bundle, err := identity.LoadBundle(path, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := Dial(addr, "", bundle)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	h := runClient(t, ads, conn, nil)
	st, _ := h.accept()
	send(t, st, TypeAuthorization, "n1", nil)

	// A root that stays keeps the stream.
	writeRoots(t, path, next.Root, pki.Root)
	if _, err := bundle.Reload(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-st.Context().Done():
		t.Fatal("the stream ended although istiod's root stayed in the bundle")
	case <-time.After(200 * time.Millisecond):
	}

	writeRoots(t, path, next.Root)
	if _, err := bundle.Reload(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-st.Context().Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the stream to istiod stayed open after its serving certificate's root was removed")
	}
	select {
	case <-ads.streams:
		t.Fatal("a new stream reached istiod under the removed root")
	case <-time.After(500 * time.Millisecond):
	}
}
