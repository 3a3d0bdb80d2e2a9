package dnsproxy

import (
	"context"
	"encoding/binary"
	"net"
	"net/netip"
	"testing"
	"time"

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

// FuzzUpstreamAnswer has an upstream answer a forwarded query with
// arbitrary bytes (under the query's ID), over UDP and, for a TCP client
// after a truncated answer, TCP: the client must get, at once, a response
// with its ID that fits its buffer and parses, or has TC set (a truncated
// answer is passed on as the upstream cut it). The upstream is a pipe, so
// the fuzzer stays off the network.
func FuzzUpstreamAnswer(f *testing.F) {
	q := new(dns.Msg).SetQuestion("outside.example.org.", dns.TypeA)
	r := new(dns.Msg).SetReply(q)
	for i := range 60 {
		r.Answer = append(r.Answer, &dns.A{Hdr: hdr(q.Question[0].Name, dns.TypeA), A: net.IPv4(192, 0, 2, byte(i+1))})
	}
	b, _ := r.Pack()
	f.Add(b, false, uint16(0))
	f.Add(b[:300], true, uint16(1232))
	r.Extra = append(r.Extra, &dns.TSIG{Hdr: dns.RR_Header{Name: "key.", Rrtype: dns.TypeTSIG, Class: dns.ClassANY},
		Algorithm: dns.HmacSHA256, TimeSigned: 1, Fudge: 300})
	b, _ = r.Pack()
	f.Add(b, false, uint16(0))
	p, _ := newProxy(f, Config{Upstreams: []netip.AddrPort{netip.MustParseAddrPort("192.0.2.53:53")}, Timeout: 50 * time.Millisecond})
	f.Fuzz(func(t *testing.T, resp []byte, tcp bool, edns uint16) {
		dial := func(_ context.Context, network, _ string) (net.Conn, error) {
			ours, theirs := net.Pipe()
			go func() {
				defer theirs.Close()
				if network == "tcp" {
					var size [2]byte
					if _, err := theirs.Read(size[:]); err != nil {
						return
					}
				}
				query := make([]byte, MaxQueryLen)
				if n, err := theirs.Read(query); err != nil || n < 2 {
					return
				}
				out := append([]byte(nil), resp...)
				if len(out) >= 2 {
					copy(out, query[:2])
				}
				if network == "tcp" {
					out = append(binary.BigEndian.AppendUint16(nil, uint16(len(out))), out...)
				}
				theirs.Write(out)
			}()
			return ours, nil
		}
		req := new(dns.Msg).SetQuestion("outside.example.org.", dns.TypeA)
		req.Id = 77
		if edns > 0 {
			req.SetEdns0(edns, false)
		}
		query, _ := req.Pack()
		proto := "udp"
		if tcp {
			proto = "tcp"
		}
		answer := p.Answer(context.Background(), client, proto, query, dial)
		if len(answer) < headerLen || binary.BigEndian.Uint16(answer) != 77 || answer[2]&0x80 == 0 {
			t.Fatalf("answer %x: not a response with the query's ID", answer)
		}
		if size := clientSize(req, tcp); len(answer) > size {
			t.Fatalf("answer of %d bytes over %s, client takes %d", len(answer), proto, size)
		}
		if err := new(dns.Msg).Unpack(answer); err != nil && answer[2]&0x02 == 0 {
			t.Fatalf("answer does not parse and is not truncated: %v", err)
		}
	})
}
