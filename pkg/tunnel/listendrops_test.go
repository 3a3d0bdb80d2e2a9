package tunnel

import (
	"context"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// backlogListener listens on 127.0.0.1 with an accept queue of one, and
// is never accepted from: the third connection finds it full.
func backlogListener(t *testing.T) net.Listener {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "backlog listener")
	defer f.Close()
	l, err := net.FileListener(f)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// overflow connects to l until the kernel counts a drop at it.
func overflow(t *testing.T, l net.Listener) uint64 {
	t.Helper()
	var n uint64
	waitfor.Until(t, "a connection dropped at the full accept queue", func() bool {
		c, err := net.DialTimeout("tcp", l.Addr().String(), 50*time.Millisecond)
		if err == nil {
			t.Cleanup(func() { c.Close() })
		}
		n, err = socketDrops(l)
		if err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
	return n
}

// A listener's full accept queue turns SYNs away in the kernel, where the
// agent never sees them: the clients retransmit and wait (1 s, then 3 s, …)
// or give up. The pods' listeners' drop counts are exported, and a pod that
// stops keeps its count in the sums, so they only grow.
func TestListenerDropsCounted(t *testing.T) {
	tun := newTestTunnel(t, nil)
	p := testPod(tun, "uid-a", netip.MustParseAddr("127.0.0.1"))
	var err error
	if p.hbone, err = tun.newHBONEServer(p); err != nil {
		t.Fatal(err)
	}
	out, in := backlogListener(t), backlogListener(t)
	p.mu.Lock()
	p.lns = []net.Listener{out, in}
	p.mu.Unlock()

	if d := tun.ListenerDrops(); d != (ListenerDrops{}) {
		t.Fatalf("drops before any connection: %+v", d)
	}
	n := overflow(t, in)
	d := tun.ListenerDrops()
	if d.Inbound < n || d.Outbound != 0 || d.HBONE != 0 || d.DNS != 0 {
		t.Fatalf("drops = %+v, want inbound >= %d and nothing else", d, n)
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := tun.StopPod(ctx, "uid-a"); err != nil {
		t.Fatal(err)
	}
	if after := tun.ListenerDrops(); after.Inbound < d.Inbound {
		t.Fatalf("drops after the pod stopped = %+v, fell from %+v", after, d)
	}
}

// A DNS socket whose receive queue is full drops the datagrams past it, and
// the count says so.
func TestSocketDropsOfFullDatagramQueue(t *testing.T) {
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.SetReadBuffer(1); err != nil { // the kernel's minimum
		t.Fatal(err)
	}
	w, err := net.DialUDP("udp4", nil, c.LocalAddr().(*net.UDPAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	for range 64 {
		if _, err := w.Write(make([]byte, 512)); err != nil {
			t.Fatal(err)
		}
	}
	n, err := socketDrops(c)
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatal("64 datagrams into a minimal receive buffer, none counted as dropped")
	}
}
