package tunnel

import (
	"net"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestInPodSocketCongestion: a socket to a pod's app gets inPodCongestion whatever the node's
// default (this machine's is BBR, which paces every write), and a socket left alone keeps it.
func TestInPodSocketCongestion(t *testing.T) {
	avail, err := os.ReadFile("/proc/sys/net/ipv4/tcp_available_congestion_control")
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	tuned, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer tuned.Close()
	plain, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	tuneInPodSocket(tuned)
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
	def, err := os.ReadFile("/proc/sys/net/ipv4/tcp_congestion_control")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := congestion(plain), strings.TrimSpace(string(def)); got != want {
		t.Errorf("an untuned socket has %q, want the default %q", got, want)
	}
	want := strings.TrimSpace(string(def))
	if strings.Contains(" "+strings.TrimSpace(string(avail))+" ", " "+inPodCongestion+" ") {
		want = inPodCongestion
	}
	if got := congestion(tuned); got != want {
		t.Errorf("a socket to an app has congestion control %q, want %q", got, want)
	}
}
