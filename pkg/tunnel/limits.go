package tunnel

import (
	"container/list"
	"fmt"
	"net"
	"net/netip"
	"sync"
)

// Limits bound the connections the agent holds open for pods: those of the
// capture listeners (outbound 15001, inbound plaintext 15006) and the
// tunnels HBONE (15008) clients open to a pod's apps, so that a flood from
// one pod, from one plaintext client or from one mesh peer cannot take
// every fd and byte of memory the agent has. Each kind has its own budget:
// a flood towards a pod never stops pods' own outbound connections, and
// plaintext clients never starve meshed ones, nor the reverse. A
// connection over a limit is reset at once (an HBONE tunnel is refused
// with 503), before any dial, and counted in
// redirector_tunnel_refused_connections_total{listener,limit}; at the node
// limit, a connection of a pod holding fewer than another takes that
// pod's oldest instead (limiter). The HBONE
// transport's own connections, handshakes and streams per connection are
// bounded apart, in package hbone.
type Limits struct {
	// PerNode bounds the open connections of each kind over all pods of
	// the node.
	PerNode int
	// PerPod bounds the open connections of each kind of one pod.
	PerPod int
	// PerSource bounds the open inbound connections from one client
	// address over all pods of the node, plaintext and HBONE tunnels each
	// on their own.
	PerSource int
}

// DefaultLimits are the limits when none are configured.
//
// A relayed connection holds two fds (one when its upstream is a shared
// HBONE connection) and, idle, about 25 KB. 30,000 per listener kind is
// 120,000 fds at most, well inside the 1,048,576 that container runtimes
// commonly grant (the Go runtime raises the soft limit to the hard one),
// and about 1.5 GB of idle relays: more than a node's pods normally open,
// less than what would take the node down. 10,000 per pod leaves room for
// the busiest proxies and gateways; 2,000 per client covers an ingress's
// connection pools to every pod of a node.
func DefaultLimits() Limits { return Limits{PerNode: 30000, PerPod: 10000, PerSource: 2000} }

// Validate reports a limit that is not positive.
func (l Limits) Validate() error {
	for _, v := range []struct {
		name string
		n    int
	}{{"per node", l.PerNode}, {"per pod", l.PerPod}, {"per source", l.PerSource}} {
		if v.n < 1 {
			return fmt.Errorf("connection limit %s is %d, want at least 1", v.name, v.n)
		}
	}
	return nil
}

// limitReason is what a CONNECT refused by a limit is told.
func limitReason(refusedBy string) string { return "over the " + refusedBy + " connection limit" }

// sourceLimitReason refuses a client over its own limit (limitReason): it
// says nothing about the destination (endpointFailed).
var sourceLimitReason = limitReason("source")

// listenerKind is a kind of connection whose count is limited.
type listenerKind int

const (
	listenerOutbound listenerKind = iota // captured at 15001
	listenerInbound                      // plaintext, captured at 15006
	listenerHBONE                        // a tunnel (CONNECT stream) to a pod's app
	numListeners
)

var listenerNames = [numListeners]string{"outbound", "inbound", "hbone"}

func (k listenerKind) String() string { return listenerNames[k] }

// reporter is ztunnel's reporter for k's connections.
func (k listenerKind) reporter() string {
	if k == listenerOutbound {
		return "source"
	}
	return "destination"
}

// bySource reports whether k is limited per client address: inbound
// kinds are, a pod's own outbound connections are not.
func (k listenerKind) bySource() bool { return k != listenerOutbound }

// limiter counts the open connections of the node's pods by kind. One
// mutex guards the node, pod and source counts: it is taken twice per
// connection, never while doing I/O.
//
// The node's budget of a kind is shared by every pod, and a pod may take
// up to PerPod of it: with the defaults three pods that keep their
// connections open, or pending to a destination that never answers, fill
// it. So a full node budget does not refuse a pod that holds fewer than
// the others: the oldest evictable connection of the pod holding the most
// is closed and its slot goes to the new one, when that pod holds at least
// two more than the pod asking (the HBONE transport's ConnLimiter does the
// same per source). Pods converge on equal shares, and one pod's flood,
// or a few pods', never stops the others. An evicted connection's dial is
// cancelled and its sockets reset (the app's, for an HBONE tunnel, which
// ends its relay and stream); slots taken with acquire are never evicted.
type limiter struct {
	lim Limits
	m   *Metrics
	log *refusalLog

	mu       sync.Mutex
	node     [numListeners]int
	bySource [numListeners]map[netip.Addr]int // inbound kinds only; no zero entries
	// holders are the pods with evictable slots of each kind.
	holders [numListeners]map[*pod]struct{}
	seq     uint64
}

func newLimiter(lim Limits, m *Metrics, log *refusalLog) *limiter {
	l := &limiter{lim: lim, m: m, log: log}
	for k := range l.bySource {
		l.bySource[k] = map[netip.Addr]int{}
		l.holders[k] = map[*pod]struct{}{}
	}
	return l
}

// slot is one admitted connection's place in the counts.
type slot struct {
	l    *limiter
	kind listenerKind
	p    *pod
	src  netip.Addr
	seq  uint64 // admission order
	// Guarded by l.mu.
	elem    *list.Element // in p.slots[kind] while evictable and held
	done    bool          // released or evicted: counted no more
	evicted bool
	close   func() // closes the connection when it is evicted
}

