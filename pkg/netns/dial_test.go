package netns_test

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// acceptOne listens in pod on port and reports the peer address of each
// connection it accepts.
func acceptOne(t *testing.T, pod *netnstest.Pod, port int) <-chan netip.AddrPort {
	t.Helper()
	l, err := netns.Listen(context.Background(), pod.Path(), "tcp", net.JoinHostPort("::", strconv.Itoa(port)), netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	peers := make(chan netip.AddrPort, 8)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			ap := c.RemoteAddr().(*net.TCPAddr).AddrPort()
			peers <- netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
			c.Close()
		}
	}()
	return peers
}

// Dial makes its socket in the source pod's namespace: the server sees the
// pod's address, over IPv4 and IPv6, and the conn knows both ends.
func TestDialFromNamespace(t *testing.T) {
	topo := netnstest.New(t, 1)
	a, b := topo.Nodes[0].AddPod("a"), topo.Nodes[0].AddPod("b")
	peers := acceptOne(t, b, 8080)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, dst := range []netip.Addr{b.IPv4, b.IPv6} {
		addr := netip.AddrPortFrom(dst, 8080)
		c, err := netns.Dial(ctx, a.Path(), "tcp", addr.String(), netns.SocketOptions{Mark: 0x539})
		if err != nil {
			t.Fatal(err)
		}
		if got := c.RemoteAddr().(*net.TCPAddr).AddrPort(); got.Addr().Unmap() != dst || got.Port() != 8080 {
			t.Errorf("RemoteAddr = %v, want %v", got, addr)
		}
		local := c.LocalAddr().(*net.TCPAddr).AddrPort()
		if _, ok := c.(*net.TCPConn); !ok {
			t.Errorf("Dial returned %T, want *net.TCPConn", c)
		}
		rc, _ := c.(syscall.Conn).SyscallConn()
		var mark int
		_ = rc.Control(func(fd uintptr) { mark, _ = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK) })
		if mark != 0x539 {
			t.Errorf("SO_MARK = %#x, want 0x539", mark)
		}
		select {
		case p := <-peers:
			if want := (netip.AddrPortFrom(local.Addr().Unmap(), local.Port())); p != want || !slices.Contains(a.Addrs(), p.Addr()) {
				t.Errorf("server saw %v, want pod a's %v", p, want)
			}
		case <-ctx.Done():
			t.Fatal("server saw no connection")
		}
		c.Close()
	}
}

