// Package admin serves the agent's HTTP endpoints on the ports Istio's agents
// use: Prometheus metrics (:15020/metrics), the readiness probe
// (:15021/healthz/ready) and, on localhost, the admin endpoint (:15000: config
// dump, pprof, log level). It is fed through functions and plain types, so it
// imports nothing of the data path, and everything it reports is computed
// when asked: a scrape or a probe never sees a stale copy.
package admin

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/pkg/unixsock"
)

// Options says what to serve where. An empty address leaves that endpoint
// out, for tests and tools that need only some of them.
type Options struct {
	// MetricsAddr serves GET /metrics from Registry.
	MetricsAddr string
	// ReadinessAddr serves GET /healthz/ready from Ready.
	ReadinessAddr string
	// ReadinessSocket, if set, serves GET /healthz/ready from Ready on a
	// unix socket at this path too: a path private to the agent's
	// container, which only this agent answers, where the shared TCP port
	// may be answered by a predecessor still running beside it (see
	// `redirector ready`, the chart's startup probe).
	ReadinessSocket string
	// AdminAddr serves the config dump, pprof and the log level. It exposes
	// the process's internals, so it belongs on a loopback address.
	AdminAddr string

	Registry *prometheus.Registry
	// Ready is asked on every probe: ready, or the reason why not, which
	// the probe's body carries so that `kubectl describe` shows it.
	Ready func() (ready bool, reason string)
	// Sections are the config dump's top-level keys, each computed when the
	// dump is asked for (see the Section* names).
	Sections map[string]func() any
	// Level is the log level that /logging reads and changes.
	Level *slog.LevelVar
	// Logger gets server errors and level changes (slog.Default if nil).
	Logger *slog.Logger
	// Listen opens the listener of the endpoint named name (EndpointMetrics,
	// ...) on addr: a predecessor's socket taken over, or ListenShared
	// beside one that does not hand them over. Nil: ListenAlone.
	Listen func(ctx context.Context, name, addr string) (net.Listener, error)

	// bindRetry is how long an endpoint whose address is in use waits
	// before it tries again (0: BindRetryPeriod); for tests.
	bindRetry time.Duration
	// reopenRetry is the first wait before ReopenReadiness, failed, tries
	// again (0: ReopenRetryPeriod); for tests.
	reopenRetry time.Duration
	// scrapeBurst is the render time of scrapes spent at once before
	// their budget applies (0: scrapeBurst, see scrapeCache); for tests.
	scrapeBurst time.Duration
}

// ReopenRetryPeriod is the first wait before the readiness endpoint, not
// served again after a take-back (ReopenReadiness), is tried again; the
// wait doubles up to ReopenRetryMax.
const (
	ReopenRetryPeriod = time.Second
	ReopenRetryMax    = 30 * time.Second
)

// BindRetryPeriod is how often an endpoint whose address another socket
// holds tries to bind it again (see Start).
const BindRetryPeriod = 5 * time.Second

// Bounds of every request, whoever sends it: the endpoints take no body
// but pprof's symbol lookups (a few KiB from the pprof tool), and no header
// set of an honest caller comes near 16 KiB (net/http's default is 1 MiB).
// A metrics or readiness answer must be written within writeTimeout.
const (
	maxHeaderBytes = 16 << 10
	maxBodyBytes   = 64 << 10
	readTimeout    = 10 * time.Second
	writeTimeout   = 30 * time.Second
)

// maxProfileSeconds bounds how long a profile or trace asked of the admin
// endpoint runs (its seconds parameter; see boundProfile): the runtime's
// tracer or CPU profiler stays on, and a trace's buffers fill, for as long
// as it runs, whether or not the caller reads. The admin server's write
// timeout is just above it, so that pprof's own check of a duration against
// the server's write timeout applies too, and a caller that stops reading
// is cut off rather than holding the profile's answer for ever.
const (
	maxProfileSeconds = 60
	adminWriteTimeout = (maxProfileSeconds + 5) * time.Second
)

