package tunnel

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/unixsock"
)

// Listener hand-over between two agent processes (an upgrade).
//
// A pod's listeners (outbound, inbound, HBONE) are in no reuseport group. A
// group admits any socket of the same user, and since Linux 6.5 the kernel
// selects again within the group of a listener the capture assigned, with
// no mark to check: a process in the pod running as root could bind the
// tunnel's port with SO_REUSEPORT and be handed a share of the pod's
// captured connections. Without SO_REUSEPORT, nothing else in the pod can
// bind the tunnel's ports at all (EADDRINUSE, on any address).
//
// A successor agent takes the very same listening sockets from the running
// one instead, over a unix socket (SCM_RIGHTS): it looks for the running
// agent's hand-over socket before it serves any pod (Predecessor), and asks
// for each pod's listeners as it starts serving the pod. From then both
// processes accept from one queue, each serving what it accepts in full.
// On SIGTERM the old agent closes its descriptors: the sockets stay open in
// the successor with every request queued on them, so no SYN meets an
// empty port and nothing moves or is reset. Established connections stay
// with the process that accepted them and drain (pod.stop). Every socket
// received is checked before use (a listening TCP socket in the pod's own
// namespace, on the port asked for, carrying the tunnel mark) and given this
// agent's socket options (pod.take).
//
// The exchange is one request and one answer per pod, each over a
// SOCK_SEQPACKET connection of its own and a JSON message of at most
// maxHandoverMessage bytes; the answer carries the descriptors in the order
// of its ports.
//
// A pod's DNS socket (dns.go) passes the same way, in a request of its own
// right after the listeners': its queue, with the queries the capture
// assigned to it, goes on with it. Both agents read it until the old one
// closes its descriptor: a datagram is dequeued by one reader, which
// answers it in full (and a stopping pod waits for its answers), as either
// agent accepts a connection and serves it. Like the listeners, the DNS
// socket is in no reuseport group. An agent from before refuses the DNS
// request (an unknown field): the successor then asks it no more and waits
// for the old agent to close its DNS socket (awaitDNS), which answers the
// pod's queries meanwhile; the listeners' request is unchanged. A socket
// handed over by a release whose DNS socket was in a reuseport group
// (6 December) leaves it on taking: no other socket can join it then.

// handoverRequest asks for the listeners of the pod in one network
// namespace.
type handoverRequest struct {
	// Netns is the inode of the pod's network namespace (nsfs), the same
	// in every process that opened it.
	Netns uint64 `json:"netns,omitempty"`
	// Endpoint, instead, names one of the agent's HTTP endpoints in the
	// node's namespace (metrics, readiness, admin): its listener is handed
	// over, so that it never shares its port in a reuseport group
	// (admin.ListenAlone).
	Endpoint string `json:"endpoint,omitempty"`
	// DNS asks for the DNS socket of the pod in Netns instead of its
	// listeners. A request of its own, not a field of the listeners' one:
	// an agent from before the DNS hand-over refuses a request with it, and
	// must still hand the listeners over.
	DNS bool `json:"dns,omitempty"`
}

// handoverReply carries the pod's listeners, one descriptor per port in
// order, or why there are none.
type handoverReply struct {
	Ports []uint16 `json:"ports,omitempty"`
	Error string   `json:"error,omitempty"`
}

// Bounds of the hand-over socket: a request or answer is a few dozen
// bytes; a successor opens one connection at a time (a pod's request, or
// WaitGone's look), the rest is room for a second agent or an operator's
// check; more wait for a slot. A request must arrive within
// handoverTimeout of its connection (Tunnel.handoverIdle), and be answered
// within handoverTimeout.
const (
	maxHandoverMessage = 512
	maxHandoverConns   = 4
	handoverTimeout    = 5 * time.Second
)

// Results of a hand-over, the label of redirector_listener_handovers_total.
const (
	handoverGiven     = "given"
	handoverTaken     = "taken"
	handoverNotServed = "not_served"
	handoverFailed    = "failed"
	handoverRefused   = "refused"
)

var handoverResults = []string{handoverGiven, handoverTaken, handoverNotServed, handoverFailed, handoverRefused}

// ServeHandover serves the hand-over socket at path until ctx ends, giving
// a successor agent the listeners of the pods this one serves. The socket
// replaces whatever socket is at path (a stale one, or a predecessor's once
// it is gone: see Predecessor.WaitGone) and is removed at the end unless a
// successor replaced it.
func (t *Tunnel) ServeHandover(ctx context.Context, path string) error {
	return t.HandoverServer(path).Serve(ctx)
}

// HandoverServer is the tunnel's hand-over socket at path, installed and
// served in two steps as cni.Server does the CNI socket. The path is shared
// by every agent of the node and names the socket of whoever installed
// last: the tunnel knows no claim on the node, so the caller, which does,
// asks Installed and serves again when the path is no longer this one's.
type HandoverServer struct {
	t    *Tunnel
	path string
	// l and ino are the socket Listen installed, for Serve.
	l   net.Listener
	ino uint64
	// serving is the inode of the socket Serve serves (0: none), for
	// Installed.
	serving atomic.Uint64
}

// HandoverServer prepares the hand-over socket at path; nothing is opened
// before Listen or Serve.
func (t *Tunnel) HandoverServer(path string) *HandoverServer {
	return &HandoverServer{t: t, path: path}
}

// Path is the socket's path.
func (s *HandoverServer) Path() string { return s.path }

