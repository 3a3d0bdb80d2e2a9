package dnsproxy

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestUpstreamErrorWithoutQuestion: an upstream that refuses a query with
// a bare header (no question, no records: miekg's server, so CoreDNS, does
// so for a query with more than one answer or authority record or two
// additional ones; unbound for any answer record) is taken at once, and the
// client gets that rcode with its own question. Before, such an answer was
// ignored as if spoofed: the client waited every upstream's timeout for a
// SERVFAIL. A bare header claiming success, or carrying records, is still
// ignored.
func TestUpstreamErrorWithoutQuestion(t *testing.T) {
	t.Run("coredns", func(t *testing.T) {
		k := startKubeDNS(t)
		p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}, Timeout: 2 * time.Second})
		q := new(dns.Msg).SetQuestion("outside.example.org.", dns.TypeA)
		q.Id = 21
		for range 3 {
			q.Extra = append(q.Extra, &dns.TXT{Hdr: hdr("x.example.org.", dns.TypeTXT), Txt: []string{"x"}})
		}
		b, err := q.Pack()
		if err != nil {
			t.Fatal(err)
		}
		for _, network := range []string{"udp", "tcp"} {
			start := time.Now()
			resp := unpack(t, p.Answer(context.Background(), client, network, b, dialLoopback))
			if took := time.Since(start); resp.Rcode != dns.RcodeFormatError || took > time.Second {
				t.Errorf("%s: %s after %v, want the upstream's FORMERR at once", network, dns.RcodeToString[resp.Rcode], took)
			}
			if resp.Id != 21 || len(resp.Question) != 1 || resp.Question[0].Name != "outside.example.org." {
				t.Errorf("%s: id %d question %v, want the client's", network, resp.Id, resp.Question)
			}
		}
	})

	bare := func(rcode int, records bool) func(q *dns.Msg, raw []byte) [][]byte {
		return func(q *dns.Msg, _ []byte) [][]byte {
			r := new(dns.Msg)
			r.Id, r.Response, r.Rcode = q.Id, true, rcode
			if records {
				r.Answer = []dns.RR{&dns.A{Hdr: hdr(q.Question[0].Name, dns.TypeA), A: net.ParseIP("203.0.113.9")}}
			}
			b, _ := r.Pack()
			return [][]byte{b}
		}
	}
	for _, c := range []struct {
		name   string
		answer func(q *dns.Msg, raw []byte) [][]byte
		rcode  int
		fast   bool
	}{
		{"formerr", bare(dns.RcodeFormatError, false), dns.RcodeFormatError, true},
		{"notimp", bare(dns.RcodeNotImplemented, false), dns.RcodeNotImplemented, true},
		{"refused", bare(dns.RcodeRefused, false), dns.RcodeRefused, true},
		{"noerror", bare(dns.RcodeSuccess, false), dns.RcodeServerFailure, false},
		{"noerror with records", bare(dns.RcodeSuccess, true), dns.RcodeServerFailure, false},
		{"formerr with records", bare(dns.RcodeFormatError, true), dns.RcodeServerFailure, false},
	} {
		up := udpUpstream(t, c.answer)
		p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{up}, Timeout: 500 * time.Millisecond})
		start := time.Now()
		resp := unpack(t, p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", dns.TypeA, 22), dialLoopback))
		took := time.Since(start)
		if resp.Rcode != c.rcode || resp.Id != 22 || len(resp.Question) != 1 || len(resp.Answer) != 0 {
			t.Errorf("%s: %s id %d, %d questions, %d answers; want %s id 22 with the question, no answer",
				c.name, dns.RcodeToString[resp.Rcode], resp.Id, len(resp.Question), len(resp.Answer), dns.RcodeToString[c.rcode])
		}
		if c.fast && took > 250*time.Millisecond {
			t.Errorf("%s: answered after %v, want at once", c.name, took)
		}
	}
}