// Servers are the running endpoints.
type Servers struct {
	metricsAddr, readinessAddr, adminAddr string

	// mu guards servers, readiness, readinessClosed and raw: the readiness
	// endpoint may be served again (ReopenReadiness).
	mu              sync.Mutex
	servers         []*http.Server
	readiness       *http.Server
	readinessClosed bool
	// readinessCloses counts CloseReadiness calls: a retry of
	// ReopenReadiness made before the last one ends (retryReadiness).
	readinessCloses uint64
	// reopenReadiness serves the readiness endpoint again on its address;
	// reopenMu makes one such serve at a time.
	reopenReadiness func(ctx context.Context) error
	reopenMu        sync.Mutex
	reopenRetry     time.Duration
	log             *slog.Logger
	// stop ends the binding of endpoints whose address was in use.
	stop     chan struct{}
	stopOnce sync.Once
	pendMu   sync.Mutex
	pending  []*pendingListener
	// raw are the endpoints' listeners by name, for a successor agent
	// to take (Listener) and OwnPorts to replace.
	raw map[string]*rebindable
	wg  sync.WaitGroup
}

// Endpoint names, as Options.Listen and Listener take them.
const (
	EndpointMetrics   = "metrics"
	EndpointReadiness = "readiness"
	EndpointAdmin     = "admin"
	// EndpointReadinessSocket names the readiness socket (ReadinessSocket)
	// in the connection metrics.
	EndpointReadinessSocket = "readiness_socket"
)

// Start listens on every address before it returns, so that a bad address
// fails the agent's start with an error naming the endpoint; then it serves
// in the background until Close. ctx bounds only the listening.
//
// An address another socket holds (EADDRINUSE) does not fail the start: the
// endpoint is bound once it is free, tried every BindRetryPeriod, and until
// then the agent is not ready, naming it. The endpoints are in the node's
// namespace, where any hostNetwork pod may bind a port the agent left for a
// moment (a crash, a restart without hand-over); a failed start then made
// the agent exit at every restart, and the enrolled pods' tunnels with it,
// for as long as that pod held the port.
func Start(ctx context.Context, o Options) (*Servers, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	s := &Servers{stop: make(chan struct{}), log: log, reopenRetry: cmp.Or(o.reopenRetry, ReopenRetryPeriod)}
	if ready := o.Ready; ready != nil {
		o.Ready = AllReady(ready, s.bound)
	}
	var reg prometheus.Registerer
	if o.Registry != nil {
		reg = o.Registry
	}
	conns := newConnMetrics(reg)
	endpoints := []struct {
		name, addr string
		handler    func() http.Handler
		bound      *string
	}{
		{EndpointMetrics, o.MetricsAddr, func() http.Handler { return metricsHandler(o.Registry, o.scrapeBurst, log) }, &s.metricsAddr},
		{EndpointReadiness, o.ReadinessAddr, func() http.Handler { return readinessHandler(o.Ready) }, &s.readinessAddr},
		{EndpointAdmin, o.AdminAddr, func() http.Handler { return adminHandler(o.Sections, o.Level, log) }, &s.adminAddr},
	}
	listen := o.Listen
	if listen == nil {
		listen = func(ctx context.Context, _, addr string) (net.Listener, error) { return ListenAlone(ctx, addr) }
	}
	retry := cmp.Or(o.bindRetry, BindRetryPeriod)
	for _, e := range endpoints {
		if e.addr == "" {
			continue
		}
		bound, err := s.serve(ctx, e.name, e.addr, listen, retry, e.handler(), conns, log)
		if err != nil {
			s.Close()
			return nil, err
		}
		*e.bound = bound
		if e.name == EndpointReadiness {
			handler := e.handler()
			s.reopenReadiness = func(ctx context.Context) error {
				_, err := s.serve(ctx, EndpointReadiness, bound, listen, retry, handler, conns, log)
				return err
			}
		}
	}
	if o.ReadinessSocket != "" {
		if err := s.serveReadinessSocket(o.ReadinessSocket, o.Ready, conns, log); err != nil {
			s.Close()
			return nil, err
		}
	}
	return s, nil
}

