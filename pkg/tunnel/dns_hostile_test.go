package tunnel

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/dnsproxy"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Addresses of the DNS tests' pod namespace :
// the pod's own, another pod's (a victim a hostile pod names as its
// source), and the upstream resolver's.
var (
	dnsPodAddr      = netip.MustParseAddr("10.9.0.2")
	dnsVictimAddr   = netip.MustParseAddr("10.9.0.7")
	dnsUpstreamAddr = netip.MustParseAddr("10.9.0.5")
	// dnsCaptured is where the pod's resolver sent its query: what the
	// capture's bpf_sk_assign leaves as the datagram's original
	// destination.
	dnsCaptured = netip.MustParseAddrPort("10.96.0.10:53")
)

// dnsPodNS is a pod namespace with the DNS tests' addresses.
func dnsPodNS(t *testing.T) *netns.Handle {
	t.Helper()
	path := podNS(t)
	name := filepath.Base(path)
	for _, args := range [][]string{
		{"-n", name, "addr", "add", dnsPodAddr.String() + "/32", "dev", "lo"},
		{"-n", name, "addr", "add", dnsVictimAddr.String() + "/32", "dev", "lo"},
		{"-n", name, "addr", "add", dnsUpstreamAddr.String() + "/32", "dev", "lo"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	h, err := netns.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// dnsTunnel serves pod uid-client at dnsPodAddr in ns with the DNS proxy
// configured by cfg (its upstream dnsUpstreamAddr:53), its DNS socket open.
func dnsTunnel(t *testing.T, ns *netns.Handle, cfg dnsproxy.Config) (*Tunnel, *pod) {
	t.Helper()
	cfg.Upstreams = []netip.AddrPort{netip.AddrPortFrom(dnsUpstreamAddr, 53)}
	tun, p := dnsTunnelWith(t, ns, cfg, nil, nil)
	waitDNSSocket(t, p)
	return tun, p
}

// dnsTunnelWith is a tunnel answering the DNS of pod uid-client (dnsPodAddr
// in ns) with the DNS proxy configured by cfg, pred as its predecessor (nil:
// none) and its log in log (nil: none); the pod is served, its DNS socket
// open or awaited.
func dnsTunnelWith(t *testing.T, ns *netns.Handle, cfg dnsproxy.Config, pred *Predecessor, log *testLog) (*Tunnel, *pod) {
	t.Helper()
	var tun *Tunnel
	proxy, err := dnsproxy.New(cfg, func() *workload.Directory { return tun.State().Dir }, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	pool := hbone.NewPool(hbone.PoolOptions{})
	t.Cleanup(func() { pool.Close() })
	tun = New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008,
		TunnelMark: testMark, Predecessor: pred, Pool: pool, Metrics: NewMetrics(prometheus.NewRegistry()), NoAccessLog: true,
		DNS: proxy, DNSPort: dnsHandoverPort, DNSCapture: true, Logger: slogTo(log)})
	tun.Update(&State{Dir: testDir(t, podObj("mesh", "client", "client-sa", dnsPodAddr.String(), nil))})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = tun.Shutdown(ctx)
	})
	if err := tun.ServePod(context.Background(), "uid-client", ns.Path(), []netip.Addr{dnsPodAddr}); err != nil {
		t.Fatal(err)
	}
	return tun, tun.pods["uid-client"]
}

// udpIn opens an unconnected UDP socket at addr in ns.
func udpIn(t *testing.T, ns *netns.Handle, addr netip.AddrPort) *net.UDPConn {
	t.Helper()
	c, err := ns.ListenPacket(context.Background(), "udp4", addr.String(), netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func dnsQuery(t *testing.T, name string) []byte {
	t.Helper()
	b, err := new(dns.Msg).SetQuestion(dns.Fqdn(name), dns.TypeA).Pack()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// readDNS waits up to wait for a DNS message on c: nil when none came.
func readDNS(t *testing.T, c *net.UDPConn, wait time.Duration) (*dns.Msg, netip.AddrPort) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(wait))
	buf := make([]byte, 65536)
	n, from, err := c.ReadFromUDPAddrPort(buf)
	if err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil, netip.AddrPort{}
		}
		t.Fatal(err)
	}
	m := new(dns.Msg)
	if err := m.Unpack(buf[:n]); err != nil {
		t.Fatalf("undecodable datagram from %s: %v", from, err)
	}
	return m, from
}

func dnsDropped(tun *Tunnel, reason string) float64 {
	return testutil.ToFloat64(tun.cfg.Metrics.dnsDropped.WithLabelValues(reason))
}

