package netns

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"runtime"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultConnectTimeout bounds a Dial whose ctx has no deadline (ztunnel's
// connection timeout). Without one, a destination that drops SYNs (a full
// accept queue, a blackholed address) holds the caller for the kernel's
// SYN retries, about 2 min with the default tcp_syn_retries of 6.
const DefaultConnectTimeout = 10 * time.Second

// Dial connects to addr, a numeric ip:port, from inside the network
// namespace at path; network is "tcp", "tcp4" or "tcp6". The connect ends
// at ctx's deadline, or after DefaultConnectTimeout if ctx has none.
//
// Only the socket is made on a thread in that namespace: a socket keeps
// the namespace it was created in. The thread leaves the namespace as soon
// as the socket exists; options, bind, connect and the wait for the
// handshake happen through the runtime poller, so a connect in progress
// holds no OS thread locked in a namespace.
func Dial(ctx context.Context, path, network, addr string, opts SocketOptions) (net.Conn, error) {
	h, err := Open(path)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", addr, err)
	}
	defer h.Close()
	return h.Dial(ctx, network, addr, opts)
}

// Dial is the package's Dial from inside h's namespace.
func (h *Handle) Dial(ctx context.Context, network, addr string, opts SocketOptions) (net.Conn, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultConnectTimeout)
		defer cancel()
	}
	c, err := dial(ctx, h, network, addr, opts)
	if err != nil {
		return nil, fmt.Errorf("dial %s from %s: %w", addr, h.Path(), err)
	}
	return c, nil
}

func dial(ctx context.Context, h *Handle, network, addr string, opts SocketOptions) (net.Conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if h == nil {
		return nil, errNoHandle
	}
	dst, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, fmt.Errorf("want a numeric ip:port: %w", err)
	}
	if dst.Addr().Zone() != "" {
		// A zone names an interface, which the runtime would look up in a
		// cache shared by every namespace the process enters.
		return nil, fmt.Errorf("address %s has a zone: want one without", dst)
	}
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	family := unix.AF_INET6
	switch {
	case network == "tcp4" && !dst.Addr().Is4(), network == "tcp6" && dst.Addr().Is4():
		return nil, fmt.Errorf("address %s is not %s", dst, network)
	case network != "tcp" && network != "tcp4" && network != "tcp6":
		return nil, fmt.Errorf("network %q: want tcp, tcp4 or tcp6", network)
	case dst.Addr().Is4():
		family = unix.AF_INET
	}
	local, err := bindAddr(opts.Local, family)
	if err != nil {
		return nil, err
	}
	rc, err := h.f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("network namespace %s: %w", h.path, err)
	}
	// A goroutine of its own: should its thread fail to leave the
	// namespace, it stays locked and exits with this goroutine.
	type result struct {
		c   net.Conn
		err error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		cerr := rc.Control(func(target uintptr) {
			r.c, r.err = dialFrom(ctx, int(target), h.path, family, dst, local, opts)
		})
		done <- result{r.c, cmp.Or(r.err, cerr)}
	}()
	r := <-done
	return r.c, r.err
}

