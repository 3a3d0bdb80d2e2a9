package dnsproxy

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestClientDialFailuresNotTheUpstreams: a forwarded query's socket is made
// in the client pod's namespace, so a failure to make it is the pod's: a
// pod that narrowed net.ipv4.ip_local_port_range (a sysctl Kubernetes lets
// any pod set) and holds its ports gets EAGAIN, one with NET_ADMIN that
// deleted its routes ENETUNREACH. Counted against the upstream, each such
// query put the first upstream on probation for every pod of the node (no
// answer came between its "sending" and its failure), so one pod steered
// every pod's forwarded queries to the upstreams it left alone, as the
// tunnel's endpointFailed refuses for service endpoints.
func TestClientDialFailuresNotTheUpstreams(t *testing.T) {
	first, second := startKubeDNS(t), startKubeDNS(t)
	p, m := newProxy(t, Config{Upstreams: []netip.AddrPort{first.addr, second.addr}})
	for _, errno := range []syscall.Errno{syscall.EAGAIN, syscall.EADDRNOTAVAIL, syscall.ENETUNREACH} {
		failing := func(ctx context.Context, network, addr string) (net.Conn, error) {
			return nil, fmt.Errorf("connect in the pod's namespace: %w", errno)
		}
		for i := range 3 {
			resp := unpack(t, p.Answer(context.Background(), client, "udp", query(t, "outside.example.org.", dns.TypeA, uint16(i)), failing))
			if resp.Rcode != dns.RcodeServerFailure {
				t.Fatalf("%v: query answered %s, want SERVFAIL", errno, dns.RcodeToString[resp.Rcode])
			}
		}
	}
	for _, u := range []netip.AddrPort{first.addr, second.addr} {
		if got := testutil.ToFloat64(m.upStruck.WithLabelValues(u.String())); got != 0 {
			t.Errorf("redirector_dns_upstream_demotions_total{%s} = %v after the client's own dials failed, want 0", u, got)
		}
		if got := testutil.ToFloat64(m.upUnanswered.WithLabelValues(u.String())); got != 0 {
			t.Errorf("redirector_dns_upstream_unanswered_total{%s} = %v after no exchange with it began, want 0", u, got)
		}
	}
	if got := ranked(p); !slices.Equal(got, []netip.AddrPort{first.addr, second.addr}) {
		t.Errorf("rank %v after one pod's dials failed, want the configured order", got)
	}
	for _, u := range p.ups {
		if probation, strikes, _ := u.state(time.Now()); probation || u.hedge() == minHedge {
			t.Errorf("upstream %s on probation (%d failures) after one pod's dials failed", u.addr, strikes)
		}
	}
}
