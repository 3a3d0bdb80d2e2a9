// Package netns runs code inside another network namespace and opens sockets
// there. A socket keeps the namespace it was created in, so one agent process
// can serve listeners in every enrolled pod after its thread has left.
package netns

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Do runs fn on an OS thread that has entered the network namespace at path,
// then returns the thread to its own namespace. If the thread cannot return,
// it stays locked and dies with the goroutine, so no other goroutine ever
// runs in a namespace it did not ask for.
func Do(path string, fn func() error) error {
	h, err := Open(path)
	if err != nil {
		return err
	}
	defer h.Close()
	return h.Do(fn)
}

// Handle is an open network namespace. It names the namespace it was opened
// on even if its path is later bound to another, and saves a caller that
// enters it often (a pod's every inbound connection) opening the path each
// time. An open Handle keeps its namespace alive: close it when the pod goes.
type Handle struct {
	f    *os.File
	path string
}

// Open opens the network namespace at path. It opens without blocking, as
// CheckPodPath: a fifo put at the path after the check is refused, not
// waited on.
func Open(path string) (*Handle, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("open network namespace %s: %w", path, err)
	}
	if err := checkNetNS(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("network namespace %s: %w", path, err)
	}
	return &Handle{f: f, path: path}, nil
}

// Path is the path h was opened on.
func (h *Handle) Path() string {
	if h == nil {
		return ""
	}
	return h.path
}

// Inode is the namespace's inode number (Inode).
func (h *Handle) Inode() (uint64, error) {
	if h == nil {
		return 0, errNoHandle
	}
	rc, err := h.f.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("network namespace %s: %w", h.path, err)
	}
	var st unix.Stat_t
	if err := controlErr(rc, func(fd int) error { return unix.Fstat(fd, &st) }); err != nil {
		return 0, fmt.Errorf("stat network namespace %s: %w", h.path, err)
	}
	return st.Ino, nil
}

// errNoHandle is what a nil Handle answers.
var errNoHandle = errors.New("no network namespace")

// Close releases the namespace. Calls already in Do keep it until they end.
func (h *Handle) Close() error {
	if h == nil {
		return errNoHandle
	}
	return h.f.Close()
}

// hostNS is the namespace every unlocked thread of the process is in, opened
// once: the runtime starts new threads from a clean template thread, and a
// thread that could not return from a namespace dies locked (Do), so it
// stays the namespace Do returns threads to.
var hostNS = sync.OnceValues(func() (*os.File, error) {
	return os.Open("/proc/thread-self/ns/net")
})

// Opened at start, on the main goroutine, before any thread can have
// entered another namespace.
func init() { _, _ = hostNS() }

// OwnInode is the inode of the agent's own network namespace: the one
// every thread not inside Do is in. /proc/self/ns/net is not it: that is
// the main thread's, and the Go runtime runs any goroutine on the main
// thread, Do's too, so it names a pod's namespace while one runs there.
func OwnInode() (uint64, error) {
	own, err := hostNS()
	if err != nil {
		return 0, fmt.Errorf("open own network namespace: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(own.Fd()), &st); err != nil {
		return 0, fmt.Errorf("stat own network namespace: %w", err)
	}
	return st.Ino, nil
}

// Do runs fn on an OS thread that has entered h's namespace, as the
// package's Do. The namespace file is held (its descriptor cannot be closed
// and reused) for the whole call, so the thread never enters another.
func (h *Handle) Do(fn func() error) error {
	if h == nil {
		return errNoHandle
	}
	rc, err := h.f.SyscallConn()
	if err != nil {
		return fmt.Errorf("network namespace %s: %w", h.path, err)
	}
	errc := make(chan error, 1)
	go func() {
		var ferr error
		cerr := rc.Control(func(target uintptr) { ferr = enterAndRun(int(target), h.path, fn) })
		errc <- cmp.Or(cerr, ferr)
	}()
	if err := <-errc; err != nil {
		return err
	}
	return nil
}

// enterAndRun runs fn with the calling goroutine's thread in the namespace
// target, and returns the thread to hostNS.
func enterAndRun(target int, path string, fn func() error) error {
	own, err := hostNS()
	if err != nil {
		return fmt.Errorf("open own network namespace: %w", err)
	}
	runtime.LockOSThread()
	if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter network namespace %s: %w", path, err)
	}
	ferr := fn()
	if err := unix.Setns(int(own.Fd()), unix.CLONE_NEWNET); err != nil {
		// Leave the thread locked: it exits with this goroutine.
		return errors.Join(ferr, fmt.Errorf("return from network namespace %s: %w", path, err))
	}
	runtime.UnlockOSThread()
	return ferr
}

func checkNetNS(f *os.File) error {
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &st); err != nil {
		return err
	}
	if st.Type != unix.NSFS_MAGIC && st.Type != unix.PROC_SUPER_MAGIC {
		return fmt.Errorf("not a namespace file")
	}
	return nil
}

// Inode returns the namespace's inode number, which identifies it.
func Inode(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("stat network namespace %s: %w", path, err)
	}
	return st.Ino, nil
}

