package admin

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/pkg/unixsock"
)

// The metrics and readiness ports listen on every node address, so any pod
// can reach them, and the admin port any process on the node. Each open
// connection costs the agent a goroutine and buffers out of the memory and
// fds it shares with every pod's data path, and net/http sets no bound of
// its own: a caller who opens connections and keeps them busy (a header
// sent a byte at a time, a request every minute) could hold as many as it
// likes. So each endpoint holds a bounded number of connections, and one
// client address a bounded share of them. Prometheus keeps one connection
// per target, kubelet opens one per probe.
//
// A connection over a bound first evicts an idle keep-alive connection (one
// that was answered and waits for its next request): the one idle longest
// of the client address holding the most connections, or of its own
// address if that is the bound it is over. Otherwise eight addresses that
// each send one honest request on 16 connections and then idle would hold
// every slot for the server's idle timeout (a minute), and kubelet's probe
// would be closed at accept: the agent would stay NotReady. Only a
// connection that no idle one can make room for is closed as soon as it is
// accepted.
const (
	// maxConnsPerEndpoint bounds the open connections of one endpoint.
	maxConnsPerEndpoint = 128
	// maxConnsPerSource bounds those of one client address on one
	// endpoint, so that one pod cannot take every slot from the scrapers
	// and probes.
	maxConnsPerSource = 16
)

// limitLogEvery is how often an endpoint says that it closes connections
// over its bounds: a flood must not become a flood of log lines.
const limitLogEvery = time.Minute

// connMetrics counts the endpoints' connections, by endpoint: those open,
// those closed at accept over a bound (limit "endpoint" or "per_source"),
// which the log reports only once a minute, and the idle ones evicted to
// admit a new one.
type connMetrics struct {
	open    *prometheus.GaugeVec
	refused *prometheus.CounterVec
	evicted *prometheus.CounterVec
}

// newConnMetrics returns the connection metrics, registered with reg if it
// is not nil (the ones already there if another Start registered them).
func newConnMetrics(reg prometheus.Registerer) *connMetrics {
	m := &connMetrics{
		open: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "redirector_endpoint_open_connections",
			Help: "Open connections of the agent's HTTP endpoints (metrics, readiness, admin), by endpoint.",
		}, []string{"endpoint"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_endpoint_refused_connections_total",
			Help: "Connections the agent's HTTP endpoints closed at accept, by endpoint and the bound they were over (endpoint: all its connections; per_source: one client address's), when no idle keep-alive connection could be evicted for them.",
		}, []string{"endpoint", "limit"}),
		evicted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_endpoint_evicted_connections_total",
			Help: "Connections the agent's HTTP endpoints closed to admit a new connection over a bound, by endpoint: an idle keep-alive connection (the one idle longest of the client address holding the most connections, or of the new connection's own address when that is the bound), or on the readiness socket the one open longest.",
		}, []string{"endpoint"}),
	}
	if reg == nil {
		return m
	}
	m.open = registered(reg, m.open)
	m.refused = registered(reg, m.refused)
	m.evicted = registered(reg, m.evicted)
	return m
}

// registered registers c with reg, or returns the equal collector already
// registered.
func registered[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
	}
	return c
}

// limitListener accepts connections within the bounds above, evicting idle
// ones to make room, and closes the others at once. Its server must report
// connection states to connState.
type limitListener struct {
	net.Listener
	name             string
	total, perSource int
	log              *slog.Logger
	openGauge        prometheus.Gauge
	refusedTotal     prometheus.Counter // over total
	refusedPerSource prometheus.Counter // over perSource
	evicted          prometheus.Counter

	// evictOldest: over a bound with no idle connection to evict, an
	// open connection is closed for the new one instead of the new one
	// (see oldest). For a socket whose honest clients send their request
	// at once and are answered at once (the readiness socket), so that
	// the oldest is a stalled one.
	evictOldest bool

	mu     sync.Mutex
	open   int
	bySrc  map[connSource]int
	idle   map[*limitedConn]time.Time // idle keep-alive connections, and since when
	conns  map[*limitedConn]time.Time // with evictOldest: every open connection, and since when
	closed uint64                     // over a bound, closed at accept, since logged
	logged time.Time                  // when that was last logged
}

func newLimitListener(l net.Listener, name string, total, perSource int, m *connMetrics, log *slog.Logger) *limitListener {
	return &limitListener{Listener: l, name: name, total: total, perSource: perSource, log: log,
		bySrc: map[connSource]int{}, idle: map[*limitedConn]time.Time{}, conns: map[*limitedConn]time.Time{},
		openGauge:        m.open.WithLabelValues(name),
		refusedTotal:     m.refused.WithLabelValues(name, "endpoint"),
		refusedPerSource: m.refused.WithLabelValues(name, "per_source"),
		evicted:          m.evicted.WithLabelValues(name),
	}
}

// Accept returns the next connection within the bounds.
func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if lc := l.admit(c); lc != nil {
			return lc, nil
		}
		c.Close()
	}
}

