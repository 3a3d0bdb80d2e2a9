package hbone

import (
	"container/list"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// budget is a leaky bucket for things a peer may do now and then but must
// not do in a flood (resets before an answer, frames that only cost us
// work): burst events at once, and burst more per period. It is integer
// arithmetic on one goroutine's timestamps: spending adds period/burst of
// debt, debt drains with time, and debt beyond period is a flood.
type budget struct {
	cost   int64 // debt per event, ns
	period int64 // debt limit, ns
	debt   int64
	at     int64 // UnixNano of the last spend
}

func newBudget(burst int, period time.Duration) budget {
	return budget{cost: int64(period) / int64(max(burst, 1)), period: int64(period)}
}

// spend takes one event from the budget at time now (UnixNano) and reports
// whether the budget still held it.
func (b *budget) spend(now int64) bool {
	b.debt = max(b.debt-(now-b.at), 0) + b.cost
	b.at = now
	return b.debt <= b.period
}

// ConnLimits bound what inbound peers can make a node's HBONE servers hold
// before any of them has proven an identity: open connections and TLS
// handshakes in progress, in total and per source address. Zero values
// pick the defaults.
type ConnLimits struct {
	// MaxConns bounds open inbound connections (handshaking or serving).
	// Default 16384: each costs a file descriptor and some 20-40 KB.
	MaxConns int
	// MaxConnsPerSource bounds them per client address. Default 1024:
	// pooled clients open one connection per destination pod and 100
	// streams.
	MaxConnsPerSource int
	// MaxHandshakes bounds connections whose TLS handshake and HTTP/2
	// preface (up to the client's first SETTINGS frame) have not finished.
	// When they are all taken, a new connection evicts (closes) the oldest
	// of them rather than being refused: an honest handshake takes
	// milliseconds, so the oldest are the silent ones, and a few source
	// addresses (each within MaxHandshakesPerSource) cannot lock every
	// client out. Default 1024.
	MaxHandshakes int
	// MaxHandshakesPerSource bounds them per client address: more are
	// refused. Default 128: a pod starting up may dial every pod of this
	// node at once, but an idle-connection flood from one address holds at
	// most this many.
	MaxHandshakesPerSource int
}

// ConnLimiter admits inbound connections against ConnLimits. One limiter is
// meant to be shared by every Server of a process (one per pod, all on
// port 15008 of their pod): the node's file descriptors are one pool.
type ConnLimiter struct {
	limits ConnLimits

	mu       sync.Mutex
	conns    int
	bySource map[netip.Addr]*sourceCount
	// pending holds the handshakes in progress (*handshakeSlot), oldest
	// first; its length is the number of handshakes counted.
	pending list.List

	refusedConns      atomic.Uint64
	refusedHandshakes atomic.Uint64
	evictedHandshakes atomic.Uint64
}

type sourceCount struct{ conns, handshakes int }

// handshakeSlot is an admitted connection's place among the handshakes in
// progress, until handshakeDone or an eviction.
type handshakeSlot struct {
	src  netip.Addr
	nc   net.Conn      // closed to evict the handshake
	elem *list.Element // in ConnLimiter.pending; nil once the slot is given back
}

// ConnLimiterStats is a snapshot of a ConnLimiter, for metrics.
type ConnLimiterStats struct {
	Conns      int // open inbound connections now
	Handshakes int // of which still handshaking
	// RefusedConns counts connections closed at accept because an open
	// connection limit (total or per source) was reached;
	// RefusedHandshakes because the per-source handshake limit was.
	RefusedConns      uint64
	RefusedHandshakes uint64
	// EvictedHandshakes counts handshakes closed, the oldest first, to
	// admit a new connection when MaxHandshakes were in progress.
	EvictedHandshakes uint64
}

// NewConnLimiter returns a limiter; zero fields of limits pick defaults.
func NewConnLimiter(limits ConnLimits) *ConnLimiter {
	if limits.MaxConns <= 0 {
		limits.MaxConns = 16384
	}
	if limits.MaxConnsPerSource <= 0 {
		limits.MaxConnsPerSource = 1024
	}
	if limits.MaxHandshakes <= 0 {
		limits.MaxHandshakes = 1024
	}
	if limits.MaxHandshakesPerSource <= 0 {
		limits.MaxHandshakesPerSource = 128
	}
	return &ConnLimiter{limits: limits, bySource: make(map[netip.Addr]*sourceCount)}
}

// Stats returns a snapshot of the limiter.
func (l *ConnLimiter) Stats() ConnLimiterStats {
	l.mu.Lock()
	defer l.mu.Unlock()
	return ConnLimiterStats{
		Conns:             l.conns,
		Handshakes:        l.pending.Len(),
		RefusedConns:      l.refusedConns.Load(),
		RefusedHandshakes: l.refusedHandshakes.Load(),
		EvictedHandshakes: l.evictedHandshakes.Load(),
	}
}

// admit takes a connection slot and a handshake slot for nc, just
// accepted from src, or returns nil when a connection limit or the
// per-source handshake limit is reached (counted). When MaxHandshakes are
// in progress, the oldest is evicted: its connection is closed (its
// goroutine then fails and gives back its connection slot) and the new
// one takes its handshake slot. An attacker would have to open
// MaxHandshakes connections within an honest handshake's few milliseconds
// to evict it; the refusal this replaces needed only MaxHandshakes silent
// connections, renewed every HandshakeTimeout.
func (l *ConnLimiter) admit(src netip.Addr, nc net.Conn) *handshakeSlot {
	l.mu.Lock()
	sc := l.bySource[src]
	if sc == nil {
		sc = &sourceCount{}
	}
	switch {
	case l.conns >= l.limits.MaxConns || sc.conns >= l.limits.MaxConnsPerSource:
		l.mu.Unlock()
		l.refusedConns.Add(1)
		return nil
	case sc.handshakes >= l.limits.MaxHandshakesPerSource:
		l.mu.Unlock()
		l.refusedHandshakes.Add(1)
		return nil
	}
	var evicted *handshakeSlot
	if l.pending.Len() >= l.limits.MaxHandshakes {
		evicted = l.pending.Front().Value.(*handshakeSlot)
		l.handshakeDoneLocked(evicted)
		l.evictedHandshakes.Add(1)
	}
	if sc.conns == 0 {
		l.bySource[src] = sc
	}
	l.conns++
	sc.conns++
	sc.handshakes++
	h := &handshakeSlot{src: src, nc: nc}
	h.elem = l.pending.PushBack(h)
	l.mu.Unlock()
	if evicted != nil {
		_ = evicted.nc.Close()
	}
	return h
}

// handshakeDone gives back h's handshake slot, unless it was given back
// already (done before, or evicted).
func (l *ConnLimiter) handshakeDone(h *handshakeSlot) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.handshakeDoneLocked(h)
}

func (l *ConnLimiter) handshakeDoneLocked(h *handshakeSlot) {
	if h.elem == nil {
		return
	}
	l.pending.Remove(h.elem)
	h.elem = nil
	if sc := l.bySource[h.src]; sc != nil {
		sc.handshakes--
	}
}

// release gives back the connection slot of an admitted connection (after
// handshakeDone).
func (l *ConnLimiter) release(src netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.conns--
	if sc := l.bySource[src]; sc != nil {
		if sc.conns--; sc.conns == 0 {
			delete(l.bySource, src)
		}
	}
}

// sourceAddr is the address a connection counts against: the client's IP,
// unmapped, or the zero Addr when it is not IP (tests' pipes).
func sourceAddr(a net.Addr) netip.Addr {
	if ta, ok := a.(*net.TCPAddr); ok {
		return ta.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}
