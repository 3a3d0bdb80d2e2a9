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

// take is spend for a budget that must not go into debt: it takes one event
// at time now only if the budget holds it, so a source refused for a while
// is not refused for longer the more it tries.
func (b *budget) take(now int64) bool {
	debt := max(b.debt-(now-b.at), 0) + b.cost
	if debt > b.period {
		return false
	}
	b.debt, b.at = debt, now
	return true
}

// drained reports whether the budget holds its whole burst again at now.
func (b *budget) drained(now int64) bool { return b.debt <= now-b.at }

// handshakeRatePeriod is the period of the per-source handshake budget: a
// source gets that many seconds' worth of handshakes at once.
const handshakeRatePeriod = 10 * time.Second

// ConnLimits bound what inbound peers can make a node's HBONE servers hold
// before any of them has proven an identity: open connections and TLS
// handshakes in progress, in total and per source address. Zero values
// pick the defaults.
type ConnLimits struct {
	// MaxConns bounds open inbound connections (handshaking or serving).
	// Default 16384: each costs a file descriptor and some 20-40 KB. When
	// they are all taken, a connection from a source holding fewer than
	// the source holding the most (by two or more) evicts (closes) that
	// source's oldest connection rather than being refused: a few
	// addresses, each within MaxConnsPerSource, cannot lock every other
	// client out of the node.
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
	// HandshakeRatePerSource bounds the connections (each a TLS
	// handshake: a key exchange and a signature, before the client proved
	// anything) one client address may open per second, with ten seconds'
	// worth at once; more are closed at accept. Default 100: pooled
	// clients open one connection per destination pod and keep it, while
	// a client that opens and drops connections as fast as it can would
	// spend this node's CPU on handshakes without ever holding one.
	HandshakeRatePerSource int
	// EarlyResetsPerSource bounds the streams one client address may have
	// reset before their answer (by RST_STREAM, or by a stream error the
	// server answers with one), over all its connections to the process's
	// servers, per 10 s; past it the connection that resets is closed with
	// GOAWAY ENHANCE_YOUR_CALM. Each connection has a budget of its own
	// (ServerOptions.MaxEarlyResets), but an address may hold
	// MaxConnsPerSource connections: with only those, one address reset
	// that many times more streams, each a handler run and maybe a dial of
	// the app. Default 1000: ten pooled connections whose CONNECTs all
	// time out at once.
	EarlyResetsPerSource int
	// MaxHandlersPerSource bounds the streams of one client address that
	// hold a handler (deciding, dialling, answering, refusing or
	// relaying), over all its connections to the process's servers; a
	// stream beyond is refused with REFUSED_STREAM (the client may retry
	// it). Each connection holds at most its MaxConcurrentStreams, but an
	// address may hold MaxConnsPerSource connections, and a client that
	// stops reading blocks every answer of its connection behind the
	// write in progress (until WriteStallTimeout), each with its handler's
	// goroutine and stream: some 1.5 MiB per connection, 1.5 GiB for the
	// 1024 connections of one address. Default 4096; the agent sets twice
	// the tunnels it relays per client address, at least that.
	MaxHandlersPerSource int
}

// DefaultMaxHandlersPerSource is ConnLimits.MaxHandlersPerSource's default.
const DefaultMaxHandlersPerSource = 4096

// defaultEarlyResetsPerSource is ConnLimits.EarlyResetsPerSource's default.
const defaultEarlyResetsPerSource = 1000

// earlyResetPeriod is the period of the per-source early-reset budget.
const earlyResetPeriod = floodPeriod

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

	// rates holds the per-source handshake budgets; sources whose budget
	// drained are swept once the map doubled since the last sweep.
	rates      map[netip.Addr]*budget
	ratesSwept int
	// resets holds the per-source early-reset budgets, swept the same way.
	resets      map[netip.Addr]*budget
	resetsSwept int
	// handlers counts the streams holding a handler, per source.
	handlers map[netip.Addr]int
	now      func() int64 // UnixNano; a variable for the tests

	refusedConns      atomic.Uint64
	refusedHandshakes atomic.Uint64
	refusedRate       atomic.Uint64
	evictedHandshakes atomic.Uint64
	evictedConns      atomic.Uint64
	sourceResetFloods atomic.Uint64
	refusedHandlers   atomic.Uint64
}

// sourceCount is what one client address holds: its connections (open
// holds their slots, oldest first) and how many of them are handshaking.
type sourceCount struct {
	conns, handshakes int
	open              list.List
}

