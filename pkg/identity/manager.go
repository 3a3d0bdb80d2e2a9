package identity

import (
	"bytes"
	"cmp"
	"context"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// DefaultTTL is the certificate lifetime a Manager asks for when given none:
// Istio's default workload certificate lifetime.
const DefaultTTL = 24 * time.Hour

// Defaults of ManagerOptions.
const (
	DefaultRequestTimeout = 10 * time.Second
	DefaultMaxConcurrent  = 8
	DefaultBackoffMin     = 500 * time.Millisecond
	DefaultBackoffMax     = 30 * time.Second
	// DefaultRequestRate and DefaultRequestBurst bound CA requests node
	// wide (see caGate): a node starting its 110 pods (the kubelet's
	// default maximum), each of its own identity, has them all issued in
	// about 2.5 s against a healthy CA, while identities refused together
	// retry at no more than 25 requests a second.
	DefaultRequestRate  = 25.0
	DefaultRequestBurst = 50
	// DefaultReleaseGrace is how long an identity's certificate is kept
	// after its last local pod left. A replaced pod (a rollout, an
	// eviction, a restarted node's pods re-created) comes back under the
	// same identity within seconds to a minute: kept that long, the
	// replacement is served at once, with no CA request, even while the
	// CA is down. Longer would keep keys of workloads that left the node.
	DefaultReleaseGrace = 2 * time.Minute
)

// MaxChainLen bounds the certificates a signer's answer may hold (the leaf
// and what follows it). A real chain is two to four long; every one is
// sent in each handshake, so a CA answering with hundreds is refused.
const MaxChainLen = 8

// defaultClockCheck is how often a waiting worker compares the time with
// its refresh time; see Manager.sleep.
const defaultClockCheck = 10 * time.Second

// Signer issues workload certificates: the file CA signs locally, the istiod
// client (package istioca) asks istiod. The Manager calls Sign only from its
// background fetches, never from a handshake, so Sign may take as long as
// ctx allows.
type Signer interface {
	// Sign returns a certificate for id valid for about ttl: the chain leaf
	// first, its private key, and Leaf set. Failures should be *CAError so
	// metrics can tell their reasons apart.
	Sign(ctx context.Context, id ID, ttl time.Duration) (*tls.Certificate, error)
	// Name says which CA this is, for inspect and logs, e.g.
	// "file:/etc/redirector/ca" or "istiod:istiod.istio-system.svc:15012".
	Name() string
}

// Trust is what peers' certificates are verified against: the mesh roots
// (a bundle may hold several during a root rotation) and the trust domain.
type Trust interface {
	TrustDomain() string
	// Roots is the current pool; it may change between calls (a reloaded
	// bundle). Callers must not modify it.
	Roots() *x509.CertPool
}

// CertState says where an identity's certificate is in its life.
type CertState string

// Certificate states reported by Snapshot.
const (
	// StatePending: no certificate yet; the first request is under way.
	StatePending CertState = "pending"
	// StateValid: before its refresh time; handshakes use it as is.
	StateValid CertState = "valid"
	// StateRefreshing: past its refresh time (about half-life); a new one is
	// being requested, handshakes still use this one.
	StateRefreshing CertState = "refreshing"
	// StateFailing: the last request failed (see LastError); handshakes use
	// the certificate while it is unexpired, and fail closed without one.
	StateFailing CertState = "failing"
	// StateExpired: past NotAfter and no new one yet; handshakes fail closed.
	StateExpired CertState = "expired"
	// StateNotYetValid: the clock is before the certificate's NotBefore (it
	// was stepped back since the certificate was issued); handshakes fail
	// closed while a new one is requested.
	StateNotYetValid CertState = "not_yet_valid"
	// StateGrace: the identity's last local pod left less than
	// ReleaseGrace ago; the certificate is kept (renewed when due) but not
	// served, for a replacement pod to take at once.
	StateGrace CertState = "grace"
)

// CertInfo describes one identity the Manager keeps a certificate for, for
// the inspect CLI, the config dump and the expiry metric.
type CertInfo struct {
	ID    ID        `json:"id"`
	CA    string    `json:"ca"` // Signer.Name
	State CertState `json:"state"`
	// Certificate fields are zero while State is pending or a failure
	// happened before the first certificate.
	Serial    string        `json:"serial,omitempty"` // lowercase hex
	NotBefore time.Time     `json:"notBefore"`
	NotAfter  time.Time     `json:"notAfter"` // the chain's end: the leaf's, or an issuer's if earlier
	RefreshAt time.Time     `json:"refreshAt"`
	Issuer    string        `json:"issuer,omitempty"`
	Chain     []ChainCert   `json:"chain,omitempty"` // leaf first, as presented to peers
	ExpiresIn time.Duration `json:"expiresIn"`       // negative once expired
	LastError string        `json:"lastError,omitempty"`
	// Failures counts requests failed in a row.
	Failures int `json:"failures,omitempty"`
}

// ChainCert is one certificate of a presented chain.
type ChainCert struct {
	Subject  string    `json:"subject"`
	Issuer   string    `json:"issuer"`
	Serial   string    `json:"serial"`
	NotAfter time.Time `json:"notAfter"`
	PEM      string    `json:"pem"`
}

// ManagerOptions configure a Manager; Signer and Trust are required.
type ManagerOptions struct {
	Signer Signer
	Trust  Trust
	// TTL is the lifetime asked for (DefaultTTL if <= 0). The CA may grant
	// less; refresh follows what was granted.
	TTL time.Duration
	// Clock is the time source for validity and peer verification
	// (time.Now if nil); waiting uses real timers.
	Clock func() time.Time
	// RequestTimeout bounds one CA request (DefaultRequestTimeout).
	RequestTimeout time.Duration
	// MaxConcurrent bounds CA requests in flight (DefaultMaxConcurrent).
	MaxConcurrent int
	// BackoffMin and BackoffMax bound the jittered exponential backoff
	// after failed requests (DefaultBackoffMin, DefaultBackoffMax).
	BackoffMin, BackoffMax time.Duration
	// RequestRate (a second) and RequestBurst bound the CA requests of all
	// identities together, renewals and first certificates alike
	// (DefaultRequestRate, DefaultRequestBurst).
	RequestRate  float64
	RequestBurst int
	// ReleaseGrace is how long an identity is kept, not served, after its
	// last local pod left (DefaultReleaseGrace; negative: dropped at once).
	ReleaseGrace time.Duration
	Logger       *slog.Logger
}

// Manager keeps one certificate per identity of this node's enrolled pods.
// An identity is added when its first local pod is enrolled (Sync or Add):
// a background worker requests its certificate at once, again at about
// half-life, and after a failure with jittered exponential backoff; the
// requests of all identities pass one caGate. When its last local pod
// leaves, a certificate is kept, not served, for ReleaseGrace, for a
// replacement pod to take at once (Add), and then dropped, so no key
// outlives its workloads on this node by more than that.
//
// Handshakes only read the cache (Certificate): one that finds no valid
// certificate fails closed, counted by reason, and never waits for the CA.
// Rotation never touches an open connection: a handshake takes the
// certificate current at that moment. It is safe for concurrent use.
type Manager struct {
	opts    ManagerOptions
	clock   func() time.Time
	gate    *caGate
	metrics *caMetrics
	log     *slog.Logger
	// clockCheck is the longest a worker waits without looking at the
	// clock again (see sleep).
	clockCheck time.Duration

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	entries map[ID]*entry
}

// entry is one identity's state; fields other than id, cancel, ready,
// wake and recheck are guarded by Manager.mu.
type entry struct {
	id      ID
	cancel  context.CancelFunc
	ready   chan struct{} // closed on the first certificate
	wake    chan struct{} // a send makes the worker request now (renewUntrusted)
	recheck chan struct{} // a send makes the worker look at graceEnd again
	// graceEnd is set while the identity's last local pod left less than
	// ReleaseGrace ago (Forget), nil while a local pod holds it; the
	// worker drops the entry when it passes, unless Add cleared it.
	graceEnd *deadline
	cert     *tls.Certificate
	// end is when peers stop verifying cert: the leaf's NotAfter or,
	// earlier, that of a certificate its chain goes through.
	end       time.Time
	refreshAt time.Time
	lastErr   error
	failures  int
}

// NewManager returns a Manager that mints from the file CA ca, which also
// provides the roots. See New.
func NewManager(ca *CA, ttl time.Duration, clock func() time.Time) *Manager {
	return New(ManagerOptions{Signer: ca, Trust: ca, TTL: ttl, Clock: clock})
}

// New returns a Manager; Close stops its workers.
func New(o ManagerOptions) *Manager {
	if o.TTL <= 0 {
		o.TTL = DefaultTTL
	}
	if o.Clock == nil {
		o.Clock = time.Now
	}
	if o.RequestTimeout <= 0 {
		o.RequestTimeout = DefaultRequestTimeout
	}
	if o.MaxConcurrent <= 0 {
		o.MaxConcurrent = DefaultMaxConcurrent
	}
	if o.BackoffMin <= 0 {
		o.BackoffMin = DefaultBackoffMin
	}
	if o.BackoffMax < o.BackoffMin {
		o.BackoffMax = max(DefaultBackoffMax, o.BackoffMin)
	}
	if o.RequestRate <= 0 {
		o.RequestRate = DefaultRequestRate
	}
	if o.RequestBurst <= 0 {
		o.RequestBurst = DefaultRequestBurst
	}
	if o.ReleaseGrace == 0 {
		o.ReleaseGrace = DefaultReleaseGrace
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &Manager{
		opts: o, clock: o.Clock, gate: newCAGate(o.RequestRate, o.RequestBurst, o.MaxConcurrent), metrics: newCAMetrics(),
		log: o.Logger, clockCheck: defaultClockCheck, ctx: ctx, cancel: cancel, entries: make(map[ID]*entry),
	}
	m.OnTrustChange(m.renewUntrusted)
	return m
}

// Close stops every worker and waits for them; cached certificates of
// identities with local pods stay readable, those kept after their last
// pod left are dropped.
func (m *Manager) Close() {
	m.cancel()
	m.mu.Lock()
	for id, e := range m.entries {
		if e.graceEnd != nil {
			delete(m.entries, id)
		}
	}
	m.mu.Unlock()
	m.wg.Wait()
}

// Trust is what peers are verified against.
func (m *Manager) Trust() Trust { return m.opts.Trust }

// CAName is the Signer's name.
func (m *Manager) CAName() string { return m.opts.Signer.Name() }

// Now is the Manager's clock.
func (m *Manager) Now() time.Time { return m.clock() }

// Sync makes the identities served exactly ids: new ones are added (their
// first request starts now, in the background, unless a certificate kept
// since their last pod left is taken back) and the others forgotten.
// Call it with the identities of this node's enrolled pods whenever that
// set may have changed.
func (m *Manager) Sync(ids []ID) {
	want := make(map[ID]bool, len(ids))
	for _, id := range ids {
		want[id] = true
		m.Add(id)
	}
	m.mu.Lock()
	var gone []ID
	for id := range m.entries {
		if !want[id] {
			gone = append(gone, id)
		}
	}
	m.mu.Unlock()
	for _, id := range gone {
		m.Forget(id)
	}
}

// Add starts keeping a certificate for id, if it is not kept already; one
// kept since id's last pod left (Forget) is served again as it is, its
// worker going on. It does not wait for the CA: see Wait.
func (m *Manager) Add(id ID) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e, ok := m.entries[id]; ok {
		if e.graceEnd != nil {
			e.graceEnd = nil
			signal(e.recheck)
			m.log.Debug("identity back within the grace period: its kept certificate is served again", "identity", id)
		}
		return
	}
	if m.ctx.Err() != nil {
		return
	}
	ctx, cancel := context.WithCancel(m.ctx)
	e := &entry{id: id, cancel: cancel, ready: make(chan struct{}), wake: make(chan struct{}, 1), recheck: make(chan struct{}, 1)}
	m.entries[id] = e
	m.wg.Add(1)
	go m.run(ctx, e)
}

// Forget stops serving id's certificate: id's last local pod left. A
// certificate is kept for ReleaseGrace, renewed only when due, for Add to
// take back, and dropped after; an identity with none (its first request
// pending or failing) is dropped now and its request cancelled. Forgetting
// an identity already in its grace period does not extend it, so those
// kept are no more than the identities whose last pod left within it.
// Open connections keep the certificate they use.
func (m *Manager) Forget(id ID) {
	now := m.clock()
	m.mu.Lock()
	e, ok := m.entries[id]
	if !ok || e.graceEnd != nil {
		m.mu.Unlock()
		return
	}
	if e.cert != nil && m.opts.ReleaseGrace > 0 && m.ctx.Err() == nil {
		g := after(now, m.opts.ReleaseGrace)
		e.graceEnd = &g
		m.mu.Unlock()
		signal(e.recheck)
		m.log.Debug("last local pod of the identity left: certificate kept for a replacement", "identity", id, "grace", m.opts.ReleaseGrace)
		return
	}
	delete(m.entries, id)
	m.mu.Unlock()
	e.cancel()
}

// drop ends the grace period g of e, if it is still e's: Add took e back
// or Forget began another meanwhile otherwise.
func (m *Manager) drop(e *entry, g *deadline) bool {
	m.mu.Lock()
	ok := e.graceEnd == g && m.entries[e.id] == e
	if ok {
		delete(m.entries, e.id)
	}
	m.mu.Unlock()
	if ok {
		e.cancel()
		m.log.Debug("grace period over: certificate of an identity without local pods dropped", "identity", e.id)
	}
	return ok
}

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// Wait blocks until id has a certificate (or ctx ends); id must have been
// added. It is for callers that may wait, such as tests and tools, never a
// handshake.
func (m *Manager) Wait(ctx context.Context, id ID) error {
	m.mu.Lock()
	e, ok := m.entries[id]
	ok = ok && e.graceEnd == nil
	m.mu.Unlock()
	if !ok {
		return fmt.Errorf("wait for %s: %w: identity not added", id, ErrNoCertificate)
	}
	select {
	case <-e.ready:
		return nil
	case <-ctx.Done():
		m.mu.Lock()
		last := e.lastErr
		m.mu.Unlock()
		if last != nil {
			return fmt.Errorf("wait for %s: %w (last CA error: %w)", id, ctx.Err(), last)
		}
		return fmt.Errorf("wait for %s: %w", id, ctx.Err())
	}
}

// Certificate returns id's current certificate for a handshake. It never
// asks the CA: with no unexpired certificate it fails closed (ErrNoCertificate,
// with the last CA error if any) and counts the reason. The result is shared
// and must not be modified.
func (m *Manager) Certificate(id ID) (*tls.Certificate, error) {
	cert, reason, err := m.lookup(id)
	if err != nil {
		m.metrics.unavailable.WithLabelValues(reason).Inc()
		return nil, err
	}
	return cert, nil
}

// Ready reports whether id has an unexpired certificate, like Certificate
// but without counting a miss: for readiness checks.
func (m *Manager) Ready(id ID) error {
	_, _, err := m.lookup(id)
	return err
}

// Reasons a handshake found no certificate, the label of
// redirector_certificate_unavailable_total.
const (
	UnavailableNotKept  = "not_enrolled" // identity of no enrolled local pod
	UnavailablePending  = "pending"      // first request not answered yet
	UnavailableFailing  = "ca_failing"   // no certificate and the CA refused or failed
	UnavailableExpired  = "expired"      // the last certificate expired unrenewed
	UnavailableNotValid = "not_yet_valid"
)

func (m *Manager) lookup(id ID) (*tls.Certificate, string, error) {
	now := m.clock()
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.entries[id]
	switch {
	case !ok || e.graceEnd != nil:
		return nil, UnavailableNotKept, fmt.Errorf("%w for %s: not an identity of an enrolled pod on this node", ErrNoCertificate, id)
	case e.cert == nil && e.lastErr != nil:
		return nil, UnavailableFailing, fmt.Errorf("%w for %s: %d CA requests failed, last: %w", ErrNoCertificate, id, e.failures, e.lastErr)
	case e.cert == nil:
		return nil, UnavailablePending, fmt.Errorf("%w for %s yet: request to %s pending", ErrNoCertificate, id, m.opts.Signer.Name())
	case !now.Before(e.end):
		if e.lastErr != nil {
			return nil, UnavailableExpired, fmt.Errorf("%w for %s: its chain expired at %s, renewal failing: %w", ErrNoCertificate, id, e.end.UTC().Format(time.RFC3339), e.lastErr)
		}
		return nil, UnavailableExpired, fmt.Errorf("%w for %s: its chain expired at %s", ErrNoCertificate, id, e.end.UTC().Format(time.RFC3339))
	case now.Before(e.cert.Leaf.NotBefore):
		return nil, UnavailableNotValid, fmt.Errorf("%w for %s: not valid before %s", ErrNoCertificate, id, e.cert.Leaf.NotBefore.UTC().Format(time.RFC3339))
	}
	return e.cert, "", nil
}

// run is id's worker: request, wait until the refresh time (or the backoff
// after a failure), repeat, until Forget, the end of a grace period, or
// Close.
func (m *Manager) run(ctx context.Context, e *entry) {
	defer m.wg.Done()
	backoff := m.opts.BackoffMin
	for {
		cert, end, err := m.request(ctx, e.id, m.urgent(e))
		if ctx.Err() != nil {
			return
		}
		now := m.clock()
		var wait time.Duration
		// validFrom, when set, ends the wait if the clock goes back before
		// it (see sleep).
		var validFrom time.Time
		// A certificate with an error is a short grant (see request): asked
		// again at the renewal pace, not the backoff's, and served unless
		// the one kept still verifies and outlives it. Only this worker
		// writes e.cert.
		shortGrant := cert != nil
		keptGood := false
		if shortGrant {
			m.mu.Lock()
			kept := e.cert
			m.mu.Unlock()
			if kept != nil {
				_, cerr := m.check(e.id, kept)
				keptGood = cerr == nil
			}
		}
		m.mu.Lock()
		if err != nil {
			if shortGrant {
				wait = m.renewFloor()
				wait = wait/2 + rand.N(wait/2+1)
			} else {
				// Full jitter in [backoff/2, backoff]: agents restarted
				// together do not retry in step.
				wait = backoff/2 + rand.N(backoff/2+1)
				backoff = min(2*backoff, m.opts.BackoffMax)
			}
			first := false
			if shortGrant && (!keptGood || e.end.Before(end)) {
				first = e.cert == nil
				e.cert, e.end, e.refreshAt = cert, end, now.Add(wait)
				validFrom = cert.Leaf.NotBefore
			}
			e.lastErr = err
			e.failures++
			failures := e.failures
			hasCert := e.cert != nil && now.Before(e.end)
			m.mu.Unlock()
			if first {
				close(e.ready)
			}
			m.log.Warn("certificate request failed", "identity", e.id, "ca", m.opts.Signer.Name(),
				"reason", ReasonOf(err), "failures", failures, "have_valid_certificate", hasCert, "retry_in", wait.Round(time.Millisecond), "error", err)
		} else {
			first := e.cert == nil
			e.cert, e.end, e.lastErr, e.failures = cert, end, nil, 0
			validFrom = cert.Leaf.NotBefore
			// Renewal follows what was granted, but never later than if
			// the TTL asked for had been granted: a CA granting years does
			// not keep one key in use for years. The end is the chain's:
			// past an issuer's end the leaf verifies no more.
			until := end
			if asked := now.Add(m.opts.TTL); asked.Before(until) {
				until = asked
			}
			e.refreshAt = refreshTime(now, until)
			wait = e.refreshAt.Sub(now)
			// Granted far less than asked: asking again at half of a few
			// seconds would hammer the CA in a loop. Not sooner than a
			// quarter of the TTL asked for, at most BackoffMax, jittered
			// (the certificate outlives that: request refuses one that
			// does not).
			floor := m.renewFloor()
			short := wait < floor
			if short {
				wait = floor/2 + rand.N(floor/2+1)
				e.refreshAt = now.Add(wait)
			}
			m.mu.Unlock()
			backoff = m.opts.BackoffMin
			if first {
				close(e.ready)
			}
			// A change of the roots between request's check and the store
			// above went by unseen: renewUntrusted saw the certificate
			// before this one, or none. Checked again now that it is
			// stored, a later change sees it.
			if _, err := m.check(e.id, cert); err != nil {
				m.log.Info("trust bundle changed while the certificate was issued: it no longer chains to a root; renewing now", "identity", e.id, "ca", m.opts.Signer.Name())
				signal(e.wake)
			}
			if granted := end.Sub(now); short || granted > m.opts.TTL+time.Minute {
				m.log.Warn("certificate lifetime is not what was asked for; renewal paced by the lifetime asked for", "identity", e.id, "ca", m.opts.Signer.Name(),
					"asked", m.opts.TTL, "granted", granted.Round(time.Second), "refresh_in", wait.Round(time.Millisecond))
			}
			m.log.Debug("certificate issued", "identity", e.id, "ca", m.opts.Signer.Name(), "not_after", end, "refresh_at", e.refreshAt)
		}
		due := after(now, wait)
	waiting:
		for {
			m.mu.Lock()
			grace := e.graceEnd
			m.mu.Unlock()
			switch m.sleep(ctx, due, grace, e, validFrom) {
			case sleepCancelled:
				return
			case sleepGraceOver:
				if m.drop(e, grace) {
					return
				}
			case sleepRenew:
				break waiting
			}
		}
	}
}

// urgent is whether e has no certificate a handshake would take while a
// local pod holds it: its request goes ahead of renewals (see caGate).
func (m *Manager) urgent(e *entry) bool {
	now := m.clock()
	m.mu.Lock()
	defer m.mu.Unlock()
	if e.graceEnd != nil {
		return false
	}
	return e.cert == nil || !now.Before(e.end) || now.Before(e.cert.Leaf.NotBefore)
}

// renewUntrusted wakes the worker of every identity whose certificate no
// longer chains to the current roots, so it is renewed now, not at its
// refresh time: a root rotation removed the root it was issued under, and
// peers holding the new bundle refuse it. It stays in use meanwhile (a
// peer whose bundle is not yet updated still takes it).
//
// An identity whose last answer was refused for not chaining to the roots
// is asked again now too: a CA that signs under a new root before this
// node's bundle holds it (istiod switched to the new intermediate as the
// ConfigMap with both roots was still on its way) is answered in vain
// until the bundle arrives, and the backoff after those refusals may
// have grown to BackoffMax.
func (m *Manager) renewUntrusted() {
	type kept struct {
		e    *entry
		cert *tls.Certificate
	}
	var all []kept
	var refused []*entry
	m.mu.Lock()
	for _, e := range m.entries {
		switch {
		case e.lastErr != nil && ReasonOf(e.lastErr) == ReasonUntrustedChain:
			refused = append(refused, e)
		case e.cert != nil:
			all = append(all, kept{e, e.cert})
		}
	}
	m.mu.Unlock()
	for _, e := range refused {
		m.log.Info("trust bundle changed: asking again for the certificate refused for not chaining to a root", "identity", e.id, "ca", m.opts.Signer.Name())
		signal(e.wake)
	}
	for _, k := range all {
		if _, err := m.check(k.e.id, k.cert); err == nil {
			continue
		}
		m.log.Info("trust bundle changed: certificate no longer chains to a root; renewing now", "identity", k.e.id, "ca", m.opts.Signer.Name())
		signal(k.e.wake)
	}
}

// deadline is a time waited for on two clocks, whichever gets there
// first (see sleep): mono on the monotonic clock, at on the Manager's.
type deadline struct{ mono, at time.Time }

// after is d after from, the Manager's time d was computed at (not read
// again here: a step of the wall clock in between would move the deadline
// by the step).
func after(from time.Time, d time.Duration) deadline {
	return deadline{mono: time.Now().Add(d), at: from.Round(0).Add(d)} // Round(0): compared on the wall clock
}

func (m *Manager) passed(d deadline) bool {
	return !time.Now().Before(d.mono) || !m.clock().Before(d.at)
}

// Why sleep returned.
const (
	sleepCancelled = iota // ctx ended
	sleepRenew            // due passed, the clock went before validFrom, or a send on e.wake
	sleepGraceOver        // grace passed
	sleepRecheck          // a send on e.recheck: grace may have changed
)

// sleep waits for due, or for grace if set (the end of e's grace period),
// on the monotonic clock or on the Manager's clock, whichever gets there
// first, or for a send on e.wake or e.recheck. Certificates expire by the
// wall clock, but a timer runs on the monotonic one, which stops while
// the machine is suspended (a paused VM) and does not follow a step of
// the wall clock: a worker woken past its refresh time, or past the
// certificate's expiry, would otherwise wait out the rest of its timer (up
// to half a lifetime) serving nothing. So it looks at the clock again
// every clockCheck.
//
// A step back is seen the same way: once the clock is before validFrom
// (the NotBefore of the certificate just stored, if any) it returns at
// once. A certificate signed on a clock that was then set back, by more
// than the 2 minutes it is backdated (the file CA signs on the node's
// clock; a node whose clock ran ahead at start), is refused by every
// handshake until the clock reaches its NotBefore again, which the wait
// for its refresh time could outlast by hours.
func (m *Manager) sleep(ctx context.Context, due deadline, grace *deadline, e *entry, validFrom time.Time) int {
	for {
		now := m.clock()
		if grace != nil && m.passed(*grace) {
			return sleepGraceOver
		}
		if m.passed(due) || now.Before(validFrom) {
			return sleepRenew
		}
		left := min(time.Until(due.mono), due.at.Sub(now))
		if grace != nil {
			left = min(left, time.Until(grace.mono), grace.at.Sub(now))
		}
		t := time.NewTimer(min(left, m.clockCheck))
		select {
		case <-ctx.Done():
			t.Stop()
			return sleepCancelled
		case <-e.wake:
			t.Stop()
			return sleepRenew
		case <-e.recheck:
			t.Stop()
			return sleepRecheck
		case <-t.C:
		}
	}
}

// refreshTime is about half of the lifetime granted, counted from issue
// (not the backdated NotBefore), less up to 5% of it at random so that
// identities issued together do not all renew in the same instant.
func refreshTime(issued, notAfter time.Time) time.Time {
	life := notAfter.Sub(issued)
	if life <= 0 {
		return issued
	}
	return issued.Add(life/2 - rand.N(life/20+1))
}

// renewFloor is the soonest a certificate is asked for again after one was
// granted: a quarter of the TTL asked for, at most BackoffMax.
func (m *Manager) renewFloor() time.Duration { return min(m.opts.BackoffMax, m.opts.TTL/4) }

// request makes one CA request, once the gate admits it (urgent: ahead of
// renewals), bounded in time, and checks what came back; it returns the
// certificate and the end of its chain (see check).
//
// A certificate whose chain ends within renewFloor would expire before it
// could be renewed: the identity would be left without one until the next
// request, and a renewal replacing a certificate with hours left would
// take those hours away. It is returned with a ReasonShortLifetime error,
// counted as a failure, for the caller to serve only when nothing it keeps
// lasts longer.
func (m *Manager) request(ctx context.Context, id ID, urgent bool) (*tls.Certificate, time.Time, error) {
	held, err := m.gate.acquire(ctx, urgent)
	if held {
		m.metrics.delayed.Inc()
	}
	if err != nil {
		return nil, time.Time{}, err
	}
	defer m.gate.release()
	rctx, cancel := context.WithTimeout(ctx, m.opts.RequestTimeout)
	defer cancel()
	start := time.Now()
	cert, err := m.opts.Signer.Sign(rctx, id, m.opts.TTL)
	var end time.Time
	if err == nil {
		end, err = m.check(id, cert)
	}
	if ctx.Err() != nil {
		// Forgotten or closed meanwhile: not the CA's failure.
		return nil, time.Time{}, ctx.Err()
	}
	if err == nil {
		if life, floor := end.Sub(m.clock()), m.renewFloor(); life < floor {
			err = &CAError{Reason: ReasonShortLifetime, Err: fmt.Errorf("granted a chain valid for %s, less than the %s before it could be renewed", life.Round(time.Millisecond), floor)}
			m.metrics.observe(time.Since(start), err)
			return cert, end, fmt.Errorf("certificate for %s from %s: %w", id, m.opts.Signer.Name(), err)
		}
	}
	m.metrics.observe(time.Since(start), err)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("certificate for %s from %s: %w", id, m.opts.Signer.Name(), err)
	}
	return cert, end, nil
}

