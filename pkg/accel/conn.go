package accel

import (
	"encoding/binary"
	"fmt"
	"net"
	"sync"
	"syscall"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/bpf"
)

// ReportEvery is how many bytes the tunnel reads from a socket between two
// reports to the kernel: well under the budget, so an app whose sends the
// tunnel keeps up with never runs out of it.
const ReportEvery = 64 << 10

// Conn is a pod-side socket of the tunnel while the acceleration is on.
//
//   - If the sockops program paired it (checked at the first read), what
//     the tunnel reads from it is reported to rd_sock_consumed, which gives
//     the app's sends their budget back. Once the app's socket has fallen
//     back to TCP for good (checked at the first read and at each report),
//     it is taken out of rd_app_socks, so its sends and reads run the
//     kernel's plain TCP code again, and reports stop.
//   - It hides the socket's splice paths (ReadFrom, WriteTo): a splice reads
//     only the TCP queue and would never see what the app's sends put in
//     the socket's redirect queue. (SyscallConn stays, for the tunnel's own
//     reads; Go's sendfile would take it too, but the kernel refuses a
//     socket as sendfile's source.)
type Conn struct {
	net.Conn // the *net.TCPConn, as an interface: its splice methods stay hidden
	tcp      *net.TCPConn
	maps     *bpf.SockopsMaps   // nil: the socket's key is unknown, nothing is reported
	key      bpf.SockopsSockKey // this socket's; the app's is the same, swapped

	mu             sync.Mutex
	read, reported uint64
	checked        bool // the first read looked the socket up
	closed, done   bool // done: nothing more to report (not paired, or the app fell back)
}

// Wrap returns a TCP socket as a Conn, and any other net.Conn as it is. It
// never fails: without the socket's key the budget is just never returned,
// and the app's connection falls back to the TCP path. Whether the socket
// was paired is looked up at its first read, not here: accept() can return
// a socket a moment before the kernel has run the pairing callback on it.
func (a *Accelerator) Wrap(c net.Conn) net.Conn {
	tcp, ok := c.(*net.TCPConn)
	if !ok {
		return c
	}
	w := &Conn{Conn: tcp, tcp: tcp}
	key, err := keyOf(tcp)
	if err != nil {
		a.cfg.Logger.Debug("sockops acceleration: no key for socket", "local", c.LocalAddr(), "remote", c.RemoteAddr(), "error", err)
		return w
	}
	w.key, w.maps = key, &a.objs.SockopsMaps
	return w
}

// keyOf is the socket's key as rd_sockops computes it.
func keyOf(c *net.TCPConn) (bpf.SockopsSockKey, error) {
	var k bpf.SockopsSockKey
	la, lok := c.LocalAddr().(*net.TCPAddr)
	ra, rok := c.RemoteAddr().(*net.TCPAddr)
	if !lok || !rok {
		return k, fmt.Errorf("not a connected TCP socket: %v -> %v", c.LocalAddr(), c.RemoteAddr())
	}
	// IPv4 addresses, plain or mapped, come out IPv4-mapped, as in the key.
	local, remote := la.AddrPort(), ra.AddrPort()
	k.Local, k.Remote = local.Addr().As16(), remote.Addr().As16()
	k.Lport, k.Rport = networkOrder(local.Port()), networkOrder(remote.Port())
	rc, err := c.SyscallConn()
	if err != nil {
		return k, err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		k.Netns, serr = unix.GetsockoptUint64(int(fd), unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	}); err != nil {
		return k, err
	}
	if serr != nil {
		return k, fmt.Errorf("SO_NETNS_COOKIE: %w", serr)
	}
	return k, nil
}

// networkOrder is p as the uint16 whose bytes in memory are big-endian.
func networkOrder(p uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return binary.NativeEndian.Uint16(b[:])
}

// Read reads from the socket and counts what it took.
func (c *Conn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.ObserveRead(n)
	return n, err
}

// ObserveRead counts n bytes read from the socket other than through Read
// (the tunnel reads through the file descriptor), and reports the total
// once ReportEvery bytes have gathered since the last report.
func (c *Conn) ObserveRead(n int) {
	if n <= 0 || c.maps == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.read += uint64(n)
	if c.closed || c.done {
		return
	}
	if !c.checked {
		c.checked = true
		if st, ok := c.state(c.key); !ok || st.Tunnel == 0 {
			c.done = true // never a redirect target: nothing to return
			return
		}
	} else if c.read-c.reported < ReportEvery {
		return
	}
	app := swapped(c.key)
	if st, ok := c.state(app); ok && st.TcpOnly != 0 {
		// The app's sends take TCP for good: stop running sk_msg on them.
		_ = c.maps.RdAppSocks.Delete(&app)
		c.done = true
		return
	}
	// A failed update (map full) only keeps the budget back.
	if c.maps.RdSockConsumed.Update(&c.key, c.read, ebpf.UpdateAny) == nil {
		c.reported = c.read
	}
}

// state is the pairing state of the socket with key k, if it is paired.
func (c *Conn) state(k bpf.SockopsSockKey) (bpf.SockopsSockState, bool) {
	var st bpf.SockopsSockState
	err := c.maps.RdSockState.Lookup(&k, &st)
	return st, err == nil
}

// swapped is the key of the socket at the other end of k's connection.
func swapped(k bpf.SockopsSockKey) bpf.SockopsSockKey {
	k.Local, k.Remote = k.Remote, k.Local
	k.Lport, k.Rport = k.Rport, k.Lport
	return k
}

// Close closes the socket and removes its report.
func (c *Conn) Close() error {
	c.mu.Lock()
	if !c.closed && c.reported > 0 {
		_ = c.maps.RdSockConsumed.Delete(&c.key)
	}
	c.closed = true
	c.mu.Unlock()
	return c.Conn.Close()
}

// SyscallConn, CloseRead, CloseWrite and SetLinger are the socket's own.
func (c *Conn) SyscallConn() (syscall.RawConn, error) { return c.tcp.SyscallConn() }

// RawWriteConn lets the tunnel write to the socket through its file
// descriptor (hbone.RawWriter): Conn adds nothing to writes.
func (c *Conn) RawWriteConn() (syscall.RawConn, error) { return c.tcp.SyscallConn() }

func (c *Conn) CloseRead() error        { return c.tcp.CloseRead() }
func (c *Conn) CloseWrite() error       { return c.tcp.CloseWrite() }
func (c *Conn) SetLinger(sec int) error { return c.tcp.SetLinger(sec) }