// serve listens for the endpoint name on addr (or binds it later if the
// address is in use, see Start) and serves handler there until Close. It
// returns the address bound.
func (s *Servers) serve(ctx context.Context, name, addr string, listen func(context.Context, string, string) (net.Listener, error),
	retry time.Duration, handler http.Handler, conns *connMetrics, log *slog.Logger) (string, error) {
	l, err := listen(ctx, name, addr)
	if errors.Is(err, syscall.EADDRINUSE) {
		l = s.bindLater(name, addr, listen, retry, err, log)
	} else if err != nil {
		return "", fmt.Errorf("%s endpoint: %w", name, err)
	}
	r := &rebindable{cur: l}
	bound := r.Addr().String()
	if name == EndpointAdmin && !isLoopback(r.Addr()) {
		log.Warn("admin endpoint is not on a loopback address: anyone who reaches it can read the config and profile the agent", "addr", bound)
	}
	total := maxConnsPerEndpoint
	if name == EndpointAdmin {
		total = maxConnsPerSource // one local caller's worth: it is on loopback
	}
	ll := newLimitListener(r, name, total, maxConnsPerSource, conns, log)
	// kubelet sends its probe at once and is answered at once, from
	// the node's address, which every hostNetwork pod may use too: a
	// connection still open long after it came is a stalled request
	// (none is kept alive), to evict rather than refuse the probe for.
	ll.evictOldest = name == EndpointReadiness
	srv := &http.Server{
		Handler:           boundBody(handler),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       time.Minute,
		MaxHeaderBytes:    maxHeaderBytes,
		ConnState:         ll.connState, // which connections are idle, and so evictable
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	switch name {
	case EndpointAdmin:
		// pprof's profile and trace run as long as asked, up to
		// maxProfileSeconds, before their answer is written.
		srv.WriteTimeout = adminWriteTimeout
	case EndpointReadiness:
		// kubelet opens a connection per probe and never reuses it:
		// an idle keep-alive connection there only holds a slot.
		srv.SetKeepAlivesEnabled(false)
	}
	s.mu.Lock()
	if s.raw == nil {
		s.raw = map[string]*rebindable{}
	}
	s.raw[name] = r
	s.servers = append(s.servers, srv)
	if name == EndpointReadiness {
		s.readiness = srv
	}
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := srv.Serve(ll); !errors.Is(err, http.ErrServerClosed) {
			log.Error("http endpoint stopped", "endpoint", name, "addr", bound, "error", err)
		}
	}()
	return bound, nil
}

// serveReadinessSocket serves the readiness handler on a unix socket at
// path, replacing a stale socket there (a restart of the container keeps
// its /tmp). It holds at most maxConnsPerSource connections, counted as
// the endpoint EndpointReadinessSocket, each peer process a source. Its
// one honest client, `redirector ready`, sends its request at once and is
// answered at once, so a connection over the bound evicts the oldest open
// one of the process holding the most, a stalled client (nothing sent, or
// half a request), rather than being refused: stalled clients that keep
// coming neither make the agent hold descriptors without bound nor keep
// the startup probe from its answer.
func (s *Servers) serveReadinessSocket(path string, ready func() (bool, string), conns *connMetrics, log *slog.Logger) error {
	raw, _, err := unixsock.Install("readiness socket", path, "unix")
	if err != nil {
		return fmt.Errorf("readiness socket: %w", err)
	}
	if err := setBacklog(raw, readinessBacklog); err != nil {
		raw.Close()
		return fmt.Errorf("readiness socket %s: set listen backlog: %w", path, err)
	}
	l := newLimitListener(raw, EndpointReadinessSocket, maxConnsPerSource, maxConnsPerSource, conns, log)
	l.evictOldest = true
	srv := &http.Server{
		Handler:           boundBody(readinessHandler(ready)),
		ConnState:         l.connState,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	srv.SetKeepAlivesEnabled(false)
	s.servers = append(s.servers, srv)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
			log.Error("readiness socket stopped", "path", path, "error", err)
		}
	}()
	return nil
}

// readinessBacklog is the readiness socket's listen backlog. The kernel
// queues connections not yet accepted in order, where no eviction reaches
// them: with the default (somaxconn, 4096) one process opening connections
// as fast as it can kept the queue full, and a probe's connection waited
// behind 4096 others, 0.1 to 0.25 s on an idle machine, 0.5 s to over the
// probe's timeout under the race detector, and so on a slow or CPU-limited
// node. Now it waits behind at most 128 (milliseconds); a connect to a
// full queue is refused at once (EAGAIN), and `redirector ready` tries
// again every 10 ms.
const readinessBacklog = 128

