package identity

import (
	"context"
	"crypto/tls"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// fakeClock is a settable time source.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

// newFakeClock starts at a whole second, the resolution of certificate
// times, so expiry arithmetic in tests is exact.
func newFakeClock() *fakeClock { return &fakeClock{now: time.Now().Truncate(time.Second)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

var (
	idWeb      = ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "web"}
	idCart     = ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "cart"}
	idImpostor = ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "impostor"}
)

// newManager returns a file-CA Manager holding certificates for idWeb,
// idCart and idImpostor, closed with the test.
func newManager(t *testing.T, ca *CA, ttl time.Duration) *Manager {
	t.Helper()
	m := NewManager(ca, ttl, nil)
	t.Cleanup(m.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, id := range []ID{idWeb, idCart, idImpostor} {
		m.Add(id)
		if err := m.Wait(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	return m
}

// fakeSigner signs with a CA, or fails with err, or blocks while gate is
// closed; it counts calls.
type fakeSigner struct {
	ca *CA

	mu    sync.Mutex
	err   error
	gate  chan struct{} // nil: open
	calls int
	as    *ID // sign this identity instead of the one asked for
}

func (f *fakeSigner) Name() string { return "fake" }

func (f *fakeSigner) Sign(ctx context.Context, id ID, ttl time.Duration) (*tls.Certificate, error) {
	f.mu.Lock()
	f.calls++
	gate, err, as := f.gate, f.err, f.as
	f.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if err != nil {
		return nil, err
	}
	if as != nil {
		id = *as
	}
	return f.ca.Sign(ctx, id, ttl)
}

func (f *fakeSigner) set(fn func(*fakeSigner)) {
	f.mu.Lock()
	fn(f)
	f.mu.Unlock()
}

func (f *fakeSigner) callCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// addAndWait adds id to m and waits (10 s at most) for its first certificate.
func addAndWait(t *testing.T, m *Manager, id ID) {
	t.Helper()
	m.Add(id)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.Wait(ctx, id); err != nil {
		t.Fatal(err)
	}
}

func stateOf(m *Manager, id ID) CertInfo {
	for _, c := range m.Snapshot() {
		if c.ID == id {
			return c
		}
	}
	return CertInfo{}
}

func unavailable(m *Manager, reason string) float64 {
	return testutil.ToFloat64(m.metrics.unavailable.WithLabelValues(reason))
}

func TestManagerPrefetchesOnAdd(t *testing.T) {
	m := NewManager(newCA(t, "cluster.local"), time.Hour, nil)
	defer m.Close()
	if _, err := m.Certificate(idWeb); !errors.Is(err, ErrNoCertificate) {
		t.Fatalf("certificate of an identity never added: err = %v", err)
	}
	if got := unavailable(m, UnavailableNotKept); got != 1 {
		t.Errorf("unavailable{not_enrolled} = %v, want 1", got)
	}
	addAndWait(t, m, idWeb)
	c, err := m.Certificate(idWeb)
	if err != nil || c.Leaf.URIs[0].String() != idWeb.String() {
		t.Fatalf("certificate after prefetch: %v %v", c, err)
	}
	if err := m.Ready(idWeb); err != nil {
		t.Errorf("Ready: %v", err)
	}
	info := stateOf(m, idWeb)
	if info.State != StateValid || info.CA != m.CAName() || len(info.Chain) != 1 || !strings.Contains(info.Chain[0].PEM, "BEGIN CERTIFICATE") {
		t.Errorf("snapshot = %+v", info)
	}
	if got := testutil.ToFloat64(m.metrics.requests); got != 1 {
		t.Errorf("ca requests = %v, want 1", got)
	}
}

// The handshake path never waits for the CA: with the CA hanging, it fails
// closed at once and counts the reason; once the CA answers, it works.
func TestManagerHandshakeNeverWaitsForCA(t *testing.T) {
	ca := newCA(t, "cluster.local")
	f := &fakeSigner{ca: ca, gate: make(chan struct{})}
	m := New(ManagerOptions{Signer: f, Trust: ca, TTL: time.Hour})
	defer m.Close()
	m.Add(idWeb)
	waitfor.Until(t, "the first request", func() bool { return f.callCount() == 1 })

	start := time.Now()
	_, err := m.Certificate(idWeb)
	if !errors.Is(err, ErrNoCertificate) || !strings.Contains(err.Error(), "pending") {
		t.Fatalf("err = %v, want a pending ErrNoCertificate", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("Certificate took %s with the CA hanging", d)
	}
	if got := unavailable(m, UnavailablePending); got != 1 {
		t.Errorf("unavailable{pending} = %v, want 1", got)
	}
	if s := stateOf(m, idWeb).State; s != StatePending {
		t.Errorf("state = %s, want pending", s)
	}
	close(f.gate)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.Wait(ctx, idWeb); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Certificate(idWeb); err != nil {
		t.Fatal(err)
	}
}

// A failing CA is retried with backoff, counted by reason, reported as
// failing with its error, and recovered from without any call from outside.
func TestManagerRetriesAndRecovers(t *testing.T) {
	ca := newCA(t, "cluster.local")
	f := &fakeSigner{ca: ca, err: &CAError{Reason: ReasonUnauthenticated, Err: errors.New("request impersonation authentication failure")}}
	m := New(ManagerOptions{Signer: f, Trust: ca, TTL: time.Hour, BackoffMin: 20 * time.Millisecond, BackoffMax: 50 * time.Millisecond})
	defer m.Close()
	m.Add(idWeb)
	// The signer's call count runs ahead of the manager's bookkeeping (the
	// third call may still be in flight): wait for three recorded failures.
	waitfor.Until(t, "three recorded failures", func() bool { return stateOf(m, idWeb).Failures >= 3 })

	info := stateOf(m, idWeb)
	if info.State != StateFailing || !strings.Contains(info.LastError, "impersonation") || info.Failures < 3 {
		t.Errorf("snapshot while failing = %+v", info)
	}
	if _, err := m.Certificate(idWeb); !errors.Is(err, ErrNoCertificate) || !strings.Contains(err.Error(), "impersonation") {
		t.Errorf("err = %v, want ErrNoCertificate naming the CA's refusal", err)
	}
	if got := unavailable(m, UnavailableFailing); got != 1 {
		t.Errorf("unavailable{ca_failing} = %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.metrics.failures.WithLabelValues(ReasonUnauthenticated)); got < 3 {
		t.Errorf("failures{unauthenticated} = %v, want >= 3", got)
	}

	f.set(func(f *fakeSigner) { f.err = nil })
	waitfor.Until(t, "recovery", func() bool { return m.Ready(idWeb) == nil })
	if info := stateOf(m, idWeb); info.State != StateValid || info.LastError != "" {
		t.Errorf("snapshot after recovery = %+v", info)
	}
}

// A certificate the CA got wrong is never used.
func TestManagerRefusesWhatItDidNotAskFor(t *testing.T) {
	ca := newCA(t, "cluster.local")
	other := newCA(t, "cluster.local")
	for name, tc := range map[string]struct {
		f      *fakeSigner
		reason string
	}{
		"other identity": {&fakeSigner{ca: ca, as: &idCart}, ReasonWrongIdentity},
		"other root":     {&fakeSigner{ca: other}, ReasonUntrustedChain},
	} {
		t.Run(name, func(t *testing.T) {
			m := New(ManagerOptions{Signer: tc.f, Trust: ca, TTL: time.Hour, BackoffMin: time.Hour})
			defer m.Close()
			m.Add(idWeb)
			waitfor.Until(t, "the refusal", func() bool { return stateOf(m, idWeb).State == StateFailing })
			if _, err := m.Certificate(idWeb); !errors.Is(err, ErrNoCertificate) {
				t.Errorf("err = %v", err)
			}
			if got := testutil.ToFloat64(m.metrics.failures.WithLabelValues(tc.reason)); got != 1 {
				t.Errorf("failures{%s} = %v, want 1", tc.reason, got)
			}
		})
	}
}

// onFakeClock is a manager with an hour's TTL on a fake clock, signing
// through a fakeSigner over a test CA; closed when the test ends.
func onFakeClock(t *testing.T) (*Manager, *fakeSigner, *fakeClock) {
	t.Helper()
	ca := newCA(t, "cluster.local")
	clock := newFakeClock()
	f := &fakeSigner{ca: ca}
	m := New(ManagerOptions{Signer: f, Trust: ca, TTL: time.Hour, Clock: clock.Now})
	t.Cleanup(m.Close)
	return m, f, clock
}

// caDown makes every request fail as istiod being unreachable.
func (f *fakeSigner) caDown() {
	f.set(func(f *fakeSigner) { f.err = &CAError{Reason: ReasonUnavailable, Err: errors.New("istiod down")} })
}

// Renewal failing past expiry: the expired certificate is not presented.
func TestManagerExpiredFailsClosed(t *testing.T) {
	m, f, clock := onFakeClock(t)
	addAndWait(t, m, idWeb)
	f.caDown()
	clock.Advance(40 * time.Minute)
	if s := stateOf(m, idWeb).State; s != StateRefreshing && s != StateFailing {
		t.Errorf("state past half-life = %s, want refreshing (or failing, once the renewal was tried)", s)
	}
	if _, err := m.Certificate(idWeb); err != nil {
		t.Errorf("past half-life but unexpired: %v", err)
	}
	clock.Advance(30 * time.Minute)
	if s := stateOf(m, idWeb).State; s != StateExpired {
		t.Errorf("state past expiry = %s, want expired", s)
	}
	if _, err := m.Certificate(idWeb); !errors.Is(err, ErrNoCertificate) || !strings.Contains(err.Error(), "expired") {
		t.Errorf("err = %v, want expired", err)
	}
	if got := unavailable(m, UnavailableExpired); got != 1 {
		t.Errorf("unavailable{expired} = %v, want 1", got)
	}
}

// Sync serves exactly the identities asked for: one whose last pod left is
// no longer served (kept in its grace period, see manager_grace_test.go),
// and one with no certificate yet is forgotten, its request in flight
// cancelled, and nothing of it remains.
func TestManagerSyncForgets(t *testing.T) {
	ca := newCA(t, "cluster.local")
	m := NewManager(ca, time.Hour, nil)
	defer m.Close()
	m.Sync([]ID{idWeb, idCart})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, id := range []ID{idWeb, idCart} {
		if err := m.Wait(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	m.Sync([]ID{idWeb})
	if s := stateOf(m, idCart).State; s != StateGrace {
		t.Errorf("state after the cart pods left = %s, want %s", s, StateGrace)
	}
	if _, err := m.Certificate(idCart); !errors.Is(err, ErrNoCertificate) {
		t.Errorf("forgotten identity still served: %v", err)
	}
	if _, err := m.Certificate(idWeb); err != nil {
		t.Errorf("kept identity: %v", err)
	}

	// A request hanging at the CA is cancelled by Forget, and its worker ends.
	f := &fakeSigner{ca: ca, gate: make(chan struct{})}
	m2 := New(ManagerOptions{Signer: f, Trust: ca})
	m2.Add(idCart)
	waitfor.Until(t, "the request", func() bool { return f.callCount() == 1 })
	m2.Sync(nil)
	done := make(chan struct{})
	go func() { m2.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("worker of a forgotten identity still waits for the CA")
	}
	if len(m2.Snapshot()) != 0 {
		t.Error("forgotten identity in snapshot")
	}
}

func TestManagerConcurrent(t *testing.T) {
	m := NewManager(newCA(t, "cluster.local"), time.Hour, nil)
	defer m.Close()
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 200; j++ {
				switch j % 4 {
				case 0:
					m.Sync([]ID{idWeb, idCart})
				case 1:
					_, _ = m.Certificate(idWeb)
				case 2:
					m.Snapshot()
				case 3:
					m.Sync([]ID{idCart})
				}
			}
		}()
	}
	wg.Wait()
}

func TestManagerCollector(t *testing.T) {
	ca := newCA(t, "cluster.local")
	f := &fakeSigner{ca: ca, err: &CAError{Reason: ReasonUnavailable, Err: errors.New("connection refused")}}
	m := New(ManagerOptions{Signer: f, Trust: ca, BackoffMin: time.Hour})
	defer m.Close()
	m.Add(idWeb)
	waitfor.Until(t, "the failure", func() bool { return stateOf(m, idWeb).State == StateFailing })
	want := `
# HELP redirector_certificates Identities of this node's enrolled pods the agent keeps a certificate for, by state: pending, valid, refreshing, failing, expired, not_yet_valid, grace (its last local pod left within the grace period, 2m by default: kept for a replacement pod, not served). Bounded by the local pods and those that left within the grace period.
# TYPE redirector_certificates gauge
redirector_certificates{state="expired"} 0
redirector_certificates{state="failing"} 1
redirector_certificates{state="grace"} 0
redirector_certificates{state="not_yet_valid"} 0
redirector_certificates{state="pending"} 0
redirector_certificates{state="refreshing"} 0
redirector_certificates{state="valid"} 0
# HELP redirector_ca_request_failures_total Certificate requests that failed, by reason: unavailable, timeout, unauthenticated (istiod refused the token or the identity), permission_denied, token, bad_response, wrong_identity, untrusted_chain, short_lifetime (a chain expiring before it could be renewed, kept only while no other certificate outlives it), not_yet_valid (the leaf starts after this node's clock: the clocks disagree), refused, local.
# TYPE redirector_ca_request_failures_total counter
redirector_ca_request_failures_total{reason="unavailable"} 1
`
	if err := testutil.CollectAndCompare(m.Collector(), strings.NewReader(want), "redirector_certificates", "redirector_ca_request_failures_total"); err != nil {
		t.Error(err)
	}
	// No certificate to keep: dropped at once.
	m.Sync(nil)
	if got := testutil.CollectAndCount(m.Collector(), "redirector_certificates"); got != 7 {
		t.Errorf("%d state series", got)
	}
	if n := len(m.Snapshot()); n != 0 {
		t.Errorf("%d identities kept after the last pod left", n)
	}
}

// TestManagerRenewsOnTheWallClock: certificates expire by the wall clock,
// but a timer runs on the monotonic clock, which stops while the machine
// is suspended (a paused VM, a laptop running kind) and does not follow a
// step of the wall clock. Waking after half the lifetime passed on the
// wall clock, the worker must renew at once, not when its timer fires
// (here half an hour later, past the certificate's expiry).
func TestManagerRenewsOnTheWallClock(t *testing.T) {
	m, f, clock := onFakeClock(t)
	m.clockCheck = 20 * time.Millisecond
	addAndWait(t, m, idWeb)
	first := stateOf(m, idWeb).Serial
	clock.Advance(40 * time.Minute) // the machine slept; the timer did not run
	waitfor.Until(t, "a renewal after the wall clock passed the refresh time", func() bool {
		return f.callCount() == 2 && stateOf(m, idWeb).Serial != first
	})
	if s := stateOf(m, idWeb).State; s != StateValid {
		t.Errorf("state after renewal = %s, want valid", s)
	}
}

// clockSigner signs with a file CA at the time of clock, as the file CA
// does on the node's clock that the Manager reads too.
type clockSigner struct {
	ca    *CA
	clock func() time.Time

	mu    sync.Mutex
	calls int
}

func (s *clockSigner) Name() string { return "file-at-clock" }

func (s *clockSigner) callCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

func (s *clockSigner) Sign(ctx context.Context, id ID, ttl time.Duration) (*tls.Certificate, error) {
	s.mu.Lock()
	s.calls++
	s.mu.Unlock()
	c, err := s.ca.signAt(id, s.clock(), ttl)
	if err != nil {
		return nil, &CAError{Reason: ReasonLocal, Err: err}
	}
	return &c, nil
}

// TestManagerRenewsAfterClockStepBack: the node's clock ran ahead when the
// certificate was signed on it, then was set back (chrony's makestep at
// boot). The certificate is not valid before a time the clock has not
// reached any more: every handshake refuses it. Before, the worker waited
// for its refresh time (half an hour here, half a day by default), and
// the identity had no usable certificate until the clock caught up with
// the step, with the CA there all along; the config dump called it valid.
func TestManagerRenewsAfterClockStepBack(t *testing.T) {
	ca := newCA(t, "cluster.local")
	clock := newFakeClock()
	clock.Advance(30 * time.Minute) // the node's clock is ahead at start
	s := &clockSigner{ca: ca, clock: clock.Now}
	m := New(ManagerOptions{Signer: s, Trust: ca, TTL: time.Hour, Clock: clock.Now})
	defer m.Close()
	m.clockCheck = 20 * time.Millisecond
	addAndWait(t, m, idWeb)
	first := stateOf(m, idWeb).Serial
	clock.Advance(-30 * time.Minute) // back to the time the CA's root was made at
	waitfor.Until(t, "a certificate valid at the stepped clock", func() bool {
		_, err := m.Certificate(idWeb)
		return err == nil
	})
	if info := stateOf(m, idWeb); info.Serial == first || info.State != StateValid {
		t.Errorf("after the step: serial %s (first %s), state %s; want a new, valid certificate", info.Serial, first, info.State)
	}
}

// TestManagerNotYetValidState: a certificate the clock is before is shown
// as such, not as valid, while handshakes refuse it.
func TestManagerNotYetValidState(t *testing.T) {
	m, f, clock := onFakeClock(t)
	addAndWait(t, m, idWeb)
	// The CA is gone and the clock goes back: nothing can replace it.
	f.caDown()
	clock.Advance(-30 * time.Minute)
	if _, err := m.Certificate(idWeb); !errors.Is(err, ErrNoCertificate) || !strings.Contains(err.Error(), "not valid before") {
		t.Errorf("handshake with a certificate not valid yet: err = %v", err)
	}
	if s := stateOf(m, idWeb).State; s != StateNotYetValid && s != StateFailing {
		t.Errorf("state = %s, want %s (or failing once the renewal it caused failed)", s, StateNotYetValid)
	}
}
