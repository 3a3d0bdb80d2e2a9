package netns

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
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
// the namespace it was created in. Options, bind, connect and the wait for
// the handshake happen on the caller's goroutine through the runtime poller,
// so a connect in progress holds no OS thread locked in a namespace.
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
	dst, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, fmt.Errorf("want a numeric ip:port: %w", err)
	}
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	family := unix.AF_INET6
	switch {
	case network == "tcp4" && !dst.Addr().Is4(), network == "tcp6" && dst.Addr().Is4():
		return nil, fmt.Errorf("address %s is not %s", dst, network)
	case network != "tcp" && network != "tcp4" && network != "tcp6":
		return nil, fmt.Errorf("network %q: want tcp, tcp4 or tcp6", network)
	case dst.Addr().Is4() && network != "tcp6":
		family = unix.AF_INET
	}
	local, err := bindAddr(opts.Local, family)
	if err != nil {
		return nil, err
	}
	f, fd, err := boundInRange(h, family, opts, local)
	if err != nil {
		return nil, err
	}
	if avoid := opts.AvoidLocalPort; avoid != 0 && localPort(fd) == avoid {
		// Holding the socket on that port while binding another makes the
		// kernel pick a different one; then it can go.
		g, gfd, err := boundSocket(h, family, opts, local)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("avoiding local port %d: %w", avoid, err)
		}
		if f, fd = g, gfd; localPort(fd) == avoid {
			f.Close()
			return nil, fmt.Errorf("avoiding local port %d: bound to it again", avoid)
		}
	}
	defer f.Close()
	if err := connect(ctx, f, fd, sockaddr(dst, family)); err != nil {
		return nil, err
	}
	// FileConn duplicates the connected socket into an ordinary
	// *net.TCPConn (addresses known, splice and SetLinger available). It
	// also sets the runtime's default keepalive, so opts' comes after.
	c, err := net.FileConn(f)
	if err != nil || opts.KeepAlive == nil {
		return c, err
	}
	rc, err := c.(syscall.Conn).SyscallConn()
	if err == nil {
		err = controlErr(rc, opts.KeepAlive.apply)
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// boundSocket makes a TCP socket in h's namespace, with opts, bound
// to local when set. The socket belongs to the returned file, which
// registers it with the poller.
func boundSocket(h *Handle, family int, opts SocketOptions, local unix.Sockaddr) (*os.File, int, error) {
	fd := -1
	err := h.Do(func() error {
		var err error
		fd, err = unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
		return os.NewSyscallError("socket", err)
	})
	if err != nil {
		if fd >= 0 { // made, but the thread could not leave the namespace
			unix.Close(fd)
		}
		return nil, -1, err
	}
	f := os.NewFile(uintptr(fd), "netns-dial")
	if err := opts.apply(fd, family == unix.AF_INET); err != nil {
		f.Close()
		return nil, -1, err
	}
	if local != nil {
		if err := unix.Bind(fd, local); err != nil {
			f.Close()
			return nil, -1, os.NewSyscallError("bind", err)
		}
	}
	return f, fd, nil
}

// localPortTries bounds how many ports of opts.LocalPorts boundInRange
// tries before it leaves the choice to the kernel.
const localPortTries = 32

// boundInRange is boundSocket with local's port taken from opts.LocalPorts
// when local has none: consecutive ports from a random one, skipping
// AvoidLocalPort and those in use, then the kernel's choice.
func boundInRange(h *Handle, family int, opts SocketOptions, local unix.Sockaddr) (*os.File, int, error) {
	lo, hi := opts.LocalPorts[0], opts.LocalPorts[1]
	ap, ok := sockaddrPort(local)
	if lo == 0 || hi < lo || !ok || ap.Port() != 0 {
		return boundSocket(h, family, opts, local)
	}
	n := int(hi-lo) + 1
	start := rand.IntN(n)
	for i := 0; i < min(n, localPortTries); i++ {
		port := lo + uint16((start+i)%n)
		if port == opts.AvoidLocalPort {
			continue
		}
		f, fd, err := boundSocket(h, family, opts, sockaddr(netip.AddrPortFrom(ap.Addr(), port), family))
		if errors.Is(err, unix.EADDRINUSE) {
			continue
		}
		return f, fd, err
	}
	return boundSocket(h, family, opts, local)
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

// connect starts a non-blocking connect on fd and waits, through f's
// poller registration, until the handshake finished or ctx ended.
func connect(ctx context.Context, f *os.File, fd int, sa unix.Sockaddr) error {
	err := unix.Connect(fd, sa)
	switch {
	case err == nil:
		return nil
	case !errors.Is(err, unix.EINPROGRESS) && !errors.Is(err, unix.EINTR):
		return os.NewSyscallError("connect", err)
	}
	if d, ok := ctx.Deadline(); ok {
		_ = f.SetWriteDeadline(d)
	}
	stop := context.AfterFunc(ctx, func() { _ = f.SetWriteDeadline(time.Unix(1, 0)) })
	defer stop()
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var cerr error
	werr := rc.Write(func(fd uintptr) bool {
		errno, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		switch {
		case err != nil:
			cerr = os.NewSyscallError("getsockopt", err)
			return true
		case errno != 0 && unix.Errno(errno) != unix.EINPROGRESS && unix.Errno(errno) != unix.EALREADY:
			cerr = os.NewSyscallError("connect", unix.Errno(errno))
			return true
		}
		// Writable with no error can still be spurious: connected only
		// once the peer's address is there.
		_, err = unix.Getpeername(int(fd))
		return err == nil
	})
	if werr != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(werr, os.ErrDeadlineExceeded) {
			// The socket's deadline is ctx's: it may fire before ctx's own
			// timer marks ctx done. Report it as ctx would.
			return context.DeadlineExceeded
		}
		return werr
	}
	return cerr
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
