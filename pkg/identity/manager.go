package identity

import (
	"cmp"
	"crypto/tls"
	"fmt"
	"slices"
	"sync"
	"time"
)

// DefaultTTL is the certificate lifetime NewManager uses when given none:
// Istio's default workload certificate lifetime.
const DefaultTTL = 24 * time.Hour

// CertState says where a cached certificate is in its life.
type CertState string

// Certificate states reported by Snapshot.
const (
	// StateValid: before half-life; handshakes use it as is.
	StateValid CertState = "valid"
	// StateExpiring: past half-life; the next handshake re-mints it.
	StateExpiring CertState = "expiring"
	// StateExpired: past NotAfter; no idle peer will accept it, and the next
	// handshake re-mints it.
	StateExpired CertState = "expired"
)

// CertInfo describes one cached certificate, for the inspect CLI and the
// expiry metrics.
type CertInfo struct {
	ID        ID            `json:"id"`
	Serial    string        `json:"serial"` // lowercase hex
	NotBefore time.Time     `json:"notBefore"`
	NotAfter  time.Time     `json:"notAfter"`
	Issuer    string        `json:"issuer"`
	State     CertState     `json:"state"`
	ExpiresIn time.Duration `json:"expiresIn"` // negative once expired
}

// Manager holds one certificate per local service account identity, minting
// it on first use and again once it is past half its lifetime. Rotation
// never touches an open connection: a handshake takes the *tls.Certificate
// current at that moment, and replacing the cache entry leaves the old value
// to the connections already using it. It is safe for concurrent use.
type Manager struct {
	ca    *CA
	ttl   time.Duration
	clock func() time.Time

	mu    sync.Mutex
	certs map[ID]*cached
}

type cached struct {
	cert     *tls.Certificate
	rotateAt time.Time
}

// NewManager returns a Manager minting certificates from ca valid for ttl
// (DefaultTTL if ttl <= 0). clock is the time source for minting, rotation
// and peer verification (time.Now if nil); tests inject a fake one.
func NewManager(ca *CA, ttl time.Duration, clock func() time.Time) *Manager {
	if ttl <= 0 {
		ttl = DefaultTTL
	}
	if clock == nil {
		clock = time.Now
	}
	return &Manager{ca: ca, ttl: ttl, clock: clock, certs: make(map[ID]*cached)}
}

// CA is the authority the Manager mints from; its Roots are what peers are
// verified against.
func (m *Manager) CA() *CA { return m.ca }

// Now is the Manager's clock.
func (m *Manager) Now() time.Time { return m.clock() }

// Certificate returns the current certificate for id, minting one if there
// is none or the cached one is past half-life. The result is shared and must
// not be modified.
func (m *Manager) Certificate(id ID) (*tls.Certificate, error) {
	now := m.clock()
	m.mu.Lock()
	defer m.mu.Unlock()
	if c, ok := m.certs[id]; ok && now.Before(c.rotateAt) {
		return c.cert, nil
	}
	cert, err := m.ca.signAt(id, now, m.ttl)
	if err != nil {
		return nil, fmt.Errorf("certificate for %s: %w", id, err)
	}
	// Half of the lifetime actually granted (it may be cut short by the
	// root's expiry), counted from issue time rather than the backdated
	// NotBefore.
	rotateAt := now.Add(cert.Leaf.NotAfter.Sub(now) / 2)
	m.certs[id] = &cached{cert: &cert, rotateAt: rotateAt}
	return &cert, nil
}

// Forget drops the cached certificate for id; call it when the last local
// pod running as id leaves, so no key outlives its workload on this node.
// Open connections keep working.
func (m *Manager) Forget(id ID) {
	m.mu.Lock()
	delete(m.certs, id)
	m.mu.Unlock()
}

// Snapshot describes every cached certificate, sorted by identity.
func (m *Manager) Snapshot() []CertInfo {
	now := m.clock()
	m.mu.Lock()
	out := make([]CertInfo, 0, len(m.certs))
	for id, c := range m.certs {
		leaf := c.cert.Leaf
		state := StateValid
		switch {
		case !now.Before(leaf.NotAfter):
			state = StateExpired
		case !now.Before(c.rotateAt):
			state = StateExpiring
		}
		out = append(out, CertInfo{
			ID:        id,
			Serial:    leaf.SerialNumber.Text(16),
			NotBefore: leaf.NotBefore,
			NotAfter:  leaf.NotAfter,
			Issuer:    leaf.Issuer.String(),
			State:     state,
			ExpiresIn: leaf.NotAfter.Sub(now),
		})
	}
	m.mu.Unlock()
	slices.SortFunc(out, func(a, b CertInfo) int { return cmp.Compare(a.ID.String(), b.ID.String()) })
	return out
}