// handshakeSlot is an admitted connection's slot: its place among the
// connections of its source until release or an eviction, and among the
// handshakes in progress until handshakeDone or an eviction.
type handshakeSlot struct {
	src      netip.Addr
	nc       net.Conn      // closed to evict the connection or its handshake
	elem     *list.Element // in ConnLimiter.pending; nil once the slot is given back
	connElem *list.Element // in its sourceCount.open; nil once the slot is given back
}

// ConnLimiterStats is a snapshot of a ConnLimiter, for metrics.
type ConnLimiterStats struct {
	Conns      int // open inbound connections now
	Handshakes int // of which still handshaking
	// RefusedConns counts connections closed at accept because an open
	// connection limit (total or per source) was reached;
	// RefusedHandshakes because the per-source handshake limit was;
	// RefusedHandshakeRate because the source opened connections faster
	// than HandshakeRatePerSource.
	RefusedConns         uint64
	RefusedHandshakes    uint64
	RefusedHandshakeRate uint64
	// EvictedHandshakes counts handshakes closed, the oldest first, to
	// admit a new connection when MaxHandshakes were in progress.
	EvictedHandshakes uint64
	// EvictedConns counts connections closed, the oldest of the source
	// holding the most, to admit one from a source holding fewer when
	// MaxConns were open.
	EvictedConns uint64
	// SourceResetFloods counts connections closed because their source
	// address spent EarlyResetsPerSource over all its connections.
	SourceResetFloods uint64
	// RefusedHandlers counts streams refused (REFUSED_STREAM) because
	// their source address held MaxHandlersPerSource handlers.
	RefusedHandlers uint64
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
	if limits.HandshakeRatePerSource <= 0 {
		limits.HandshakeRatePerSource = 100
	}
	if limits.EarlyResetsPerSource <= 0 {
		limits.EarlyResetsPerSource = defaultEarlyResetsPerSource
	}
	if limits.MaxHandlersPerSource <= 0 {
		limits.MaxHandlersPerSource = DefaultMaxHandlersPerSource
	}
	return &ConnLimiter{
		limits:   limits,
		bySource: make(map[netip.Addr]*sourceCount),
		rates:    make(map[netip.Addr]*budget),
		resets:   make(map[netip.Addr]*budget),
		handlers: make(map[netip.Addr]int),
		now:      func() int64 { return time.Now().UnixNano() },
	}
}

// Stats returns a snapshot of the limiter.
func (l *ConnLimiter) Stats() ConnLimiterStats {
	l.mu.Lock()
	defer l.mu.Unlock()
	return ConnLimiterStats{
		Conns:                l.conns,
		Handshakes:           l.pending.Len(),
		RefusedConns:         l.refusedConns.Load(),
		RefusedHandshakes:    l.refusedHandshakes.Load(),
		RefusedHandshakeRate: l.refusedRate.Load(),
		EvictedHandshakes:    l.evictedHandshakes.Load(),
		EvictedConns:         l.evictedConns.Load(),
		SourceResetFloods:    l.sourceResetFloods.Load(),
		RefusedHandlers:      l.refusedHandlers.Load(),
	}
}

// takeHandler counts a stream of src that takes a handler, or reports
// false (counted) when src holds MaxHandlersPerSource.
func (l *ConnLimiter) takeHandler(src netip.Addr) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.handlers[src] >= l.limits.MaxHandlersPerSource {
		l.refusedHandlers.Add(1)
		return false
	}
	l.handlers[src]++
	return true
}

// releaseHandler gives back what takeHandler took.
func (l *ConnLimiter) releaseHandler(src netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.handlers[src]--; l.handlers[src] <= 0 {
		delete(l.handlers, src)
	}
}

