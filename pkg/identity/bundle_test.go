package identity

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
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

// An expired root in the bundle is left out and reported, not a reason to
// refuse the file: the valid roots next to it are trusted. Before, one
// expired root made the agent refuse to start, or (while running) kept it
// on the previous roots, so a root added by a rotation was never trusted.
// A bundle with no valid root at all is still refused.
func TestBundleLeavesOutExpiredRoots(t *testing.T) {
	dir := t.TempDir()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "old root"},
		NotBefore: time.Now().Add(-48 * time.Hour), NotAfter: time.Now().Add(-time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	valid := newCA(t, "cluster.local")
	both := filepath.Join(dir, "both.pem")
	os.WriteFile(both, append(pemCert(der), identitytest.CertPEM(valid.cert)...), 0o644)
	b, err := LoadBundle(both, "cluster.local")
	if err != nil {
		t.Fatalf("bundle with one expired and one valid root: %v", err)
	}
	if got := b.Certificates(); len(got) != 1 || !got[0].Equal(valid.cert) {
		t.Errorf("trusted roots %d, want only the valid one", len(got))
	}
	if exp := b.Expired(); len(exp) != 1 || !strings.Contains(exp[0], "old root") || !strings.Contains(exp[0], "expired at") {
		t.Errorf("Expired() = %q, want the old root named", exp)
	}
	leaf, err := valid.signAt(idWeb, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := leaf.Leaf.Verify(x509.VerifyOptions{Roots: b.Roots(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Errorf("leaf of the valid root: %v", err)
	}
	only := filepath.Join(dir, "expired.pem")
	os.WriteFile(only, pemCert(der), 0o644)
	if _, err := LoadBundle(only, "cluster.local"); err == nil || !strings.Contains(err.Error(), "no root is valid") || !strings.Contains(err.Error(), "old root") {
		t.Errorf("bundle of expired roots only: err = %v, want it refused naming the root", err)
	}
}

// A handshake verified its peer against the roots of its moment. When the
// bundle drops a root, the Manager says so (OnTrustChange) and Reverify
// refuses, on a connection made before, the peer that chained to it, so
// the tunnel can drain that connection; a peer under a root still in the
// bundle verifies as before, and a reload that changes nothing notifies
// no one.
func TestTrustChangeReverifies(t *testing.T) {
	oldCA, newCA := newCA(t, "cluster.local"), newCA(t, "cluster.local")
	path := filepath.Join(t.TempDir(), "root-cert.pem")
	if err := os.WriteFile(path, identitytest.CertPEM(oldCA.cert, newCA.cert), 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := LoadBundle(path, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	m := New(ManagerOptions{Signer: newCA, Trust: b})
	t.Cleanup(m.Close)
	var changes int
	m.OnTrustChange(func() { changes++ })

	state := func(ca *CA) tls.ConnectionState {
		return tls.ConnectionState{HandshakeComplete: true, PeerCertificates: []*x509.Certificate{mint(t, ca, idWeb, nil).Leaf}}
	}
	underOld, underNew := state(oldCA), state(newCA)
	for _, cs := range []tls.ConnectionState{underOld, underNew} {
		if err := m.Reverify(cs, x509.ExtKeyUsageClientAuth); err != nil {
			t.Fatalf("before the change: %v", err)
		}
	}
	if changed, err := b.Reload(); changed || err != nil || changes != 0 {
		t.Fatalf("reload of the same file: changed %v, err %v, %d notified", changed, err, changes)
	}

	if err := os.WriteFile(path, identitytest.CertPEM(newCA.cert), 0o644); err != nil {
		t.Fatal(err)
	}
	if changed, err := b.Reload(); !changed || err != nil {
		t.Fatalf("reload without the old root: changed %v, err %v", changed, err)
	}
	if changes != 1 {
		t.Errorf("%d notified of the change, want 1", changes)
	}
	if err := m.Reverify(underOld, x509.ExtKeyUsageClientAuth); !errors.Is(err, ErrUntrustedPeer) {
		t.Errorf("peer under the dropped root: err = %v, want ErrUntrustedPeer", err)
	}
	if err := m.Reverify(underNew, x509.ExtKeyUsageServerAuth); err != nil {
		t.Errorf("peer under the root kept: %v", err)
	}
}

// switchSigner signs with whichever CA it holds now.
type switchSigner struct {
	mu    sync.Mutex
	ca    *CA
	calls int
}

func (s *switchSigner) Name() string { return "switch" }

func (s *switchSigner) Sign(ctx context.Context, id ID, ttl time.Duration) (*tls.Certificate, error) {
	s.mu.Lock()
	ca := s.ca
	s.calls++
	s.mu.Unlock()
	return ca.Sign(ctx, id, ttl)
}

// TestTrustChangeRenewsOwnCertificates: a root rotation that removes the
// root this node's certificates were issued under leaves them refused by
// every peer holding the new bundle. They are renewed at once, not at
// their refresh time (half a lifetime away); those still under a kept
// root are left alone.
func TestTrustChangeRenewsOwnCertificates(t *testing.T) {
	oldCA, newCA := newCA(t, "cluster.local"), newCA(t, "cluster.local")
	path := filepath.Join(t.TempDir(), "root-cert.pem")
	if err := os.WriteFile(path, identitytest.CertPEM(oldCA.cert, newCA.cert), 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := LoadBundle(path, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	s := &switchSigner{ca: oldCA}
	m := New(ManagerOptions{Signer: s, Trust: b, TTL: time.Hour})
	t.Cleanup(m.Close)
	addAndWait(t, m, idWeb)
	calls := func() int { s.mu.Lock(); defer s.mu.Unlock(); return s.calls }

	// istiod signs under the new root; the bundle still holds both: the
	// certificate issued under the old root stays until its refresh.
	s.mu.Lock()
	s.ca = newCA
	s.mu.Unlock()
	if err := os.WriteFile(path, identitytest.CertPEM(newCA.cert, oldCA.cert), 0o644); err != nil {
		t.Fatal(err)
	}
	if changed, err := b.Reload(); !changed || err != nil {
		t.Fatalf("reload with both roots: changed %v, err %v", changed, err)
	}
	time.Sleep(100 * time.Millisecond)
	if n := calls(); n != 1 {
		t.Fatalf("%d requests after a change that kept this node's root, want 1", n)
	}

	if err := os.WriteFile(path, identitytest.CertPEM(newCA.cert), 0o644); err != nil {
		t.Fatal(err)
	}
	if changed, err := b.Reload(); !changed || err != nil {
		t.Fatalf("reload without the old root: changed %v, err %v", changed, err)
	}
	waitfor.Until(t, "a certificate under the new root", func() bool {
		c, err := m.Certificate(idWeb)
		return err == nil && c.Leaf.CheckSignatureFrom(newCA.cert) == nil
	})
	if n := calls(); n != 2 {
		t.Errorf("%d requests, want 2", n)
	}
}

// within fails t if f does not return within 5 s (a read blocked on a fifo).
func within(t *testing.T, what string, f func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		return err
	case <-time.After(5 * time.Second):
		t.Fatalf("%s did not return in 5s", what)
		return nil
	}
}

// TestSettingFilesNotRegular: a trust bundle or CA file path that holds a
// fifo, a device or an outsized file is an error naming it. Before, a fifo
// blocked the read for ever (the agent hung at start, or its bundle
// watcher for good, with the bundle's lock held), and /dev/zero or a huge
// file filled the memory, re-read every 10 s.
func TestSettingFilesNotRegular(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(dir, "big.pem")
	if err := os.WriteFile(big, make([]byte, maxPEMFileBytes+1), 0o644); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{fifo: "is not a regular file (a fifo)", "/dev/zero": "is not a regular file (a device)", big: fmt.Sprintf("has %d bytes, more than the %d read", maxPEMFileBytes+1, maxPEMFileBytes)} {
		err := within(t, "LoadBundle("+path+")", func() error { _, err := LoadBundle(path, "cluster.local"); return err })
		if err == nil || !strings.Contains(err.Error(), path+" "+want) {
			t.Errorf("LoadBundle(%s) = %v, want %q", path, err, want)
		}
	}
	// A CA directory whose root certificate is a fifo.
	caDir := t.TempDir()
	if err := syscall.Mkfifo(filepath.Join(caDir, RootCertFile), 0o600); err != nil {
		t.Fatal(err)
	}
	err := within(t, "LoadCAFor", func() error { _, err := LoadCAFor(caDir, "cluster.local"); return err })
	if err == nil || !strings.Contains(err.Error(), "is not a regular file (a fifo)") {
		t.Errorf("LoadCAFor(root-cert.pem a fifo) = %v, want it named as a fifo", err)
	}
}

// raceTrust is a Trust whose roots change, its OnChange callbacks run, in
// the middle of the first read of them after it is armed: between a
// Manager's check of a certificate and its storing, the moment a reload
// may come.
type raceTrust struct {
	mu       sync.Mutex
	pool     *x509.CertPool
	next     *x509.CertPool // swapped in at the armed read
	onChange []func()
}

func (r *raceTrust) TrustDomain() string { return "cluster.local" }

func (r *raceTrust) OnChange(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.onChange = append(r.onChange, f)
}

func (r *raceTrust) Roots() *x509.CertPool {
	r.mu.Lock()
	pool, next, fs := r.pool, r.next, r.onChange
	if next != nil {
		r.pool, r.next = next, nil
	}
	r.mu.Unlock()
	if next != nil {
		for _, f := range fs {
			f()
		}
	}
	return pool
}

// TestTrustChangeDuringIssue: the root a certificate was checked against
// is removed before the certificate is stored. The pass over the kept
// certificates ran before it was stored and did not see it; it must be
// renewed at once all the same. Before, it was served, refused by every
// peer holding the new roots, until its refresh time.
func TestTrustChangeDuringIssue(t *testing.T) {
	oldCA, newCA := newCA(t, "cluster.local"), newCA(t, "cluster.local")
	trust := &raceTrust{pool: oldCA.Roots(), next: newCA.Roots()}
	s := &switchSigner{ca: oldCA}
	m := New(ManagerOptions{Signer: s, Trust: trust, TTL: time.Hour})
	t.Cleanup(m.Close)
	// The rotation reaches the CA with the bundle: what it signs next is
	// under the new root.
	m.OnTrustChange(func() {
		s.mu.Lock()
		s.ca = newCA
		s.mu.Unlock()
	})
	m.Add(idWeb)
	waitfor.Until(t, "a certificate under the new root", func() bool {
		c, err := m.Certificate(idWeb)
		return err == nil && c.Leaf.CheckSignatureFrom(newCA.cert) == nil
	})
}

// TestTrustChangeRetriesRefusedChain: the CA signs under a new root before
// this node's bundle holds it (istiod switched to the new intermediate
// while the ConfigMap with both roots was on its way). Its answers are
// refused; once the bundle brings the root, the identity is asked for
// again at once, not when its backoff (up to 30 s, an hour here) ends.
func TestTrustChangeRetriesRefusedChain(t *testing.T) {
	oldCA, newCA := newCA(t, "cluster.local"), newCA(t, "cluster.local")
	path := filepath.Join(t.TempDir(), "root-cert.pem")
	if err := os.WriteFile(path, identitytest.CertPEM(oldCA.cert), 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := LoadBundle(path, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	s := &switchSigner{ca: newCA}
	m := New(ManagerOptions{Signer: s, Trust: b, TTL: time.Hour, BackoffMin: time.Hour})
	t.Cleanup(m.Close)
	m.Add(idWeb)
	waitfor.Until(t, "the refusal", func() bool { return stateOf(m, idWeb).State == StateFailing })
	if err := os.WriteFile(path, identitytest.CertPEM(oldCA.cert, newCA.cert), 0o644); err != nil {
		t.Fatal(err)
	}
	if changed, err := b.Reload(); !changed || err != nil {
		t.Fatalf("reload with the new root: changed %v, err %v", changed, err)
	}
	waitfor.Until(t, "a certificate under the new root", func() bool {
		_, err := m.Certificate(idWeb)
		return err == nil
	})
}
