package tunnel

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
)

// Accept backoff, as net/http's Server.Serve: an accept that fails (EMFILE,
// ENFILE, ENOBUFS, ENOMEM, a connection aborted before it was accepted)
// is retried after 5 ms, doubling up to 1 s, and the delay resets after
// the next success. Exiting instead would leave the listener open with
// nobody accepting: the capture keeps handing it SYNs that are never
// answered, and the kernel's accept queue fills.
const (
	minAcceptBackoff = 5 * time.Millisecond
	maxAcceptBackoff = time.Second
)

// listenerHealth is what readiness knows about one accept loop: whether
// its last accept failed (and since when, with what error), or whether the
// loop ended while the pod was still served.
type listenerHealth struct {
	port uint16

	mu        sync.Mutex
	failing   bool
	since     time.Time
	failures  uint64
	lastErr   error
	stopped   bool // the loop ended (listener closed) while the pod runs
	stopCause error
}

// fail records a failed accept; it reports whether it starts a streak.
func (h *listenerHealth) fail(err error, now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	first := !h.failing
	if first {
		h.failing, h.since, h.failures = true, now, 0
	}
	h.failures++
	h.lastErr = err
	return first
}

// ok records a successful accept; it returns the streak it ends, if any.
func (h *listenerHealth) ok(now time.Time) (failures uint64, lasted time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.failing {
		return 0, 0
	}
	h.failing = false
	return h.failures, now.Sub(h.since)
}

func (h *listenerHealth) stop(cause error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.stopped, h.stopCause = true, cause
}

// problem says why the listener does not accept now; "" when it does.
func (h *listenerHealth) problem(now time.Time) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case h.stopped:
		return fmt.Sprintf("port %d: not accepting (listener closed: %v)", h.port, h.stopCause)
	case h.failing:
		return fmt.Sprintf("port %d: accept failing for %s (%d errors, last: %v)",
			h.port, now.Sub(h.since).Round(time.Millisecond), h.failures, h.lastErr)
	}
	return ""
}

// acceptLoop accepts on l until l is closed, handing each connection to
// admit (which may refuse it at once) and then to handle on a goroutine of
// its own. A failed accept is retried with backoff, never ends the loop.
func (p *pod) acceptLoop(l net.Listener, h *listenerHealth, admit func(net.Conn) (*slot, bool), handle func(net.Conn)) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		var backoff time.Duration
		for {
			raw, err := l.Accept()
			if err != nil {
				if p.ctx.Err() != nil {
					return
				}
				if errors.Is(err, net.ErrClosed) {
					if p.stopping.Load() {
						return
					}
					h.stop(err)
					p.t.log.Error("tunnel listener closed while the pod is served", "pod", p.uid, "port", h.port, "error", err)
					return
				}
				backoff = min(max(2*backoff, minAcceptBackoff), maxAcceptBackoff)
				if h.fail(err, time.Now()) {
					p.t.log.Warn("accept failed; retrying with backoff", "pod", p.uid, "port", h.port, "error", err)
				}
				p.t.cfg.Metrics.acceptErrors.WithLabelValues(listenerName(h.port, p.t.cfg)).Inc()
				select {
				case <-time.After(backoff):
				case <-p.ctx.Done():
					return
				}
				continue
			}
			if n, d := h.ok(time.Now()); n > 0 {
				p.t.log.Info("accepting again", "pod", p.uid, "port", h.port, "failed_accepts", n, "after", d.Round(time.Millisecond))
			}
			backoff = 0
			s, ok := admit(raw)
			if !ok {
				continue
			}
			c, _ := p.wrap(raw, nil)
			p.holdAccepted(c, s)
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				defer p.release(c)
				handle(c)
			}()
		}
	}()
}

// listenerName names a tunnel port in metrics.
func listenerName(port uint16, cfg Config) string {
	switch port {
	case cfg.OutboundPort:
		return "outbound"
	case cfg.InboundPort:
		return "inbound"
	case cfg.HBONEPort:
		return "hbone"
	}
	return "other"
}

// serveHBONE runs the pod's HBONE server on l and records it in h if it
// stops while the pod is served.
func (p *pod) serveHBONE(l net.Listener, h *listenerHealth) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		err := p.hbone.Serve(l)
		if p.ctx.Err() == nil && !p.stopping.Load() {
			h.stop(err)
			p.t.log.Error("HBONE server stopped while the pod is served", "pod", p.uid, "port", h.port, "error", err)
		}
	}()
}
