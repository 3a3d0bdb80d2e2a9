package tunnel

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/dnsproxy"
	"github.com/redirector-mesh/redirector/pkg/netns"
)

// The DNS hand-over tests capture the pod's queries as the capture
// programs do, with the kernel's own means: a TPROXY rule in the pod's
// namespace assigns every datagram to dnsCaptured (an address of the pod's
// lo, like a resolver's Service address routed locally) to the UDP socket
// on port 15053, which then reads dnsCaptured as the datagram's original
// destination. Each agent forwards to an upstream of its own, so an
// answer says which agent read the query: 192.0.2.1 the old one,
// 192.0.2.2 the successor.
var (
	dnsOldUpstream  = dnsUpstreamAddr
	dnsNewUpstream  = netip.MustParseAddr("10.9.0.6")
	dnsOldAnswer    = netip.MustParseAddr("192.0.2.1")
	dnsNewAnswer    = netip.MustParseAddr("192.0.2.2")
	dnsHandoverPort = uint16(15053)
)

// captureDNS makes ns's queries to dnsCaptured reach the socket on
// dnsHandoverPort (TPROXY, as bpf_sk_assign), and starts both upstreams.
func captureDNS(t *testing.T, ns *netns.Handle) {
	t.Helper()
	name := filepath.Base(ns.Path())
	for _, args := range [][]string{
		{"-n", name, "addr", "add", dnsNewUpstream.String() + "/32", "dev", "lo"},
		{"-n", name, "addr", "add", dnsCaptured.Addr().String() + "/32", "dev", "lo"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	rules := fmt.Sprintf(`table ip dnscapture {
	chain pre {
		type filter hook prerouting priority mangle; policy accept;
		ip daddr %s udp dport %d tproxy to :%d
	}
}
`, dnsCaptured.Addr(), dnsCaptured.Port(), dnsHandoverPort)
	cmd := exec.Command("ip", "netns", "exec", name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nft in the pod's namespace: %v: %s", err, out)
	}
	answeringUpstream(t, ns, dnsOldUpstream, dnsOldAnswer)
	answeringUpstream(t, ns, dnsNewUpstream, dnsNewAnswer)
}

// answeringUpstream answers every query in ns at addr:53 with one A record
// of answer, at once.
func answeringUpstream(t *testing.T, ns *netns.Handle, addr, answer netip.Addr) {
	t.Helper()
	c := udpIn(t, ns, netip.AddrPortFrom(addr, 53))
	go func() {
		buf := make([]byte, 4096)
		for {
			n, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			req := new(dns.Msg)
			if req.Unpack(buf[:n]) != nil || len(req.Question) != 1 {
				continue
			}
			resp := new(dns.Msg).SetReply(req)
			resp.Answer = append(resp.Answer, &dns.A{Hdr: dns.RR_Header{Name: req.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 30},
				A: answer.AsSlice()})
			b, _ := resp.Pack()
			_, _ = c.WriteToUDPAddrPort(b, from)
		}
	}()
}

// dnsAgentServing is dnsTunnelWith, forwarding to upstream.
func dnsAgentServing(t *testing.T, ns *netns.Handle, upstream netip.Addr, pred *Predecessor, log *testLog) (*Tunnel, *pod) {
	t.Helper()
	return dnsTunnelWith(t, ns, dnsproxy.Config{Upstreams: []netip.AddrPort{netip.AddrPortFrom(upstream, 53)}, Timeout: 2 * time.Second}, pred, log)
}

// dnsAgent is dnsAgentServing, whose pod has its DNS socket open.
func dnsAgent(t *testing.T, ns *netns.Handle, upstream netip.Addr, pred *Predecessor, log *testLog) (*Tunnel, *pod) {
	t.Helper()
	tun, p := dnsAgentServing(t, ns, upstream, pred, log)
	waitDNSSocket(t, p)
	return tun, p
}

func (p *pod) dnsSocket() *net.UDPConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dns
}

// waitDNSSocket waits for the pod to have a DNS socket: it opens its own
// once the port is free (awaitDNS).
func waitDNSSocket(t *testing.T, p *pod) *net.UDPConn {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if c := p.dnsSocket(); c != nil {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatal("the pod has no DNS socket")
		}
	}
}

