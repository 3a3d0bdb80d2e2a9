package dnsproxy

import (
	"context"
	"encoding/binary"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestForwardedAnswerUnchangedButID: a name outside the mesh goes to the
// upstream (under another ID) and its answer comes back byte for byte,
// but for the client's ID; the query and the forwarding are counted
// with ztunnel's labels.
func TestForwardedAnswerUnchangedButID(t *testing.T) {
	k := startKubeDNS(t)
	p, m := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}})
	for _, edns := range []uint16{0, 1232} {
		q := new(dns.Msg).SetQuestion("outside.example.org.", dns.TypeA)
		q.Id = 4242
		if edns > 0 {
			q.SetEdns0(edns, true)
		}
		b, err := q.Pack()
		if err != nil {
			t.Fatal(err)
		}
		answer := p.Answer(context.Background(), client, "udp", b, dialLoopback)
		upstream := slices.Clone(k.lastReply())
		if upstream == nil {
			t.Fatal("upstream not asked")
		}
		binary.BigEndian.PutUint16(upstream, 4242)
		if !slices.Equal(answer, upstream) {
			t.Errorf("edns %d: answer\n%x\nwant the upstream's with the client's ID\n%x", edns, answer, upstream)
		}
		if resp := unpack(t, answer); !slices.Equal(addrsOf(resp), []string{"192.0.2.1"}) || resp.Authoritative {
			t.Errorf("edns %d: %v", edns, resp)
		}
	}
	// NXDOMAIN from upstream is passed on as it is.
	resp := unpack(t, p.Answer(context.Background(), client, "tcp", query(t, "nowhere.example.org.", dns.TypeA, 7), dialLoopback))
	if resp.Rcode != dns.RcodeNameError || resp.Id != 7 {
		t.Errorf("nowhere: %s id %d, want NXDOMAIN id 7", dns.RcodeToString[resp.Rcode], resp.Id)
	}

	udpA := []string{"a", "udp", "app", "v1"}
	if got := testutil.ToFloat64(m.requests.WithLabelValues(udpA...)); got != 2 {
		t.Errorf("istio_dns_requests_total{a,udp,app,v1} = %v, want 2", got)
	}
	if got := testutil.ToFloat64(m.upstreamRequests.WithLabelValues("a", "tcp", "app", "v1")); got != 1 {
		t.Errorf("istio_dns_upstream_requests_total{a,tcp} = %v, want 1", got)
	}
	if got := testutil.CollectAndCount(m.upstreamDuration); got != 2 {
		t.Errorf("istio_dns_upstream_request_duration_seconds: %d series, want 2 (udp, tcp)", got)
	}
	if got := testutil.CollectAndCount(m.upstreamFailures); got != 0 {
		t.Errorf("istio_dns_upstream_failures_total: %d series, want none (NXDOMAIN is an answer)", got)
	}
	// A query type outside the fixed set is labelled "other".
	p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", 65280, 8), dialLoopback)
	if got := testutil.ToFloat64(m.requests.WithLabelValues("other", "udp", "app", "v1")); got != 1 {
		t.Errorf("istio_dns_requests_total{other} = %v, want 1", got)
	}
}

