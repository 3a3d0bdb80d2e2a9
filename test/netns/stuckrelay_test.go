package netnstest

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"
)

// TestUnenrollWithStuckRelay: a meshed app that writes to a plaintext
// server (outside the mesh) which stops reading, and sends nothing, leaves
// its relay blocked on the upstream socket. Before the fix the pod's stop
// closed only the app's side, then waited for the relay for ever: the pod
// was never reported unenrolled, its outbound slot stayed, and the
// reconciler (its worker for that pod, and the read lock a full pass
// waits for) hung, so the pod was never enrolled again either.
func TestUnenrollWithStuckRelay(t *testing.T) {
	ms, client, server, plain := meshed(t)
	stop := make(chan struct{})
	defer close(stop)
	ServeTCP(t, plain, 9100, func(c net.Conn) {
		_ = c.(*net.TCPConn).SetReadBuffer(4 << 10)
		<-stop
	})
	app := dialApp(t, client, netip.AddrPortFrom(plain.IPv4, 9100))
	outbound := func() float64 {
		return metricSum(scrape(t, ms.agents[0], "http://127.0.0.1:15020/metrics"), "redirector_tunnel_open_connections", `listener="outbound"`)
	}
	if n := outbound(); n != 1 {
		t.Fatalf("open outbound connections %v, want 1 (the captured one)", n)
	}
	buf := make([]byte, 64<<10)
	for deadline := time.Now().Add(20 * time.Second); ; {
		if time.Now().After(deadline) {
			t.Fatal("writes to a server that reads nothing never blocked")
		}
		_ = app.SetWriteDeadline(time.Now().Add(300 * time.Millisecond))
		if _, err := app.Write(buf); errors.Is(err, os.ErrDeadlineExceeded) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
	}

	// Unenroll the client pod (opt-out label), then enroll it again.
	unenrolled := strings.Count(ms.agents[0].Log(), "pod unenrolled")
	m := &Manifest{}
	m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
		Pod(client, "mesh", "client-sa", "app=client", "istio.io/dataplane-mode=none").
		Pod(server, "mesh", "server-sa", "app=server").
		Pod(plain, "plain", "default")
	if err := m.Write(ms.manifest); err != nil {
		t.Fatal(err)
	}
	Eventually(t, 15*time.Second, func() error {
		if n := strings.Count(ms.agents[0].Log(), "pod unenrolled"); n == unenrolled {
			return errors.New("the client pod is not reported unenrolled")
		}
		if n := outbound(); n != 0 {
			return fmt.Errorf("%v outbound connections still open", n)
		}
		return nil
	})
	enrolled := strings.Count(ms.agents[0].Log(), "pod enrolled")
	ms.rewrite(t, client, server, plain)
	Eventually(t, 15*time.Second, func() error {
		if strings.Count(ms.agents[0].Log(), "pod enrolled") == enrolled {
			return errors.New("the client pod is not enrolled again")
		}
		out, err := Curl(client, URL(server.IPv4, 8080))
		if err != nil {
			return err
		}
		if !strings.Contains(out, "server peer="+client.IPv4.String()) {
			return fmt.Errorf("unexpected answer %q", out)
		}
		return nil
	})
}