// admit takes a connection slot and a handshake slot for nc, just
// accepted from src, or returns nil and the limit that refused it
// (counted). When MaxHandshakes are in progress, the oldest is evicted:
// its connection is closed (its goroutine then fails) and the new one
// takes its handshake slot. An attacker would have to open MaxHandshakes
// connections within an honest handshake's few milliseconds to evict it;
// the refusal this replaces needed only MaxHandshakes silent connections,
// renewed every HandshakeTimeout. When MaxConns are open, the oldest
// connection of the source holding the most may be evicted the same way
// (fairShareVictimLocked), its slot given back at once.
func (l *ConnLimiter) admit(src netip.Addr, nc net.Conn) (h *handshakeSlot, refusedBy string) {
	l.mu.Lock()
	sc := l.bySource[src]
	if sc == nil {
		sc = &sourceCount{}
	}
	var victim *handshakeSlot
	switch {
	case sc.conns >= l.limits.MaxConnsPerSource:
		l.mu.Unlock()
		l.refusedConns.Add(1)
		return nil, "connections per source"
	case sc.handshakes >= l.limits.MaxHandshakesPerSource:
		l.mu.Unlock()
		l.refusedHandshakes.Add(1)
		return nil, "handshakes in progress per source"
	case !l.takeHandshakeLocked(src):
		l.mu.Unlock()
		l.refusedRate.Add(1)
		return nil, "handshakes per second per source"
	case l.conns >= l.limits.MaxConns:
		if victim = l.fairShareVictimLocked(sc); victim == nil {
			l.mu.Unlock()
			l.refusedConns.Add(1)
			return nil, "connections per node"
		}
		l.releaseLocked(victim)
		l.evictedConns.Add(1)
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
	h = &handshakeSlot{src: src, nc: nc}
	h.elem = l.pending.PushBack(h)
	h.connElem = sc.open.PushBack(h)
	l.mu.Unlock()
	for _, e := range []*handshakeSlot{victim, evicted} {
		if e != nil {
			_ = e.nc.Close()
		}
	}
	return h, ""
}

// takeHandshakeLocked takes a handshake from src's rate budget, if it holds
// one. A source's budget is kept after its connections closed, until it
// drained: one that opens and drops connections holds none.
func (l *ConnLimiter) takeHandshakeLocked(src netip.Addr) bool {
	now := l.now()
	burst := l.limits.HandshakeRatePerSource * int(handshakeRatePeriod/time.Second)
	return sourceBudgetLocked(l.rates, &l.ratesSwept, src, burst, handshakeRatePeriod, now).take(now)
}

// takeEarlyReset takes a stream reset before its answer from src's
// early-reset budget, shared by all its connections, if it holds one; a
// false answer is counted, and the caller closes its connection as a
// flood. Like the handshake budget, a source refused for a while is not
// refused for longer the more it tries.
func (l *ConnLimiter) takeEarlyReset(src netip.Addr) bool {
	l.mu.Lock()
	now := l.now()
	ok := sourceBudgetLocked(l.resets, &l.resetsSwept, src, l.limits.EarlyResetsPerSource, earlyResetPeriod, now).take(now)
	l.mu.Unlock()
	if !ok {
		l.sourceResetFloods.Add(1)
	}
	return ok
}

// sourceBudgetLocked returns src's budget in m, new if it has none. A
// source's budget is kept after its connections closed, until it drained;
// drained ones are swept once m doubled since the last sweep (*swept), so
// m holds about the sources active within a period.
func sourceBudgetLocked(m map[netip.Addr]*budget, swept *int, src netip.Addr, burst int, period time.Duration, now int64) *budget {
	b := m[src]
	if b != nil {
		return b
	}
	if len(m) >= 2**swept+1024 {
		for a, rb := range m {
			if rb.drained(now) {
				delete(m, a)
			}
		}
		*swept = len(m)
	}
	nb := newBudget(burst, period)
	nb.at = now
	m[src] = &nb
	return &nb
}

// fairShareVictimLocked returns the oldest connection of the source
// holding the most connections, if that source holds at least two more
// than sc: closing it for sc's new one leaves that source still the larger,
// so sources converge on equal shares of MaxConns and never take turns
// evicting each other. Nil when sc already holds its share. It scans every
// source, but only when every connection slot is taken.
func (l *ConnLimiter) fairShareVictimLocked(sc *sourceCount) *handshakeSlot {
	var most *sourceCount
	for _, other := range l.bySource {
		if most == nil || other.conns > most.conns {
			most = other
		}
	}
	if most == nil || most.conns < sc.conns+2 || most.open.Len() == 0 {
		return nil
	}
	return most.open.Front().Value.(*handshakeSlot)
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
// handshakeDone), unless an eviction gave it back already.
func (l *ConnLimiter) release(h *handshakeSlot) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.releaseLocked(h)
}

func (l *ConnLimiter) releaseLocked(h *handshakeSlot) {
	if h.connElem == nil {
		return
	}
	l.handshakeDoneLocked(h)
	l.conns--
	if sc := l.bySource[h.src]; sc != nil {
		sc.open.Remove(h.connElem)
		if sc.conns--; sc.conns == 0 {
			delete(l.bySource, h.src)
		}
	}
	h.connElem = nil
}

// sourceAddr is the address a connection counts against: the client's IP,
// unmapped, or the zero Addr when it is not IP (tests' pipes).
func sourceAddr(a net.Addr) netip.Addr {
	if ta, ok := a.(*net.TCPAddr); ok {
		return ta.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}
