package netnstest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// TestDeletedPodSealed: a meshed pod gone from its source while its network
// namespace lives, as a force-deleted pod is (`--grace-period=0 --force`
// removes the object at once; the kubelet kills the containers after). The
// stand-in for the API server and the kubelet is the manifest the agents
// read: the pod is dropped from it, its namespace left running. Before the
// fix the agent detached it like a pod that opted out, and what its apps
// opened until they were killed left the node in plaintext. Now it is
// sealed: its capture stays and its tunnel is stopped and served again, so
// its open connection is reset and its new ones are refused, to meshed and
// unmeshed peers alike, as are a meshed client's connections to it, and
// nothing of it crosses its interface in the clear. Listed again, it is
// served again; its namespace gone, it is unenrolled.
func TestDeletedPodSealed(t *testing.T) {
	ms, client, server, plain := meshed(t)
	agent := ms.agents[0]
	const marker = "sealed-plaintext-marker-91c4"

	var mu sync.Mutex
	var got []string // what the apps read, in the clear
	record := func(c net.Conn) {
		buf := make([]byte, 4096)
		for {
			n, err := c.Read(buf)
			if n > 0 {
				mu.Lock()
				got = append(got, string(buf[:n]))
				mu.Unlock()
			}
			if err != nil {
				return
			}
		}
	}
	ServeTCP(t, server, 9200, record)
	ServeTCP(t, plain, 9300, record)
	meshedDst := netip.AddrPortFrom(server.IPv4, 9200)
	plainDst := netip.AddrPortFrom(plain.IPv4, 9300)
	dial := func(dst netip.AddrPort, timeout time.Duration) (net.Conn, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		return netns.Dial(ctx, client.Path(), "tcp", dst.String(), netns.SocketOptions{})
	}
	withoutClient := func() {
		t.Helper()
		m := &Manifest{}
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
			Pod(server, "mesh", "server-sa", "app=server").
			Pod(plain, "plain", "default")
		if err := m.Write(ms.manifest); err != nil {
			t.Fatal(err)
		}
	}
	metric := func(name string, labels ...string) float64 {
		return metricSum(scrape(t, agent, "http://127.0.0.1:15020/metrics"), name, labels...)
	}

	var open net.Conn
	Eventually(t, 10*time.Second, func() error {
		var err error
		open, err = dial(meshedDst, 3*time.Second)
		return err
	})
	defer open.Close()
	if _, err := open.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	stopCapture := Capture(t, client.Node.Path(), client.HostVeth)

	sealed := strings.Count(agent.Log(), "pod sealed")
	withoutClient()
	Eventually(t, 15*time.Second, func() error {
		if strings.Count(agent.Log(), "pod sealed") == sealed && !strings.Contains(agent.Log(), "pod unenrolled") {
			return fmt.Errorf("the client pod is not reported sealed")
		}
		return nil
	})
	if strings.Contains(agent.Log(), "pod unenrolled") {
		t.Error("the deleted pod was unenrolled while its namespace lives")
	}
	if n := metric("redirector_pods_sealed"); n != 1 {
		t.Errorf("redirector_pods_sealed = %v, want 1", n)
	}

	// Its open connection was reset with the tunnel's stop: writes fail.
	Eventually(t, 10*time.Second, func() error {
		_ = open.SetWriteDeadline(time.Now().Add(time.Second))
		if _, err := open.Write([]byte(marker)); err == nil {
			return fmt.Errorf("the open connection still takes writes")
		}
		return nil
	})
	// New connections, to a meshed and to an unmeshed peer, are refused:
	// the pod has no identity any more. Their bytes, if a connection
	// were made, would carry the marker.
	refused := metric("redirector_fail_closed_total", `reason="unknown_source"`)
	for _, dst := range []netip.AddrPort{meshedDst, plainDst} {
		start := time.Now()
		c, err := dial(dst, 3*time.Second)
		if err == nil {
			_, err = c.Write([]byte(marker))
			if err == nil {
				_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
				_, err = c.Read(make([]byte, 1))
			}
			c.Close()
		}
		if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("the sealed pod's connection to %s was carried: %v", dst, err)
		}
		t.Logf("the sealed pod's connection to %s: %v after %s", dst, err, time.Since(start).Round(time.Millisecond))
	}
	if grew := metric("redirector_fail_closed_total", `reason="unknown_source"`) - refused; grew < 2 {
		t.Errorf("fail_closed{unknown_source} grew by %v, want both connections refused and counted", grew)
	}
	// A meshed client's connection to it is refused as well. The pod is
	// no workload for the client's node either, so that request crosses
	// the wire in plaintext, as to any address outside the mesh: it
	// carries its own marker, which the capture does not look for.
	const inbound = "sealed-inbound-request-3e07"
	ServeTCP(t, client, 9400, record)
	if out, err := Curl(server, URL(client.IPv4, 9400)+inbound); err == nil {
		t.Errorf("a meshed client reached the sealed pod's app: %q", out)
	}
	time.Sleep(300 * time.Millisecond)
	if seen := stopCapture(); bytes.Contains(seen, []byte(marker)) {
		t.Fatal("the sealed pod's bytes crossed its interface in plaintext")
	}
	mu.Lock()
	for _, s := range got {
		if strings.Contains(s, marker) {
			t.Errorf("an app read the sealed pod's bytes: %q", s)
		}
		if strings.Contains(s, inbound) {
			t.Errorf("the sealed pod's app read a request to it: %q", s)
		}
	}
	mu.Unlock()

	// Listed again (the same pod, its uid unchanged), it is served again.
	ms.rewrite(t, client, server, plain)
	Eventually(t, 15*time.Second, func() error {
		c, err := dial(meshedDst, 2*time.Second)
		if err != nil {
			return err
		}
		c.Close()
		if n := metric("redirector_pods_sealed"); n != 0 {
			return fmt.Errorf("redirector_pods_sealed = %v, want 0", n)
		}
		return nil
	})
	out, err := Curl(client, URL(server.IPv4, 8080))
	if err != nil || !strings.Contains(out, "server peer="+client.IPv4.String()) {
		t.Fatalf("the pod listed again reached the server with %q, %v; want it meshed", out, err)
	}

	// Gone again, then its namespace too: unenrolled, nothing left sealed.
	sealed = strings.Count(agent.Log(), "pod sealed")
	withoutClient()
	Eventually(t, 15*time.Second, func() error {
		if strings.Count(agent.Log(), "pod sealed") == sealed {
			return fmt.Errorf("the client pod is not reported sealed again")
		}
		return nil
	})
	// Detached by the sweep ("sealed pod unenrolled") or by the next pass
	// ("pod unenrolled"), whichever comes first.
	unenrolled := strings.Count(agent.Log(), "pod unenrolled")
	if out, err := exec.Command("ip", "netns", "del", client.NS).CombinedOutput(); err != nil {
		t.Fatalf("ip netns del %s: %v: %s", client.NS, err, out)
	}
	Eventually(t, 10*time.Second, func() error {
		if strings.Count(agent.Log(), "pod unenrolled") == unenrolled {
			return fmt.Errorf("the sealed pod is not unenrolled once its namespace went")
		}
		if n := metric("redirector_pods_sealed"); n != 0 {
			return fmt.Errorf("redirector_pods_sealed = %v, want 0", n)
		}
		if n := metric("redirector_enrolled_pods"); n != 0 {
			return fmt.Errorf("redirector_enrolled_pods = %v, want 0", n)
		}
		return nil
	})
}