// Listen installs the socket at the path (unixsock.Install) without
// serving it yet; Serve, called next from the same goroutine, serves it.
// Connections made in between wait in the socket's backlog.
func (s *HandoverServer) Listen() error {
	if s.l != nil {
		return nil
	}
	l, ino, err := unixsock.Install("hand-over socket", s.path, "unixpacket")
	if err != nil {
		return err
	}
	s.l, s.ino = l, ino
	return nil
}

// Installed reports whether the path still names the socket Serve serves:
// an agent that installed its own over it afterwards (and may remove it as
// it stops), or anyone who removed it, leaves this one serving a socket no
// successor reaches.
func (s *HandoverServer) Installed() bool {
	ino := s.serving.Load()
	return ino != 0 && unixsock.Names(s.path, ino)
}

// Serve installs the socket if Listen did not, and serves it until ctx
// ends, as ServeHandover.
func (s *HandoverServer) Serve(ctx context.Context) error {
	if err := s.Listen(); err != nil {
		return err
	}
	l, ino := s.l, s.ino
	s.l = nil // a Serve after this one installs anew
	s.serving.Store(ino)
	defer s.serving.Store(0)
	defer unixsock.RemoveIfOwn(s.path, ino)
	return s.t.serveHandover(ctx, l, s.path)
}

// serveHandover accepts on l, the hand-over socket at path, until ctx ends.
func (t *Tunnel) serveHandover(ctx context.Context, l net.Listener, path string) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	t.log.InfoContext(ctx, "listener hand-over socket listening", "socket", path)
	slots := make(chan struct{}, maxHandoverConns)
	var wg sync.WaitGroup
	defer wg.Wait()
	backoff := time.Duration(0)
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			// EMFILE and the like pass; the socket stays.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			t.log.WarnContext(ctx, "hand-over socket: accept failed; retrying", "socket", path, "error", err, "retry_in", backoff)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
			continue
		}
		backoff = 0
		cred, err := unixsock.PeerCred(c)
		if err != nil || !unixsock.Trusted(cred) {
			t.cfg.Metrics.handover.WithLabelValues(handoverRefused).Inc()
			t.log.WarnContext(ctx, "hand-over socket: connection refused: only root or the agent's user may take listeners", "peer", credString(cred), "error", err)
			c.Close()
			continue
		}
		// A connection waits for a slot (the next ones wait in the
		// socket's backlog): every served one ends within t.handoverIdle
		// plus handoverTimeout.
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			c.Close()
			return nil
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			defer context.AfterFunc(ctx, func() { c.Close() })()
			defer c.Close()
			t.serveHandoverConn(ctx, c.(*net.UnixConn), cred)
		}()
	}
}

func credString(cred *unix.Ucred) string {
	if cred == nil {
		return "unknown"
	}
	return fmt.Sprintf("pid %d uid %d", cred.Pid, cred.Uid)
}

// serveHandoverConn answers the one request of c.
func (t *Tunnel) serveHandoverConn(ctx context.Context, c *net.UnixConn, cred *unix.Ucred) {
	buf := make([]byte, maxHandoverMessage)
	// One request per connection, right after it: an idle connection
	// holds its slot for t.handoverIdle at most.
	_ = c.SetReadDeadline(time.Now().Add(t.handoverIdle))
	n, _, flags, _, err := c.ReadMsgUnix(buf, nil)
	if err != nil || n == 0 {
		return // closed, or idle too long
	}
	var req handoverRequest
	dec := json.NewDecoder(bytes.NewReader(buf[:n]))
	dec.DisallowUnknownFields()
	if flags&unix.MSG_TRUNC != 0 {
		err = fmt.Errorf("request longer than %d bytes", maxHandoverMessage)
	} else if err = dec.Decode(&req); err == nil && (req.Netns == 0) == (req.Endpoint == "") {
		err = errors.New("request names neither a network namespace nor an endpoint, or both")
	} else if err == nil && req.DNS && req.Netns == 0 {
		err = errors.New("request for a DNS socket names no network namespace")
	}
	if err != nil {
		t.cfg.Metrics.handover.WithLabelValues(handoverRefused).Inc()
		t.log.WarnContext(ctx, "hand-over socket: bad request; closing the connection", "peer", credString(cred), "error", err)
		return
	}
	var (
		fds   []int
		uid   string
		ports []uint16
		what  = "listeners"
	)
	switch {
	case req.Endpoint != "":
		uid = "endpoint " + req.Endpoint
		fds, ports, err = t.endpointFD(req.Endpoint)
	case req.DNS:
		what = "DNS socket"
		fds, uid, ports, err = t.podDNSFD(req.Netns)
	default:
		fds, uid, ports, err = t.podListenerFDs(req.Netns)
	}
	reply := handoverReply{Ports: ports}
	if err != nil {
		reply = handoverReply{Error: err.Error()}
	}
	msg, _ := json.Marshal(reply)
	var rights []byte
	if len(fds) > 0 {
		rights = unix.UnixRights(fds...)
	}
	_ = c.SetWriteDeadline(time.Now().Add(handoverTimeout))
	_, _, werr := c.WriteMsgUnix(msg, rights, nil)
	closeFDs(fds)
	switch {
	case werr != nil:
		t.log.WarnContext(ctx, "hand-over socket: answer not sent", "peer", credString(cred), "error", werr)
	case err != nil:
		t.cfg.Metrics.handover.WithLabelValues(handoverNotServed).Inc()
		t.log.DebugContext(ctx, "hand-over: nothing to give", "what", what, "netns_inode", req.Netns, "reason", err)
	default:
		t.cfg.Metrics.handover.WithLabelValues(handoverGiven).Inc()
		t.log.InfoContext(ctx, what+" handed over to a successor", "uid", uid, "ports", ports, "peer", credString(cred))
	}
}