// dialFrom dials dst with a socket made in the namespace target. The
// calling goroutine's thread enters it for the socket call; the dialer's
// control function, which runs right after it, sets the options, binds
// (a second socket, to hold an avoided port, is made there too) and
// returns the thread to the process's namespace and unlocks it before the
// connect starts. If the thread cannot return, it stays locked and the
// error says so: the caller's goroutine must end.
//
// net.Dialer makes the *net.TCPConn itself, so nothing is duplicated:
// wrapping a socket made by hand (net.FileConn) took a dup, two address
// lookups, a second poller registration and the runtime's keepalive, about
// a dozen system calls more per dial.
func dialFrom(ctx context.Context, target int, path string, family int, dst netip.AddrPort, local unix.Sockaddr, opts SocketOptions) (net.Conn, error) {
	own, err := hostNS()
	if err != nil {
		return nil, fmt.Errorf("open own network namespace: %w", err)
	}
	runtime.LockOSThread()
	if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("enter network namespace %s: %w", path, err)
	}
	inside := true
	var stuck error
	leave := func() {
		if !inside {
			return
		}
		inside = false
		if err := unix.Setns(int(own.Fd()), unix.CLONE_NEWNET); err != nil {
			stuck = fmt.Errorf("return from network namespace %s: %w", path, err)
			return
		}
		runtime.UnlockOSThread()
	}
	var perr error
	d := net.Dialer{
		ControlContext: func(_ context.Context, _, _ string, c syscall.RawConn) error {
			if !inside {
				// net.Dialer makes a new socket after EADDRNOTAVAIL (bind or
				// connect) or a connection to itself: the thread has left,
				// so it would be in the process's own namespace.
				return cmp.Or(perr, errRedial)
			}
			perr = controlErr(c, func(fd int) error { return prepare(fd, family, opts, local, dst) })
			leave()
			return cmp.Or(stuck, perr)
		},
	}
	// One socket per dial: a failed MPTCP dial (GODEBUG=multipathtcp=1)
	// falls back to a second.
	d.SetMultipathTCP(false)
	if ka := opts.KeepAlive; ka != nil {
		d.KeepAliveConfig = net.KeepAliveConfig{Enable: true, Idle: ka.Idle, Interval: ka.Interval, Count: ka.Count}
	}
	network := "tcp4"
	if family == unix.AF_INET6 {
		network = "tcp6"
	}
	c, err := d.DialContext(ctx, network, dst.String())
	leave() // when the dial failed before its socket was made
	if stuck != nil {
		if c != nil {
			c.Close()
		}
		return nil, errors.Join(err, stuck)
	}
	var oe *net.OpError
	switch {
	case err == nil:
		return c, nil
	case errors.Is(err, os.ErrDeadlineExceeded):
		// The socket's deadline is ctx's: it may fire before ctx's own
		// timer marks ctx done. Report it as ctx would.
		return nil, context.DeadlineExceeded
	case errors.As(err, &oe):
		return nil, oe.Err // the caller names the address and namespace
	}
	return nil, err
}

// errRedial is what a dial answers when net.Dialer wants a second socket.
var errRedial = errors.New("net.Dialer wants a new socket (after EADDRNOTAVAIL or a connection to itself), which would not be in the namespace")

// prepare sets opts on a new socket and binds it to local when set: in
// opts.LocalPorts when local has no port, never to opts.AvoidLocalPort. It
// runs on the thread that made the socket, still in its namespace, which
// dst is dialled from.
func prepare(fd, family int, opts SocketOptions, local unix.Sockaddr, dst netip.AddrPort) error {
	if err := opts.apply(fd, family == unix.AF_INET); err != nil {
		return err
	}
	if ka := opts.KeepAlive; ka != nil {
		// The rest of the keepalive settings follow the connect (net.Dialer);
		// this one the runtime does not know.
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(ka.UserTimeout/time.Millisecond)); err != nil {
			return fmt.Errorf("set TCP_USER_TIMEOUT: %w", err)
		}
	}
	if local == nil {
		return nil
	}
	ap, _ := sockaddrPort(local)
	if lo, hi := opts.LocalPorts[0], opts.LocalPorts[1]; lo != 0 && hi >= lo && ap.Port() == 0 {
		if done, err := bindInRange(fd, family, ap.Addr(), lo, hi, opts.AvoidLocalPort, dst); done {
			return err
		}
	}
	avoid := opts.AvoidLocalPort
	if avoid == 0 || ap.Port() != 0 {
		return os.NewSyscallError("bind", unix.Bind(fd, local))
	}
	// The kernel picks the port. Holding the avoided one on a socket of
	// its own while binding makes it pick another; then that one can go.
	hold, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil {
		return fmt.Errorf("avoiding local port %d: %w", avoid, os.NewSyscallError("socket", err))
	}
	defer unix.Close(hold)
	if err := opts.apply(hold, family == unix.AF_INET); err != nil {
		return fmt.Errorf("avoiding local port %d: %w", avoid, err)
	}
	if err := unix.Bind(hold, sockaddr(netip.AddrPortFrom(ap.Addr(), avoid), family)); err != nil && !errors.Is(err, unix.EADDRINUSE) {
		return fmt.Errorf("avoiding local port %d: %w", avoid, os.NewSyscallError("bind", err))
	}
	if err := unix.Bind(fd, local); err != nil {
		return fmt.Errorf("avoiding local port %d: %w", avoid, os.NewSyscallError("bind", err))
	}
	if localPort(fd) == avoid {
		return fmt.Errorf("avoiding local port %d: bound to it", avoid)
	}
	return nil
}