// TestUpstreamTruncatedMidRecord: an answer with TC set whose records are
// cut short (the client is to discard them and ask over TCP, RFC 2181 9)
// is judged by its header and question: the UDP client gets it, or if it
// is longer than the client takes its header and question with TC set, at
// once. Before, it did not parse and was ignored: SERVFAIL after the
// timeout, and a client that would have retried over TCP failed.
func TestUpstreamTruncatedMidRecord(t *testing.T) {
	for _, cut := range []int{500, 1000} {
		up := udpUpstream(t, func(q *dns.Msg, _ []byte) [][]byte {
			r := new(dns.Msg).SetReply(q)
			for i := range 100 {
				r.Answer = append(r.Answer, &dns.A{Hdr: hdr(q.Question[0].Name, dns.TypeA), A: net.IPv4(192, 0, 2, byte(i+1))})
			}
			r.Truncated = true
			b, _ := r.Pack()
			return [][]byte{b[:cut]}
		})
		p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{up}, Timeout: 500 * time.Millisecond})
		start := time.Now()
		raw := p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", dns.TypeA, 23), dialLoopback)
		took := time.Since(start)
		if len(raw) < headerLen || raw[2]&0x02 == 0 || len(raw) > dns.MinMsgSize || raw[0] != 0 || raw[1] != 23 || raw[3]&0xf != dns.RcodeSuccess {
			t.Errorf("cut at %d: answer %d bytes %x..., want at most 512, id 23, NOERROR, TC set", cut, len(raw), raw[:min(len(raw), 4)])
		}
		if took > 250*time.Millisecond {
			t.Errorf("cut at %d: answered after %v, want at once", cut, took)
		}
	}
}

// TestAnswerAlwaysFitsTheClient: an answer over UDP is never longer than
// the client takes, nor than a UDP datagram carries, even where miekg's
// Truncate cannot shorten it (it leaves an answer with a TSIG record
// whole, and cannot cut an OPT record longer than the client's size):
// then the client gets the header and question, TC set, and asks over
// TCP. Before, such answers went out whole (2 KB to a 512-byte client),
// and a mesh answer for a client announcing 65535 bytes could exceed
// what a datagram carries (65507 bytes over IPv4), so it was never sent.
func TestAnswerAlwaysFitsTheClient(t *testing.T) {
	many := func(q *dns.Msg) *dns.Msg {
		r := new(dns.Msg).SetReply(q)
		for i := range 100 {
			r.Answer = append(r.Answer, &dns.A{Hdr: hdr(q.Question[0].Name, dns.TypeA), A: net.IPv4(192, 0, 2, byte(i+1))})
		}
		return r
	}
	for _, c := range []struct {
		name string
		edit func(r *dns.Msg)
	}{
		{"tsig", func(r *dns.Msg) {
			r.Extra = append(r.Extra, &dns.TSIG{Hdr: dns.RR_Header{Name: "key.", Rrtype: dns.TypeTSIG, Class: dns.ClassANY},
				Algorithm: dns.HmacSHA256, TimeSigned: 1, Fudge: 300, OrigId: r.Id})
		}},
		{"long opt", func(r *dns.Msg) {
			r.SetEdns0(4096, false)
			opt := r.IsEdns0()
			opt.Option = append(opt.Option, &dns.EDNS0_PADDING{Padding: make([]byte, 600)})
		}},
	} {
		up := udpUpstream(t, func(q *dns.Msg, _ []byte) [][]byte {
			r := many(q)
			c.edit(r)
			b, err := r.Pack()
			if err != nil {
				panic(err)
			}
			return [][]byte{b}
		})
		p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{up}, Timeout: time.Second})
		raw := p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", dns.TypeA, 24), dialLoopback)
		resp := unpack(t, raw)
		if len(raw) > dns.MinMsgSize || !resp.Truncated || resp.Id != 24 || len(resp.Question) != 1 {
			t.Errorf("%s: %d bytes, TC %v, id %d; want at most 512, TC, id 24, the question", c.name, len(raw), resp.Truncated, resp.Id)
		}
	}

	// A headless service with more ready endpoints than a datagram holds.
	var eps []workload.Endpoint
	for i := range 5000 {
		eps = append(eps, workload.Endpoint{Addr: netip.AddrFrom4([4]byte{10, 2, byte(i / 250), byte(1 + i%250)}), Ready: true})
	}
	huge := &workload.Service{Name: "huge", Namespace: "mesh", Hostname: workload.ClusterHostname("huge", "mesh"), Endpoints: eps}
	dir, errs := workload.NewDirectory([]*workload.Workload{client}, []*workload.Service{huge})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	p, err := New(Config{}, func() *workload.Directory { return dir }, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	q := new(dns.Msg).SetQuestion("huge.mesh.svc.cluster.local.", dns.TypeA)
	q.SetEdns0(dns.MaxMsgSize, false)
	b, _ := q.Pack()
	raw := p.Answer(context.Background(), client, "udp", b, dialLoopback)
	resp := unpack(t, raw)
	if len(raw) > maxUDPPayload || !resp.Truncated {
		t.Errorf("huge headless service: %d bytes, TC %v; want at most %d, TC", len(raw), resp.Truncated, maxUDPPayload)
	}
	// And it is sent: a datagram that size goes over IPv4 loopback.
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	if _, err := pc.WriteTo(raw, pc.LocalAddr()); err != nil {
		t.Errorf("sending the answer: %v", err)
	}
}
