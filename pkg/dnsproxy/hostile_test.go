package dnsproxy

import (
	"context"
	"encoding/binary"
	"net/netip"
	"slices"
	"testing"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestHostileQueries: what is not one well-formed query gets a cheap,
// clear answer (FORMERR, NOTIMP, BADVERS) or, too short to carry an ID,
// nothing; none goes upstream, each is counted by reason.
func TestHostileQueries(t *testing.T) {
	k := startKubeDNS(t)
	p, m := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}})

	good := query(t, "outside.example.org.", dns.TypeA, 0x1234)
	edit := func(f func(*dns.Msg)) []byte {
		q := new(dns.Msg)
		if err := q.Unpack(good); err != nil {
			t.Fatal(err)
		}
		f(q)
		b, err := q.Pack()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	withName := func(labels ...string) []byte {
		// The wire form by hand: miekg would refuse to pack these.
		b := slices.Clone(good[:12])
		for _, l := range labels {
			b = append(b, byte(len(l)))
			b = append(b, l...)
		}
		return append(b, 0, 0, 1, 0, 1)
	}
	for _, c := range []struct {
		name   string
		query  []byte
		rcode  int // -1: dropped
		reason string
	}{
		{"empty", nil, -1, "short"},
		{"short", good[:7], -1, "short"},
		{"question missing", good[:12], dns.RcodeFormatError, "question_count"},
		{"cut question", good[:20], dns.RcodeFormatError, "malformed"},
		{"garbage after header", append(slices.Clone(good[:12]), 0xc0, 0xff, 0xc0, 0x0c), dns.RcodeFormatError, "malformed"},
		{"zero questions", edit(func(q *dns.Msg) { q.Question = nil }), dns.RcodeFormatError, "question_count"},
		{"two questions", edit(func(q *dns.Msg) {
			q.Question = append(q.Question, dns.Question{Name: "b.example.", Qtype: dns.TypeA, Qclass: dns.ClassINET})
		}), dns.RcodeFormatError, "question_count"},
		{"response", edit(func(q *dns.Msg) { q.Response = true }), dns.RcodeFormatError, "response"},
		{"notify", edit(func(q *dns.Msg) { q.Opcode = dns.OpcodeNotify }), dns.RcodeNotImplemented, "opcode"},
		{"update", edit(func(q *dns.Msg) { q.Opcode = dns.OpcodeUpdate }), dns.RcodeNotImplemented, "opcode"},
		{"oversized", append(slices.Clone(good), make([]byte, MaxQueryLen)...), dns.RcodeFormatError, "oversized"},
		{"space in name", withName("a b", "example"), dns.RcodeFormatError, "invalid_name"},
		{"NUL in name", withName("a\x00", "example"), dns.RcodeFormatError, "invalid_name"},
		{"dot in label", withName("a.b", "example"), dns.RcodeFormatError, "invalid_name"},
		{"binary label", withName("\xff\xfe", "example"), dns.RcodeFormatError, "invalid_name"},
		{"two OPT", edit(func(q *dns.Msg) { q.SetEdns0(1232, false); q.Extra = append(q.Extra, q.Extra[0]) }), dns.RcodeFormatError, "malformed"},
		{"EDNS version 1", edit(func(q *dns.Msg) { q.SetEdns0(1232, false); q.IsEdns0().SetVersion(1) }), dns.RcodeBadVers, "edns_version"},
	} {
		before := testutil.ToFloat64(m.rejected.WithLabelValues(c.reason))
		for _, network := range []string{"udp", "tcp"} {
			answer := p.Answer(context.Background(), client, network, c.query, dialLoopback)
			if c.rcode < 0 {
				if answer != nil {
					t.Errorf("%s: answered %x, want dropped", c.name, answer)
				}
				continue
			}
			if len(answer) < 12 {
				t.Fatalf("%s %s: answer %x, want a header at least", c.name, network, answer)
			}
			resp := unpack(t, answer)
			rcode := resp.Rcode
			if id := binary.BigEndian.Uint16(answer); id != 0x1234 || !resp.Response || rcode != c.rcode {
				t.Errorf("%s %s: id %#x qr %v %s, want id 0x1234, a response, %s", c.name, network, id, resp.Response,
					dns.RcodeToString[rcode], dns.RcodeToString[c.rcode])
			}
		}
		if got := testutil.ToFloat64(m.rejected.WithLabelValues(c.reason)) - before; got != 2 {
			t.Errorf("%s: redirector_dns_rejected_total{reason=%q} went up by %v, want 2", c.name, c.reason, got)
		}
	}
	if q := k.queries(); len(q) > 0 {
		t.Errorf("upstream asked %v, want nothing", q)
	}
	if got := testutil.CollectAndCount(m.requests); got != 0 {
		t.Errorf("istio_dns_requests_total: %d series, want none for rejected queries", got)
	}
	// The well-formed query itself is answered: the cases above fail for
	// what they break, not for the base.
	if resp := unpack(t, p.Answer(context.Background(), client, "udp", good, dialLoopback)); resp.Rcode != dns.RcodeSuccess {
		t.Errorf("good query: %s", dns.RcodeToString[resp.Rcode])
	}
}

// TestUnknownClientServfail: a query from no pod the tunnel knows gets
// SERVFAIL, as ztunnel's, and is counted with unknown labels.
func TestUnknownClientServfail(t *testing.T) {
	p, m := newProxy(t, Config{})
	resp := unpack(t, p.Answer(context.Background(), nil, "udp", query(t, "reviews.mesh.svc.cluster.local.", dns.TypeA, 3), dialLoopback))
	if resp.Rcode != dns.RcodeServerFailure {
		t.Errorf("%s, want SERVFAIL", dns.RcodeToString[resp.Rcode])
	}
	if got := testutil.ToFloat64(m.requests.WithLabelValues("a", "udp", "unknown", "unknown")); got != 1 {
		t.Errorf("istio_dns_requests_total{unknown} = %v", got)
	}
}
