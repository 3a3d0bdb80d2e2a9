package netns_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// Marks as the loader's defaults: the capture's reinject mark and the
// tunnel's, compared under the mask.
const (
	testReinject = 0x111
	testTunnel   = 0x539
	testMask     = 0xfff
)

// destroyConn is one connection of TestDestroyTCP: how its socket is set
// up, and whether DestroyTCP must end it.
type destroyConn struct {
	name   string
	dst    netip.Addr
	mark   int
	stored bool // given an entry in the test's socket-storage map
	// closeWait: the server closes its side first, so the socket is in
	// CLOSE_WAIT, as an app's whose relay ended with a FIN.
	closeWait bool
	end       bool
	c         net.Conn
}

// TestDestroyTCP: DestroyTCP ends exactly the sockets its match picks (the
// reinject mark under the mask, other bits of the mark whatever they are,
// or an entry in a socket-storage map), IPv4 and IPv6, established or in
// CLOSE_WAIT: their next write fails with ECONNABORTED and nothing more is
// sent. Unmarked sockets, tunnel-marked ones and sockets of another
// namespace are left alone, and still carry data, and so are marked
// listeners and connects not answered yet. Max bounds what one call
// ends, the rest counted as left, and the context bounds its time.
func TestDestroyTCP(t *testing.T) {
	topo := netnstest.New(t, 1)
	a, b, other := topo.Nodes[0].AddPod("a"), topo.Nodes[0].AddPod("b"), topo.Nodes[0].AddPod("other")
	accepted := serveHold(t, b, 9300)

	storage, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.SkStorage, Flags: unix.BPF_F_NO_PREALLOC,
		KeySize: 4, ValueSize: 1, Key: &btf.Int{Name: "int", Size: 4, Encoding: btf.Signed}, Value: &btf.Int{Name: "u8", Size: 1}})
	if err != nil {
		t.Fatalf("create a socket-storage map: %v", err)
	}
	defer storage.Close()
	info, err := storage.Info()
	if err != nil {
		t.Fatal(err)
	}
	mapID, _ := info.ID()

	var conns []*destroyConn
	for _, dst := range []netip.Addr{b.IPv4, b.IPv6} {
		conns = append(conns,
			&destroyConn{name: "reinject mark", dst: dst, mark: testReinject, end: true},
			&destroyConn{name: "reinject mark, other bits", dst: dst, mark: 0x7000 | testReinject, end: true},
			&destroyConn{name: "reinject mark, CLOSE_WAIT", dst: dst, mark: testReinject, closeWait: true, end: true},
			&destroyConn{name: "stored", dst: dst, stored: true, end: true},
			&destroyConn{name: "stored, CLOSE_WAIT", dst: dst, stored: true, closeWait: true, end: true},
			&destroyConn{name: "unmarked", dst: dst},
			&destroyConn{name: "unmarked, CLOSE_WAIT", dst: dst, closeWait: true},
			&destroyConn{name: "tunnel mark", dst: dst, mark: testTunnel, stored: true},
			&destroyConn{name: "other bits only", dst: dst, mark: 0x1000},
		)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, c := range conns {
		c.c, err = netns.Dial(ctx, a.Path(), "tcp", netip.AddrPortFrom(c.dst, 9300).String(), netns.SocketOptions{Mark: uint32(c.mark)})
		if err != nil {
			t.Fatal(err)
		}
		defer c.c.Close()
		srv := <-accepted
		defer srv.Close()
		if c.stored {
			if err := storage.Update(uint32(connFD(t, c.c)), uint8(1), ebpf.UpdateAny); err != nil {
				t.Fatalf("storage entry for %s: %v", c.name, err)
			}
		}
		if c.closeWait {
			srv.Close()
		}
	}
	// The same kind of sockets in another namespace are not a's.
	otherConn, err := netns.Dial(ctx, other.Path(), "tcp", netip.AddrPortFrom(b.IPv4, 9300).String(), netns.SocketOptions{Mark: testReinject})
	if err != nil {
		t.Fatal(err)
	}
	defer otherConn.Close()
	defer (<-accepted).Close()
	// A listener and a connect not answered yet, both marked and stored,
	// are no connection to end.
	idle := []struct {
		name  string
		fd    int
		state uint8
	}{
		{"listener", markedSocket(t, a, storage, func(fd int) error {
			if err := unix.Bind(fd, &unix.SockaddrInet4{Port: 9301}); err != nil {
				return err
			}
			return unix.Listen(fd, 8)
		}), 10},
		{"connect in progress", markedSocket(t, a, storage, func(fd int) error {
			// No one has this address: the SYN waits for ARP.
			addr := a.IPv4.As4()
			addr[3] = 250
			if err := unix.Connect(fd, &unix.SockaddrInet4{Port: 9300, Addr: addr}); !errors.Is(err, unix.EINPROGRESS) {
				return fmt.Errorf("connect: %v, want EINPROGRESS", err)
			}
			return nil
		}), 2},
	}
	time.Sleep(100 * time.Millisecond) // the FINs arrive

	h := openHandle(t, a)
	var seen []netns.TCPSocket
	match := func(s netns.TCPSocket) bool {
		seen = append(seen, s)
		if s.Mark&testMask == testTunnel {
			return false
		}
		return s.Mark&testMask == testReinject || s.Stored
	}
	want := 0
	for _, c := range conns {
		if c.end {
			want++
		}
	}

	// A deadline come and gone: nothing is ended, and the error says why.
	done, stop := context.WithCancel(ctx)
	stop()
	if res, err := h.DestroyTCP(done, netns.DestroyOptions{Match: match}); !errors.Is(err, context.Canceled) || res.Destroyed != 0 {
		t.Fatalf("with its context ended: %+v, %v; want nothing ended and the context's error", res, err)
	}
	// Bounded: one call ends at most Max, and counts the rest.
	res, err := h.DestroyTCP(ctx, netns.DestroyOptions{Storage: &netns.StorageMap{FD: storage.FD(), ID: uint32(mapID)}, Match: match, Max: 3})
	if err != nil {
		t.Fatal(err)
	}
	if res.StorageErr != nil {
		t.Fatalf("socket storage refused: %v", res.StorageErr)
	}
	if res.Destroyed != 3 || res.Left != want-3 {
		t.Fatalf("with Max 3: %+v, want 3 destroyed and %d left", res, want-3)
	}
	seen = nil
	res, err = h.DestroyTCP(ctx, netns.DestroyOptions{Storage: &netns.StorageMap{FD: storage.FD(), ID: uint32(mapID)}, Match: match})
	if err != nil {
		t.Fatal(err)
	}
	if res.Destroyed != want-3 || res.Left != 0 || res.Failed != 0 {
		t.Fatalf("second call: %+v, want %d destroyed", res, want-3)
	}
	// Every socket of a's was seen, with its mark; none of the other
	// namespace's.
	if len(seen) != len(conns)-3 {
		t.Errorf("the match saw %d sockets, want %d: %+v", len(seen), len(conns)-3, seen)
	}
	for _, s := range seen {
		if s.Local.Addr().Unmap() != a.IPv4 && s.Local.Addr() != a.IPv6 {
			t.Errorf("the match saw a socket of another namespace: %+v", s)
		}
	}

	for _, c := range conns {
		_ = c.c.SetWriteDeadline(time.Now().Add(2 * time.Second))
		_, err := c.c.Write([]byte("after"))
		switch {
		case c.end && !errors.Is(err, syscall.ECONNABORTED):
			t.Errorf("%s to %s: write after the destroy: %v, want ECONNABORTED", c.name, c.dst, err)
		case !c.end && err != nil:
			t.Errorf("%s to %s: write: %v, want it left alone", c.name, c.dst, err)
		}
	}
	for _, s := range idle {
		info, err := unix.GetsockoptTCPInfo(s.fd, unix.IPPROTO_TCP, unix.TCP_INFO)
		if err != nil || info.State != s.state {
			t.Errorf("the marked %s: state %d (%v), want %d, left alone", s.name, info.State, err, s.state)
		}
	}
	if _, err := otherConn.Write([]byte("after")); err != nil {
		t.Errorf("another namespace's marked socket: %v, want it left alone", err)
	}
}