// A local address binds the socket before connect.
func TestDialBindsLocal(t *testing.T) {
	topo := netnstest.New(t, 1)
	a, b := topo.Nodes[0].AddPod("a"), topo.Nodes[0].AddPod("b")
	peers := acceptOne(t, b, 8081)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	local := &net.TCPAddr{IP: a.IPv4.AsSlice(), Port: 40001}
	c, err := netns.Dial(ctx, a.Path(), "tcp", netip.AddrPortFrom(b.IPv4, 8081).String(), netns.SocketOptions{Local: local, Transparent: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if p := <-peers; p != netip.AddrPortFrom(a.IPv4, 40001) {
		t.Errorf("server saw %v, want %v", p, local)
	}
}

// Failures name what went wrong and never hang.
func TestDialErrors(t *testing.T) {
	topo := netnstest.New(t, 1)
	a, b := topo.Nodes[0].AddPod("a"), topo.Nodes[0].AddPod("b")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()

	_, err := netns.Dial(ctx, a.Path(), "tcp", netip.AddrPortFrom(b.IPv4, 9).String(), netns.SocketOptions{})
	if !errors.Is(err, unix.ECONNREFUSED) {
		t.Errorf("dial to a closed port: %v, want connection refused", err)
	}
	cancelled, stop := context.WithCancel(ctx)
	stop()
	if _, err := netns.Dial(cancelled, a.Path(), "tcp", netip.AddrPortFrom(b.IPv4, 9).String(), netns.SocketOptions{}); !errors.Is(err, context.Canceled) {
		t.Errorf("dial with a cancelled context: %v", err)
	}
	bad := []struct{ network, addr, want string }{
		{"tcp", "localhost:80", "numeric"},
		{"udp", netip.AddrPortFrom(b.IPv4, 80).String(), `network "udp"`},
		{"tcp6", netip.AddrPortFrom(b.IPv4, 80).String(), "is not tcp6"},
		{"tcp", "[fe80::1%eth0]:80", "has a zone"},
	}
	for _, c := range bad {
		if _, err := netns.Dial(ctx, a.Path(), c.network, c.addr, netns.SocketOptions{}); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Dial(%s, %s) = %v, want an error about %s", c.network, c.addr, err, c.want)
		}
	}
	if _, err := netns.Dial(ctx, "/nonexistent/netns", "tcp", netip.AddrPortFrom(b.IPv4, 80).String(), netns.SocketOptions{}); err == nil || !strings.Contains(err.Error(), "/nonexistent/netns") {
		t.Errorf("dial from a missing namespace: %v", err)
	}
}

// A destination whose accept queue is full drops the SYNs; the kernel
// would retry them for about 2 min. Without a deadline of its own, Dial
// gives up after DefaultConnectTimeout (before, it waited out every retry).
func TestDialFullBacklogTimesOut(t *testing.T) {
	topo := netnstest.New(t, 1)
	a, b := topo.Nodes[0].AddPod("a"), topo.Nodes[0].AddPod("b")
	dst, first := fillBacklog(t, a, b)
	defer first.Close()

	start := time.Now()
	c, err := netns.Dial(context.Background(), a.Path(), "tcp", dst, netns.SocketOptions{})
	took := time.Since(start)
	if err == nil {
		c.Close()
		t.Fatal("dial to a full accept queue succeeded")
	}
	if !errors.Is(err, context.DeadlineExceeded) || took > netns.DefaultConnectTimeout+5*time.Second {
		t.Errorf("dial to a full accept queue: %v after %v, want a deadline error after %v", err, took.Round(time.Millisecond), netns.DefaultConnectTimeout)
	}
}

// fillBacklog opens a listener in b with backlog 0 that never accepts, and
// fills its queue with one connection from a: the next SYN to dst is
// dropped, so a dial stays in progress.
func fillBacklog(t *testing.T, a, b *netnstest.Pod) (dst string, first net.Conn) {
	t.Helper()
	var lfd int
	err := netns.Do(b.Path(), func() error {
		var err error
		if lfd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		if err := unix.Bind(lfd, &unix.SockaddrInet4{Port: 8090, Addr: b.IPv4.As4()}); err != nil {
			return err
		}
		return unix.Listen(lfd, 0)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(lfd) })
	dst = netip.AddrPortFrom(b.IPv4, 8090).String()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	first, err = netns.Dial(ctx, a.Path(), "tcp", dst, netns.SocketOptions{})
	if err != nil {
		t.Fatalf("first connection, into the empty queue: %v", err)
	}
	return dst, first
}

// While a dial waits for its handshake, no thread of the process is in the
// namespace it dials from: the thread that made the socket left at once,
// so dials to destinations that drop SYNs pin no threads there.
func TestDialHoldsNoThreadInNamespace(t *testing.T) {
	topo := netnstest.New(t, 1)
	a, b := topo.Nodes[0].AddPod("a"), topo.Nodes[0].AddPod("b")
	dst, first := fillBacklog(t, a, b)
	defer first.Close()
	podNS, err := os.Readlink(a.Path())
	if err != nil {
		podNS, err = nsLink(a.Path())
		if err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	const dials = 8
	errs := make(chan error, dials)
	for range dials {
		go func() {
			_, err := netns.Dial(ctx, a.Path(), "tcp", dst, netns.SocketOptions{Mark: 0x539})
			errs <- err
		}()
	}
	time.Sleep(500 * time.Millisecond) // every dial is waiting for its SYN-ACK
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		if ns, err := os.Readlink("/proc/self/task/" + task.Name() + "/ns/net"); err == nil && ns == podNS {
			t.Errorf("thread %s is in the dialling pod's namespace (%s) while its dials wait", task.Name(), ns)
		}
	}
	for range dials {
		if err := <-errs; !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("dial to a full accept queue: %v, want a deadline error", err)
		}
	}
}

// nsLink names the namespace at path as /proc's ns links do (net:[inode]).
func nsLink(path string) (string, error) {
	ino, err := netns.Inode(path)
	if err != nil {
		return "", err
	}
	return "net:[" + strconv.FormatUint(ino, 10) + "]", nil
}