// TestDNSAnswersOnlyThePodsCapturedQueries: the pod's DNS socket answers
// the queries the capture assigned to it (original destination port 53)
// from the pod's own addresses, and nothing else. Before, any datagram
// was answered, from the pod's namespace with the tunnel mark (past the
// capture), to whatever address it named as its source: a pod (or,
// directly on port 15053, any peer) made the agent send DNS answers
// "from the resolver" to another pod's address and port, and a peer on
// another node that sent to port 15053 with the pod's own (IPv6) address
// made the agent forward queries upstream as the pod, spending its bound
// of queries in flight.
func TestDNSAnswersOnlyThePodsCapturedQueries(t *testing.T) {
	ns := dnsPodNS(t)
	tun, p := dnsTunnel(t, ns, dnsproxy.Config{Timeout: 500 * time.Millisecond})
	victim := udpIn(t, ns, netip.AddrPortFrom(dnsVictimAddr, 40000))
	own := udpIn(t, ns, netip.AddrPortFrom(dnsPodAddr, 0))
	ownAddr := netip.AddrPortFrom(dnsPodAddr, own.LocalAddr().(*net.UDPAddr).AddrPort().Port())
	socket := netip.AddrPortFrom(dnsPodAddr, 15053)
	q := dnsQuery(t, "outside.test")

	// Straight to the DNS socket, not assigned by the capture: from
	// another address (a peer, or a pod of this node), and from the pod.
	if _, err := victim.WriteToUDPAddrPort(q, socket); err != nil {
		t.Fatal(err)
	}
	if m, from := readDNS(t, victim, 700*time.Millisecond); m != nil {
		t.Errorf("a query sent straight to port 15053 from another address was answered (%s from %s)", dns.RcodeToString[m.Rcode], from)
	}
	if _, err := own.WriteToUDPAddrPort(q, socket); err != nil {
		t.Fatal(err)
	}
	if m, from := readDNS(t, own, 700*time.Millisecond); m != nil {
		t.Errorf("a query sent straight to port 15053 (not captured) was answered (%s from %s)", dns.RcodeToString[m.Rcode], from)
	}

	// Assigned by the capture, but from an address that is not the pod's
	// (spoofed), or from port 0.
	p.dispatchDNS(netip.AddrPortFrom(dnsVictimAddr, 40000), dnsCaptured, q)
	if m, from := readDNS(t, victim, 700*time.Millisecond); m != nil {
		t.Errorf("a captured query naming another pod's address as its source was answered to it (%s from %s)", dns.RcodeToString[m.Rcode], from)
	}
	p.dispatchDNS(netip.AddrPortFrom(dnsPodAddr, 0), dnsCaptured, q)

	// The pod's own captured query is answered, from where it was sent
	// (SERVFAIL: no upstream listens).
	p.dispatchDNS(ownAddr, dnsCaptured, q)
	m, from := readDNS(t, own, 3*time.Second)
	if m == nil || from != dnsCaptured {
		t.Fatalf("the pod's own captured query: answer %v from %s, want one from %s", m, from, dnsCaptured)
	}
	for reason, want := range map[string]float64{"not_captured": 2, "foreign_source": 2} {
		if got := dnsDropped(tun, reason); got != want {
			t.Errorf("redirector_dns_dropped_total{reason=%q} = %v, want %v", reason, got, want)
		}
	}
}

// slowUpstream answers every A query in ns at dnsUpstreamAddr:53 with
// 192.0.2.7 after delay (never, if delay < 0), and counts the queries.
func slowUpstream(t *testing.T, ns *netns.Handle, delay time.Duration) *atomic.Int64 {
	t.Helper()
	c := udpIn(t, ns, netip.AddrPortFrom(dnsUpstreamAddr, 53))
	var got atomic.Int64
	go func() {
		buf := make([]byte, 4096)
		for {
			n, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			got.Add(1)
			if delay < 0 {
				continue
			}
			req := new(dns.Msg)
			if req.Unpack(buf[:n]) != nil {
				continue
			}
			go func() {
				time.Sleep(delay)
				resp := new(dns.Msg).SetReply(req)
				resp.Answer = append(resp.Answer, &dns.A{Hdr: dns.RR_Header{Name: req.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 30},
					A: net.IPv4(192, 0, 2, 7)})
				b, _ := resp.Pack()
				_, _ = c.WriteToUDPAddrPort(b, from)
			}()
		}
	}()
	return &got
}

// TestDNSStopAnswersQueriesInFlight: a pod stopped (the agent handing
// over to its successor, or re-serving the pod) while a forwarded query is
// in flight still answers it within the stop's grace. Before, the
// answering goroutine was not waited for: stop returned at once, cancelled
// the query (the client got SERVFAIL, or nothing once the namespace handle
// closed) and the client's resolver failed the lookup or waited its 5 s
// retry.
func TestDNSStopAnswersQueriesInFlight(t *testing.T) {
	ns := dnsPodNS(t)
	asked := slowUpstream(t, ns, 400*time.Millisecond)
	_, p := dnsTunnel(t, ns, dnsproxy.Config{Timeout: 2 * time.Second})
	own := udpIn(t, ns, netip.AddrPortFrom(dnsPodAddr, 0))
	ownAddr := netip.AddrPortFrom(dnsPodAddr, own.LocalAddr().(*net.UDPAddr).AddrPort().Port())

	p.dispatchDNS(ownAddr, dnsCaptured, dnsQuery(t, "outside.test"))
	for deadline := time.Now().Add(2 * time.Second); asked.Load() == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the query never reached the upstream")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	go p.stop(ctx)
	m, from := readDNS(t, own, 3*time.Second)
	switch {
	case m == nil:
		t.Fatal("the query in flight when the pod stopped was never answered")
	case m.Rcode != dns.RcodeSuccess || len(m.Answer) != 1 || !strings.Contains(m.Answer[0].String(), "192.0.2.7"):
		t.Fatalf("the query in flight when the pod stopped got %s %v from %s, want the upstream's 192.0.2.7", dns.RcodeToString[m.Rcode], m.Answer, from)
	}
}