// TestUpstreamDown: with every upstream down (or none), a forwarded
// query is SERVFAIL, soon, and counted as an upstream failure; with the
// first down, the next one answers.
func TestUpstreamDown(t *testing.T) {
	down := closedPort(t)
	k := startKubeDNS(t)
	for _, c := range []struct {
		name      string
		upstreams []netip.AddrPort
		rcode     int
	}{
		{"down", []netip.AddrPort{down}, dns.RcodeServerFailure},
		{"none", nil, dns.RcodeServerFailure},
		{"first down", []netip.AddrPort{down, k.addr}, dns.RcodeSuccess},
	} {
		p, m := newProxy(t, Config{Upstreams: c.upstreams, Timeout: 2 * time.Second})
		for _, network := range []string{"udp", "tcp"} {
			start := time.Now()
			resp := unpack(t, p.Answer(context.Background(), client, network, query(t, "outside.example.org.", dns.TypeA, 99), dialLoopback))
			if resp.Rcode != c.rcode || resp.Id != 99 || !resp.Response {
				t.Errorf("%s %s: %s id %d, want %s id 99", c.name, network, dns.RcodeToString[resp.Rcode], resp.Id, dns.RcodeToString[c.rcode])
			}
			if took := time.Since(start); took > time.Second {
				t.Errorf("%s %s: took %v; a refused port should fail at once", c.name, network, took)
			}
			failures := testutil.ToFloat64(m.upstreamFailures.WithLabelValues("a", network, "app", "v1"))
			if want := map[bool]float64{true: 1, false: 0}[c.rcode != dns.RcodeSuccess]; failures != want {
				t.Errorf("%s %s: istio_dns_upstream_failures_total = %v, want %v", c.name, network, failures, want)
			}
		}
	}
}

// closedPort is a loopback port nothing listens on (UDP and TCP): queries
// to it are refused at once.
func closedPort(t *testing.T) netip.AddrPort {
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := pc.LocalAddr().(*net.UDPAddr).AddrPort()
	pc.Close()
	return a
}

// TestUpstreamAnswerMustMatch: datagrams that do not answer the query
// (another ID, another question, not a response, garbage) are never
// passed on; the proxy waits for the real answer, or SERVFAILs at the
// timeout.
func TestUpstreamAnswerMustMatch(t *testing.T) {
	for _, honest := range []bool{true, false} {
		up := liar(t, honest)
		p, m := newProxy(t, Config{Upstreams: []netip.AddrPort{up}, Timeout: 500 * time.Millisecond})
		resp := unpack(t, p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", dns.TypeA, 5), dialLoopback))
		want := []string{"192.0.2.1"}
		if !honest {
			want = nil
		}
		if !slices.Equal(addrsOf(resp), want) || resp.Id != 5 {
			t.Errorf("honest %v: answer %v id %d, want %v", honest, addrsOf(resp), resp.Id, want)
		}
		if !honest && (resp.Rcode != dns.RcodeServerFailure || testutil.ToFloat64(m.upstreamFailures.WithLabelValues("a", "udp", "app", "v1")) != 1) {
			t.Errorf("liar: %s, want SERVFAIL counted as an upstream failure", dns.RcodeToString[resp.Rcode])
		}
	}
}

// liar is an upstream that first sends answers that are not answers to
// the query: another ID, another name, the query itself, garbage; then,
// if honest, the real answer.
func liar(t *testing.T, honest bool) netip.AddrPort {
	return udpUpstream(t, func(q *dns.Msg, raw []byte) [][]byte {
		reply := func(edit func(*dns.Msg)) []byte {
			r := new(dns.Msg).SetReply(q)
			r.Answer = []dns.RR{&dns.A{Hdr: hdr(q.Question[0].Name, dns.TypeA), A: net.ParseIP("192.0.2.1")}}
			edit(r)
			b, _ := r.Pack()
			return b
		}
		out := [][]byte{
			reply(func(r *dns.Msg) { r.Id++; r.Answer[0].(*dns.A).A = net.ParseIP("203.0.113.1") }),
			reply(func(r *dns.Msg) {
				r.Question[0].Name = "evil.example."
				r.Answer[0].(*dns.A).A = net.ParseIP("203.0.113.2")
			}),
			reply(func(r *dns.Msg) { r.Question[0].Qtype = dns.TypeAAAA }),
			reply(func(r *dns.Msg) { r.Response = false }),
			append(slices.Clone(raw[:2]), 0x81, 0x80, 0, 1, 0, 1, 0xff, 0xff),
		}
		if honest {
			out = append(out, reply(func(*dns.Msg) {}))
		}
		return out
	})
}

// TestTruncation: over UDP an answer fits the client's buffer, 512 bytes
// or its EDNS0 size, with TC set when records were left out: answers
// from the mesh, and forwarded ones; over TCP it is whole, the proxy
// asking upstream again over TCP when the UDP answer was truncated.
func TestTruncation(t *testing.T) {
	k := startKubeDNS(t)
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}})
	addr := serve(t, p, client)
	for _, name := range []string{"big.mesh.svc.cluster.local.", "big.example.org."} {
		for _, c := range []struct {
			network   string
			edns      uint16
			truncated bool
			maxLen    int
		}{
			{"udp", 0, true, 512},
			{"udp", 1000, true, 1000},
			{"udp", 4096, false, 4096},
			{"tcp", 0, false, 65535},
		} {
			q := new(dns.Msg).SetQuestion(name, dns.TypeA)
			q.Id = 77
			if c.edns > 0 {
				q.SetEdns0(c.edns, false)
			}
			b, _ := q.Pack()
			raw := p.Answer(context.Background(), client, c.network, b, dialLoopback)
			resp := unpack(t, raw)
			if len(raw) > c.maxLen || resp.Truncated != c.truncated {
				t.Errorf("%s %s edns %d: %d bytes, TC %v; want at most %d, TC %v", name, c.network, c.edns, len(raw), resp.Truncated, c.maxLen, c.truncated)
			}
			if !c.truncated && len(resp.Answer) != 100 {
				t.Errorf("%s %s edns %d: %d answers, want all 100", name, c.network, c.edns, len(resp.Answer))
			}
			if c.truncated && (len(resp.Answer) == 0 || len(resp.Answer) >= 100) && name == "big.mesh.svc.cluster.local." {
				t.Errorf("%s %s edns %d: %d answers, want as many as fit", name, c.network, c.edns, len(resp.Answer))
			}
		}
	}
	if q := k.queries(); !slices.Contains(q, "tcp big.example.org. A") {
		t.Errorf("upstream asked %v: want the truncated answer asked again over TCP for the TCP client", q)
	}
	// A real client over UDP retries over TCP on TC and gets everything.
	resp := ask(t, "udp", addr, "big.mesh.svc.cluster.local.", dns.TypeA, 0)
	if !resp.Truncated {
		t.Errorf("udp client: not truncated")
	}
	if resp = ask(t, "tcp", addr, "big.mesh.svc.cluster.local.", dns.TypeA, 0); len(resp.Answer) != 100 {
		t.Errorf("tcp client: %d answers, want 100", len(resp.Answer))
	}
}