// check refuses a certificate that does not carry exactly id, is not for
// the private key returned with it, is not usable both as a client and as
// a server certificate (a tunnel is both), has an outsized chain, or does
// not chain to the current roots: whatever a CA returns, this node presents
// nothing else. The signers check some of this themselves; checking here
// holds for every signer. It returns when the chain stops verifying: the
// first end among the certificates of the verified chain (the latest such
// end if several chains verify), which an issuer or the root may set
// before the leaf's own end when the CA does not clamp the leaf to it.
func (m *Manager) check(id ID, cert *tls.Certificate) (time.Time, error) {
	roots, err := m.roots()
	if err != nil {
		return time.Time{}, &CAError{Reason: ReasonUntrustedChain, Err: err}
	}
	return checkIssued(id, cert, roots, m.clock())
}

// checkIssued is Manager.check against roots at now; the file CA checks
// itself with it at load.
func checkIssued(id ID, cert *tls.Certificate, roots *x509.CertPool, now time.Time) (time.Time, error) {
	if cert == nil || cert.Leaf == nil || len(cert.Certificate) == 0 {
		return time.Time{}, &CAError{Reason: ReasonBadResponse, Err: errors.New("signer returned no certificate")}
	}
	if n := len(cert.Certificate); n > MaxChainLen {
		return time.Time{}, &CAError{Reason: ReasonBadResponse, Err: fmt.Errorf("chain of %d certificates, at most %d accepted", n, MaxChainLen)}
	}
	if !bytes.Equal(cert.Certificate[0], cert.Leaf.Raw) {
		return time.Time{}, &CAError{Reason: ReasonBadResponse, Err: errors.New("the parsed leaf is not the first certificate of the chain")}
	}
	pub, ok := cert.PrivateKey.(interface{ Public() crypto.PublicKey })
	if !ok {
		return time.Time{}, &CAError{Reason: ReasonBadResponse, Err: fmt.Errorf("private key of type %T", cert.PrivateKey)}
	}
	if eq, ok := pub.Public().(interface{ Equal(crypto.PublicKey) bool }); !ok || !eq.Equal(cert.Leaf.PublicKey) {
		return time.Time{}, &CAError{Reason: ReasonBadResponse, Err: errors.New("leaf is not for the private key it came with")}
	}
	got, err := idFromLeaf(cert.Leaf)
	if err != nil {
		return time.Time{}, &CAError{Reason: ReasonWrongIdentity, Err: err}
	}
	if got != id {
		return time.Time{}, &CAError{Reason: ReasonWrongIdentity, Err: fmt.Errorf("%w: asked for %s, leaf carries %s", ErrUnexpectedIdentity, id, got)}
	}
	// Said before Verify, whose words ("expired or is not yet valid",
	// "untrusted") do not point at the cause: the clocks. istiod backdates
	// NotBefore by 2 minutes, so a node whose clock is further behind
	// istiod's has every answer refused, until its clock is put right.
	if nb := cert.Leaf.NotBefore; now.Before(nb) {
		return time.Time{}, &CAError{Reason: ReasonNotYetValid, Err: fmt.Errorf("the leaf is not valid before %s, %s after this node's clock: is this node's clock behind the CA's?",
			nb.UTC().Format(time.RFC3339), nb.Sub(now).Round(time.Second))}
	}
	opts := x509.VerifyOptions{
		Roots:         roots,
		Intermediates: x509.NewCertPool(),
		CurrentTime:   now,
	}
	for _, der := range cert.Certificate[1:] {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return time.Time{}, &CAError{Reason: ReasonBadResponse, Err: fmt.Errorf("parse chain: %w", err)}
		}
		opts.Intermediates.AddCert(c)
	}
	// Each usage on its own: Verify accepts a chain allowing any one of
	// those listed, and peers check the one their side needs.
	var end time.Time
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth} {
		opts.KeyUsages = []x509.ExtKeyUsage{usage}
		chains, err := cert.Leaf.Verify(opts)
		if err == nil {
			err = strongChain(chains, usage)
		}
		if err != nil {
			return time.Time{}, &CAError{Reason: ReasonUntrustedChain, Err: fmt.Errorf("%w: %w", ErrUntrustedPeer, err)}
		}
		if e := chainsEnd(chains, usage); end.IsZero() || e.Before(end) {
			end = e
		}
	}
	return end, nil
}

