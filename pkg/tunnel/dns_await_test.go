package tunnel

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/dnsproxy"
	"github.com/redirector-mesh/redirector/pkg/netns"
)

// TestDNSSocketTakenOnceFree: a process in the pod that holds UDP port
// 15053 when the agent serves the pod (an app of its own there; or, once
// the DNS socket leaves its reuseport group, a predecessor whose socket
// was not handed over) keeps the agent from opening the pod's DNS socket.
// Before, that was logged once and never tried again: the pod's captured
// queries (every lookup it makes) were dropped for as long as the agent
// served it, long after the port was free, and readiness said nothing.
// Now the socket is opened again every 20 ms until it opens, and after a
// while readiness names the pod and port, as for the listeners' ports.
func TestDNSSocketTakenOnceFree(t *testing.T) {
	defer func(d time.Duration) { dnsAwaitReport = d }(dnsAwaitReport)
	dnsAwaitReport = 200 * time.Millisecond
	ns := dnsPodNS(t)
	held, err := ns.ListenPacket(context.Background(), "udp", "[::]:15053", netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()

	tun, p := dnsTunnelWith(t, ns, dnsproxy.Config{Upstreams: []netip.AddrPort{netip.AddrPortFrom(dnsUpstreamAddr, 53)}}, nil, nil)
	time.Sleep(500 * time.Millisecond)
	if p.dnsSocket() != nil {
		t.Fatal("the pod's DNS socket opened though port 15053 is held")
	}
	problems := strings.Join(tun.ListenerProblems(), "\n")
	if !strings.Contains(problems, "port 15053") {
		t.Errorf("readiness problems while the DNS port is held: %q, want the pod and port 15053 named", problems)
	}

	held.Close()
	for deadline := time.Now().Add(2 * time.Second); p.dnsSocket() == nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the pod's DNS socket never opened once port 15053 was free")
		}
	}
	if problems := tun.ListenerProblems(); len(problems) != 0 {
		t.Errorf("readiness problems once the DNS socket is open: %q, want none", problems)
	}
	// The socket answers the pod's captured queries: it reads them.
	if got := p.dnsSocket().LocalAddr().String(); !strings.HasSuffix(got, ":15053") {
		t.Errorf("DNS socket at %s, want port 15053", got)
	}
}

// TestDNSAwaitEndsWithPod: a pod whose DNS socket is still being retried
// stops at once: stop waits for the pod's goroutines before it cancels
// them, and the retry must not hold it for the whole drain.
func TestDNSAwaitEndsWithPod(t *testing.T) {
	ns := dnsPodNS(t)
	held, err := ns.ListenPacket(context.Background(), "udp", "[::]:15053", netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	tun, _ := dnsTunnelWith(t, ns, dnsproxy.Config{Upstreams: []netip.AddrPort{netip.AddrPortFrom(dnsUpstreamAddr, 53)}}, nil, nil)
	time.Sleep(100 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	if err := tun.StopPod(ctx, "uid-client"); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("stopping a pod whose DNS socket was being retried took %s, want well under the 5 s drain", took)
	}
}
