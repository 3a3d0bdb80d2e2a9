package identity

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redirector-mesh/redirector/internal/smallfile"
)

// Bundle is a trust bundle read from a PEM file that may hold several roots
// (during a root rotation both the old and the new one), such as the
// root-cert.pem of istiod's istio-ca-root-cert ConfigMap mounted into the
// agent. Watch re-reads it, so a rotation reaches the agent without a
// restart; a file that turns unreadable or invalid keeps the last good
// roots. A root that has expired is left out (and reported by Expired)
// rather than failing the whole file: a rotation that adds a new root next
// to an old one that has run out must still deliver the new one. It
// implements Trust.
type Bundle struct {
	path        string
	trustDomain string

	mu       sync.Mutex // serialises Reload
	cur      atomic.Pointer[bundleState]
	onChange []func() // guarded by mu
}

type bundleState struct {
	pool    *x509.CertPool
	certs   []*x509.Certificate
	expired []string // the roots left out, described
	sum     [sha256.Size]byte
}

// LoadBundle reads the roots in path for trustDomain.
func LoadBundle(path, trustDomain string) (*Bundle, error) {
	if err := ValidateTrustDomain(trustDomain); err != nil {
		return nil, fmt.Errorf("trust bundle: %w", err)
	}
	b := &Bundle{path: path, trustDomain: trustDomain}
	if _, err := b.Reload(); err != nil {
		return nil, err
	}
	return b, nil
}

// TrustDomain implements Trust.
func (b *Bundle) TrustDomain() string { return b.trustDomain }

// Roots implements Trust: the pool of the last good read.
func (b *Bundle) Roots() *x509.CertPool { return b.cur.Load().pool }

// Certificates are the roots of the last good read.
func (b *Bundle) Certificates() []*x509.Certificate { return b.cur.Load().certs }

// Expired describes the roots of the last good read that were left out
// because they had expired.
func (b *Bundle) Expired() []string { return b.cur.Load().expired }

// Path is the file the bundle is read from.
func (b *Bundle) Path() string { return b.path }

// OnChange registers f to run after every Reload that changed the roots,
// on the reloading goroutine, without the bundle's lock. A handshake
// checks the roots of its moment only: connections made before a root was
// removed must be checked again (Manager.OnTrustChange).
func (b *Bundle) OnChange(f func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.onChange = append(b.onChange, f)
}

// Reload re-reads the file; it reports whether the roots changed. On error
// the previous roots stay in force.
func (b *Bundle) Reload() (bool, error) {
	changed, notify, err := b.reload()
	if changed {
		for _, f := range notify {
			f()
		}
	}
	return changed, err
}

// reload is Reload under the lock; it returns the OnChange functions to run.
func (b *Bundle) reload() (bool, []func(), error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	data, err := smallfile.Read(b.path, maxPEMFileBytes)
	if err != nil {
		return false, nil, fmt.Errorf("trust bundle: %w", err)
	}
	sum := sha256.Sum256(bytes.TrimSpace(data))
	if old := b.cur.Load(); old != nil && old.sum == sum {
		return false, nil, nil
	}
	certs, err := ParseCertificates(data)
	if err != nil {
		return false, nil, fmt.Errorf("trust bundle %s: %w", b.path, err)
	}
	next := &bundleState{pool: x509.NewCertPool(), sum: sum}
	now := time.Now()
	for i, c := range certs {
		if !c.IsCA || !c.BasicConstraintsValid {
			return false, nil, fmt.Errorf("trust bundle %s: certificate %d (%s) is not a CA certificate", b.path, i+1, c.Subject)
		}
		if now.After(c.NotAfter) {
			next.expired = append(next.expired, fmt.Sprintf("certificate %d (%s) expired at %s", i+1, c.Subject, c.NotAfter.UTC().Format(time.RFC3339)))
			continue
		}
		next.pool.AddCert(c)
		next.certs = append(next.certs, c)
	}
	if len(next.certs) == 0 {
		return false, nil, fmt.Errorf("trust bundle %s: no root is valid: %s", b.path, strings.Join(next.expired, "; "))
	}
	b.cur.Store(next)
	return true, slices.Clone(b.onChange), nil
}

// Watch re-reads the file every interval until ctx ends, logging changes
// and errors. Polling rather than inotify: a mounted ConfigMap is updated
// by swapping a symlink, which polling sees without special cases.
func (b *Bundle) Watch(ctx context.Context, interval time.Duration, log *slog.Logger) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		changed, err := b.Reload()
		switch {
		case err != nil:
			log.Error("trust bundle reload failed; keeping the previous roots", "path", b.path, "error", err)
		case changed:
			var subjects []string
			for _, c := range b.Certificates() {
				subjects = append(subjects, c.Subject.String())
			}
			log.Info("trust bundle reloaded", "path", b.path, "roots", subjects)
			if exp := b.Expired(); len(exp) > 0 {
				log.Warn("trust bundle holds expired roots; they are not trusted", "path", b.path, "expired", exp)
			}
		}
	}
}