// checkPodCannotBindDNSPort: no process in the pod, as root (the agent's
// own user), can bind the pod's DNS port beside the agent's socket, on any
// address, with SO_REUSEPORT or SO_REUSEADDR. A socket that could would
// be handed a share of the pod's captured queries (a reuseport group
// spreads them by hash) and answer them.
func checkPodCannotBindDNSPort(t *testing.T, ns *netns.Handle) {
	t.Helper()
	for _, b := range []struct{ network, addr string }{
		{"udp", "[::]"}, {"udp6", "[::]"}, {"udp4", "0.0.0.0"}, {"udp4", dnsPodAddr.String()}, {"udp4", "127.0.0.1"}, {"udp6", "[::1]"},
	} {
		for _, opt := range []struct {
			name string
			opt  int
		}{{"SO_REUSEPORT", unix.SO_REUSEPORT}, {"SO_REUSEADDR", unix.SO_REUSEADDR}} {
			lc := listenConfigWith(opt.opt)
			addr := fmt.Sprintf("%s:%d", b.addr, dnsHandoverPort)
			var c net.PacketConn
			err := ns.Do(func() error {
				var err error
				c, err = lc.ListenPacket(context.Background(), b.network, addr)
				return err
			})
			if err == nil {
				c.Close()
				t.Errorf("a process in the pod bound %s %s with %s next to the agent's DNS socket", b.network, addr, opt.name)
			} else if !errors.Is(err, syscall.EADDRINUSE) {
				t.Errorf("bind %s %s with %s: %v, want EADDRINUSE", b.network, addr, opt.name, err)
			}
		}
	}
}

// TestPodProcessCannotBindDNSPort: the pod's DNS socket is in no reuseport
// group, whether the agent opened it or took it from a predecessor whose
// socket was in one (the release of 6 December set SO_REUSEPORT so that
// a successor could open its own beside it). Before, a process in the pod
// running as root joined the group and was handed a share of the pod's
// own captured queries.
func TestPodProcessCannotBindDNSPort(t *testing.T) {
	t.Run("opened", func(t *testing.T) {
		ns := dnsPodNS(t)
		_, p := dnsAgent(t, ns, dnsOldUpstream, nil, nil)
		waitDNSSocket(t, p)
		checkPodCannotBindDNSPort(t, ns)
	})
	t.Run("taken from a reuseport group", func(t *testing.T) {
		ns := dnsPodNS(t)
		grouped := netns.SocketOptions{Transparent: true, Mark: testMark, ReusePort: true, RecvOrigDst: true}
		pred := mustPredecessor(t, dnsFakePredecessor(t, `{"ports":[15053]}`, func() int {
			return dnsSocketFD(t, ns, "udp", "[::]:15053", grouped, netip.AddrPort{})
		}))
		log := newTestLog()
		tun, p := dnsAgent(t, ns, dnsOldUpstream, pred, log)
		if got := handoverCount(tun, handoverTaken); got != 1 {
			t.Fatalf("taken = %v, want 1 (the DNS socket); log:\n%s", got, log.String())
		}
		waitDNSSocket(t, p)
		checkPodCannotBindDNSPort(t, ns)
	})
}

// dnsClients are the pod's resolvers: sockets on dnsPodAddr, each on a
// port of its own (a reuseport group spreads datagrams by their ports),
// that send queries to dnsCaptured and collect the answers by query ID.
type dnsClients struct {
	t     *testing.T
	socks []*net.UDPConn
	next  uint16

	mu      sync.Mutex
	sent    map[uint16]time.Time
	answers map[uint16][]netip.Addr // the A records of each answer to the ID
}

