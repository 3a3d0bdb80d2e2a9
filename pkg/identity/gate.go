package identity

import (
	"context"
	"slices"
	"sync"
	"time"
)

// caGate admits the Manager's CA requests for the whole node: at most
// maxInFlight at once, and at most rate a second beyond a burst (a token
// bucket). Each identity's backoff paces its own retries only: 200
// identities refused at once (istiod's informers lagging at a node's start)
// made about 170 requests a second for the first seconds before; through
// the gate they make no more than the rate, whatever their backoffs.
//
// Waiters are admitted in two classes, each in arrival order: requests for
// an identity that has no certificate a handshake would take (a first
// certificate, an expired one) go ahead of renewals of one still served,
// so a new pod's first certificate does not queue behind renewals that
// have hours left.
type caGate struct {
	rate        float64 // tokens a second
	burst       float64
	maxInFlight int
	now         func() time.Time // time.Now; a test's clock

	mu       sync.Mutex
	tokens   float64
	last     time.Time // of the last refill
	inFlight int
	queue    [2][]*gateWaiter // [urgent, renewal]
	timer    *time.Timer      // armed while the first waiter waits for a token
}

type gateWaiter struct {
	ready    chan struct{} // closed on admission
	admitted bool          // guarded by caGate.mu
}

func newCAGate(rate float64, burst, maxInFlight int) *caGate {
	g := &caGate{rate: rate, burst: float64(burst), maxInFlight: maxInFlight, now: time.Now}
	g.tokens, g.last = g.burst, g.now()
	return g
}

// acquire waits for a token and a slot, or for ctx to end; release must
// follow a nil error. held is whether the request could not go at once.
func (g *caGate) acquire(ctx context.Context, urgent bool) (held bool, err error) {
	class := 1
	if urgent {
		class = 0
	}
	w := &gateWaiter{ready: make(chan struct{})}
	g.mu.Lock()
	g.queue[class] = append(g.queue[class], w)
	held = len(g.queue[0])+len(g.queue[1]) > 1 || !g.canAdmitLocked()
	g.dispatchLocked()
	g.mu.Unlock()
	select {
	case <-w.ready:
		return held, nil
	case <-ctx.Done():
	}
	g.mu.Lock()
	if w.admitted {
		// Admitted as ctx ended: hand the slot back.
		g.inFlight--
		g.dispatchLocked()
	} else {
		g.queue[class] = slices.DeleteFunc(g.queue[class], func(x *gateWaiter) bool { return x == w })
	}
	g.mu.Unlock()
	return held, ctx.Err()
}

// release frees the slot of an admitted request.
func (g *caGate) release() {
	g.mu.Lock()
	g.inFlight--
	g.dispatchLocked()
	g.mu.Unlock()
}

// canAdmitLocked is whether a slot and a token are free now.
func (g *caGate) canAdmitLocked() bool {
	g.refillLocked()
	return g.inFlight < g.maxInFlight && g.tokens >= 1
}

func (g *caGate) refillLocked() {
	now := g.now()
	if d := now.Sub(g.last); d > 0 {
		g.tokens = min(g.burst, g.tokens+d.Seconds()*g.rate)
	}
	g.last = now
}

// dispatchLocked admits waiters, urgent first, while slots and tokens
// last; with a slot but no token it arms the timer for the next token (a
// freed slot calls it again).
func (g *caGate) dispatchLocked() {
	for g.inFlight < g.maxInFlight {
		class := 0
		if len(g.queue[0]) == 0 {
			class = 1
		}
		if len(g.queue[class]) == 0 {
			return
		}
		g.refillLocked()
		if g.tokens < 1 {
			if g.timer == nil {
				wait := time.Duration((1 - g.tokens) / g.rate * float64(time.Second))
				g.timer = time.AfterFunc(max(wait, time.Millisecond), func() {
					g.mu.Lock()
					g.timer = nil
					g.dispatchLocked()
					g.mu.Unlock()
				})
			}
			return
		}
		w := g.queue[class][0]
		g.queue[class][0] = nil
		g.queue[class] = g.queue[class][1:]
		g.tokens--
		g.inFlight++
		w.admitted = true
		close(w.ready)
	}
}