// TestCheckCongestion: an algorithm the kernel has passes (reno is always
// built in); an unknown name fails, naming it and what the kernel offers.
func TestCheckCongestion(t *testing.T) {
	if err := netns.CheckCongestion("reno"); err != nil {
		t.Fatalf("reno: %v", err)
	}
	err := netns.CheckCongestion("no-such-algo")
	if err == nil {
		t.Fatal("no-such-algo: no error")
	}
	for _, want := range []string{`"no-such-algo"`, "this kernel offers:", "reno"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

// A dialer told to avoid a local port never gets it, even where the
// kernel would pick it: the inbound tunnel dials the app from its
// client's address, and the client's own port would give the dial the
// tuple of the connection it relays. The pod's port range is cut to two
// ports, so whichever the kernel prefers, one case moves it to the other;
// with one port left, the dial fails and says why.
func TestDialAvoidsLocalPort(t *testing.T) {
	topo := netnstest.New(t, 1)
	b := topo.Nodes[0].AddPod("b")
	acceptOne(t, b, 8080)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	portRange := func(r string) {
		t.Helper()
		if out, err := netnstest.Exec(ctx, b.Path(), "sysctl", "-w", "net.ipv4.ip_local_port_range="+r); err != nil {
			t.Fatalf("sysctl: %v: %s", err, out)
		}
	}
	portRange("40000 40001")
	dst := netip.AddrPortFrom(b.IPv4, 8080).String()
	local := &net.TCPAddr{IP: b.IPv4.AsSlice()}
	for _, avoid := range []uint16{40000, 40001, 40000, 40001} {
		c, err := netns.Dial(ctx, b.Path(), "tcp", dst, netns.SocketOptions{Local: local, AvoidLocalPort: avoid})
		if err != nil {
			t.Fatalf("avoid %d: %v", avoid, err)
		}
		if got := c.LocalAddr().(*net.TCPAddr).Port; got == int(avoid) {
			t.Errorf("avoid %d: bound to it", avoid)
		}
		c.(*net.TCPConn).SetLinger(0) // a reset: no TIME_WAIT left on the port
		c.Close()
	}
	portRange("40000 40000")
	if _, err := netns.Dial(ctx, b.Path(), "tcp", dst, netns.SocketOptions{Local: local, AvoidLocalPort: 40000}); err == nil || !strings.Contains(err.Error(), "avoiding local port 40000") {
		t.Errorf("one port in range, avoided: err = %v", err)
	}
}

// A dialer given LocalPorts binds in that range, never to AvoidLocalPort,
// skips a port in use, and leaves the choice to the kernel when the range
// has none free.
func TestDialLocalPorts(t *testing.T) {
	topo := netnstest.New(t, 1)
	b := topo.Nodes[0].AddPod("b")
	acceptOne(t, b, 8080)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	dst := netip.AddrPortFrom(b.IPv4, 8080).String()
	local := &net.TCPAddr{IP: b.IPv4.AsSlice()}
	held, err := netns.Dial(ctx, b.Path(), "tcp", dst, netns.SocketOptions{Local: &net.TCPAddr{IP: b.IPv4.AsSlice(), Port: 20002}})
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	for i := 0; i < 6; i++ {
		c, err := netns.Dial(ctx, b.Path(), "tcp", dst, netns.SocketOptions{Local: local, LocalPorts: [2]uint16{20000, 20002}, AvoidLocalPort: 20000})
		if err != nil {
			t.Fatal(err)
		}
		if got := c.LocalAddr().(*net.TCPAddr).Port; got != 20001 {
			t.Errorf("dial %d: bound to %d, want 20001 (20000 avoided, 20002 in use)", i, got)
		}
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	}
	c, err := netns.Dial(ctx, b.Path(), "tcp", dst, netns.SocketOptions{Local: local, LocalPorts: [2]uint16{20002, 20002}})
	if err != nil {
		t.Fatalf("range all in use: %v", err)
	}
	if got := c.LocalAddr().(*net.TCPAddr).Port; got < 32768 {
		t.Errorf("range all in use: bound to %d, want the kernel's ephemeral choice", got)
	}
	c.Close()
}

// A dialer given LocalPorts skips a port whose tuple towards the
// destination a socket of the namespace already holds from the
// destination's side: the inbound tunnel's accepted socket of another
// connection of the same plaintext client from that port, which bind does
// not see. Here the client's address is made local in b (a local route),
// so b's sockets of a's connections stand for the tunnel's: one in
// TIME_WAIT (the server closed first, port 20000), one open (20001).
// Before, the dial bound the port, and its SYN met that socket: the
// TIME_WAIT took it as a new connection only when its timestamp looked
// newer (never from a client on another node's clock), and the open one
// answered a challenge ACK, so across nodes the dial timed out.
func TestDialLocalPortsSkipTakenTuples(t *testing.T) {
	topo := netnstest.New(t, 1)
	a, b := topo.Nodes[0].AddPod("a"), topo.Nodes[0].AddPod("b")
	acceptOne(t, b, 8080) // closes each connection first: TIME_WAIT in b
	held, err := netns.Listen(context.Background(), b.Path(), "tcp", "[::]:8081", netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { held.Close() })
	go func() {
		for {
			c, err := held.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, fam := range []struct{ client, server netip.Addr }{{a.IPv4, b.IPv4}, {a.IPv6, b.IPv6}} {
		// a's connection to 8080 from port 20000, closed by b first.
		c, err := netns.Dial(ctx, a.Path(), "tcp", netip.AddrPortFrom(fam.server, 8080).String(),
			netns.SocketOptions{Local: &net.TCPAddr{IP: fam.client.AsSlice(), Port: 20000}})
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil {
			t.Fatal("b's first close: read data")
		}
		c.Close()
		// a's connection to 8081 from port 20001, left open.
		open, err := netns.Dial(ctx, a.Path(), "tcp", netip.AddrPortFrom(fam.server, 8081).String(),
			netns.SocketOptions{Local: &net.TCPAddr{IP: fam.client.AsSlice(), Port: 20001}})
		if err != nil {
			t.Fatal(err)
		}
		defer open.Close()
		time.Sleep(100 * time.Millisecond) // the last ACKs
		bits := "/32"
		if fam.client.Is6() {
			bits = "/128"
		}
		if out, err := netnstest.Exec(ctx, b.Path(), "ip", "route", "add", "local", fam.client.String()+bits, "dev", "lo"); err != nil {
			t.Fatalf("local route: %v: %s", err, out)
		}
		for _, tc := range []struct {
			port uint16
			dst  netip.AddrPort
		}{{20000, netip.AddrPortFrom(fam.server, 8080)}, {20001, netip.AddrPortFrom(fam.server, 8081)}} {
			dctx, dcancel := context.WithTimeout(ctx, 3*time.Second)
			d, err := netns.Dial(dctx, b.Path(), "tcp", tc.dst.String(),
				netns.SocketOptions{Transparent: true, Local: &net.TCPAddr{IP: fam.client.AsSlice()}, LocalPorts: [2]uint16{tc.port, tc.port}})
			dcancel()
			if err != nil {
				t.Errorf("%s from %s: %v", tc.dst, fam.client, err)
				continue
			}
			if got := d.LocalAddr().(*net.TCPAddr).Port; got == int(tc.port) {
				t.Errorf("%s from %s: bound to %d, whose tuple b holds", tc.dst, fam.client, got)
			}
			d.(*net.TCPConn).SetLinger(0)
			d.Close()
		}
	}
}

// net.Dialer makes a new socket when its first one's bind or connect
// fails with EADDRNOTAVAIL. The thread has left the pod's namespace by
// then: that socket must not be made (it would be in the agent's own).
// Local here is an address of the agent's namespace, listened on there,
// which the pod does not have: a socket made outside the pod connects.
func TestDialRetryStaysInNamespace(t *testing.T) {
	topo := netnstest.New(t, 1)
	a := topo.Nodes[0].AddPod("a")
	var host netip.Addr
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, ia := range addrs {
		if ipn, ok := ia.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(ipn.IP); ok && ip.Unmap().Is4() && !ip.IsLoopback() && !slices.Contains(a.Addrs(), ip.Unmap()) {
				host = ip.Unmap()
				break
			}
		}
	}
	if !host.IsValid() {
		t.Skip("the test's own namespace has no IPv4 address but loopback")
	}
	l, err := net.Listen("tcp4", netip.AddrPortFrom(host, 0).String())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := netns.Dial(ctx, a.Path(), "tcp", l.Addr().String(), netns.SocketOptions{Local: &net.TCPAddr{IP: host.AsSlice()}})
	if err == nil {
		defer c.Close()
		t.Fatalf("dial from %s bound to %s, which it does not have, connected %v -> %v: the socket is not in the pod's namespace", a.Name, host, c.LocalAddr(), c.RemoteAddr())
	}
	if !errors.Is(err, unix.EADDRNOTAVAIL) {
		t.Errorf("dial bound to an address the pod does not have: %v, want EADDRNOTAVAIL", err)
	}
}

// With MPTCP asked for (GODEBUG=multipathtcp=1), a failed MPTCP dial
// falls back to a new TCP socket: it too must be in the pod's namespace,
// so a refused dial is refused.
func TestDialMultipathTCPRefused(t *testing.T) {
	topo := netnstest.New(t, 1)
	a, b := topo.Nodes[0].AddPod("a"), topo.Nodes[0].AddPod("b")
	t.Setenv("GODEBUG", "multipathtcp=1")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := netns.Dial(ctx, a.Path(), "tcp", netip.AddrPortFrom(b.IPv4, 9).String(), netns.SocketOptions{})
	if err == nil {
		c.Close()
		t.Fatalf("dial to a closed port with GODEBUG=multipathtcp=1 connected %v -> %v: the socket is not in the pod's namespace", c.LocalAddr(), c.RemoteAddr())
	}
	if !errors.Is(err, unix.ECONNREFUSED) {
		t.Errorf("dial to a closed port with GODEBUG=multipathtcp=1: %v, want connection refused", err)
	}
}