func newDNSClients(t *testing.T, ns *netns.Handle, n int) *dnsClients {
	c := &dnsClients{t: t, sent: map[uint16]time.Time{}, answers: map[uint16][]netip.Addr{}}
	for range n {
		s := udpIn(t, ns, netip.AddrPortFrom(dnsPodAddr, 0))
		c.socks = append(c.socks, s)
		go func() {
			buf := make([]byte, 4096)
			for {
				n, from, err := s.ReadFromUDPAddrPort(buf)
				if err != nil {
					return
				}
				m := new(dns.Msg)
				if from != dnsCaptured || m.Unpack(buf[:n]) != nil {
					continue
				}
				var a netip.Addr
				if len(m.Answer) == 1 {
					if rr, ok := m.Answer[0].(*dns.A); ok {
						a, _ = netip.AddrFromSlice(rr.A.To4())
					}
				}
				c.mu.Lock()
				c.answers[m.Id] = append(c.answers[m.Id], a)
				c.mu.Unlock()
			}
		}()
	}
	return c
}

// send sends one query, from the next socket in turn.
func (c *dnsClients) send() {
	c.next++
	id := c.next
	m := new(dns.Msg).SetQuestion(fmt.Sprintf("q%d.outside.test.", id), dns.TypeA)
	m.Id = id
	b, err := m.Pack()
	if err != nil {
		c.t.Fatal(err)
	}
	c.mu.Lock()
	c.sent[id] = time.Now()
	c.mu.Unlock()
	if _, err := c.socks[int(id)%len(c.socks)].WriteToUDPAddrPort(b, dnsCaptured); err != nil {
		c.t.Fatal(err)
	}
}

// result counts the queries sent that got no answer or more than one, and
// the answers by the A record they carry; it waits up to wait for the
// missing ones.
func (c *dnsClients) result(wait time.Duration) (missing, duplicated int, by map[netip.Addr]int) {
	deadline := time.Now().Add(wait)
	for {
		c.mu.Lock()
		missing, duplicated, by = 0, 0, map[netip.Addr]int{}
		for id := range c.sent {
			as := c.answers[id]
			switch {
			case len(as) == 0:
				missing++
			case len(as) > 1:
				duplicated++
			}
			for _, a := range as {
				by[a]++
			}
		}
		c.mu.Unlock()
		if missing == 0 || time.Now().After(deadline) {
			return missing, duplicated, by
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitLog waits up to 2 s for log to contain s.
func waitLog(t *testing.T, log *testLog, s string) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Second); !strings.Contains(log.String(), s); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("log lacks %q:\n%s", s, log.String())
		}
	}
}

// TestDNSHandoverKeepsQueuedQueries: the successor takes the pod's DNS
// socket itself, with the queries queued on it, and answers them after the
// old agent closed its descriptor. The old agent here stops reading before
// the queries come (a reader behind, the moment between two reads, made
// long): they wait in the socket's queue. Before, the successor opened a
// socket of its own beside the old one (SO_REUSEPORT), the queries queued
// on the old one were lost when the old agent closed it, and every client
// waited its resolver's timeout (5 s for glibc) to ask again.
func TestDNSHandoverKeepsQueuedQueries(t *testing.T) {
	ns := dnsPodNS(t)
	captureDNS(t, ns)
	oldLog, newLog := newTestLog(), newTestLog()
	old, oldPod := dnsAgent(t, ns, dnsOldUpstream, nil, oldLog)
	sock, stop := serveHandover(t, old)
	clients := newDNSClients(t, ns, 16)

	// Captured queries are answered, by the old agent.
	clients.send()
	if missing, _, by := clients.result(3 * time.Second); missing != 0 || by[dnsOldAnswer] != 1 {
		t.Fatalf("before the hand-over: %d unanswered, answers %v; want the old agent's; log:\n%s", missing, by, oldLog.String())
	}

	// The old agent stops reading: the queries that follow queue.
	_ = oldPod.dnsSocket().SetReadDeadline(time.Now())
	waitLog(t, oldLog, "DNS socket failed")
	const queued = 64
	for range queued {
		clients.send()
	}
	time.Sleep(200 * time.Millisecond)
	if missing, _, _ := clients.result(0); missing != queued {
		t.Fatalf("%d of the %d queued queries answered with no agent reading", queued-missing, queued)
	}

	next, newPod := dnsAgent(t, ns, dnsNewUpstream, mustPredecessor(t, sock), newLog)
	if got := handoverCount(next, handoverTaken); got != 2 {
		t.Errorf("taken = %v, want 2 (the listeners, the DNS socket); log:\n%s", got, newLog.String())
	}
	if a, b := socketInode(t, oldPod.dnsSocket()), socketInode(t, newPod.dnsSocket()); a != b {
		t.Errorf("the successor's DNS socket %d is not the old agent's %d", b, a)
	}
	// The old agent goes (SIGTERM): it closes its descriptors.
	if err := stop(); err != nil {
		t.Error(err)
	}
	dctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	old.Drain(dctx, nil)

	missing, duplicated, by := clients.result(3 * time.Second)
	if missing != 0 || duplicated != 0 {
		t.Errorf("of %d queries queued when the old agent closed its DNS socket, %d were never answered and %d twice; answers %v; log:\n%s",
			queued, missing, duplicated, by, newLog.String())
	}
	if by[dnsNewAnswer] != queued {
		t.Errorf("the successor answered %d queries, want the %d queued", by[dnsNewAnswer], queued)
	}
}

