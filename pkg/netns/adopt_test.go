package netns

import (
	"context"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestAdoptKeepsKeepalive: a listener passed over from another process
// (here: rebuilt from a duplicate of its descriptor, as a successor agent
// gets it) accepts connections with the keepalive timings it was opened
// with once adopted. Without Adopt the runtime gives each accepted
// connection its own 15 s default, which the test checks too, so that it
// can fail.
func TestAdoptKeepsKeepalive(t *testing.T) {
	ka := &KeepAlive{Idle: 180 * time.Second, Interval: 20 * time.Second, Count: 6, UserTimeout: 300 * time.Second}
	opts := SocketOptions{KeepAlive: ka}
	orig, err := Listen(context.Background(), "/proc/self/ns/net", "tcp", "127.0.0.1:0", opts)
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	passed := func() net.Listener {
		f, err := orig.(*net.TCPListener).File()
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		l, err := net.FileListener(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		return l
	}
	// timings accepts one connection on l: its idle, interval, count and
	// user timeout (ms).
	timings := func(l net.Listener) [4]int {
		t.Helper()
		// The handshake completes in the listener's queue: no goroutine.
		d, err := net.Dial("tcp", orig.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		c, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		rc, err := c.(*net.TCPConn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var got [4]int
		_ = rc.Control(func(fd uintptr) {
			for i, opt := range []int{unix.TCP_KEEPIDLE, unix.TCP_KEEPINTVL, unix.TCP_KEEPCNT, unix.TCP_USER_TIMEOUT} {
				got[i], _ = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, opt)
			}
		})
		return got
	}
	want := [4]int{180, 20, 6, 300_000}
	if got := timings(passed()); got == want {
		t.Errorf("a file listener's connection already has %v: the runtime no longer sets its own keepalive, and the check below proves nothing", got)
	}
	adopted, err := Adopt(passed(), opts)
	if err != nil {
		t.Fatal(err)
	}
	if got := timings(adopted); got != want {
		t.Errorf("an adopted listener's connection has keepalive %v, want %v", got, want)
	}
}