// setBacklog sets the listen backlog of l, a listening socket, to n: Linux
// takes a second listen(2) on a listening socket as a new backlog, and the
// net package has no other way to choose one.
func setBacklog(l net.Listener, n int) error {
	sc, ok := l.(syscall.Conn)
	if !ok {
		return fmt.Errorf("%T has no file descriptor", l)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return err
	}
	var lerr error
	if err := rc.Control(func(fd uintptr) { lerr = unix.Listen(int(fd), n) }); err != nil {
		return err
	}
	return lerr
}

func (o Options) validate() error {
	switch {
	case o.MetricsAddr != "" && o.Registry == nil:
		return errors.New("metrics endpoint: no registry given")
	case (o.ReadinessAddr != "" || o.ReadinessSocket != "") && o.Ready == nil:
		return errors.New("readiness endpoint: no readiness check given")
	case o.AdminAddr != "" && o.Level == nil:
		return errors.New("admin endpoint: no log level variable given")
	}
	return nil
}

func isLoopback(a net.Addr) bool {
	t, ok := a.(*net.TCPAddr)
	return ok && t.IP.IsLoopback()
}

// MetricsAddr is the address /metrics is served on ("" if it is not), with
// the port the kernel chose if it was given as 0.
func (s *Servers) MetricsAddr() string { return s.metricsAddr }

// ReadinessAddr is the address /healthz/ready is served on ("" if it is not).
func (s *Servers) ReadinessAddr() string { return s.readinessAddr }

// AdminAddr is the address of the admin endpoint ("" if it is not served).
func (s *Servers) AdminAddr() string { return s.adminAddr }

// Close stops every endpoint at once, open requests included, and waits for
// the servers to return. Calling it again is harmless.
func (s *Servers) Close() error {
	if s.stop != nil {
		s.stopOnce.Do(func() { close(s.stop) })
	}
	s.mu.Lock()
	servers := slices.Clone(s.servers)
	s.mu.Unlock()
	var errs []error
	for _, srv := range servers {
		errs = append(errs, srv.Close())
	}
	s.wg.Wait()
	return errors.Join(errs...)
}

// CloseReadiness stops the readiness endpoint only. An agent that a newer
// one succeeded calls it: the two share the port (SO_REUSEPORT), and a
// probe meant for the successor must not be answered by the old agent, or
// the successor would pass for ready before it is. The old agent's own
// probes then reach the successor. Calling it again is harmless.
func (s *Servers) CloseReadiness() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.readiness == nil || s.readinessClosed {
		return nil
	}
	s.readinessClosed = true
	s.readinessCloses++
	return s.readiness.Close()
}

// ReopenReadiness serves the readiness endpoint again, on the address it
// had, after CloseReadiness: the newer agent this one yielded to gave the
// node up (an upgrade rolled back), and this agent answers the node's
// probes again. The newer agent may still hold the port while it drains:
// the endpoint is then bound once it is free, as at Start. Calling it while
// the endpoint is served is harmless.
//
// Any other failure is returned, and serving is tried again in the
// background, after ReopenRetryPeriod doubling up to ReopenRetryMax, until
// it succeeds, the servers close or CloseReadiness is called (a newer agent
// took the node again). Before, the agent stayed unready for good, and the
// chart's liveness probe restarted it, losing every connection it carried.
func (s *Servers) ReopenReadiness(ctx context.Context) error {
	if s == nil {
		return nil
	}
	s.reopenMu.Lock()
	defer s.reopenMu.Unlock()
	s.mu.Lock()
	reopen := s.readinessClosed && s.reopenReadiness != nil
	s.readinessClosed = false
	closes := s.readinessCloses
	s.mu.Unlock()
	select {
	case <-s.stop:
		return nil // closed
	default:
	}
	if !reopen {
		return nil
	}
	err := s.reopenReadiness(ctx)
	if err != nil {
		s.wg.Add(1)
		go s.retryReadiness(closes, err)
	}
	return err
}

// retryReadiness serves the readiness endpoint again after ReopenReadiness
// failed with first, while no CloseReadiness came after it (closes is the
// count it saw) and the servers run.
func (s *Servers) retryReadiness(closes uint64, first error) {
	defer s.wg.Done()
	err := first
	for wait := s.reopenRetry; ; wait = min(2*wait, ReopenRetryMax) {
		s.log.Error("readiness endpoint not served again; retrying", "error", err, "retry_in", wait)
		select {
		case <-s.stop:
			return
		case <-time.After(wait):
		}
		if done := s.retryReadinessOnce(closes, wait, &err); done {
			return
		}
	}
}