// TestUpstreamIgnoringClientSize: an upstream answering over UDP with more
// than the client's buffer (512 bytes, or its EDNS0 size) allows is
// passed on truncated to fit, TC set, at once. Before, such an answer was
// dropped as if it were no answer: the client waited the whole timeout for
// a SERVFAIL, though forward truncates such answers itself.
func TestUpstreamIgnoringClientSize(t *testing.T) {
	up := udpUpstream(t, func(q *dns.Msg, _ []byte) [][]byte {
		r := new(dns.Msg).SetReply(q)
		for i := range 60 { // about 1 KB: over 512
			r.Answer = append(r.Answer, &dns.A{Hdr: hdr(q.Question[0].Name, dns.TypeA), A: net.IPv4(192, 0, 2, byte(i+1))})
		}
		b, _ := r.Pack()
		return [][]byte{b}
	})
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{up}, Timeout: 2 * time.Second})
	start := time.Now()
	raw := p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", dns.TypeA, 9), dialLoopback)
	took := time.Since(start)
	resp := unpack(t, raw)
	if resp.Rcode != dns.RcodeSuccess || !resp.Truncated || len(raw) > 512 || len(resp.Answer) == 0 || resp.Id != 9 {
		t.Errorf("answer %s, TC %v, %d bytes, %d records, id %d; want NOERROR truncated to 512 bytes with the records that fit",
			dns.RcodeToString[resp.Rcode], resp.Truncated, len(raw), len(resp.Answer), resp.Id)
	}
	if took > time.Second {
		t.Errorf("answered after %v: the upstream's answer was not taken", took)
	}
}