// podListenerFDs duplicates the listeners of the pod served in the
// namespace with inode ino, with their ports. The descriptors are the
// caller's to close. They are duplicated with fcntl, not through an
// os.File: File.Fd puts the descriptor in blocking mode, and O_NONBLOCK
// belongs to the open file, which the pod's own listener shares: its
// accepts would then block a thread when the successor took the
// connection first, and its close would wait for them.
func (t *Tunnel) podListenerFDs(ino uint64) ([]int, string, []uint16, error) {
	p := t.podByInode(ino)
	if p == nil {
		return nil, "", nil, fmt.Errorf("no pod served in network namespace %d", ino)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopping.Load() || len(p.lns) == 0 {
		return nil, p.uid, nil, fmt.Errorf("pod %s has no open listeners", p.uid)
	}
	var fds []int
	var ports []uint16
	for _, l := range p.lns {
		fd, err := dupSocket(l)
		if err != nil {
			closeFDs(fds)
			return nil, p.uid, nil, fmt.Errorf("pod %s: listener %s: %w", p.uid, l.Addr(), err)
		}
		fds = append(fds, fd)
		ports = append(ports, addrPortOf(l.Addr()).Port())
	}
	return fds, p.uid, ports, nil
}

// podDNSFD duplicates the DNS socket of the pod served in the namespace
// with inode ino (as podListenerFDs its listeners), with its port. A pod
// stopping has none to give: its socket closes with it unless a successor
// already holds it.
func (t *Tunnel) podDNSFD(ino uint64) ([]int, string, []uint16, error) {
	p := t.podByInode(ino)
	if p == nil {
		return nil, "", nil, fmt.Errorf("no pod served in network namespace %d", ino)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopping.Load() || p.dns == nil {
		return nil, p.uid, nil, fmt.Errorf("pod %s has no open DNS socket", p.uid)
	}
	fd, err := dupSocket(p.dns)
	if err != nil {
		return nil, p.uid, nil, fmt.Errorf("pod %s: DNS socket: %w", p.uid, err)
	}
	return []int{fd}, p.uid, []uint16{addrPortOf(p.dns.LocalAddr()).Port()}, nil
}

// podByInode is the pod served in the namespace with inode ino, or nil.
func (t *Tunnel) podByInode(ino uint64) *pod {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, p := range t.pods {
		if p.nsInode == ino {
			return p
		}
	}
	return nil
}

// ShareEndpoints makes the listeners of the agent's HTTP endpoints, by
// name, available to a successor asking the hand-over socket (see
// admin.Servers.Listener).
func (t *Tunnel) ShareEndpoints(get func(name string) net.Listener) {
	t.endpoints.Store(&get)
}

// endpointFD duplicates the listener of the HTTP endpoint named name, with
// its port.
func (t *Tunnel) endpointFD(name string) ([]int, []uint16, error) {
	get := t.endpoints.Load()
	var l net.Listener
	if get != nil {
		l = (*get)(name)
	}
	if l == nil {
		return nil, nil, fmt.Errorf("endpoint %q not served", name)
	}
	fd, err := dupSocket(l)
	if err != nil {
		return nil, nil, fmt.Errorf("endpoint %q: %w", name, err)
	}
	return []int{fd}, []uint16{addrPortOf(l.Addr()).Port()}, nil
}

// dupSocket duplicates the descriptor of s, a listener or a UDP socket
// (close-on-exec), leaving its flags alone.
func dupSocket(s any) (int, error) {
	sc, ok := s.(syscall.Conn)
	if !ok {
		return -1, fmt.Errorf("a %T has no descriptor", s)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	var derr error
	if err := rc.Control(func(s uintptr) { fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return -1, err
	}
	if derr != nil {
		return -1, fmt.Errorf("dup: %w", derr)
	}
	return fd, nil
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// Predecessor is the agent that served the node before this one, reached
// at its hand-over socket with one connection per request, one at a time
// (the pod workers start many pods at once; the socket takes a few
// connections). This agent leaves the socket's path to it until it is gone
// (WaitGone), and asks it nothing after that.
type Predecessor struct {
	path string
	turn chan struct{} // one request at a time; a waiter can give up
	// gone is set once WaitGone saw no agent at the path: from then on the
	// path may be this agent's own socket.
	gone     atomic.Bool
	goneCh   chan struct{} // closed when gone is set
	goneOnce sync.Once
	// quietUntil (unix nanoseconds) pauses requests after one timed out: a
	// predecessor that stopped answering would otherwise hold every pod
	// start for the full timeout, one after the other.
	quietUntil atomic.Int64
	// noDNS is set once the predecessor closed a request for a DNS socket
	// unanswered: a release from before the DNS hand-over, which refuses
	// the request's field. It is asked for none again.
	noDNS atomic.Bool
}

// Errors of dialHandover: nothing listens at the path, or a socket not an
// agent's does.
var (
	errNoPredecessor = errors.New("no agent serves the hand-over socket")
	errUntrusted     = errors.New("served by a user neither root nor the agent's: refusing its listeners")
)

// errUnanswered: the agent closed the connection without answering, as
// one refuses a request it cannot decode.
var errUnanswered = errors.New("connection closed without an answer")

// errNoDNSHandover: the predecessor hands no DNS socket over, for any pod
// (a release from before, which refuses the request); errDNSRefused is the
// refusal that showed it, once per predecessor.
var (
	errNoDNSHandover = errors.New("the predecessor hands no DNS sockets over")
	errDNSRefused    = fmt.Errorf("%w (it refused the request: a release from before)", errNoDNSHandover)
)

// predecessorQuiet is how long requests pause after one timed out.
const predecessorQuiet = 10 * time.Second

// dialHandover connects to the hand-over socket at path: errNoPredecessor
// when nothing listens there (no socket, or a stale one), errUntrusted
// when the socket is served by a user other than root or this process's
// (its listeners would not be an agent's).
func dialHandover(ctx context.Context, path string) (*net.UnixConn, error) {
	d := net.Dialer{Timeout: handoverTimeout}
	c, err := d.DialContext(ctx, "unixpacket", path)
	if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
		return nil, errNoPredecessor
	}
	if err != nil {
		return nil, fmt.Errorf("hand-over socket %s: %w", path, err)
	}
	cred, err := unixsock.PeerCred(c)
	if err == nil && !unixsock.Trusted(cred) {
		err = fmt.Errorf("%w (uid %d)", errUntrusted, cred.Uid)
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("hand-over socket %s: %w", path, err)
	}
	return c.(*net.UnixConn), nil
}

// DialPredecessor checks for an agent serving the hand-over socket at
// path, as this agent starts: nil and no error when there is none.
func DialPredecessor(ctx context.Context, path string) (*Predecessor, error) {
	c, err := dialHandover(ctx, path)
	if errors.Is(err, errNoPredecessor) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	c.Close()
	return &Predecessor{path: path, turn: make(chan struct{}, 1), goneCh: make(chan struct{})}, nil
}

// predecessorPoll is how often WaitGone checks for the predecessor.
const predecessorPoll = 250 * time.Millisecond

// WaitGone returns once nothing has served the predecessor's hand-over
// socket for absent (it exited, or began to drain), or a socket not an
// agent's took its place, or ctx ended. Until then this agent leaves the
// path to the predecessor: an agent started next (this one restarted after
// a crash, say) must reach the agent that still holds the pods' listeners.
// Any other failure to connect (a predecessor slow to accept, this process
// short of descriptors) counts as the predecessor still there.
//
// The path follows the agent holding the node, which puts its socket back
// when another agent's replaced it (cmd/redirector); absent covers the
// moment between a yielded agent removing its socket as it stopped and the
// holder putting its own back. Seen as gone, the holder was asked nothing
// more, and this agent's pods waited for the holder to exit.
func (pr *Predecessor) WaitGone(ctx context.Context, absent time.Duration) {
	tick := time.NewTicker(predecessorPoll)
	defer tick.Stop()
	var since time.Time // when the path was first seen served by no agent
	for {
		c, err := dialHandover(ctx, pr.path)
		gone := errors.Is(err, errUntrusted)
		switch {
		case errors.Is(err, errNoPredecessor):
			if since.IsZero() {
				since = time.Now()
			}
			gone = time.Since(since) >= absent
		case err == nil:
			c.Close()
			fallthrough
		default:
			since = time.Time{}
		}
		if gone {
			pr.gone.Store(true)
			pr.goneOnce.Do(func() { close(pr.goneCh) })
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// take asks the predecessor for the listeners of the pod in the namespace
// with inode ino, on ports in order, and checks each socket it receives
// (checkHandedListener). It returns nil and no error when the predecessor
// does not serve that pod, errNoPredecessor when no agent serves the
// socket, and another error when the exchange or a check failed. Every
// received descriptor that is not returned is closed.
func (pr *Predecessor) take(ctx context.Context, ino uint64, ports []uint16, mark uint32) ([]net.Listener, error) {
	fds, reply, err := pr.exchange(ctx, handoverRequest{Netns: ino}, len(ports))
	if err != nil || reply.Error != "" {
		return nil, err
	}
	if !slices.Equal(reply.Ports, ports) || len(fds) != len(ports) {
		closeFDs(fds)
		return nil, fmt.Errorf("hand-over socket %s: answer for ports %v with %d descriptors, asked for %v", pr.path, reply.Ports, len(fds), ports)
	}
	lns := make([]net.Listener, 0, len(fds))
	for i, fd := range fds {
		l, err := handedListener(fd, ino, ports[i], mark)
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			closeFDs(fds[i+1:])
			return nil, fmt.Errorf("hand-over socket %s: port %d: %w", pr.path, ports[i], err)
		}
		lns = append(lns, l)
	}
	return lns, nil
}

// takeDNS asks the predecessor for the DNS socket of the pod in the
// namespace with inode ino, on port, and checks it (checkHandedDNSSocket).
// It returns nil and no error when the predecessor has none for that pod,
// errNoDNSHandover when it hands DNS sockets over for no pod (a release
// from before: noDNS; errDNSRefused the first time), errNoPredecessor when
// no agent serves the socket, and another error when the exchange or the
// check failed. A received descriptor not returned is closed.
func (pr *Predecessor) takeDNS(ctx context.Context, ino uint64, port uint16, mark uint32) (*net.UDPConn, error) {
	if pr.noDNS.Load() {
		return nil, errNoDNSHandover
	}
	fds, reply, err := pr.exchange(ctx, handoverRequest{Netns: ino, DNS: true}, 1)
	if errors.Is(err, errUnanswered) && ctx.Err() == nil {
		if pr.noDNS.CompareAndSwap(false, true) {
			return nil, errDNSRefused
		}
		return nil, errNoDNSHandover
	}
	if err != nil || reply.Error != "" {
		return nil, err
	}
	if len(fds) != 1 || len(reply.Ports) != 1 || reply.Ports[0] != port {
		closeFDs(fds)
		return nil, fmt.Errorf("hand-over socket %s: answer for ports %v with %d descriptors, asked for the DNS socket on port %d", pr.path, reply.Ports, len(fds), port)
	}
	f := os.NewFile(uintptr(fds[0]), "handed-over DNS socket")
	defer f.Close()
	if err := checkHandedDNSSocket(fds[0], ino, port, mark); err != nil {
		return nil, fmt.Errorf("hand-over socket %s: DNS socket: %w", pr.path, err)
	}
	// Bound already, it stays where it is; with the flag off, a bind of
	// another socket to the port fails, reuseport or not.
	if err := unix.SetsockoptInt(fds[0], unix.SOL_SOCKET, unix.SO_REUSEPORT, 0); err != nil {
		return nil, fmt.Errorf("hand-over socket %s: DNS socket: clear SO_REUSEPORT: %w", pr.path, err)
	}
	c, err := net.FilePacketConn(f)
	if err != nil {
		return nil, fmt.Errorf("hand-over socket %s: DNS socket: %w", pr.path, err)
	}
	uc, ok := c.(*net.UDPConn)
	if !ok {
		c.Close()
		return nil, fmt.Errorf("hand-over socket %s: DNS socket is a %T", pr.path, c)
	}
	return uc, nil
}

// checkHandedDNSSocket checks that fd is a pod's DNS socket as listenDNS
// opens it: an unconnected UDP socket in the network namespace with inode
// ino, bound to port on the wildcard address (dual-stack if IPv6) and to no
// device, carrying the tunnel mark (the capture assigns queries only to
// such a socket), transparent, and asking for each datagram's original
// destination (without it the reader answers nothing). SO_REUSEPORT may be
// set (a release of 6 December set it): takeDNS clears it.
func checkHandedDNSSocket(fd int, ino uint64, port uint16, mark uint32) error {
	for _, o := range []sockOptWant{
		{unix.SOL_SOCKET, unix.SO_TYPE, unix.SOCK_DGRAM, "SO_TYPE"},
		{unix.SOL_SOCKET, unix.SO_PROTOCOL, unix.IPPROTO_UDP, "SO_PROTOCOL (UDP)"},
		{unix.SOL_SOCKET, unix.SO_MARK, int(mark), "SO_MARK (the tunnel mark)"},
		{unix.SOL_SOCKET, unix.SO_BINDTOIFINDEX, 0, "SO_BINDTOIFINDEX (bound to a device)"},
	} {
		if err := o.check(fd); err != nil {
			return err
		}
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return fmt.Errorf("getsockname: %w", err)
	}
	var family []sockOptWant
	switch sa.(type) {
	case *unix.SockaddrInet4:
		family = []sockOptWant{
			{unix.SOL_IP, unix.IP_TRANSPARENT, 1, "IP_TRANSPARENT"},
			{unix.SOL_IP, unix.IP_RECVORIGDSTADDR, 1, "IP_RECVORIGDSTADDR"},
		}
	case *unix.SockaddrInet6:
		// IPv4 queries reach a dual-stack socket too, with IP_ORIGDSTADDR.
		family = []sockOptWant{
			{unix.SOL_IPV6, unix.IPV6_V6ONLY, 0, "IPV6_V6ONLY (IPv4 queries would find no socket)"},
			{unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1, "IPV6_TRANSPARENT"},
			{unix.SOL_IPV6, unix.IPV6_RECVORIGDSTADDR, 1, "IPV6_RECVORIGDSTADDR"},
			{unix.SOL_IP, unix.IP_RECVORIGDSTADDR, 1, "IP_RECVORIGDSTADDR"},
		}
	default:
		return fmt.Errorf("bound to a %T, not an IP address", sa)
	}
	for _, o := range family {
		if err := o.check(fd); err != nil {
			return err
		}
	}
	addr := sockaddrPort(sa)
	if addr.Port() != port {
		return fmt.Errorf("bound to port %d", addr.Port())
	}
	if !addr.Addr().IsUnspecified() {
		return fmt.Errorf("bound to %s, not the wildcard address", addr.Addr())
	}
	// A connected socket takes datagrams from its peer only.
	if _, err := unix.Getpeername(fd); !errors.Is(err, unix.ENOTCONN) {
		return fmt.Errorf("connected (getpeername: %v)", err)
	}
	got, err := socketNetNS(fd)
	if err != nil {
		return err
	}
	if got != ino {
		return fmt.Errorf("in network namespace %d, not the pod's (%d)", got, ino)
	}
	return nil
}

// exchange sends req to the predecessor and returns the descriptors of its
// answer (at most want) with the answer: none and no error when it serves
// nothing of the kind (reply.Error), errNoPredecessor when no agent serves
// the socket. Every received descriptor not returned is closed.
func (pr *Predecessor) exchange(ctx context.Context, req handoverRequest, want int) ([]int, handoverReply, error) {
	var reply0 handoverReply
	if pr.gone.Load() || time.Now().UnixNano() < pr.quietUntil.Load() {
		return nil, reply0, errNoPredecessor
	}
	select {
	case pr.turn <- struct{}{}:
		defer func() { <-pr.turn }()
	case <-ctx.Done():
		return nil, reply0, ctx.Err()
	}
	c, err := dialHandover(ctx, pr.path)
	if err != nil {
		return nil, reply0, err
	}
	defer c.Close()
	msg, _ := json.Marshal(req)
	buf := make([]byte, maxHandoverMessage)
	oob := make([]byte, unix.CmsgSpace(4*want))
	deadline := time.Now().Add(handoverTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = c.SetDeadline(deadline)
	n, oobn, flags := 0, 0, 0
	if _, err = c.Write(msg); err == nil {
		n, oobn, flags, _, err = c.ReadMsgUnix(buf, oob)
	}
	if errors.Is(err, os.ErrDeadlineExceeded) && ctx.Err() == nil {
		pr.quietUntil.Store(time.Now().Add(predecessorQuiet).UnixNano())
	}
	// Descriptors may come with an error or an empty message: take them
	// first, so that every one is closed.
	fds, ferr := receivedFDs(oob[:oobn])
	var reply handoverReply
	switch {
	case n == 0 && (err == nil || errors.Is(err, io.EOF)):
		err = fmt.Errorf("%w (%w)", errUnanswered, io.ErrUnexpectedEOF)
	case err != nil:
	case ferr != nil:
		err = ferr
	case flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0:
		err = fmt.Errorf("answer longer than %d bytes or with more than %d descriptors", maxHandoverMessage, want)
	default:
		err = json.Unmarshal(buf[:n], &reply)
	}
	if err != nil {
		closeFDs(fds)
		return nil, reply0, fmt.Errorf("hand-over socket %s: %w", pr.path, err)
	}
	if reply.Error != "" {
		closeFDs(fds)
		if len(fds) > 0 {
			return nil, reply0, fmt.Errorf("hand-over socket %s: an answer with %d descriptors and an error: %s", pr.path, len(fds), reply.Error)
		}
		return nil, reply, nil
	}
	return fds, reply, nil
}

// Gone is closed once WaitGone saw no agent at the predecessor's socket.
func (pr *Predecessor) Gone() <-chan struct{} { return pr.goneCh }

// TakeEndpoint asks the predecessor for the listener of its HTTP endpoint
// named name, which this agent would open on addr (host:port, the host
// empty or an IP address), and checks it: a listening TCP socket in this
// agent's network namespace bound to that very address. It returns nil and
// no error when there is nothing to take: no predecessor (any more), an
// endpoint it does not serve, or an address that names no fixed socket
// (port 0, a host name); an error when the exchange or the check failed.
func (pr *Predecessor) TakeEndpoint(ctx context.Context, name, addr string) (net.Listener, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("endpoint %s address %q: %w", name, addr, err)
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || port == 0 {
		return nil, nil
	}
	var ip netip.Addr // invalid: the wildcard
	if host != "" {
		if ip, err = netip.ParseAddr(host); err != nil {
			return nil, nil
		}
	}
	fds, reply, err := pr.exchange(ctx, handoverRequest{Endpoint: name}, 1)
	if errors.Is(err, errNoPredecessor) || (err == nil && reply.Error != "") {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if len(fds) != 1 || len(reply.Ports) != 1 || reply.Ports[0] != uint16(port) {
		closeFDs(fds)
		return nil, fmt.Errorf("hand-over socket %s: answer for ports %v with %d descriptors, asked for endpoint %s on port %d", pr.path, reply.Ports, len(fds), name, port)
	}
	f := os.NewFile(uintptr(fds[0]), "handed-over endpoint "+name)
	defer f.Close()
	if err := checkHandedEndpoint(fds[0], ip, uint16(port)); err != nil {
		return nil, fmt.Errorf("hand-over socket %s: endpoint %s: %w", pr.path, name, err)
	}
	return net.FileListener(f)
}

// checkHandedEndpoint checks that fd is a listening TCP socket in this
// process's network namespace, bound to ip (invalid: the wildcard, either
// family) and port.
func checkHandedEndpoint(fd int, ip netip.Addr, port uint16) error {
	sa, err := checkTCPListener(fd)
	if err != nil {
		return err
	}
	got := sockaddrPort(sa)
	wantAddr := ip.IsValid() && got.Addr() == ip.Unmap() || !ip.IsValid() && got.Addr().IsUnspecified()
	if got.Port() != port || !wantAddr {
		return fmt.Errorf("bound to %s, not the endpoint's address", got)
	}
	ino, err := socketNetNS(fd)
	if err != nil {
		return err
	}
	// Not /proc/self/ns/net: that is the main thread's namespace, a pod's
	// while a goroutine visits one there.
	own, err := netns.OwnInode()
	if err != nil {
		return fmt.Errorf("this agent's network namespace: %w", err)
	}
	if ino != own {
		return fmt.Errorf("in network namespace %d, not this agent's (%d)", ino, own)
	}
	return nil
}

// checkTCPListener checks that fd is a listening TCP (or MPTCP: the
// runtime opens listeners so where the kernel has it, and serves plain TCP
// clients as TCP) stream socket with each of the SOL_SOCKET options of
// extra, and returns its address, which is an IP one.
func checkTCPListener(fd int, extra ...sockOptWant) (unix.Sockaddr, error) {
	for _, o := range append([]sockOptWant{
		{unix.SOL_SOCKET, unix.SO_TYPE, unix.SOCK_STREAM, "SO_TYPE"},
		{unix.SOL_SOCKET, unix.SO_ACCEPTCONN, 1, "SO_ACCEPTCONN (listening)"},
	}, extra...) {
		if err := o.check(fd); err != nil {
			return nil, err
		}
	}
	if proto, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PROTOCOL); err != nil {
		return nil, fmt.Errorf("SO_PROTOCOL: %w", err)
	} else if proto != unix.IPPROTO_TCP && proto != unix.IPPROTO_MPTCP {
		return nil, fmt.Errorf("SO_PROTOCOL is %d, neither TCP nor MPTCP", proto)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return nil, fmt.Errorf("getsockname: %w", err)
	}
	switch sa.(type) {
	case *unix.SockaddrInet4, *unix.SockaddrInet6:
		return sa, nil
	}
	return nil, fmt.Errorf("bound to a %T, not an IP address", sa)
}

// sockOptWant is a socket option a handed socket must have.
type sockOptWant struct {
	level int
	opt   int
	want  int
	name  string
}

func (o sockOptWant) check(fd int) error {
	got, err := unix.GetsockoptInt(fd, o.level, o.opt)
	if err != nil {
		return fmt.Errorf("%s: %w", o.name, err)
	}
	if got != o.want {
		return fmt.Errorf("%s is %d, want %d", o.name, got, o.want)
	}
	return nil
}

// sockaddrPort is the address and port of an IP socket address (IPv4 as
// itself, not mapped).
func sockaddrPort(sa unix.Sockaddr) netip.AddrPort {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr).Unmap(), uint16(a.Port))
	}
	return netip.AddrPort{}
}

// socketNetNS is the inode of the network namespace fd's socket is in.
func socketNetNS(fd int) (uint64, error) {
	nsfd, err := unix.IoctlRetInt(fd, unix.SIOCGSKNS)
	if err != nil {
		return 0, fmt.Errorf("its network namespace (SIOCGSKNS): %w", err)
	}
	defer unix.Close(nsfd)
	var st unix.Stat_t
	if err := unix.Fstat(nsfd, &st); err != nil {
		return 0, fmt.Errorf("its network namespace: %w", err)
	}
	return st.Ino, nil
}

// receivedFDs are the descriptors of SCM_RIGHTS messages in oob.
func receivedFDs(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("control message: %w", err)
	}
	var fds []int
	for _, m := range msgs {
		if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS {
			continue
		}
		got, err := unix.ParseUnixRights(&m)
		if err != nil {
			closeFDs(fds)
			return nil, fmt.Errorf("SCM_RIGHTS: %w", err)
		}
		fds = append(fds, got...)
	}
	return fds, nil
}

// handedListener checks that fd is a listening TCP socket in the network
// namespace with inode ino, bound to port on the wildcard address (dual-stack
// if IPv6) and carrying the tunnel mark, and returns it as a listener; fd
// is closed either way.
func handedListener(fd int, ino uint64, port uint16, mark uint32) (net.Listener, error) {
	f := os.NewFile(uintptr(fd), "handed-over listener")
	defer f.Close()
	if err := checkHandedListener(fd, ino, port, mark); err != nil {
		return nil, err
	}
	return net.FileListener(f)
}

func checkHandedListener(fd int, ino uint64, port uint16, mark uint32) error {
	sa, err := checkTCPListener(fd, sockOptWant{unix.SOL_SOCKET, unix.SO_MARK, int(mark), "SO_MARK (the tunnel mark)"})
	if err != nil {
		return err
	}
	addr := sockaddrPort(sa)
	if addr.Port() != port {
		return fmt.Errorf("bound to port %d", addr.Port())
	}
	got, err := socketNetNS(fd)
	if err != nil {
		return err
	}
	if got != ino {
		return fmt.Errorf("in network namespace %d, not the pod's (%d)", got, ino)
	}
	// The capture assigns SYNs for every address of the pod, IPv4 and
	// IPv6, to the listener of the port: one bound to a single address, or
	// IPv6 only, would take none (or no IPv4), and hold the port against
	// the pod's own wildcard listener (listenWildcard) all the same.
	if !addr.Addr().IsUnspecified() {
		return fmt.Errorf("bound to %s, not the wildcard address", addr.Addr())
	}
	if _, ok := sa.(*unix.SockaddrInet6); ok {
		v6only, err := unix.GetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY)
		if err != nil {
			return fmt.Errorf("IPV6_V6ONLY: %w", err)
		}
		if v6only != 0 {
			return errors.New("IPv6 only (IPV6_V6ONLY): IPv4 connections would find no listener")
		}
	}
	return nil
}

// DrainMetrics count what a drain (SIGTERM) did with the relayed
// connections: finished on their own within the grace period, or closed at
// its end.
type DrainMetrics struct {
	draining prometheus.Gauge
	finished prometheus.Counter
	closed   prometheus.Counter
}

// NewDrainMetrics registers the drain metrics with reg.
func NewDrainMetrics(reg prometheus.Registerer) *DrainMetrics {
	m := &DrainMetrics{
		draining: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "redirector_drain_open_connections",
			Help: "Relayed connections still open while the agent drains (after SIGTERM), 0 otherwise."}),
		finished: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redirector_drain_finished_connections_total",
			Help: "Relayed connections open when the drain began that ended on their own within the drain timeout."}),
		closed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redirector_drain_closed_connections_total",
			Help: "Relayed connections the agent closed because the drain timeout ran out."}),
	}
	reg.MustRegister(m.draining, m.finished, m.closed)
	return m
}