// retryReadinessOnce is one try of retryReadiness; it reports whether the
// retries are over (served, or no longer wanted), else sets *err.
func (s *Servers) retryReadinessOnce(closes uint64, wait time.Duration, err *error) bool {
	s.reopenMu.Lock()
	defer s.reopenMu.Unlock()
	wanted := func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.readinessCloses == closes
	}
	if !wanted() {
		return true
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	if *err = s.reopenReadiness(ctx); *err != nil {
		return false
	}
	if !wanted() {
		// Closed while this one was being served: it must not answer.
		s.mu.Lock()
		srv := s.readiness
		s.mu.Unlock()
		_ = srv.Close()
		return true
	}
	s.log.Info("readiness endpoint served again", "addr", s.readinessAddr)
	return true
}

// Listener is the listener of the endpoint named name (EndpointMetrics,
// ...) as opened, nil if it is not served: the socket a successor agent
// takes over (tunnel's hand-over), so that the two accept from one queue
// while both run and the port is never free nor shared with anyone else.
func (s *Servers) Listener(name string) net.Listener {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	r := s.raw[name]
	s.mu.Unlock()
	if r == nil {
		return nil
	}
	l := r.current()
	if p, ok := l.(*pendingListener); ok {
		return p.bound() // nil until bound
	}
	return l
}

// bindLater returns a listener for the endpoint name at addr, which is in
// use (first is why): it binds addr every retry until that succeeds or
// the servers close, and accepts only once bound.
func (s *Servers) bindLater(name, addr string, listen func(context.Context, string, string) (net.Listener, error), retry time.Duration, first error, log *slog.Logger) *pendingListener {
	p := &pendingListener{name: name, addr: addr, ready: make(chan struct{}), closed: make(chan struct{}), err: first}
	if a, err := net.ResolveTCPAddr("tcp", addr); err == nil {
		p.placeholder = a
	} else {
		p.placeholder = &net.TCPAddr{}
	}
	s.pendMu.Lock()
	s.pending = append(s.pending, p)
	s.pendMu.Unlock()
	log.Error("http endpoint address in use by another socket: the agent runs without the endpoint, not ready, and binds it once it is free",
		"endpoint", name, "addr", addr, "error", first, "retry_in", retry)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			select {
			case <-s.stop:
				return
			case <-p.closed:
				return
			case <-time.After(retry):
			}
			ctx, cancel := context.WithTimeout(context.Background(), retry)
			l, err := listen(ctx, name, addr)
			cancel()
			if err == nil {
				if p.set(l) {
					log.Info("http endpoint bound at last", "endpoint", name, "addr", addr)
				}
				return
			}
			p.fail(err)
		}
	}()
	return p
}

// bound is the readiness check of the endpoints not bound yet.
func (s *Servers) bound() (bool, string) {
	s.pendMu.Lock()
	defer s.pendMu.Unlock()
	var why []string
	for _, p := range s.pending {
		if err := p.unbound(); err != nil {
			why = append(why, fmt.Sprintf("%s endpoint %s not served: %v (tried again every few seconds)", p.name, p.addr, err))
		}
	}
	return len(why) == 0, strings.Join(why, "; ")
}

// pendingListener is an endpoint's listener whose address was in use: it
// accepts once bindLater has bound it.
type pendingListener struct {
	name, addr  string
	placeholder net.Addr // the address asked for, until bound
	ready       chan struct{}
	closed      chan struct{}

	mu       sync.Mutex
	l        net.Listener
	err      error // why it is not bound yet
	isClosed bool
}

// set installs the bound listener, or closes it if p was closed meanwhile.
func (p *pendingListener) set(l net.Listener) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.isClosed {
		l.Close()
		return false
	}
	p.l, p.err = l, nil
	close(p.ready)
	return true
}

func (p *pendingListener) fail(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.err = err
}

// unbound is why p is not bound yet; nil once closed: a readiness
// endpoint closed and served again (ReopenReadiness) is judged by its new
// listener.
func (p *pendingListener) unbound() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.isClosed {
		return nil
	}
	return p.err
}

func (p *pendingListener) bound() net.Listener {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.l
}

