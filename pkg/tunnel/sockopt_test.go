package tunnel

import (
	"context"
	"net"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// TestInPodSocketCongestion: the sockets to a pod's apps (a dial to the app, and what a
// listener for the apps accepts) get inPodCongestion from their creation whatever the node's
// default (this machine's is BBR, which paces every write); other sockets keep the default.
func TestInPodSocketCongestion(t *testing.T) {
	def, err := os.ReadFile("/proc/sys/net/ipv4/tcp_congestion_control")
	if err != nil {
		t.Fatal(err)
	}
	want := inPodCongestionName()
	if want == "" {
		want = strings.TrimSpace(string(def))
	}
	const self = "/proc/self/ns/net"
	ctx := context.Background()
	l, err := netns.Listen(ctx, self, "tcp", "127.0.0.1:0", netns.SocketOptions{Congestion: inPodCongestionName()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	plain, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	a, ok := <-accepted
	if !ok {
		t.Fatal("accept failed")
	}
	defer a.Close()
	dialled, err := netns.Dial(ctx, self, "tcp", l.Addr().String(), netns.SocketOptions{Congestion: inPodCongestionName()})
	if err != nil {
		t.Fatal(err)
	}
	defer dialled.Close()

	congestion := func(c net.Conn) string {
		rc, err := c.(*net.TCPConn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var name string
		_ = rc.Control(func(fd uintptr) {
			name, err = unix.GetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION)
		})
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimRight(name, "\x00")
	}
	if got, d := congestion(plain), strings.TrimSpace(string(def)); got != d {
		t.Errorf("a socket without the option has %q, want the default %q", got, d)
	}
	if got := congestion(a); got != want {
		t.Errorf("a socket accepted from an app has %q, want %q", got, want)
	}
	if got := congestion(dialled); got != want {
		t.Errorf("a dial to an app has %q, want %q", got, want)
	}
}
