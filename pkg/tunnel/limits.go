package tunnel

import (
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
// redirector_tunnel_refused_connections_total{listener,limit}. The HBONE
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
type limiter struct {
	lim Limits
	m   *Metrics

	mu       sync.Mutex
	node     [numListeners]int
	bySource [numListeners]map[netip.Addr]int // inbound kinds only; no zero entries
}

func newLimiter(lim Limits, m *Metrics) *limiter {
	l := &limiter{lim: lim, m: m}
	for k := range l.bySource {
		l.bySource[k] = map[netip.Addr]int{}
	}
	return l
}

// acquire takes a slot for a new connection of pod p from src (src counts
// for inbound kinds only). It returns the limit that refused it ("node",
// "pod", "source"), or a release that may be called more than once (only
// the first counts) when the connection closes.
func (l *limiter) acquire(kind listenerKind, p *pod, src netip.Addr) (release func(), refusedBy string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.node[kind] >= l.lim.PerNode:
		return nil, "node"
	case p.open[kind] >= l.lim.PerPod:
		return nil, "pod"
	case kind.bySource() && l.bySource[kind][src] >= l.lim.PerSource:
		return nil, "source"
	}
	l.node[kind]++
	p.open[kind]++
	if kind.bySource() {
		l.bySource[kind][src]++
	}
	l.m.openConns.WithLabelValues(kind.String()).Inc()
	l.m.socketsOpen.WithLabelValues(kind.reporter()).Inc()
	var once sync.Once
	return func() { once.Do(func() { l.release(kind, p, src) }) }, ""
}

func (l *limiter) release(kind listenerKind, p *pod, src netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.node[kind]--
	p.open[kind]--
	if kind.bySource() {
		if l.bySource[kind][src]--; l.bySource[kind][src] <= 0 {
			delete(l.bySource[kind], src)
		}
	}
	l.m.openConns.WithLabelValues(kind.String()).Dec()
	l.m.socketsOpen.WithLabelValues(kind.reporter()).Dec()
}

// admitter returns the accept loop's admission for one listener of p: a
// connection over a limit is reset at once and counted, with a
// rate-limited log.
func (p *pod) admitter(kind listenerKind) func(net.Conn) (func(), bool) {
	t := p.t
	return func(c net.Conn) (func(), bool) {
		src := addrPortOf(c.RemoteAddr())
		release, refusedBy := t.limits.acquire(kind, p, src.Addr())
		if refusedBy == "" {
			return release, true
		}
		resetConn(c)
		t.cfg.Metrics.limitRefused.WithLabelValues(kind.String(), refusedBy).Inc()
		t.refusals.note(p.ctx, "connection refused: over the "+refusedBy+" connection limit",
			"listener", kind.String(), "pod", p.uid, "client", src, "dst", addrPortOf(c.LocalAddr()))
		return nil, false
	}
}
