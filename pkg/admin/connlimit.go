package admin

import (
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The metrics and readiness ports listen on every node address, so any pod
// can reach them, and the admin port any process on the node. Each open
// connection costs the agent a goroutine and buffers out of the memory and
// fds it shares with every pod's data path, and net/http sets no bound of
// its own: a caller who opens connections and keeps them busy (a header
// sent a byte at a time, a request every minute) could hold as many as it
// likes. So each endpoint holds a bounded number of connections, and one
// client address a bounded share of them; a connection over either bound
// is closed as soon as it is accepted. Prometheus keeps one connection per
// target, kubelet opens one per probe.
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
// and those closed at accept over a bound (limit "endpoint" or
// "per_source"), which the log reports only once a minute.
type connMetrics struct {
	open    *prometheus.GaugeVec
	refused *prometheus.CounterVec
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
			Help: "Connections the agent's HTTP endpoints closed at accept, by endpoint and the bound they were over (endpoint: all its connections; per_source: one client address's).",
		}, []string{"endpoint", "limit"}),
	}
	if reg == nil {
		return m
	}
	m.open = registered(reg, m.open)
	m.refused = registered(reg, m.refused)
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

// limitListener accepts connections within the bounds above and closes
// the others at once.
type limitListener struct {
	net.Listener
	name             string
	total, perSource int
	log              *slog.Logger
	openGauge        prometheus.Gauge
	refusedTotal     prometheus.Counter // over total
	refusedPerSource prometheus.Counter // over perSource

	mu     sync.Mutex
	open   int
	bySrc  map[netip.Addr]int
	closed uint64    // over a bound, closed at accept, since logged
	logged time.Time // when that was last logged
}

func newLimitListener(l net.Listener, name string, total, perSource int, m *connMetrics, log *slog.Logger) *limitListener {
	return &limitListener{Listener: l, name: name, total: total, perSource: perSource, log: log, bySrc: map[netip.Addr]int{},
		openGauge:        m.open.WithLabelValues(name),
		refusedTotal:     m.refused.WithLabelValues(name, "endpoint"),
		refusedPerSource: m.refused.WithLabelValues(name, "per_source"),
	}
}

// Accept returns the next connection within the bounds.
func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		src := sourceOf(c)
		l.mu.Lock()
		if overTotal := l.open >= l.total; overTotal || l.bySrc[src] >= l.perSource {
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
			l.mu.Unlock()
			c.Close()
			if n > 0 {
				l.log.Warn("http endpoint closes connections over its limit", "endpoint", l.name, "source", src,
					"closed", n, "limit", l.total, "limit_per_source", l.perSource)
			}
			continue
		}
		l.open++
		l.bySrc[src]++
		l.mu.Unlock()
		l.openGauge.Inc()
		return &limitedConn{Conn: c, l: l, src: src}, nil
	}
}

func (l *limitListener) release(src netip.Addr) {
	l.openGauge.Dec()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.open--
	if l.bySrc[src]--; l.bySrc[src] <= 0 {
		delete(l.bySrc, src) // the map holds only addresses with open connections
	}
}

func sourceOf(c net.Conn) netip.Addr {
	if t, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		if a, ok := netip.AddrFromSlice(t.IP); ok {
			return a.Unmap()
		}
	}
	return netip.Addr{}
}

// limitedConn gives its slot back when it is closed, once.
type limitedConn struct {
	net.Conn
	l    *limitListener
	src  netip.Addr
	once sync.Once
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.release(c.src) })
	return err
}
