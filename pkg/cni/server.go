package cni

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// maxEventBytes bounds a request body; a real event is a few hundred bytes.
const maxEventBytes = 1 << 20

// Handler decides and carries out what an event asks for. The agent's
// handler is expected to answer:
//
//   - ADD: decide selection for the pod; if it is not selected, return
//     Response{Reason: why} at once; if it is, enroll it with ev.NetNS and
//     return Response{Enrolled: true, Reason: why} only once its programs and
//     listeners are in place, because the runtime starts the pod's containers
//     as soon as the plugin returns. An error fails the ADD and the runtime
//     retries the sandbox later.
//   - CHECK: a selected pod that is not enrolled is an error (or
//     Response.Error); anything else is fine.
//   - DEL: forget the pod (ev.NetNS may be empty). The answer is only logged:
//     DEL never fails.
//
// It is called concurrently, one call per plugin invocation, and its context
// ends when the plugin gives up waiting or the server stops. A returned error
// reaches the plugin as Response.Error.
type Handler func(ctx context.Context, ev PodEvent) (Response, error)

// Server receives plugin events on a unix socket and passes them to a Handler.
type Server struct {
	path   string
	handle Handler
	log    *slog.Logger
	ready  chan struct{}
	once   sync.Once
}

// NewServer prepares a server on socketPath (DefaultSocketPath if empty);
// nothing is opened before Serve.
func NewServer(socketPath string, handle Handler, log *slog.Logger) *Server {
	if socketPath == "" {
		socketPath = DefaultSocketPath
	}
	if log == nil {
		log = slog.Default()
	}
	return &Server{path: socketPath, handle: handle, log: log, ready: make(chan struct{})}
}

// Path is the socket the server listens on.
func (s *Server) Path() string { return s.path }

// Ready is closed once the socket accepts connections, so that the agent
// installs the plugin's configuration only when events can be answered.
func (s *Server) Ready() <-chan struct{} { return s.ready }

// Serve listens until ctx ends, then closes the listener, waits briefly for
// answers in flight and removes the socket. It creates the socket's directory
// (mode 0700) if missing, replaces a stale socket left by a dead agent, and
// refuses to start if another process still answers on it. The socket is
// mode 0600: only root (the runtime running the plugin) may talk to it.
func (s *Server) Serve(ctx context.Context) error {
	l, err := s.listen()
	if err != nil {
		return err
	}
	srv := &http.Server{
		Handler:           http.HandlerFunc(s.serveEvent),
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return ctx },
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	s.once.Do(func() { close(s.ready) })
	s.log.InfoContext(ctx, "CNI event server listening", "socket", s.path)

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve CNI events on %s: %w", s.path, err)
	case <-ctx.Done():
	}
	// Handlers see ctx end too, so in-flight answers finish quickly.
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		_ = srv.Close()
	}
	<-errc
	return nil
}

// listen opens the socket, clearing a stale one first.
func (s *Server) listen() (net.Listener, error) {
	dir := filepath.Dir(s.path)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		// Only a directory we create gets our mode: chmod on an existing one
		// (say /tmp) would be a surprise for everyone else using it.
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("create CNI socket directory: %w", err)
		}
	}
	if fi, err := os.Lstat(s.path); err == nil {
		if fi.Mode().Type() != os.ModeSocket {
			return nil, fmt.Errorf("CNI socket path %s exists and is not a socket; remove it", s.path)
		}
		if c, err := net.DialTimeout("unix", s.path, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("CNI socket %s is in use by another process (is another agent running?)", s.path)
		}
		if err := os.Remove(s.path); err != nil {
			return nil, fmt.Errorf("remove stale CNI socket: %w", err)
		}
		s.log.Info("removed stale CNI socket", "socket", s.path)
	}
	l, err := net.Listen("unix", s.path)
	if err != nil {
		return nil, fmt.Errorf("listen for CNI events: %w", err)
	}
	if err := os.Chmod(s.path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("restrict CNI socket: %w", err)
	}
	return l, nil
}

func (s *Server) serveEvent(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != EventPath {
		writeResponse(w, http.StatusNotFound, Response{Error: fmt.Sprintf("unknown path %s (this agent serves %s)", r.URL.Path, EventPath)})
		return
	}
	if r.Method != http.MethodPost {
		writeResponse(w, http.StatusMethodNotAllowed, Response{Error: "events must be POSTed"})
		return
	}
	// Unknown fields are ignored: a plugin from a newer release may still
	// talk to this agent during a rolling upgrade.
	var ev PodEvent
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxEventBytes))
	if err := dec.Decode(&ev); err != nil {
		writeResponse(w, http.StatusBadRequest, Response{Error: fmt.Sprintf("decode CNI event: %v", err)})
		return
	}
	if err := ev.Validate(); err != nil {
		writeResponse(w, http.StatusBadRequest, Response{Error: "invalid CNI event: " + err.Error()})
		return
	}
	ctx := r.Context()
	log := s.log.With("command", ev.Command, "pod", ev.String(), "container", ev.ContainerID, "netns", ev.NetNS)
	start := time.Now()
	resp, err := s.handle(ctx, ev)
	if err != nil {
		resp.Error = err.Error()
	}
	status := http.StatusOK
	if resp.Error != "" {
		status = http.StatusInternalServerError
		log.WarnContext(ctx, "CNI event failed", "error", resp.Error, "took", time.Since(start))
	} else {
		log.InfoContext(ctx, "CNI event handled", "enrolled", resp.Enrolled, "reason", resp.Reason, "took", time.Since(start))
	}
	writeResponse(w, status, resp)
}

func writeResponse(w http.ResponseWriter, status int, resp Response) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(resp)
}