// admit takes c's slot, evicting an idle connection if c is over a bound,
// or returns nil if it cannot.
func (l *limitListener) admit(c net.Conn) *limitedConn {
	src := sourceOf(c)
	l.mu.Lock()
	overTotal, overSource := l.open >= l.total, l.bySrc[src] >= l.perSource
	var victim *limitedConn
	if overTotal || overSource {
		if victim = l.evictable(src, overSource); victim == nil && l.evictOldest {
			victim = l.oldest(src, overSource)
		}
		if victim == nil {
			n := l.countRefused(overTotal)
			l.mu.Unlock()
			if n > 0 {
				l.log.Warn("http endpoint closes connections over its limit", "endpoint", l.name, "source", src.String(),
					"closed", n, "limit", l.total, "limit_per_source", l.perSource)
			}
			return nil
		}
		l.releaseLocked(victim)
	}
	lc := &limitedConn{Conn: c, l: l, src: src}
	if l.evictOldest {
		l.conns[lc] = time.Now()
	}
	l.open++
	l.bySrc[src]++
	l.openGauge.Inc()
	l.mu.Unlock()
	if victim != nil {
		victim.Conn.Close() // its server's read fails, and it forgets the connection
		l.evicted.Inc()
	}
	return lc
}

// evictable is the idle connection to close for a new one from src: the
// one idle longest of src's own if src is over its bound, otherwise of the
// address holding the most connections, and only if that address holds
// more than src does (a client whose connections are busy must not evict
// Prometheus's one idle keep-alive with its fifteenth). nil if none is.
func (l *limitListener) evictable(src connSource, ownOnly bool) *limitedConn {
	var victim *limitedConn
	for c, since := range l.idle {
		if ownOnly && c.src != src {
			continue
		}
		if victim == nil || l.bySrc[c.src] > l.bySrc[victim.src] ||
			(l.bySrc[c.src] == l.bySrc[victim.src] && since.Before(l.idle[victim])) {
			victim = c
		}
	}
	if victim != nil && !ownOnly && l.bySrc[victim.src] <= l.bySrc[src] {
		return nil
	}
	return victim
}

// oldest is the connection to close for a new one from src with
// evictOldest: the one open longest of src's own if ownOnly, otherwise of
// the source holding the most connections (so that one client opening
// connections as fast as it can only ever evicts its own); nil if there
// is none.
func (l *limitListener) oldest(src connSource, ownOnly bool) *limitedConn {
	var victim *limitedConn
	for c, since := range l.conns {
		if ownOnly && c.src != src {
			continue
		}
		if victim == nil || l.bySrc[c.src] > l.bySrc[victim.src] ||
			(l.bySrc[c.src] == l.bySrc[victim.src] && since.Before(l.conns[victim])) {
			victim = c
		}
	}
	return victim
}

// countRefused counts a connection closed over a bound and returns how
// many to log now: all since the last line, once a minute, else 0.
func (l *limitListener) countRefused(overTotal bool) uint64 {
	if overTotal {
		l.refusedTotal.Inc()
	} else {
		l.refusedPerSource.Inc()
	}
	l.closed++
	var n uint64
	if now := time.Now(); now.Sub(l.logged) >= limitLogEvery {
		n, l.closed, l.logged = l.closed, 0, now
	}
	return n
}

// connState is the server's ConnState hook: it tells which connections are
// idle between requests, and so evictable.
func (l *limitListener) connState(c net.Conn, state http.ConnState) {
	lc, ok := c.(*limitedConn)
	if !ok {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if lc.released {
		return
	}
	if state == http.StateIdle {
		l.idle[lc] = time.Now()
	} else {
		delete(l.idle, lc)
	}
}

// releaseLocked gives c's slot back, once.
func (l *limitListener) releaseLocked(c *limitedConn) {
	if c.released {
		return
	}
	c.released = true
	l.openGauge.Dec()
	l.open--
	if l.bySrc[c.src]--; l.bySrc[c.src] <= 0 {
		delete(l.bySrc, c.src) // the map holds only addresses with open connections
	}
	delete(l.idle, c)
	delete(l.conns, c)
}

// connSource is who a connection is from, for the per-source bound: the
// client address of a TCP connection; the process (SO_PEERCRED) of a unix
// one, which has no address. The zero value is one bucket for all (a peer
// whose credentials could not be read).
type connSource struct {
	addr netip.Addr
	pid  int32
}

func (s connSource) String() string {
	if s.pid != 0 {
		return fmt.Sprintf("pid %d", s.pid)
	}
	return s.addr.String()
}

func sourceOf(c net.Conn) connSource {
	switch t := c.RemoteAddr().(type) {
	case *net.TCPAddr:
		if a, ok := netip.AddrFromSlice(t.IP); ok {
			return connSource{addr: a.Unmap()}
		}
	case *net.UnixAddr:
		if cred, err := unixsock.PeerCred(c); err == nil {
			return connSource{pid: cred.Pid}
		}
	}
	return connSource{}
}

// limitedConn gives its slot back when it is closed or evicted.
type limitedConn struct {
	net.Conn
	l        *limitListener
	src      connSource
	released bool // under l.mu
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.l.mu.Lock()
	c.l.releaseLocked(c)
	c.l.mu.Unlock()
	return err
}
