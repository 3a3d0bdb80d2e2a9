package dnsproxy

import (
	"context"
	"encoding/binary"
	"testing"

	"github.com/miekg/dns"
)

// FuzzAnswer feeds Answer arbitrary bytes, over UDP and TCP: it must
// never panic, drop only what is too short to carry an ID, and otherwise
// answer with a well-formed response bearing the query's ID that fits
// the client's buffer. Forwarding has no upstream here (SERVFAIL), so the
// fuzzer stays off the network. Seeds: testdata/fuzz/FuzzAnswer.
func FuzzAnswer(f *testing.F) {
	for _, name := range []string{"reviews.", "reviews.mesh.mesh.svc.cluster.local.", "big.mesh.svc.cluster.local.", "foo.wild.example.com.", "outside.example.org."} {
		for _, qtype := range []uint16{dns.TypeA, dns.TypeAAAA, dns.TypeMX} {
			q := new(dns.Msg).SetQuestion(name, qtype)
			q.SetEdns0(1232, true)
			b, _ := q.Pack()
			f.Add(b, false)
		}
	}
	p, _ := newProxy(f, Config{})
	f.Fuzz(func(t *testing.T, query []byte, tcp bool) {
		proto := "udp"
		if tcp {
			proto = "tcp"
		}
		answer := p.Answer(context.Background(), client, proto, query, dialLoopback)
		if len(query) < headerLen {
			if answer != nil {
				t.Fatalf("answered a %d-byte query", len(query))
			}
			return
		}
		if len(answer) < headerLen {
			t.Fatalf("answer %x to a %d-byte query", answer, len(query))
		}
		if binary.BigEndian.Uint16(answer) != binary.BigEndian.Uint16(query) || answer[2]&0x80 == 0 {
			t.Fatalf("answer %x: not a response with the query's ID", answer[:4])
		}
		resp := new(dns.Msg)
		if err := resp.Unpack(answer); err != nil {
			t.Fatalf("answer does not parse: %v", err)
		}
		limit := dns.MaxMsgSize
		if !tcp {
			limit = dns.MinMsgSize
			req := new(dns.Msg)
			if req.Unpack(query) == nil && req.IsEdns0() != nil {
				limit = max(limit, int(req.IsEdns0().UDPSize()))
			}
		}
		if len(answer) > limit {
			t.Fatalf("answer of %d bytes over %s, client takes %d", len(answer), proto, limit)
		}
	})
}