// DrainResult is what Drain did.
type DrainResult struct {
	Pods     int // pods whose listeners were closed
	Open     int // relayed connections open when the drain began
	Finished int // of those, ended within the grace period
	Closed   int // closed when ctx ended
}

// Drain stops accepting in every pod (a successor that took the listeners
// keeps the sockets open, with their queued requests), sends
// GOAWAY on every HBONE server connection so peers open new streams to the
// successor, lets the relayed connections run until ctx ends, then closes
// what is left. m may be nil.
func (t *Tunnel) Drain(ctx context.Context, m *DrainMetrics) DrainResult {
	t.mu.Lock()
	t.draining = true
	pods := t.pods
	t.pods = map[string]*pod{}
	for _, p := range pods {
		t.retire(p)
	}
	t.cfg.Metrics.servedPods.Set(0)
	t.mu.Unlock()
	var (
		mu  sync.Mutex
		res = DrainResult{Pods: len(pods)}
		wg  sync.WaitGroup
	)
	for _, p := range pods {
		wg.Add(1)
		go func() {
			defer wg.Done()
			open, forced := p.stop(ctx)
			mu.Lock()
			res.Open += open
			res.Closed += forced
			mu.Unlock()
		}()
	}
	if m != nil {
		// The gauge follows the connections while they drain.
		stop := make(chan struct{})
		go func() {
			tick := time.NewTicker(250 * time.Millisecond)
			defer tick.Stop()
			for {
				m.draining.Set(float64(t.drainingConns(pods)))
				select {
				case <-stop:
					return
				case <-tick.C:
				}
			}
		}()
		defer close(stop)
	}
	wg.Wait()
	res.Finished = max(res.Open-res.Closed, 0)
	if m != nil {
		m.draining.Set(0)
		m.finished.Add(float64(res.Finished))
		m.closed.Add(float64(res.Closed))
	}
	return res
}

