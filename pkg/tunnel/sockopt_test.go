package tunnel

import (
	"bytes"
	"context"
	"net"
	"os"
	"strings"
	"testing"

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
		name, err := socketCongestion(c.(*net.TCPConn))
		if err != nil {
			t.Fatal(err)
		}
		return name
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

// TestCheckCongestionWarnsOnce: an HBONE socket without the algorithm the
// setting names is logged, once; one with it is not.
func TestCheckCongestionWarnsOnce(t *testing.T) {
	var log bytes.Buffer
	tun := newTestTunnel(t, &log)
	tun.cfg.HBONECongestion = "reno"
	listen := func(algo string) net.Listener {
		t.Helper()
		l, err := netns.Listen(context.Background(), "/proc/self/ns/net", "tcp", "127.0.0.1:0", netns.SocketOptions{Congestion: algo})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		return l
	}
	tun.checkCongestion(listen("reno"), "with the setting")
	if log.Len() != 0 {
		t.Fatalf("a socket using the named algorithm was logged: %s", log.String())
	}
	other := "cubic"
	if def, _ := os.ReadFile("/proc/sys/net/ipv4/tcp_congestion_control"); strings.TrimSpace(string(def)) != "reno" {
		other = "" // the namespace's default, not reno
	}
	tun.checkCongestion(listen(other), "first")
	tun.checkCongestion(listen(other), "second")
	if got := strings.Count(log.String(), "does not use the congestion control"); got != 1 {
		t.Fatalf("warned %d times, want once: %s", got, log.String())
	}
	if !strings.Contains(log.String(), "want=reno") || !strings.Contains(log.String(), "socket=first") {
		t.Errorf("warning does not name what was asked for and where: %s", log.String())
	}
}
