package netnstest

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/bpf"
	"github.com/redirector-mesh/redirector/pkg/netns"
)

// TestSockopsAccelerationTupleReuse: the server half-closes first, so the
// tunnel's socket sends its FIN first and, at the app's FIN, goes to
// TIME_WAIT while the tunnel still has the app's last bytes to read (the
// server reads slowly, the tunnel waits on its HBONE window). The app's next
// connection from the same port to the same server has the same key:
// pairing its tunnel socket must not throw away what the old one holds.
func TestSockopsAccelerationTupleReuse(t *testing.T) {
	ms, client, server := sockopsPair(t)
	got := make(chan int64, 2)
	release := make(chan struct{})
	ServeTCP(t, server, 9700, func(c net.Conn) {
		c.(*net.TCPConn).CloseWrite()
		<-release
		n, _ := io.Copy(io.Discard, c)
		got <- n
	})
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	consumed, err := ebpf.LoadPinnedMap(filepath.Join(ms.agents[0].BPFRoot, bpf.SockopsMapRdSockConsumed), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer consumed.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dst := netip.AddrPortFrom(server.IPv4, 9700)
	c := dialPod(t, ctx, client, server, 9700)
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil { // the server's FIN
		t.Fatal(err)
	}
	port := c.LocalAddr().(*net.TCPAddr).Port
	key := tunnelKey(t, c.(*net.TCPConn), dst, port)
	// Send until the tunnel stops reading (its reports stand still for 20
	// sends; it reports every 8), then a little more, within the budget:
	// redirected, waiting in the tunnel socket's queue.
	chunk := make([]byte, 8<<10)
	var sent int64
	var last uint64
	still := 0
	for still < 20 && sent < 64<<20 {
		if _, err := c.Write(chunk); err != nil {
			t.Fatal(err)
		}
		sent += int64(len(chunk))
		time.Sleep(time.Millisecond)
		var r uint64
		consumed.Lookup(&key, &r)
		if r == last {
			still++
		} else {
			last, still = r, 0
		}
		if still == 20 { // a pause, or the window spent? Spent if it lasts.
			time.Sleep(200 * time.Millisecond)
			consumed.Lookup(&key, &r)
			if r != last {
				last, still = r, 0
			}
		}
	}
	extra := 0
	for uint64(sent)-last < 128<<10 {
		c.Write(chunk)
		sent += int64(len(chunk))
		extra++
	}
	d := accelTotals(t, ms)
	t.Logf("sent %d, tunnel reported %d read, then %d more chunks; counters %+v", sent, last, extra, d)
	c.Close()
	time.Sleep(50 * time.Millisecond)
	// The same port to the same server: the same key.
	var c2 net.Conn
	Eventually(t, 10*time.Second, func() error {
		var err error
		c2, err = netns.Dial(ctx, client.Path(), "tcp4", dst.String(),
			netns.SocketOptions{ReuseAddr: true, Local: &net.TCPAddr{IP: client.IPv4.AsSlice(), Port: port}})
		return err
	})
	c2.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.Copy(io.Discard, c2); err != nil {
		t.Fatal(err)
	}
	if _, err := c2.Write([]byte("second")); err != nil {
		t.Fatal(err)
	}
	c2.Close()
	// Left unpaired while the first's socket is open (its relay waits on
	// the server).
	if u := accelTotals(t, ms).Sub(d).Unpaired; u == 0 {
		t.Error("the second connection's tunnel socket took the key of the first's, still open, or was not counted")
	}
	close(release)
	want := map[int64]bool{sent: true, int64(len("second")): true}
	for range 2 {
		select {
		case n := <-got:
			if !want[n] {
				t.Errorf("the server read %d bytes on a connection; the app sent %d on the first and %d on the second", n, sent, len("second"))
			}
			delete(want, n)
		case <-time.After(30 * time.Second):
			t.Fatal("the server read nothing")
		}
	}
}

// tunnelKey is the sockops key of the tunnel's socket at the other end of
// the app's connection c from port to dst.
func tunnelKey(t *testing.T, c *net.TCPConn, dst netip.AddrPort, port int) bpf.SockopsSockKey {
	t.Helper()
	order := func(p uint16) uint16 {
		var b [2]byte
		binary.BigEndian.PutUint16(b[:], p)
		return binary.NativeEndian.Uint16(b[:])
	}
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var cookie uint64
	var serr error
	rc.Control(func(fd uintptr) { cookie, serr = unix.GetsockoptUint64(int(fd), unix.SOL_SOCKET, unix.SO_NETNS_COOKIE) })
	if serr != nil {
		t.Fatal(serr)
	}
	local := c.LocalAddr().(*net.TCPAddr).AddrPort().Addr()
	return bpf.SockopsSockKey{Local: netip.AddrFrom16(dst.Addr().As16()).As16(), Remote: local.As16(),
		Lport: order(dst.Port()), Rport: order(uint16(port)), Netns: cookie}
}