// SocketOptions are applied to a socket before bind.
type SocketOptions struct {
	// Transparent lets a listener accept connections to any address and a
	// dialer bind to an address the namespace does not own.
	Transparent bool
	// Mark is the SO_MARK of the socket; the BPF programs never capture
	// packets carrying the tunnel mark.
	Mark uint32
	// Local is the address a dialer binds to (zero: chosen by the kernel).
	Local net.Addr
	// AvoidLocalPort is a port a dialer bound to Local with port 0 must not
	// get (0: any). The inbound tunnel dials the app from its client's
	// address; the client's own port there would give the dial the tuple of
	// the connection it relays, whose socket would answer the dial's SYN.
	AvoidLocalPort uint16
	// LocalPorts, when set (inclusive), is where a dialer bound to Local
	// with port 0 takes its port, at random, instead of the namespace's
	// ephemeral range (the kernel's choice when none there is free). The
	// inbound tunnel dials the app from its client's address: a port in the
	// range the client's own kernel picks from would be taken by the
	// client's next connection to the same app, whose SYN then meets the
	// app's socket of the relayed connection and is lost.
	LocalPorts [2]uint16
	// ReusePort sets SO_REUSEPORT on a listener. The tunnel's pod
	// listeners never set it (any socket of the same user could join their
	// group; see tunnel/handover.go); tests use it to stand for such a
	// process.
	ReusePort bool
	// ReuseAddr sets SO_REUSEADDR: a UDP socket that answers from the
	// address a query was sent to binds it next to others doing the same.
	ReuseAddr bool
	// RecvOrigDst asks a UDP socket for each datagram's original
	// destination (IP_RECVORIGDSTADDR, IPV6_RECVORIGDSTADDR): a datagram
	// the capture assigned to it was sent to another address.
	RecvOrigDst bool
	// Congestion is the TCP congestion control, set before the socket
	// connects or listens, so the node's default is never initialised on it
	// (a listener's accepted sockets inherit it). Failing to set it is not an
	// error: only speed is at stake.
	Congestion string
	// KeepAlive, when set, turns TCP keepalive on with its timings and sets
	// TCP_USER_TIMEOUT: on a listener before it listens, and its accepted
	// sockets inherit both from it, so nothing is set per accepted
	// connection (nor the runtime's own 15 s keepalive default). On a dialled
	// socket the timings are the dialer's (set once it is connected, instead
	// of the runtime's default) and TCP_USER_TIMEOUT is set before the
	// connect, where it also bounds the handshake: keep it above the connect
	// timeout.
	KeepAlive *KeepAlive
}

// KeepAlive holds TCP keepalive timings and the TCP_USER_TIMEOUT.
type KeepAlive struct {
	Idle, Interval time.Duration
	Count          int
	// UserTimeout bounds how long sent data may go unacknowledged.
	UserTimeout time.Duration
}

// controlErr runs fn on c's descriptor.
func controlErr(c syscall.RawConn, fn func(fd int) error) error {
	var ferr error
	if err := c.Control(func(fd uintptr) { ferr = fn(int(fd)) }); err != nil {
		return err
	}
	return ferr
}

// apply sets k on socket fd.
func (k *KeepAlive) apply(fd int) error {
	for _, o := range []struct {
		level, opt, val int
		name            string
	}{
		{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1, "SO_KEEPALIVE"},
		{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, int(k.Idle / time.Second), "TCP_KEEPIDLE"},
		{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, int(k.Interval / time.Second), "TCP_KEEPINTVL"},
		{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, k.Count, "TCP_KEEPCNT"},
		{unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(k.UserTimeout / time.Millisecond), "TCP_USER_TIMEOUT"},
	} {
		if err := unix.SetsockoptInt(fd, o.level, o.opt, o.val); err != nil {
			return fmt.Errorf("set %s: %w", o.name, err)
		}
	}
	return nil
}

// CheckCongestion tells whether TCP sockets can use the congestion control
// algo, by setting it on a throwaway socket: the kernel's own answer, which
// also loads its module if one exists and this process may load it.
func CheckCongestion(algo string) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("congestion control %q: socket: %w", algo, err)
	}
	defer unix.Close(fd)
	if err := unix.SetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_CONGESTION, algo); err != nil {
		if errors.Is(err, unix.EPERM) {
			allowed, _ := os.ReadFile("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
			return fmt.Errorf("congestion control %q: %w (without CAP_NET_ADMIN a socket may use only net.ipv4.tcp_allowed_congestion_control: %s)",
				algo, err, strings.TrimSpace(string(allowed)))
		}
		avail, _ := os.ReadFile("/proc/sys/net/ipv4/tcp_available_congestion_control")
		return fmt.Errorf("congestion control %q: %w (this kernel offers: %s)", algo, err, strings.TrimSpace(string(avail)))
	}
	return nil
}

func (o SocketOptions) control(network, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		serr = o.apply(int(fd), network == "tcp4" || network == "udp4")
	})
	if err != nil {
		return err
	}
	return serr
}