func (p *pendingListener) Accept() (net.Conn, error) {
	select {
	case <-p.ready:
		return p.bound().Accept()
	case <-p.closed:
		return nil, net.ErrClosed
	}
}

func (p *pendingListener) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.isClosed {
		return nil
	}
	p.isClosed = true
	close(p.closed)
	if p.l != nil {
		return p.l.Close()
	}
	return nil
}

func (p *pendingListener) Addr() net.Addr {
	if l := p.bound(); l != nil {
		return l.Addr()
	}
	return p.placeholder
}

// ListenAlone listens on addr (TCP) without SO_REUSEPORT: no other socket
// may bind the port while it is open. The endpoints are in the node's
// namespace: with SO_REUSEPORT any process of the agent's user there (a
// hostNetwork container running as root) could join the port and take a
// share of its connections (kubelet's probes, scrapes, admin calls), or
// all of them on the node's own address, which a specific bind wins over
// the wildcard. A successor agent takes the very socket instead
// (Listener).
func ListenAlone(ctx context.Context, addr string) (net.Listener, error) {
	return (&net.ListenConfig{}).Listen(ctx, "tcp", addr)
}

// ListenShared listens on addr with SO_REUSEPORT, beside a predecessor
// that does not hand its endpoints over (a release before hand-over of
// the endpoints, whose sockets are in a reuseport group): the two then
// share the port, open to anyone of the agent's user, until Unshare.
func ListenShared(ctx context.Context, addr string) (net.Listener, error) {
	return (&net.ListenConfig{Control: reusePort}).Listen(ctx, "tcp", addr)
}

// OwnPorts gives each endpoint that shares its port (SO_REUSEPORT: bound
// by ListenShared, or such a socket a predecessor handed over) a socket of
// its own: the shared one is closed and the address bound again alone.
// Call it once no predecessor shares the ports any more. A socket with
// SO_REUSEPORT stays open to joiners for as long as it lives (clearing the
// option does not close the port's bind bucket), and a successor takes it
// over as it is: without this, every later agent would carry it on. The
// port is free for the moment between the close and the bind: a connection
// then is refused, and the caller sees an error if something took the port.
func (s *Servers) OwnPorts(ctx context.Context) error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	raw := maps.Clone(s.raw)
	s.mu.Unlock()
	var errs []error
	for name, r := range raw {
		shared, err := reusePortSet(r.current())
		if err != nil || !shared {
			continue
		}
		if err := r.rebind(ctx); err != nil {
			errs = append(errs, fmt.Errorf("%s endpoint: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// reusePortSet reports whether l has SO_REUSEPORT.
func reusePortSet(l net.Listener) (bool, error) {
	sc, ok := l.(syscall.Conn)
	if !ok {
		return false, fmt.Errorf("a %T has no descriptor", l)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false, err
	}
	var v int
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		v, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT)
	}); err != nil {
		return false, err
	}
	return v != 0, gerr
}

// rebindable is an endpoint's listener that OwnPorts can replace under
// its server: Accept goes on on the new socket.
type rebindable struct {
	mu     sync.Mutex
	cur    net.Listener
	closed bool
}

func (r *rebindable) current() net.Listener {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cur
}

func (r *rebindable) Accept() (net.Conn, error) {
	for {
		l := r.current()
		c, err := l.Accept()
		if err == nil {
			return c, nil
		}
		// rebind holds mu from closing the old socket to installing the
		// new one.
		r.mu.Lock()
		again := !r.closed && r.cur != l
		r.mu.Unlock()
		if !again {
			return nil, err
		}
	}
}

func (r *rebindable) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	return r.cur.Close()
}

func (r *rebindable) Addr() net.Addr { return r.current().Addr() }

func (r *rebindable) rebind(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	addr := r.cur.Addr().String()
	if err := r.cur.Close(); err != nil {
		return fmt.Errorf("close the shared socket: %w", err)
	}
	l, err := ListenAlone(ctx, addr)
	if err != nil {
		// The server stops: Accept returns the old socket's error.
		return fmt.Errorf("bind %s alone: %w", addr, err)
	}
	r.cur = l
	return nil
}

// reusePort sets SO_REUSEPORT (ListenShared).
func reusePort(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("set SO_REUSEPORT: %w", serr)
	}
	return nil
}
