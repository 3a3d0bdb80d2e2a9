// Package admin serves the agent's HTTP endpoints on the ports Istio's agents
// use: Prometheus metrics (:15020/metrics), the readiness probe
// (:15021/healthz/ready) and, on localhost, the admin endpoint (:15000: config
// dump, pprof, log level). It is fed through functions and plain types, so it
// imports nothing of the data path, and everything it reports is computed
// when asked: a scrape or a probe never sees a stale copy.
package admin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/prometheus/client_golang/prometheus"
)

// Options says what to serve where. An empty address leaves that endpoint
// out, for tests and tools that need only some of them.
type Options struct {
	// MetricsAddr serves GET /metrics from Registry.
	MetricsAddr string
	// ReadinessAddr serves GET /healthz/ready from Ready.
	ReadinessAddr string
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
}

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

	servers   []*http.Server
	readiness *http.Server
	wg        sync.WaitGroup
}

// Start listens on every address before it returns, so a port already in use
// fails the agent's start with an error naming the endpoint and address
// rather than a log line later; then it serves in the background until Close.
// ctx bounds only the listening.
func Start(ctx context.Context, o Options) (*Servers, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	s := &Servers{}
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
		{"metrics", o.MetricsAddr, func() http.Handler { return metricsHandler(o.Registry, log) }, &s.metricsAddr},
		{"readiness", o.ReadinessAddr, func() http.Handler { return readinessHandler(o.Ready) }, &s.readinessAddr},
		{"admin", o.AdminAddr, func() http.Handler { return adminHandler(o.Sections, o.Level, log) }, &s.adminAddr},
	}
	for _, e := range endpoints {
		if e.addr == "" {
			continue
		}
		l, err := (&net.ListenConfig{Control: reusePort}).Listen(ctx, "tcp", e.addr)
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("%s endpoint: %w", e.name, err)
		}
		*e.bound = l.Addr().String()
		if e.name == "admin" && !isLoopback(l.Addr()) {
			log.Warn("admin endpoint is not on a loopback address: anyone who reaches it can read the config and profile the agent", "addr", *e.bound)
		}
		total := maxConnsPerEndpoint
		if e.name == "admin" {
			total = maxConnsPerSource // one local caller's worth: it is on loopback
		}
		ll := newLimitListener(l, e.name, total, maxConnsPerSource, conns, log)
		l = ll
		srv := &http.Server{
			Handler:           boundBody(e.handler()),
			ReadHeaderTimeout: 5 * time.Second,
			ReadTimeout:       readTimeout,
			WriteTimeout:      writeTimeout,
			IdleTimeout:       time.Minute,
			MaxHeaderBytes:    maxHeaderBytes,
			ConnState:         ll.connState, // which connections are idle, and so evictable
			ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		}
		switch e.name {
		case "admin":
			// pprof's profile and trace run as long as asked, up to
			// maxProfileSeconds, before their answer is written.
			srv.WriteTimeout = adminWriteTimeout
		case "readiness":
			// kubelet opens a connection per probe and never reuses it:
			// an idle keep-alive connection there only holds a slot.
			srv.SetKeepAlivesEnabled(false)
		}
		s.servers = append(s.servers, srv)
		if e.name == "readiness" {
			s.readiness = srv
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
				log.Error("http endpoint stopped", "endpoint", e.name, "addr", l.Addr().String(), "error", err)
			}
		}()
	}
	return s, nil
}

func (o Options) validate() error {
	switch {
	case o.MetricsAddr != "" && o.Registry == nil:
		return errors.New("metrics endpoint: no registry given")
	case o.ReadinessAddr != "" && o.Ready == nil:
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
	var errs []error
	for _, srv := range s.servers {
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
	if s.readiness == nil {
		return nil
	}
	return s.readiness.Close()
}

// reusePort sets SO_REUSEPORT: during an upgrade the new agent binds the
// same ports while the old one still runs (and drains), so the endpoints
// never clash and never disappear. While both run, a connection reaches
// either process.
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