// apply sets the options on socket fd; ipv4Only says it is an AF_INET
// socket (an IPv6 one may carry IPv4 too).
func (o SocketOptions) apply(fd int, ipv4Only bool) error {
	if o.Mark != 0 {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(o.Mark)); err != nil {
			return fmt.Errorf("set SO_MARK: %w", err)
		}
	}
	if o.ReusePort {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
			return fmt.Errorf("set SO_REUSEPORT: %w", err)
		}
	}
	if o.ReuseAddr {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
			return fmt.Errorf("set SO_REUSEADDR: %w", err)
		}
	}
	if o.RecvOrigDst {
		if err := unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_RECVORIGDSTADDR, 1); err != nil {
			return fmt.Errorf("set IP_RECVORIGDSTADDR: %w", err)
		}
		if !ipv4Only {
			if err := unix.SetsockoptInt(fd, unix.SOL_IPV6, unix.IPV6_RECVORIGDSTADDR, 1); err != nil {
				return fmt.Errorf("set IPV6_RECVORIGDSTADDR: %w", err)
			}
		}
	}
	if o.Congestion != "" {
		_ = unix.SetsockoptString(fd, unix.IPPROTO_TCP, unix.TCP_CONGESTION, o.Congestion)
	}
	if !o.Transparent {
		return nil
	}
	var err error
	if ipv4Only {
		err = unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1)
	} else {
		err = unix.SetsockoptInt(fd, unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
		if err == nil {
			_ = unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1)
		}
	}
	if err != nil {
		return fmt.Errorf("set transparent: %w", err)
	}
	return nil
}

// Adopt gives a listener another process opened (passed over a unix
// socket) the options of opts that a listener carries: those set before
// bind or listen, and the keepalive. The sockets it accepts inherit them
// from the listener, except the keepalive timings: on every connection a
// listener it did not open accepts, the runtime turns on its own 15 s
// keepalive (a file listener has no ListenConfig to say otherwise). So the
// listener returned sets opts' timings again on each accepted connection
// (three setsockopts more per connection), as best effort, as the runtime
// does its own. It embeds the *net.TCPListener, so its descriptor can be
// passed on again.
func Adopt(l net.Listener, opts SocketOptions) (net.Listener, error) {
	tl, ok := l.(*net.TCPListener)
	if !ok {
		return nil, fmt.Errorf("a %T is not a TCP listener", l)
	}
	rc, err := tl.SyscallConn()
	if err != nil {
		return nil, err
	}
	err = controlErr(rc, func(fd int) error {
		domain, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
		if err != nil {
			return fmt.Errorf("SO_DOMAIN: %w", err)
		}
		if err := opts.apply(fd, domain == unix.AF_INET); err != nil {
			return err
		}
		if opts.KeepAlive != nil {
			return opts.KeepAlive.apply(fd)
		}
		return nil
	})
	if err != nil || opts.KeepAlive == nil {
		return tl, err
	}
	k := opts.KeepAlive
	return &adoptedListener{TCPListener: tl, keepAlive: net.KeepAliveConfig{Enable: true, Idle: k.Idle, Interval: k.Interval, Count: k.Count}}, nil
}

// adoptedListener is an adopted listener whose accepted connections get
// the keepalive timings its own sockets were opened with (Adopt).
type adoptedListener struct {
	*net.TCPListener
	keepAlive net.KeepAliveConfig
}

func (l *adoptedListener) Accept() (net.Conn, error) {
	c, err := l.AcceptTCP()
	if err != nil {
		return nil, err
	}
	_ = c.SetKeepAliveConfig(l.keepAlive)
	return c, nil
}

// Listen opens a TCP listener inside the network namespace at path.
func Listen(ctx context.Context, path, network, addr string, opts SocketOptions) (net.Listener, error) {
	var l net.Listener
	err := Do(path, func() error {
		var err error
		lc := net.ListenConfig{Control: opts.control}
		if opts.KeepAlive != nil {
			lc.KeepAlive = -1 // the accepted sockets inherit the listener's
			lc.Control = func(network, address string, c syscall.RawConn) error {
				if err := opts.control(network, address, c); err != nil {
					return err
				}
				return controlErr(c, opts.KeepAlive.apply)
			}
		}
		l, err = lc.Listen(ctx, network, addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen on %s %s in %s: %w", network, addr, path, err)
	}
	return l, nil
}

// ListenPacket opens a UDP socket inside the namespace h holds.
func (h *Handle) ListenPacket(ctx context.Context, network, addr string, opts SocketOptions) (*net.UDPConn, error) {
	var c net.PacketConn
	err := h.Do(func() error {
		var err error
		c, err = (&net.ListenConfig{Control: opts.control}).ListenPacket(ctx, network, addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen on %s %s in %s: %w", network, addr, h.path, err)
	}
	return c.(*net.UDPConn), nil
}

// DialUDP opens a UDP socket inside the namespace h holds, connected to
// addr.
func (h *Handle) DialUDP(ctx context.Context, network, addr string, opts SocketOptions) (net.Conn, error) {
	var c net.Conn
	err := h.Do(func() error {
		var err error
		c, err = (&net.Dialer{Control: opts.control}).DialContext(ctx, network, addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("dial %s %s in %s: %w", network, addr, h.path, err)
	}
	return c, nil
}