// TestDestroyTCPWithoutStorage: a storage map the kernel will not read
// (not socket storage) is reported, and the sockets are matched on the
// rest, not left alone.
func TestDestroyTCPWithoutStorage(t *testing.T) {
	a, b, accepted := heldPair(t)
	notStorage, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer notStorage.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := netns.Dial(ctx, a.Path(), "tcp", netip.AddrPortFrom(b.IPv6, 9300).String(), netns.SocketOptions{Mark: testReinject})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	defer (<-accepted).Close()
	h := openHandle(t, a)
	res, err := h.DestroyTCP(ctx, netns.DestroyOptions{Storage: &netns.StorageMap{FD: notStorage.FD(), ID: 1},
		Match: func(s netns.TCPSocket) bool { return s.Mark&testMask == testReinject }})
	if err != nil {
		t.Fatal(err)
	}
	if res.StorageErr == nil || res.Destroyed != 1 {
		t.Fatalf("%+v, want the storage refused and the marked socket destroyed", res)
	}
	if _, err := c.Write([]byte("x")); !errors.Is(err, syscall.ECONNABORTED) {
		t.Fatalf("write after the destroy: %v, want ECONNABORTED", err)
	}
}

// markedSocket makes a non-blocking IPv4 TCP socket in pod carrying the
// reinject mark and an entry in storage, and sets it up with setup; it is
// closed when the test ends.
func markedSocket(t *testing.T, pod *netnstest.Pod, storage *ebpf.Map, setup func(fd int) error) int {
	t.Helper()
	var fd int
	err := netns.Do(pod.Path(), func() error {
		var err error
		if fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, testReinject); err != nil {
			return err
		}
		return setup(fd)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := storage.Update(uint32(fd), uint8(1), ebpf.UpdateAny); err != nil {
		t.Fatalf("storage entry: %v", err)
	}
	return fd
}

// serveHold accepts on port in pod (both families) and hands each
// connection to the test, which closes it.
func serveHold(t *testing.T, pod *netnstest.Pod, port int) <-chan net.Conn {
	t.Helper()
	l, err := netns.Listen(context.Background(), pod.Path(), "tcp", fmt.Sprintf("[::]:%d", port), netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	out := make(chan net.Conn, 64)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			out <- c
		}
	}()
	return out
}

// heldPair is a node with two pods: a, whose sockets a test ends, and b,
// which holds open every connection to its port 9300 (handed on accepted),
// so that only a's side can end one.
func heldPair(t *testing.T) (a, b *netnstest.Pod, accepted <-chan net.Conn) {
	t.Helper()
	node := netnstest.New(t, 1).Nodes[0]
	a, b = node.AddPod("a"), node.AddPod("b")
	return a, b, serveHold(t, b, 9300)
}

// openHandle opens pod's namespace, where DestroyTCP lists and ends
// sockets; the handle closes when the test ends.
func openHandle(t *testing.T, pod *netnstest.Pod) *netns.Handle {
	t.Helper()
	h, err := netns.Open(pod.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// connFD is c's socket descriptor (valid while c is open).
func connFD(t *testing.T, c net.Conn) int {
	t.Helper()
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var fd int
	if err := rc.Control(func(f uintptr) { fd = int(f) }); err != nil {
		t.Fatal(err)
	}
	return fd
}
