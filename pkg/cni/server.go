package cni

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redirector-mesh/redirector/pkg/unixsock"
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

	// readTimeout bounds reading one request, body included; maxConns
	// the connections open at once (see the defaults).
	readTimeout time.Duration
	maxConns    int

	statsMu sync.Mutex
	stats   ServerStats

	// l and ino are the socket Listen opened, for Serve.
	l   net.Listener
	ino uint64
	// serving is the inode of the socket Serve serves (0: none), for
	// Installed.
	serving atomic.Uint64
}

// Bounds of the server. A real event is a few hundred bytes sent at once;
// the plugin waits for the answer up to DefaultNotifyTimeout, which bounds
// how long an honest connection stays open. The connection bound is above
// any node's pod count (each ADD of a starting pod holds one); connections
// past it wait in the socket's backlog, and their plugins time out and are
// retried by the runtime if none frees.
const (
	DefaultReadTimeout = 10 * time.Second
	DefaultMaxConns    = 512
)

// ServerStats are counts of what the server refused or held back.
type ServerStats struct {
	// Open is the number of connections open now.
	Open uint64
	// RefusedPeers counts connections closed unread because the peer was
	// neither root nor the agent's own user (SO_PEERCRED).
	RefusedPeers uint64
	// Waited counts connections that waited for a slot (DefaultMaxConns).
	Waited uint64
	// Invalid counts events refused unhandled: undecodable, or with a
	// field no runtime sends (PodEvent.Validate).
	Invalid uint64
}

// Stats returns the server's counts.
func (s *Server) Stats() ServerStats {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	return s.stats
}

func (s *Server) count(f func(*ServerStats)) {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	f(&s.stats)
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
	return &Server{path: socketPath, handle: handle, log: log, ready: make(chan struct{}),
		readTimeout: DefaultReadTimeout, maxConns: DefaultMaxConns}
}

// Path is the socket the server listens on.
func (s *Server) Path() string { return s.path }

// Ready is closed once the socket accepts connections, so that the agent
// installs the plugin's configuration only when events can be answered.
func (s *Server) Ready() <-chan struct{} { return s.ready }

// Serve listens until ctx ends, then closes the listener, waits briefly for
// answers in flight and removes the socket unless a successor replaced it.
// It creates the socket's directory (mode 0700) if missing and atomically
// replaces whatever socket is at the path: a stale one left by a dead agent,
// or the live one of the agent it upgrades. The socket is mode 0600: only
// root (the runtime running the plugin) may talk to it.
func (s *Server) Serve(ctx context.Context) error {
	if err := s.Listen(); err != nil {
		return err
	}
	l, ino := s.l, s.ino
	s.l = nil // a Serve after this one listens anew
	s.serving.Store(ino)
	defer s.serving.Store(0)
	l = &guardedListener{Listener: l, s: s, slots: make(chan struct{}, s.maxConns), closed: make(chan struct{})}
	srv := &http.Server{
		Handler: http.HandlerFunc(s.serveEvent),
		// The whole request, not only its headers: a client that stalls
		// in the body must not hold its connection for ever.
		ReadTimeout: s.readTimeout,
		BaseContext: func(net.Listener) context.Context { return ctx },
		ErrorLog:    slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	// One event per connection, as the plugin sends: no idle connections.
	srv.SetKeepAlivesEnabled(false)
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
	// Remove the path only while it is still ours: after a hand-over it is
	// the successor's socket.
	unixsock.RemoveIfOwn(s.path, ino)
	return nil
}

// Installed reports whether the path still names the socket Serve serves.
// The path belongs to whoever renamed a socket over it last: another agent
// that installed its own after this one (and may remove it as it stops), or
// anything that removed it, leaves this server serving a socket no plugin
// reaches.
func (s *Server) Installed() bool {
	ino := s.serving.Load()
	return ino != 0 && unixsock.Names(s.path, ino)
}

// Listen opens the socket and installs it at the path (see Serve) without
// serving it yet, so that a caller knows whether it can serve the path;
// Serve, called next from the same goroutine, serves it. Connections made
// in between wait in the socket's backlog.
func (s *Server) Listen() error {
	if s.l != nil {
		return nil
	}
	l, ino, err := s.listen()
	if err != nil {
		return err
	}
	s.l, s.ino = l, ino
	return nil
}

// guardedListener admits only connections from root or the agent's own
// user, at most cap(slots) at once. The socket's mode says the same, but is
// set after bind (a connection made in between stays open) and cannot
// speak for a directory mounted with other modes: enrolling a pod means
// entering a namespace the event names.
type guardedListener struct {
	net.Listener
	s         *Server
	slots     chan struct{}
	closed    chan struct{}
	closeOnce sync.Once
}

func (l *guardedListener) Accept() (net.Conn, error) {
	for {
		select {
		case l.slots <- struct{}{}:
		default:
			l.s.count(func(st *ServerStats) { st.Waited++ })
			select {
			case l.slots <- struct{}{}:
			case <-l.closed:
				return nil, net.ErrClosed
			}
		}
		c, err := l.Listener.Accept()
		if err != nil {
			<-l.slots
			return nil, err
		}
		cred, err := unixsock.PeerCred(c)
		if err != nil || !unixsock.Trusted(cred) {
			uid := -1
			if cred != nil {
				uid = int(cred.Uid)
			}
			// Counted before the close: whoever sees the close sees the count.
			l.s.count(func(st *ServerStats) { st.RefusedPeers++ })
			c.Close()
			<-l.slots
			l.s.log.Warn("CNI socket: connection refused: only root or the agent's user may send pod events", "peer_uid", uid, "error", err)
			continue
		}
		l.s.count(func(st *ServerStats) { st.Open++ })
		return &slotConn{Conn: c, release: func() {
			<-l.slots
			l.s.count(func(st *ServerStats) { st.Open-- })
		}}, nil
	}
}

func (l *guardedListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

// slotConn gives its slot back once, when closed.
type slotConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *slotConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// listen opens the socket and installs it at the path (see Serve); it
// returns the inode, by which Serve knows the path is still its own.
func (s *Server) listen() (net.Listener, uint64, error) {
	return unixsock.Install("CNI socket", s.path, "unix")
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
		s.count(func(st *ServerStats) { st.Invalid++ })
		writeResponse(w, http.StatusBadRequest, Response{Error: fmt.Sprintf("decode CNI event: %v", err)})
		return
	}
	if err := ev.Validate(); err != nil {
		s.count(func(st *ServerStats) { st.Invalid++ })
		s.log.WarnContext(r.Context(), "CNI event refused", "error", err)
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