// chainsEnd is the latest of the ends of the verified chains that
// strongChain accepts for usage, each the first NotAfter among its
// certificates.
func chainsEnd(chains [][]*x509.Certificate, usage x509.ExtKeyUsage) time.Time {
	var latest time.Time
	for _, chain := range chains {
		if c, _ := unusable(chain, usage); c != nil {
			continue
		}
		end := chain[0].NotAfter
		for _, c := range chain[1:] {
			if c.NotAfter.Before(end) {
				end = c.NotAfter
			}
		}
		if end.After(latest) {
			latest = end
		}
	}
	return latest
}

// TrustRoots is t's current pool, for VerifyOptions.Roots. A nil pool is
// an error rather than passed on: crypto/x509 verifies against the host's
// system roots when Roots is nil, so a Trust that holds none would trust
// every public or enterprise CA instead of none.
func TrustRoots(t Trust) (*x509.CertPool, error) {
	roots := t.Roots()
	if roots == nil {
		return nil, errors.New("no trust roots loaded")
	}
	return roots, nil
}

func (m *Manager) roots() (*x509.CertPool, error) { return TrustRoots(m.opts.Trust) }

// Snapshot describes every kept identity, those in their grace period
// too, sorted.
func (m *Manager) Snapshot() []CertInfo {
	now := m.clock()
	m.mu.Lock()
	out := make([]CertInfo, 0, len(m.entries))
	for id, e := range m.entries {
		ci := CertInfo{ID: id, CA: m.opts.Signer.Name(), Failures: e.failures}
		if e.lastErr != nil {
			ci.LastError = e.lastErr.Error()
		}
		switch {
		case e.graceEnd != nil:
			ci.State = StateGrace
		case e.cert == nil && e.lastErr != nil:
			ci.State = StateFailing
		case e.cert == nil:
			ci.State = StatePending
		case !now.Before(e.end):
			ci.State = StateExpired
		case now.Before(e.cert.Leaf.NotBefore):
			ci.State = StateNotYetValid
		case e.lastErr != nil:
			ci.State = StateFailing
		case !now.Before(e.refreshAt):
			ci.State = StateRefreshing
		default:
			ci.State = StateValid
		}
		if e.cert != nil {
			leaf := e.cert.Leaf
			ci.Serial = leaf.SerialNumber.Text(16)
			ci.NotBefore, ci.NotAfter, ci.RefreshAt = leaf.NotBefore, e.end, e.refreshAt
			ci.Issuer = leaf.Issuer.String()
			ci.ExpiresIn = e.end.Sub(now)
			ci.Chain = describeChain(e.cert.Certificate)
		}
		out = append(out, ci)
	}
	m.mu.Unlock()
	slices.SortFunc(out, func(a, b CertInfo) int { return cmp.Compare(a.ID.String(), b.ID.String()) })
	return out
}

func describeChain(ders [][]byte) []ChainCert {
	out := make([]ChainCert, 0, len(ders))
	for _, der := range ders {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			continue
		}
		out = append(out, ChainCert{Subject: c.Subject.String(), Issuer: c.Issuer.String(), Serial: c.SerialNumber.Text(16),
			NotAfter: c.NotAfter, PEM: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))})
	}
	return out
}