// drainingConns counts the relayed connections of pods being drained.
func (t *Tunnel) drainingConns(pods map[string]*pod) int {
	n := 0
	for _, p := range pods {
		p.mu.Lock()
		n += len(p.conns)
		p.mu.Unlock()
	}
	return n
}

// Taking the ports over from a predecessor that did not hand its listeners
// over (a release from before hand-over, whose listeners sit in
// SO_REUSEPORT groups this agent's sockets cannot join; no hand-over
// socket; a failed exchange): binding fails with EADDRINUSE until it closes
// them on SIGTERM. The pod counts as
// served meanwhile (readiness must pass, or a surge rollout would wait
// forever for this agent while the old one keeps the ports), and binding is
// retried every awaitPortsEvery: the gap after the predecessor closes is at
// most that, and a SYN in it is dropped and retransmitted (about 1 s).
// After awaitPortsReport, readiness names the pod: something else than an
// agent on its way out may hold the port (an app listening on 15001).
const (
	awaitPortsEvery  = 20 * time.Millisecond
	awaitPortsAsk    = time.Second
	awaitPortsAskMax = 30 * time.Second
	awaitPortsReport = 60 * time.Second
)

// dnsAwaitReport is how long the pod's DNS socket may fail to open before
// readiness names the pod and port, as awaitPortsReport for the listeners
// (a variable for tests).
var dnsAwaitReport = awaitPortsReport