// TestDNSHandoverContinuousQueries: queries sent every millisecond or so
// across a hand-over are each answered exactly once. While both agents
// hold the socket both read it, and both answer (each a datagram the other
// did not get: a read dequeues it); once the old agent drains, the
// successor answers everything.
func TestDNSHandoverContinuousQueries(t *testing.T) {
	ns := dnsPodNS(t)
	captureDNS(t, ns)
	newLog := newTestLog()
	old, _ := dnsAgent(t, ns, dnsOldUpstream, nil, nil)
	sock, stop := serveHandover(t, old)
	clients := newDNSClients(t, ns, 16)

	sending := make(chan struct{})
	var sender sync.WaitGroup
	sender.Add(1)
	go func() {
		defer sender.Done()
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-sending:
				return
			case <-tick.C:
				clients.send()
			}
		}
	}()
	time.Sleep(200 * time.Millisecond)
	next, _ := dnsAgent(t, ns, dnsNewUpstream, mustPredecessor(t, sock), newLog)
	if got := handoverCount(next, handoverTaken); got != 2 {
		t.Errorf("taken = %v, want 2 (the listeners, the DNS socket); log:\n%s", got, newLog.String())
	}
	time.Sleep(400 * time.Millisecond) // both agents read
	_ = stop()
	dctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	old.Drain(dctx, nil)
	time.Sleep(200 * time.Millisecond)
	close(sending)
	sender.Wait()

	missing, duplicated, by := clients.result(3 * time.Second)
	t.Logf("%d queries sent: answers %v", len(clients.sent), by)
	if missing != 0 || duplicated != 0 {
		t.Errorf("%d queries never answered, %d answered twice (answers %v)", missing, duplicated, by)
	}
	if by[dnsOldAnswer] == 0 || by[dnsNewAnswer] == 0 {
		t.Errorf("answers %v: want both agents' (the old one before and during the hand-over, the successor after it)", by)
	}
}

// oldReleaseHandover serves a hand-over socket as a release from before
// the DNS hand-over does, in front of tun's own (at sock): it decodes each
// request as that release did, refusing one with a field it does not know
// by closing the connection, and passes the others on. It counts the DNS
// requests it refused.
func oldReleaseHandover(t *testing.T, sock string) (string, func() int) {
	t.Helper()
	front := filepath.Join(t.TempDir(), "old-release.sock")
	l, err := net.Listen("unixpacket", front)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var mu sync.Mutex
	refused := 0
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, maxHandoverMessage)
				n, err := c.Read(buf)
				if err != nil {
					return
				}
				var req struct {
					Netns    uint64 `json:"netns,omitempty"`
					Endpoint string `json:"endpoint,omitempty"`
				}
				dec := json.NewDecoder(bytes.NewReader(buf[:n]))
				dec.DisallowUnknownFields()
				if dec.Decode(&req) != nil {
					mu.Lock()
					refused++
					mu.Unlock()
					return
				}
				up, err := net.Dial("unixpacket", sock)
				if err != nil {
					return
				}
				defer up.Close()
				if _, err := up.Write(buf[:n]); err != nil {
					return
				}
				oob := make([]byte, unix.CmsgSpace(4*4))
				n, oobn, _, _, err := up.(*net.UnixConn).ReadMsgUnix(buf, oob)
				if err != nil {
					return
				}
				fds, _ := receivedFDs(oob[:oobn])
				defer closeFDs(fds)
				var rights []byte
				if len(fds) > 0 {
					rights = unix.UnixRights(fds...)
				}
				_, _, _ = c.(*net.UnixConn).WriteMsgUnix(buf[:n], rights, nil)
			}()
		}
	}()
	return front, func() int { mu.Lock(); defer mu.Unlock(); return refused }
}