// acquire takes a slot for a new connection of pod p from src (src counts
// for inbound kinds only) that cannot be evicted. It returns the limit
// that refused it ("node", "pod", "source"), or a release that may be
// called more than once (only the first counts) when the connection
// closes.
func (l *limiter) acquire(kind listenerKind, p *pod, src netip.Addr) (release func(), refusedBy string) {
	s, refusedBy := l.take(kind, p, src, false)
	if s == nil {
		return nil, refusedBy
	}
	return s.release, ""
}

// take is acquire's slot; an evictable one may be evicted (see limiter)
// for another pod's connection, which closes the connection (setClose).
func (l *limiter) take(kind listenerKind, p *pod, src netip.Addr, evictable bool) (*slot, string) {
	l.mu.Lock()
	switch {
	case p.open[kind] >= l.lim.PerPod:
		l.mu.Unlock()
		return nil, "pod"
	case kind.bySource() && l.bySource[kind][src] >= l.lim.PerSource:
		l.mu.Unlock()
		return nil, "source"
	}
	var victim *slot
	if l.node[kind] >= l.lim.PerNode {
		if victim = l.victimLocked(kind, p); victim == nil {
			l.mu.Unlock()
			return nil, "node"
		}
		victim.evicted = true
		l.dropLocked(victim)
	}
	l.node[kind]++
	p.open[kind]++
	if kind.bySource() {
		l.bySource[kind][src]++
	}
	l.seq++
	s := &slot{l: l, kind: kind, p: p, src: src, seq: l.seq}
	if evictable {
		s.elem = p.slots[kind].PushBack(s)
		l.holders[kind][p] = struct{}{}
	}
	var closeVictim func()
	if victim != nil {
		closeVictim = victim.close
	}
	l.mu.Unlock()
	l.m.openConns.WithLabelValues(kind.String()).Inc()
	l.m.socketsOpen.WithLabelValues(kind.reporter()).Inc()
	if victim != nil {
		l.m.limitEvicted.WithLabelValues(kind.String()).Inc()
		l.log.note(p.ctx, "connection closed: the node's connection limit was reached and a pod holding fewer opened one",
			"listener", kind.String(), "pod", victim.p.uid, "for_pod", p.uid)
		if closeVictim != nil {
			closeVictim()
		}
	}
	return s, ""
}

// victimLocked returns the oldest evictable slot of the pod holding the
// most evictable slots of kind (of two holding as many, the one whose
// oldest is older), if it holds at least two more than p; nil if none
// does.
func (l *limiter) victimLocked(kind listenerKind, p *pod) *slot {
	need := p.open[kind] + 2
	var best *slot
	bestN := 0
	for q := range l.holders[kind] {
		n := q.slots[kind].Len()
		if q == p || n < need {
			continue
		}
		oldest := q.slots[kind].Front().Value.(*slot)
		if best == nil || n > bestN || (n == bestN && oldest.seq < best.seq) {
			best, bestN = oldest, n
		}
	}
	return best
}

// dropLocked uncounts s, once.
func (l *limiter) dropLocked(s *slot) {
	if s.done {
		return
	}
	s.done = true
	l.node[s.kind]--
	s.p.open[s.kind]--
	if s.kind.bySource() {
		if l.bySource[s.kind][s.src]--; l.bySource[s.kind][s.src] <= 0 {
			delete(l.bySource[s.kind], s.src)
		}
	}
	if s.elem != nil {
		s.p.slots[s.kind].Remove(s.elem)
		s.elem = nil
		if s.p.slots[s.kind].Len() == 0 {
			delete(l.holders[s.kind], s.p)
		}
	}
	l.m.openConns.WithLabelValues(s.kind.String()).Dec()
	l.m.socketsOpen.WithLabelValues(s.kind.reporter()).Dec()
}

// release gives the slot back when its connection closes; only the first
// call (or an eviction before it) counts.
func (s *slot) release() {
	s.l.mu.Lock()
	defer s.l.mu.Unlock()
	s.l.dropLocked(s)
}

// setClose gives s what closes its connection when it is evicted; if it
// was evicted already, close runs now.
func (s *slot) setClose(close func()) {
	s.l.mu.Lock()
	evicted := s.evicted
	if !evicted {
		s.close = close
	}
	s.l.mu.Unlock()
	if evicted {
		close()
	}
}

// admitter returns the accept loop's admission for one listener of p: a
// connection over a limit is reset at once and counted, with a
// rate-limited log.
func (p *pod) admitter(kind listenerKind) func(net.Conn) (*slot, bool) {
	t := p.t
	return func(c net.Conn) (*slot, bool) {
		src := addrPortOf(c.RemoteAddr())
		s, refusedBy := t.limits.take(kind, p, src.Addr(), true)
		if refusedBy == "" {
			return s, true
		}
		// Counted first: whoever sees the reset sees the count.
		t.cfg.Metrics.limitRefused.WithLabelValues(kind.String(), refusedBy).Inc()
		resetConn(c)
		t.refusals.note(p.ctx, "connection refused: over the "+refusedBy+" connection limit",
			"listener", kind.String(), "pod", p.uid, "client", src, "dst", addrPortOf(c.LocalAddr()))
		return nil, false
	}
}