// awaitPorts retries listen until it succeeds or the pod stops.
func (p *pod) awaitPorts(ctx context.Context, first error) {
	p.t.log.InfoContext(ctx, "pod ports held by another process (an agent without listener hand-over?); taking them when it lets go",
		"uid", p.uid, "netns", p.netns, "error", first)
	start := time.Now()
	p.awaitFree(awaitPortsReport, func(takeOver bool) error {
		lns, err := p.listen(p.ctx, takeOver)
		if err != nil {
			return err
		}
		if !p.serve(lns) {
			return nil
		}
		for _, h := range p.health {
			h.ok(time.Now())
		}
		p.t.log.Info("serving pod (ports taken over)", "uid", p.uid, "netns", p.netns, "waited", time.Since(start).Round(time.Millisecond))
		return nil
	}, func(err error) {
		for _, h := range p.health {
			h.fail(err, time.Now())
		}
		p.t.log.Error("pod ports still held by another process", "uid", p.uid, "netns", p.netns, "error", err)
	})
}

// awaitFree calls try every awaitPortsEvery, on a goroutine counted in
// p.wg, until it succeeds or the pod stops. takeOver (ask the predecessor
// to hand the sockets over) is set awaitPortsAsk after the start, the
// caller having just asked, then at intervals doubling up to
// awaitPortsAskMax: an exchange that failed once may succeed later, but a
// predecessor whose exchanges keep failing should not cost a failure
// counted and logged every second per pod. Once the wait passes report,
// held is called with try's last error.
func (p *pod) awaitFree(report time.Duration, try func(takeOver bool) error, held func(err error)) {
	start := time.Now()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		tick := time.NewTicker(awaitPortsEvery)
		defer tick.Stop()
		reported := false
		nextAsk, askEvery := start.Add(awaitPortsAsk), awaitPortsAsk
		for {
			select {
			case <-p.ctx.Done():
				return
			case <-tick.C:
			}
			// stop waits for this goroutine before it cancels p.ctx
			if p.stopping.Load() {
				return
			}
			takeOver := !time.Now().Before(nextAsk)
			if takeOver {
				askEvery = min(2*askEvery, awaitPortsAskMax)
				nextAsk = time.Now().Add(askEvery)
			}
			err := try(takeOver)
			if err == nil {
				return
			}
			if !reported && time.Since(start) > report && p.ctx.Err() == nil {
				reported = true
				held(err)
			}
		}
	}()
}