// TestDNSHandoverFromOldRelease: a predecessor from before the DNS
// hand-over refuses the request for a DNS socket; it still hands the
// listeners over, the successor asks for no other pod's DNS socket, and
// waits for the old agent's to close before it opens its own (no reuseport
// group to share): the pod's queries are answered throughout, by the old
// agent and then by the successor. And a predecessor that serves the pod without a DNS
// socket (its node answers no DNS) has none to give.
func TestDNSHandoverFromOldRelease(t *testing.T) {
	ns := dnsPodNS(t)
	captureDNS(t, ns)
	log := newTestLog()
	old, oldPod := dnsAgent(t, ns, dnsOldUpstream, nil, nil)
	sock, stop := serveHandover(t, old)
	front, refused := oldReleaseHandover(t, sock)
	next, newPod := dnsAgentServing(t, ns, dnsNewUpstream, mustPredecessor(t, front), log)
	if got := handoverCount(next, handoverTaken); got != 1 {
		t.Errorf("taken = %v, want 1 (the listeners); log:\n%s", got, log.String())
	}
	if n := refused(); n != 1 {
		t.Errorf("the old release refused %d requests, want 1 (the DNS socket's)", n)
	}
	for i := range oldPod.lns {
		if a, b := socketInode(t, oldPod.lns[i]), socketInode(t, newPod.lns[i]); a != b {
			t.Errorf("listener %d: the successor's socket %d is not the old agent's %d", i, b, a)
		}
	}
	if newPod.dnsSocket() != nil {
		t.Error("the successor opened a DNS socket while the old release's holds the port")
	}
	// A second pod: the old release is not asked for its DNS socket again.
	other := podNS(t)
	if err := next.ServePod(context.Background(), "pod-b", other, []netip.Addr{netip.MustParseAddr("10.9.0.3")}); err != nil {
		t.Fatal(err)
	}
	if n := refused(); n != 1 {
		t.Errorf("the old release refused %d requests, want still 1: asked again for a DNS socket it does not know", n)
	}
	// not_served is the answers "not served": pod-b's listeners. A DNS
	// socket the old release does not hand over for any pod is no pod it
	// does not serve (before, each pod's counted as one: 3).
	if got := handoverCount(next, handoverNotServed); got != 1 {
		t.Errorf("not_served = %v, want 1 (pod-b's listeners); log:\n%s", got, log.String())
	}
	clients := newDNSClients(t, ns, 16)
	for range 32 {
		clients.send()
	}
	if missing, _, by := clients.result(3 * time.Second); missing != 0 || by[dnsOldAnswer] != 32 {
		t.Errorf("%d of 32 queries unanswered while the old release holds the port; answers %v, want all the old agent's", missing, by)
	}
	// The old agent goes (SIGTERM): the successor takes the port.
	if err := stop(); err != nil {
		t.Error(err)
	}
	dctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	old.Drain(dctx, nil)
	waitDNSSocket(t, newPod)
	after := newDNSClients(t, ns, 16)
	for range 32 {
		after.send()
	}
	if missing, _, by := after.result(3 * time.Second); missing != 0 || by[dnsNewAnswer] != 32 {
		t.Errorf("%d of 32 queries unanswered once the old agent went; answers %v, want all the successor's; log:\n%s", missing, by, log.String())
	}

	// An agent serving the pod with no DNS socket: nothing to take.
	nsB := dnsPodNS(t)
	noDNS := handoverTunnel(t, nil, nil)
	if err := noDNS.ServePod(context.Background(), "uid-client", nsB.Path(), []netip.Addr{dnsPodAddr}); err != nil {
		t.Fatal(err)
	}
	sockB, _ := serveHandover(t, noDNS)
	third, thirdPod := dnsAgent(t, nsB, dnsNewUpstream, mustPredecessor(t, sockB), nil)
	if taken, notServed := handoverCount(third, handoverTaken), handoverCount(third, handoverNotServed); taken != 1 || notServed != 1 {
		t.Errorf("taken = %v, not_served = %v; want 1 each (the listeners; no DNS socket)", taken, notServed)
	}
	if thirdPod.dnsSocket() == nil {
		t.Error("the pod has no DNS socket")
	}
}

