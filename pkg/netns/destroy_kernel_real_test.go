package netns_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// captured is the loader's match (endCaptured).
func captured(s netns.TCPSocket) bool {
	m := s.Mark & testMask
	return m != testTunnel && (m == testReinject || s.Stored)
}

func newStorage(t *testing.T) (*ebpf.Map, *netns.StorageMap) {
	t.Helper()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.SkStorage, Flags: unix.BPF_F_NO_PREALLOC,
		KeySize: 4, ValueSize: 1, Key: &btf.Int{Name: "int", Size: 4, Encoding: btf.Signed}, Value: &btf.Int{Name: "u8", Size: 1}})
	if err != nil {
		t.Fatalf("create a socket-storage map: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return m, &netns.StorageMap{FD: m.FD(), ID: uint32(id)}
}

// rawConn makes a blocking TCP socket of family in pod, with mark, set up
// by setup (bind, connect), and hands it over as a net.Conn.
func rawConn(t *testing.T, pod *netnstest.Pod, family, mark int, setup func(fd int) error) net.Conn {
	t.Helper()
	var fd int
	err := netns.Do(pod.Path(), func() error {
		var err error
		if fd, err = unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, mark); err != nil {
			unix.Close(fd)
			return err
		}
		if err := setup(fd); err != nil {
			unix.Close(fd)
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "tcp")
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func connect6(dst netip.AddrPort) func(fd int) error {
	return func(fd int) error {
		return unix.Connect(fd, &unix.SockaddrInet6{Port: int(dst.Port()), Addr: dst.Addr().As16()})
	}
}

// TestDestroyTCPMapped: an app of a dual-stack socket (AF_INET6, an IPv4
// peer as ::ffff:a.b.c.d, as Java and many servers open them) has its
// captured IPv4 connections listed among the IPv6 sockets, and ended the
// same; its uncaptured ones are left alone.
func TestDestroyTCPMapped(t *testing.T) {
	a, b, accepted := heldPair(t)
	storage, sm := newStorage(t)
	dst := netip.AddrPortFrom(netip.AddrFrom16(b.IPv4.As16()), 9300)
	marked := rawConn(t, a, unix.AF_INET6, testReinject, connect6(dst))
	defer (<-accepted).Close()
	stored := rawConn(t, a, unix.AF_INET6, 0, connect6(dst))
	defer (<-accepted).Close()
	if err := storage.Update(uint32(connFD(t, stored)), uint8(1), ebpf.UpdateAny); err != nil {
		t.Fatal(err)
	}
	plain := rawConn(t, a, unix.AF_INET6, 0, connect6(dst))
	defer (<-accepted).Close()
	if l := marked.LocalAddr().(*net.TCPAddr); l.IP.To4() == nil {
		t.Fatalf("the app's socket is at %s, want an IPv4 address of an AF_INET6 socket", l)
	}

	h := openHandle(t, a)
	var seen []netns.TCPSocket
	res, err := h.DestroyTCP(context.Background(), netns.DestroyOptions{Storage: sm, Match: func(s netns.TCPSocket) bool {
		seen = append(seen, s)
		return captured(s)
	}})
	if err != nil || res.Destroyed != 2 || res.StorageErr != nil {
		t.Fatalf("%+v %v, want the 2 captured sockets ended", res, err)
	}
	for _, s := range seen {
		if !s.Local.Addr().Is4In6() || s.Remote.Addr().Unmap() != b.IPv4 {
			t.Errorf("listed %s -> %s, want IPv4-mapped addresses", s.Local, s.Remote)
		}
	}
	for name, c := range map[string]net.Conn{"marked": marked, "stored": stored} {
		if _, err := c.Write([]byte("x")); !errors.Is(err, syscall.ECONNABORTED) {
			t.Errorf("the %s dual-stack socket: write after the destroy: %v, want ECONNABORTED", name, err)
		}
	}
	if _, err := plain.Write([]byte("x")); err != nil {
		t.Errorf("the uncaptured dual-stack socket: %v, want it left alone", err)
	}
}

// TestDestroyTCPTupleReused: a listed socket closed, and its tuple taken
// by a new connection, before its turn (here, while the listing is still
// read) is gone: the new socket is not ended, whatever it carries.
func TestDestroyTCPTupleReused(t *testing.T) {
	a, b, accepted := heldPair(t)
	dst := netip.AddrPortFrom(b.IPv6, 9300)
	const port = 41234
	bindConnect := func(fd int) error {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
			return err
		}
		if err := unix.Bind(fd, &unix.SockaddrInet6{Port: port, Addr: a.IPv6.As16()}); err != nil {
			return err
		}
		return connect6(dst)(fd)
	}
	old := rawConn(t, a, unix.AF_INET6, testReinject, bindConnect)
	defer (<-accepted).Close()
	var reused net.Conn
	var reuseErr error
	h := openHandle(t, a)
	res, err := h.DestroyTCP(context.Background(), netns.DestroyOptions{Match: func(s netns.TCPSocket) bool {
		if s.Local.Port() != port || reused != nil || reuseErr != nil {
			return false
		}
		// Reset (no TIME_WAIT), and its tuple taken by a new socket,
		// marked as the old one was.
		reuseErr = old.(*net.TCPConn).SetLinger(0)
		old.Close()
		reused = rawConn(t, a, unix.AF_INET6, testReinject, bindConnect)
		return true
	}})
	if reuseErr != nil {
		t.Fatal(reuseErr)
	}
	if reused == nil {
		t.Fatal("the socket was not listed")
	}
	defer (<-accepted).Close()
	if err != nil || res.Gone != 1 || res.Destroyed != 0 {
		t.Fatalf("%+v %v, want the listed socket gone and nothing ended", res, err)
	}
	if reused.LocalAddr().String() != old.LocalAddr().String() {
		t.Fatalf("the new socket is at %s, want %s", reused.LocalAddr(), old.LocalAddr())
	}
	if _, err := reused.Write([]byte("x")); err != nil {
		t.Errorf("the new socket of the tuple: %v, want it left alone", err)
	}
}

// TestDestroyTCPClosingStates: a captured socket whose app shut its
// sending side still matters while data it wrote waits to go (FIN_WAIT1:
// sent after the detach, it would leave in plaintext), and one whose
// data all went (FIN_WAIT2) can be ended without harm: both are ended.
// A captured connection already in TIME_WAIT has nothing left to send and
// is not listed.
func TestDestroyTCPClosingStates(t *testing.T) {
	a, b, accepted := heldPair(t)
	dst := netip.AddrPortFrom(b.IPv6, 9300)
	state := func(c net.Conn) uint8 {
		info, err := unix.GetsockoptTCPInfo(connFD(t, c), unix.IPPROTO_TCP, unix.TCP_INFO)
		if err != nil {
			t.Fatal(err)
		}
		return info.State
	}
	// FIN_WAIT1: the peer reads nothing, so what the app wrote fills its
	// window, and the FIN waits behind it.
	finWait1 := rawConn(t, a, unix.AF_INET6, testReinject, connect6(dst))
	srv1 := <-accepted
	defer srv1.Close()
	_ = finWait1.SetWriteDeadline(time.Now().Add(500 * time.Millisecond))
	for {
		if _, err := finWait1.Write(make([]byte, 64<<10)); err != nil {
			break
		}
	}
	// FIN_WAIT2: the peer acknowledged everything, and keeps its side open.
	finWait2 := rawConn(t, a, unix.AF_INET6, testReinject, connect6(dst))
	srv2 := <-accepted
	defer srv2.Close()
	for _, c := range []net.Conn{finWait1, finWait2} {
		if err := c.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
	}
	netnstest.Eventually(t, 5*time.Second, func() error {
		if s1, s2 := state(finWait1), state(finWait2); s1 != 4 || s2 != 5 {
			return fmt.Errorf("states %d and %d, want FIN_WAIT1 (4) and FIN_WAIT2 (5)", s1, s2)
		}
		return nil
	})
	h := openHandle(t, a)
	res, err := h.DestroyTCP(context.Background(), netns.DestroyOptions{Match: captured})
	if err != nil || res.Destroyed != 2 {
		t.Fatalf("%+v %v, want both ended", res, err)
	}
	for name, c := range map[string]net.Conn{"FIN_WAIT1": finWait1, "FIN_WAIT2": finWait2} {
		if s := state(c); s != 7 {
			t.Errorf("the %s socket is in state %d after the destroy, want closed (7)", name, s)
		}
	}
}

// TestDestroyTCPBound: a namespace with more captured sockets than Max has
// Max ended by one call and the rest counted as left, then ended by the
// next; the uncaptured sockets listed with them are left alone. The
// sockets are the apps' closed ones (orphans in FIN_WAIT2, marked), which
// need no descriptor, so there can be many.
func TestDestroyTCPBound(t *testing.T) {
	const n, bound = 6000, 4000
	topo := netnstest.New(t, 1)
	a := topo.Nodes[0].AddPod("a")
	if _, err := netnstest.Exec(context.Background(), a.Path(), "sysctl", "-qw", "net.core.somaxconn=8192"); err != nil {
		t.Fatal(err)
	}
	// The peer never accepts: its sockets wait in the listener's queue,
	// no descriptor either.
	var ln int
	err := netns.Do(a.Path(), func() error {
		var err error
		if ln, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		if err := unix.Bind(ln, &unix.SockaddrInet4{Port: 9300, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
			return err
		}
		if err := unix.Listen(ln, n+10); err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, testReinject); err != nil {
				return err
			}
			if err := unix.Connect(fd, &unix.SockaddrInet4{Port: 9300, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
				return fmt.Errorf("connection %d: %w", i, err)
			}
			unix.Close(fd)
		}
		return nil
	})
	if ln > 0 {
		defer unix.Close(ln)
	}
	if err != nil {
		t.Fatal(err)
	}
	h := openHandle(t, a)
	listed := 0
	match := func(s netns.TCPSocket) bool {
		listed++
		return captured(s)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	res, err := h.DestroyTCP(ctx, netns.DestroyOptions{Match: match, Max: bound})
	took := time.Since(start)
	if err != nil || res.Destroyed != bound || res.Left != n-bound {
		t.Fatalf("%+v %v, want %d ended and %d left", res, err, bound, n-bound)
	}
	if listed < 2*n {
		t.Errorf("%d sockets listed, want both ends of %d connections", listed, n)
	}
	t.Logf("%d sockets ended in %v, %d others listed", res.Destroyed, took, listed-n)
	res, err = h.DestroyTCP(ctx, netns.DestroyOptions{Match: match, Max: bound})
	if err != nil || res.Destroyed != n-bound || res.Left != 0 {
		t.Fatalf("second call: %+v %v, want the %d left ended", res, err, n-bound)
	}
}
