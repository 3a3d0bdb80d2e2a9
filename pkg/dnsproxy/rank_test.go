package dnsproxy

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// blackhole is an upstream on ip (a loopback address) that reads queries
// and never answers, as a resolver behind a firewall dropping its
// packets; it counts what it read.
func blackhole(t *testing.T, ip string) (netip.AddrPort, *atomic.Int32) {
	t.Helper()
	pc, err := net.ListenPacket("udp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	var n atomic.Int32
	go func() {
		buf := make([]byte, 4096)
		for {
			if _, _, err := pc.ReadFrom(buf); err != nil {
				return
			}
			n.Add(1)
		}
	}()
	return pc.LocalAddr().(*net.UDPAddr).AddrPort(), &n
}

// ranked is the proxy's current order of its upstreams.
func ranked(p *Proxy) []netip.AddrPort {
	var out []netip.AddrPort
	for _, u := range rank(p.ups, time.Now()) {
		out = append(out, u.addr)
	}
	return out
}

// TestDeadFirstUpstreamNotWaitedFor: with the first upstream blackholed,
// the first query is answered by the second once the first has not
// answered within its hedge delay, and later queries ask the second first:
// answered well before the 5 s per-upstream timeout, the blackhole no
// longer asked. Before, every forwarded query waited the blackhole's 5 s.
// With that upstream alone, a query still waits its whole timeout.
func TestDeadFirstUpstreamNotWaitedFor(t *testing.T) {
	hole, asked := blackhole(t, "127.0.0.2")
	k := startKubeDNS(t)
	p, m := newProxy(t, Config{Upstreams: []netip.AddrPort{hole, k.addr}})
	if got := ranked(p); !slices.Equal(got, []netip.AddrPort{hole, k.addr}) {
		t.Fatalf("rank before any query %v, want the configured order", got)
	}
	for i := range 10 {
		start := time.Now()
		resp := unpack(t, p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", dns.TypeA, uint16(i)), dialLoopback))
		took := time.Since(start)
		if resp.Rcode != dns.RcodeSuccess || !slices.Equal(addrsOf(resp), []string{"192.0.2.1"}) {
			t.Fatalf("query %d: %s %v, want the good upstream's answer", i, dns.RcodeToString[resp.Rcode], addrsOf(resp))
		}
		if took >= DefaultTimeout {
			t.Fatalf("query %d answered after %v: waited the blackhole's whole timeout", i, took)
		}
	}
	if got := ranked(p); !slices.Equal(got, []netip.AddrPort{k.addr, hole}) {
		t.Errorf("rank %v, want the good upstream first", got)
	}
	if n := asked.Load(); n != 1 {
		t.Errorf("blackhole asked %d times, want once", n)
	}
	if got := testutil.ToFloat64(m.upHedged.WithLabelValues(hole.String())); got != 1 {
		t.Errorf("redirector_dns_upstream_hedged_total{blackhole} = %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.upSRTT.WithLabelValues(k.addr.String())); got <= 0 {
		t.Errorf("redirector_dns_upstream_srtt_seconds{good} = %v, want measured", got)
	}

	// Alone, the blackhole is waited for its whole timeout: no hedge cuts it.
	p, _ = newProxy(t, Config{Upstreams: []netip.AddrPort{hole}, Timeout: 500 * time.Millisecond})
	start := time.Now()
	resp := unpack(t, p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", dns.TypeA, 11), dialLoopback))
	if took := time.Since(start); resp.Rcode != dns.RcodeServerFailure || took < 500*time.Millisecond {
		t.Errorf("blackhole alone: %s after %v, want SERVFAIL after the 500 ms timeout", dns.RcodeToString[resp.Rcode], took)
	}
}

// TestTwoDeadOfThreeReachTheThird: with the first two upstreams
// blackholed, a query with the tunnel's 10 s deadline is answered by the
// third, and the next asks it first. Before, each blackhole took its 5 s
// and the third was never asked: SERVFAIL at the deadline.
func TestTwoDeadOfThreeReachTheThird(t *testing.T) {
	hole1, asked1 := blackhole(t, "127.0.0.2")
	hole2, asked2 := blackhole(t, "127.0.0.3")
	k := startKubeDNS(t)
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{hole1, hole2, k.addr}})
	for i := range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp := unpack(t, p.Answer(ctx, client, "udp", query(t, "outside.example.org.", dns.TypeA, uint16(i)), dialLoopback))
		cancel()
		if resp.Rcode != dns.RcodeSuccess || !slices.Equal(addrsOf(resp), []string{"192.0.2.1"}) {
			t.Fatalf("query %d: %s %v, want the third upstream's answer within the deadline", i, dns.RcodeToString[resp.Rcode], addrsOf(resp))
		}
	}
	if got := ranked(p); got[0] != k.addr {
		t.Errorf("rank %v, want the live upstream first", got)
	}
	if n1, n2 := asked1.Load(), asked2.Load(); n1 != 1 || n2 != 1 {
		t.Errorf("blackholes asked %d and %d times, want once each", n1, n2)
	}
}

// TestUpstreamNotDemotedByNames: an upstream answering SERVFAIL for one
// name (the next upstream is then asked, as hickory does) or never
// answering a pod's slow names, while it answers the other queries, is not
// demoted: it stays first, and answers the other names. Only an upstream
// that answers nothing counts as failing, so one pod's names cannot steer
// every pod's queries.
//
// The test's upstreams answer from its own process, on a loaded machine
// (the other packages' tests) at times tens of milliseconds late: what the
// ranking would make of that is not what this test is about, so both
// upstreams start measured alike (a least RTT of 1 ms: one answer of 10 ms
// or more, alone, ranked the first after the other for speed), and the
// first's slow-name exchanges run to the timeout (its hedge delay set long
// by a slow name answered before: 200 ms with no answer to another query,
// its process starved, was a strike).
func TestUpstreamNotDemotedByNames(t *testing.T) {
	first := udpUpstream(t, func(q *dns.Msg, _ []byte) [][]byte {
		r := new(dns.Msg).SetReply(q)
		switch q.Question[0].Name {
		case "fail.example.org.":
			r.Rcode = dns.RcodeServerFailure
		case "slow.example.org.":
			return nil // a name whose servers never answer
		default:
			r.Answer = []dns.RR{&dns.A{Hdr: hdr(q.Question[0].Name, dns.TypeA), A: net.ParseIP("192.0.2.200")}}
		}
		b, _ := r.Pack()
		return [][]byte{b}
	})
	k := startKubeDNS(t)
	p, m := newProxy(t, Config{Upstreams: []netip.AddrPort{first, k.addr}, Timeout: time.Second})
	for _, u := range p.ups {
		u.answered(time.Now(), time.Millisecond)
	}

	for i := range 20 {
		resp := unpack(t, p.Answer(context.Background(), client, "udp", query(t, "fail.example.org.", dns.TypeA, uint16(i)), dialLoopback))
		if resp.Rcode != dns.RcodeNameError {
			t.Errorf("fail.example.org: %s, want the second upstream's NXDOMAIN", dns.RcodeToString[resp.Rcode])
		}
	}
	if got := ranked(p); !slices.Equal(got, []netip.AddrPort{first, k.addr}) {
		t.Errorf("after SERVFAILs: rank %v, want the first upstream still first", got)
	}

	// A slow name answered after 2 s: the least RTT stays, the hedge delay
	// is at its longest (2 s), beyond the timeout.
	p.ups[0].answered(time.Now(), 2*time.Second)
	if h := p.ups[0].hedge(); h <= time.Second {
		t.Fatalf("hedge delay %v after a slow answer, want over the 1 s timeout", h)
	}

	// Other pods' queries, answered by the first upstream throughout.
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var others atomic.Int32
	wg.Go(func() {
		q := new(dns.Msg).SetQuestion("other.example.org.", dns.TypeA)
		b, _ := q.Pack()
		for ctx.Err() == nil {
			resp := new(dns.Msg)
			if resp.Unpack(p.Answer(ctx, otherClient, "udp", b, dialLoopback)) == nil && slices.Equal(addrsOf(resp), []string{"192.0.2.200"}) {
				others.Add(1)
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
	var slow sync.WaitGroup
	slowQuery := query(t, "slow.example.org.", dns.TypeA, 100)
	for range 20 {
		slow.Go(func() { p.Answer(context.Background(), client, "udp", slowQuery, dialLoopback) })
	}
	slow.Wait()
	stop()
	wg.Wait()
	if got := ranked(p); !slices.Equal(got, []netip.AddrPort{first, k.addr}) {
		t.Errorf("rank %v, want the first upstream still first", got)
	}
	if got := testutil.ToFloat64(m.upStruck.WithLabelValues(first.String())); got != 0 {
		t.Errorf("redirector_dns_upstream_demotions_total{first} = %v, want 0", got)
	}
	if others.Load() == 0 {
		t.Error("no other query answered by the first upstream")
	}
	resp := unpack(t, p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", dns.TypeA, 999), dialLoopback))
	if !slices.Equal(addrsOf(resp), []string{"192.0.2.200"}) {
		t.Errorf("outside.example.org: %v, want the first upstream's answer", addrsOf(resp))
	}
}

// TestRefusedUpstreamRankedLast: an upstream whose port is closed (ICMP
// port unreachable: the exchange fails at once) is counted and ranked
// after the live one; after its probation it is asked first again, and
// ranked first once it answers.
func TestRefusedUpstreamRankedLast(t *testing.T) {
	down := closedPort(t)
	k := startKubeDNS(t)
	p, m := newProxy(t, Config{Upstreams: []netip.AddrPort{down, k.addr}})
	resp := unpack(t, p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", dns.TypeA, 1), dialLoopback))
	if resp.Rcode != dns.RcodeSuccess {
		t.Fatalf("%s, want the live upstream's answer", dns.RcodeToString[resp.Rcode])
	}
	if got := ranked(p); !slices.Equal(got, []netip.AddrPort{k.addr, down}) {
		t.Errorf("rank %v, want the refused upstream last", got)
	}
	if got := testutil.ToFloat64(m.upUnanswered.WithLabelValues(down.String())); got != 1 {
		t.Errorf("redirector_dns_upstream_unanswered_total{down} = %v, want 1", got)
	}
	// Probation over: first again, in its configured place.
	later := time.Now().Add(3 * time.Second)
	if got := rank(p.ups, later); got[0].addr != down {
		t.Errorf("rank 3 s later starts with %v, want the refused upstream on trial", got[0].addr)
	}
}

// TestRankBySpeedCoarsely: an upstream much slower than another (100 ms
// against half a millisecond) is ranked after it; upstreams alike in speed
// (a cluster's DNS at 0.5 and 3 ms) keep their configured order, so noise
// does not swap them; and the least RTT ranks, so slow answers to some
// names do not demote an upstream.
func TestRankBySpeedCoarsely(t *testing.T) {
	now := time.Now()
	order := func(rtts ...[]time.Duration) []int {
		ups := newUpstreams([]netip.AddrPort{
			netip.MustParseAddrPort("192.0.2.1:53"), netip.MustParseAddrPort("192.0.2.2:53"), netip.MustParseAddrPort("192.0.2.3:53")})
		for i, rs := range rtts {
			for _, r := range rs {
				ups[i].answered(now, r)
			}
		}
		var out []int
		for _, u := range rank(ups, now) {
			out = append(out, u.idx)
		}
		return out
	}
	ms := time.Millisecond
	for _, c := range []struct {
		name string
		rtts [][]time.Duration
		want []int
	}{
		{"alike", [][]time.Duration{{3 * ms}, {ms / 2}, {ms}}, []int{0, 1, 2}},
		{"first slow", [][]time.Duration{{100 * ms}, {ms / 2}, {ms}}, []int{1, 2, 0}},
		{"slow names", [][]time.Duration{{ms, 2 * time.Second, 3 * time.Second}, {ms / 2}, {}}, []int{0, 1, 2}},
		{"not measured", [][]time.Duration{{100 * ms}, {}, {30 * ms}}, []int{1, 2, 0}},
	} {
		if got := order(c.rtts...); !slices.Equal(got, c.want) {
			t.Errorf("%s: rank %v, want %v", c.name, got, c.want)
		}
	}
}

// TestSpeedNotRaisedBySlowNames: an upstream's least RTT rises only after
// a whole window without a faster answer: a slow answer (a pod's slow
// name) right after a window ends does not rank it after a slower
// upstream; and a measure two windows old is forgotten, so an upstream
// once ranked last for being slow is asked first again and measured anew.
func TestSpeedNotRaisedBySlowNames(t *testing.T) {
	t0 := time.Now()
	ups := newUpstreams([]netip.AddrPort{netip.MustParseAddrPort("192.0.2.1:53"), netip.MustParseAddrPort("192.0.2.2:53")})
	first := func(now time.Time) int { return rank(ups, now)[0].idx }
	ups[0].answered(t0, time.Millisecond)
	ups[1].answered(t0, 100*time.Millisecond)
	if got := first(t0); got != 0 {
		t.Fatalf("first %d, want the fast upstream", got)
	}
	t1 := t0.Add(minRTTWindow + time.Second)
	ups[0].answered(t1, 3*time.Second)
	if got := first(t1); got != 0 {
		t.Errorf("after one slow answer in a new window: first %d, want the fast upstream still", got)
	}
	t2 := t1.Add(minRTTWindow + time.Second)
	ups[0].answered(t2, 3*time.Second)
	ups[1].answered(t2, 100*time.Millisecond)
	if got := first(t2); got != 1 {
		t.Errorf("after a window of slow answers only: first %d, want the other", got)
	}
	t3 := t2.Add(2*minRTTWindow + time.Second)
	ups[1].answered(t3, 100*time.Millisecond)
	if got := first(t3); got != 0 {
		t.Errorf("two windows later: first %d, want the upstream unmeasured since, in its configured place", got)
	}
}