// TestDNSHandoverPodStopping: a pod the old agent is stopping has no DNS
// socket to give (its socket closes with it: the successor opens its own),
// and a pod the successor stops after taking the socket leaves the old
// agent's descriptor, and its answers, alone.
func TestDNSHandoverPodStopping(t *testing.T) {
	ns := dnsPodNS(t)
	captureDNS(t, ns)
	old, oldPod := dnsAgent(t, ns, dnsOldUpstream, nil, nil)
	sock, _ := serveHandover(t, old)
	next, _ := dnsAgent(t, ns, dnsNewUpstream, mustPredecessor(t, sock), nil)
	if got := handoverCount(next, handoverTaken); got != 2 {
		t.Fatalf("taken = %v, want 2", got)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := next.StopPod(ctx, "uid-client"); err != nil {
		t.Fatal(err)
	}
	clients := newDNSClients(t, ns, 4)
	for range 16 {
		clients.send()
	}
	if missing, _, by := clients.result(3 * time.Second); missing != 0 || by[dnsOldAnswer] != 16 {
		t.Errorf("with the successor's pod stopped: %d unanswered, answers %v; want all from the old agent", missing, by)
	}

	oldPod.stopping.Store(true) // as stop sets it first, under mu
	if fds, _, _, err := old.podDNSFD(oldPod.nsInode); err == nil || len(fds) != 0 {
		closeFDs(fds)
		t.Errorf("a stopping pod gave its DNS socket (%v)", err)
	}
	oldPod.stopping.Store(false)
}

// dnsFakePredecessor answers a request for a DNS socket with answer and
// the descriptor send returns (closed after sending), and any other
// request with "not served".
func dnsFakePredecessor(t *testing.T, answer string, send func() int) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.Listen("unixpacket", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 512)
				n, err := c.Read(buf)
				if err != nil {
					return
				}
				var req handoverRequest
				_ = json.Unmarshal(buf[:n], &req)
				if !req.DNS {
					_, _ = c.Write([]byte(`{"error":"not served"}`))
					return
				}
				fd := send()
				_, _, _ = c.(*net.UnixConn).WriteMsgUnix([]byte(answer), unix.UnixRights(fd), nil)
				unix.Close(fd)
			}()
		}
	}()
	return sock
}

// dnsSocketFD opens a UDP socket in ns at addr with opts (and conn, if
// valid, connected there), and returns a descriptor of it.
func dnsSocketFD(t *testing.T, ns *netns.Handle, network, addr string, opts netns.SocketOptions, conn netip.AddrPort) int {
	t.Helper()
	c, err := ns.ListenPacket(context.Background(), network, addr, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	fd := -1
	var derr error
	_ = rc.Control(func(s uintptr) {
		if conn.IsValid() {
			if derr = unix.Connect(int(s), &unix.SockaddrInet4{Port: int(conn.Port()), Addr: conn.Addr().As4()}); derr != nil {
				return
			}
		}
		fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0)
	})
	if derr != nil {
		t.Fatal(derr)
	}
	return fd
}