// localPortTries bounds how many ports of SocketOptions.LocalPorts
// bindInRange tries before it leaves the choice to the kernel.
const localPortTries = 32

// bindInRange binds fd to addr with a port in [lo, hi]: consecutive ports
// from a random one, skipping avoid, those in use, and those whose tuple
// towards dst a socket of the namespace holds from dst's side. done is
// false when none of the ports tried was free (fd is still unbound): the
// kernel chooses then.
//
// That last kind: the inbound tunnel dials the app from a plaintext
// client's address (IP_TRANSPARENT), and the tunnel's accepted socket of
// another connection of that client, from that port (live, closing or in
// TIME_WAIT), is not bound to the client's address in this namespace, so
// bind does not see it. The dial's SYN met it: a challenge ACK sent to the
// client, or the TIME_WAIT's ACK for a SYN whose timestamp it took for
// old, and the dial timed out. Clients pick such ports whenever their
// ephemeral range reaches below 32768 (net.ipv4.ip_local_port_range
// "1024 65535", a common tuning and a sysctl Kubernetes lets any pod set).
func bindInRange(fd, family int, addr netip.Addr, lo, hi, avoid uint16, dst netip.AddrPort) (done bool, err error) {
	n := int(hi-lo) + 1
	start := rand.IntN(n)
	probe := newTupleProbe()
	defer probe.close()
	for i := 0; i < min(n, localPortTries); i++ {
		port := lo + uint16((start+i)%n)
		if port == avoid || probe.taken(dst, netip.AddrPortFrom(addr, port)) {
			continue
		}
		err := unix.Bind(fd, sockaddr(netip.AddrPortFrom(addr, port), family))
		if errors.Is(err, unix.EADDRINUSE) {
			continue
		}
		return true, os.NewSyscallError("bind", err)
	}
	return false, nil
}

// sockaddrPort is the address and port of an inet sockaddr.
func sockaddrPort(sa unix.Sockaddr) (netip.AddrPort, bool) {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port)), true
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port)), true
	}
	return netip.AddrPort{}, false
}

// localPort is the port fd is bound to (0 when unknown).
func localPort(fd int) uint16 {
	switch sa, _ := unix.Getsockname(fd); sa := sa.(type) {
	case *unix.SockaddrInet4:
		return uint16(sa.Port)
	case *unix.SockaddrInet6:
		return uint16(sa.Port)
	}
	return 0
}

// bindAddr converts the local address a dialer binds to; nil: none.
func bindAddr(local net.Addr, family int) (unix.Sockaddr, error) {
	if local == nil {
		return nil, nil
	}
	ta, ok := local.(*net.TCPAddr)
	if !ok {
		return nil, fmt.Errorf("local address %v: want *net.TCPAddr", local)
	}
	ap := ta.AddrPort()
	a := ap.Addr().Unmap()
	if !a.IsValid() {
		return nil, fmt.Errorf("local address %v is not an IP address", local)
	}
	if family == unix.AF_INET && !a.Is4() {
		return nil, fmt.Errorf("local address %v cannot dial an IPv4 destination", local)
	}
	return sockaddr(netip.AddrPortFrom(a, ap.Port()), family), nil
}

// sockaddr is ap for a socket of family (IPv4 mapped into an AF_INET6 one).
func sockaddr(ap netip.AddrPort, family int) unix.Sockaddr {
	if family == unix.AF_INET {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
}
