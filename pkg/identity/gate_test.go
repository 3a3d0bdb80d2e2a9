package identity

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// ids returns n distinct identities.
func ids(n int) []ID {
	out := make([]ID, n)
	for i := range out {
		out[i] = ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: fmt.Sprintf("sa%d", i)}
	}
	return out
}

// TestCARequestRateUnderRefusals: 200 identities refused at once (istiod's
// informers lagging at a node's start) retry each on its own backoff.
// Before, only 8 requests in flight bounded them: about 170 requests a
// second for the first seconds against a CA refusing at once. The node-wide
// rate holds whatever their backoffs: no more requests than the burst plus
// the rate over the time elapsed.
func TestCARequestRateUnderRefusals(t *testing.T) {
	ca := newCA(t, "cluster.local")
	f := &fakeSigner{ca: ca, err: &CAError{Reason: ReasonUnauthenticated, Err: errors.New("no such pod on this node")}}
	start := time.Now()
	m := New(ManagerOptions{Signer: f, Trust: ca, TTL: time.Hour})
	defer m.Close()
	m.Sync(ids(200))
	waitfor.Until(t, "the burst and two seconds' worth of requests", func() bool {
		return f.callCount() >= DefaultRequestBurst+2*DefaultRequestRate
	})
	calls := f.callCount()
	elapsed := time.Since(start)
	if limit := DefaultRequestBurst + DefaultRequestRate*elapsed.Seconds() + 1; float64(calls) > limit {
		t.Errorf("%d CA requests in %s, more than the burst of %d and %v a second allow (%.0f)", calls, elapsed, DefaultRequestBurst, DefaultRequestRate, limit)
	}
	if got := testutil.ToFloat64(m.metrics.delayed); got == 0 {
		t.Error("redirector_ca_requests_delayed_total = 0, want the requests held back counted")
	}
	t.Logf("%d CA requests in %s", calls, elapsed.Round(time.Millisecond))
}

// TestCARequestsNodeStart: a node starting its 110 pods (the kubelet's
// default maximum), each of its own identity, gets every certificate
// within a few seconds against a healthy CA, each with one request.
func TestCARequestsNodeStart(t *testing.T) {
	ca := newCA(t, "cluster.local")
	f := &fakeSigner{ca: ca}
	m := New(ManagerOptions{Signer: f, Trust: ca, TTL: time.Hour})
	defer m.Close()
	all := ids(110)
	start := time.Now()
	m.Sync(all)
	waitfor.Until(t, "110 certificates", func() bool {
		for _, id := range all {
			if m.Ready(id) != nil {
				return false
			}
		}
		return true
	})
	t.Logf("110 identities issued in %s", time.Since(start).Round(time.Millisecond))
	if n := f.callCount(); n != len(all) {
		t.Errorf("%d CA requests, want %d", n, len(all))
	}
	if got := testutil.ToFloat64(m.metrics.delayed); got == 0 {
		t.Error("redirector_ca_requests_delayed_total = 0 with more identities than the burst")
	}
}

// admitted reports whether ch (a gate waiter's result) has a value.
func admitted(ch <-chan error) bool {
	select {
	case err := <-ch:
		return err == nil
	default:
		return false
	}
}

func queued(g *caGate, urgent, renewal int) func() bool {
	return func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return len(g.queue[0]) == urgent && len(g.queue[1]) == renewal
	}
}

func acquireAsync(g *caGate, urgent bool) <-chan error {
	ch := make(chan error, 1)
	go func() {
		_, err := g.acquire(context.Background(), urgent)
		ch <- err
	}()
	return ch
}

// TestCAGateFirstCertificatesFirst: a request for an identity with no
// certificate a handshake takes goes ahead of renewals waiting before it,
// for a free slot and for a token alike.
func TestCAGateFirstCertificatesFirst(t *testing.T) {
	t.Run("slot", func(t *testing.T) {
		g := newCAGate(1000, 1000, 1)
		if held, err := g.acquire(context.Background(), false); held || err != nil {
			t.Fatalf("first acquire: held %v, err %v", held, err)
		}
		renewal := acquireAsync(g, false)
		waitfor.Until(t, "the renewal queued", queued(g, 0, 1))
		first := acquireAsync(g, true)
		waitfor.Until(t, "the first certificate queued", queued(g, 1, 1))
		g.release()
		waitfor.Until(t, "the first certificate admitted", func() bool { return admitted(first) })
		if admitted(renewal) {
			t.Fatal("renewal admitted with the one slot taken")
		}
		g.release()
		waitfor.Until(t, "the renewal admitted", func() bool { return admitted(renewal) })
	})
	t.Run("token", func(t *testing.T) {
		clock := newFakeClock()
		g := newCAGate(1, 1, 8)
		g.now = clock.Now
		g.last = clock.Now()
		if held, err := g.acquire(context.Background(), false); held || err != nil {
			t.Fatalf("first acquire: held %v, err %v", held, err)
		}
		renewal := acquireAsync(g, false)
		waitfor.Until(t, "the renewal queued", queued(g, 0, 1))
		first := acquireAsync(g, true)
		waitfor.Until(t, "the first certificate queued", queued(g, 1, 1))
		clock.Advance(time.Second)
		g.mu.Lock()
		g.dispatchLocked() // what the timer does
		g.mu.Unlock()
		waitfor.Until(t, "the first certificate admitted", func() bool { return admitted(first) })
		if admitted(renewal) {
			t.Fatal("renewal admitted with no token left")
		}
		clock.Advance(time.Second)
		g.mu.Lock()
		g.dispatchLocked()
		g.mu.Unlock()
		waitfor.Until(t, "the renewal admitted", func() bool { return admitted(renewal) })
	})
}

// TestCAGateCancelWhileQueued: a waiter whose request is cancelled (its
// identity forgotten, the manager closed) leaves the queue.
func TestCAGateCancelWhileQueued(t *testing.T) {
	g := newCAGate(1000, 1000, 1)
	if _, err := g.acquire(context.Background(), true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		held, err := g.acquire(ctx, true)
		if !held {
			err = errors.New("not held with the slot taken")
		}
		done <- err
	}()
	waitfor.Until(t, "the waiter queued", queued(g, 1, 0))
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	waitfor.Until(t, "the queue empty", queued(g, 0, 0))
	g.release()
	if _, err := g.acquire(context.Background(), false); err != nil {
		t.Fatal(err)
	}
}

// TestManagerUrgentClass: which requests go ahead of renewals.
func TestManagerUrgentClass(t *testing.T) {
	ca := newCA(t, "cluster.local")
	clock := newFakeClock()
	m := New(ManagerOptions{Signer: ca, Trust: ca, TTL: time.Hour, Clock: clock.Now})
	defer m.Close()
	addAndWait(t, m, idWeb)
	m.mu.Lock()
	e := m.entries[idWeb]
	m.mu.Unlock()
	if m.urgent(e) {
		t.Error("renewal of a certificate still served is urgent")
	}
	clock.Advance(2 * time.Hour)
	if !m.urgent(e) {
		t.Error("request for an identity whose certificate expired is not urgent")
	}
	m.Forget(idWeb)
	if m.urgent(e) {
		t.Error("request for an identity in its grace period is urgent")
	}
	if !m.urgent(&entry{id: idCart}) {
		t.Error("first certificate is not urgent")
	}
}