// TestDNSHandoverRefusesForeignSockets: the DNS socket a predecessor hands
// over is checked as the listeners are: a TCP socket, one on another port
// or address, in another namespace, without the tunnel mark, without the
// original destination the reader needs, not transparent, connected, or
// IPv6 only: each is refused (counted,
// logged, closed) and the pod opens its own DNS socket. Before, nothing
// was handed over and nothing checked; a successor taking any socket it
// was given would have served a pod through a socket the capture skips,
// or one that reads no datagram's destination and so answers nothing.
func TestDNSHandoverRefusesForeignSockets(t *testing.T) {
	pod := dnsPodNS(t)
	elsewhere := dnsPodNS(t)
	good := netns.SocketOptions{Transparent: true, Mark: testMark, RecvOrigDst: true}
	without := func(f func(o *netns.SocketOptions)) netns.SocketOptions { o := good; f(&o); return o }
	udp := func(ns *netns.Handle, network, addr string, opts netns.SocketOptions) func() int {
		return func() int { return dnsSocketFD(t, ns, network, addr, opts, netip.AddrPort{}) }
	}
	answer := `{"ports":[15053]}`
	cases := map[string]struct {
		answer string
		send   func() int
		want   string
	}{
		"a TCP socket": {answer, func() int {
			return listenerFD(t, pod.Path(), "[::]:15053", netns.SocketOptions{Mark: testMark, Transparent: true})
		}, "SO_TYPE is 1, want 2"},
		"another port":          {`{"ports":[15054]}`, udp(pod, "udp", "[::]:15054", good), "asked for the DNS socket on port 15053"},
		"bound to another port": {answer, udp(pod, "udp", "[::]:15054", good), "bound to port 15054"},
		"one address":           {answer, udp(pod, "udp4", dnsPodAddr.String()+":15053", good), "not the wildcard address"},
		"another namespace":     {answer, udp(elsewhere, "udp", "[::]:15053", good), "not the pod's"},
		"no tunnel mark":        {answer, udp(pod, "udp", "[::]:15053", without(func(o *netns.SocketOptions) { o.Mark = 0 })), "SO_MARK (the tunnel mark) is 0"},
		"no original destination": {answer, udp(pod, "udp", "[::]:15053", without(func(o *netns.SocketOptions) { o.RecvOrigDst = false })),
			"RECVORIGDSTADDR is 0"},
		"not transparent": {answer, udp(pod, "udp4", "0.0.0.0:15053", without(func(o *netns.SocketOptions) { o.Transparent = false })),
			"IP_TRANSPARENT is 0"},
		"connected": {answer, func() int {
			return dnsSocketFD(t, pod, "udp4", "0.0.0.0:15053", good, netip.AddrPortFrom(dnsPodAddr, 9))
		}, "connected"},
		// Go opens "udp6" sockets IPv6 only.
		"IPv6 only": {answer, udp(pod, "udp6", "[::]:15053", good), "IPV6_V6ONLY"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			pred := mustPredecessor(t, dnsFakePredecessor(t, c.answer, c.send))
			log := newTestLog()
			_ = pod.Do(func() error { return nil })
			before := openFDs(t)
			tun, p := dnsAgent(t, pod, dnsOldUpstream, pred, log)
			if !strings.Contains(log.String(), c.want) {
				t.Errorf("log lacks %q:\n%s", c.want, log.String())
			}
			if got := waitDNSSocket(t, p).LocalAddr().String(); got != "[::]:15053" {
				t.Errorf("the pod's DNS socket is on %s, want its own on [::]:15053", got)
			}
			// The fake predecessor closes its copy of the socket just after
			// sending it, so the agent's own bind can race it, fail, and ask
			// again a moment later: each refusal is counted once.
			refusals := strings.Count(log.String(), "DNS socket hand-over failed")
			if got := handoverCount(tun, handoverFailed); got < 1 || int(got) != refusals {
				t.Errorf("failed = %v, want 1 per refusal logged (%d); log:\n%s", got, refusals, log.String())
			}
			// The pod's own listeners, DNS socket and namespace handle are
			// the only descriptors added.
			checkFDsAdded(t, before, 5, "the pod's own listeners, DNS socket and namespace")
		})
	}
}