// TestDNSAnswersBoundedPerPod: a pod flooding its DNS socket holds at most
// dnsMaxPendingPerPod answering goroutines (each may hold an upstream
// socket and then a reply socket in the pod's namespace), whatever the
// resolver's own bounds; the rest are dropped and counted. Before, every
// datagram got its goroutine: the reader outruns the answers (each opens
// sockets in the pod's namespace), and a reply socket is opened after the
// resolver has released its slot, so neither bound held them.
func TestDNSAnswersBoundedPerPod(t *testing.T) {
	ns := dnsPodNS(t)
	slowUpstream(t, ns, -1) // never answers: every forwarded query waits its timeout
	tun, p := dnsTunnel(t, ns, dnsproxy.Config{Timeout: 3 * time.Second, MaxInFlight: 100000, MaxInFlightPerPod: 100000})
	q := dnsQuery(t, "outside.test")
	base := runtime.NumGoroutine()
	n := 3 * dnsMaxPendingPerPod
	for i := range n {
		p.dispatchDNS(netip.AddrPortFrom(dnsPodAddr, uint16(20000+i)), dnsCaptured, q)
	}
	time.Sleep(300 * time.Millisecond)
	if held := runtime.NumGoroutine() - base; held > dnsMaxPendingPerPod+20 {
		t.Errorf("%d queries of one pod hold %d goroutines, want at most %d", n, held, dnsMaxPendingPerPod)
	}
	if got, want := dnsDropped(tun, "busy"), float64(n-dnsMaxPendingPerPod); got < want {
		t.Errorf("redirector_dns_dropped_total{reason=busy} = %v, want at least %v", got, want)
	}
}

// TestDNSOversizedDatagramRejected: a datagram larger than the resolver
// takes (dnsproxy.MaxQueryLen) is answered FORMERR as oversized, not cut
// to the reader's buffer and answered as if the client had sent the cut.
// Before, the reader read into a MaxQueryLen buffer: a query padded past
// it was taken whole (forwarded upstream, trailing bytes and all), a
// longer one judged on its first 4096 bytes.
func TestDNSOversizedDatagramRejected(t *testing.T) {
	ns := dnsPodNS(t)
	_, p := dnsTunnel(t, ns, dnsproxy.Config{Timeout: 300 * time.Millisecond})
	// A socket of the pod's own on port 53 stands in for the capture: its
	// datagrams' original destination is port 53. (SO_REUSEADDR: the
	// answer's socket binds the same address.)
	c, err := ns.ListenPacket(context.Background(), "udp4", netip.AddrPortFrom(dnsPodAddr, 53).String(),
		netns.SocketOptions{RecvOrigDst: true, ReuseAddr: true})
	if err != nil {
		t.Fatal(err)
	}
	p.wg.Add(1)
	p.serveDNS(c)
	t.Cleanup(func() { c.Close() })
	own := udpIn(t, ns, netip.AddrPortFrom(dnsPodAddr, 0))
	padded := append(dnsQuery(t, "outside.test"), make([]byte, dnsproxy.MaxQueryLen+100)...)
	if _, err := own.WriteToUDPAddrPort(padded, netip.AddrPortFrom(dnsPodAddr, 53)); err != nil {
		t.Fatal(err)
	}
	m, _ := readDNS(t, own, 3*time.Second)
	if m == nil || m.Rcode != dns.RcodeFormatError {
		t.Fatalf("a %d-byte query got %v, want FORMERR", len(padded), m)
	}
}

// TestDNSSocketNotWaitingForPorts: a pod whose TCP ports another process
// holds (a predecessor that did not hand them over: awaitPorts) has its
// DNS socket at once, since that socket needs none of those ports; and
// taking the ports later opens no second one. Before, the DNS socket
// opened only with the listeners: while the ports were held, every
// captured query of the pod was dropped for want of a socket (all of
// them, with a predecessor that answers no DNS).
func TestDNSSocketNotWaitingForPorts(t *testing.T) {
	ns := dnsPodNS(t)
	held, err := netns.Listen(context.Background(), ns.Path(), "tcp", "[::]:15001", netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	_, p := dnsTunnel(t, ns, dnsproxy.Config{}) // fails unless the DNS socket opens
	p.mu.Lock()
	first, lns := p.dns, p.lns
	p.mu.Unlock()
	if lns != nil {
		t.Fatal("the pod serves its listeners though port 15001 is held")
	}
	held.Close()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		p.mu.Lock()
		lns = p.lns
		p.mu.Unlock()
		if lns != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the pod never took its ports once they were free")
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dns != first {
		t.Errorf("taking the ports opened another DNS socket (%p, was %p)", p.dns, first)
	}
}
