package dnsproxy

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/miekg/dns"
)

// TestMeshServiceInEverySearchForm resolves a service by every name a
// pod's resolver sends for it (short, with the namespace, with svc, the
// FQDN, and those with a search domain appended), over UDP and TCP: all
// are answered from the mesh, authoritatively, without asking upstream.
func TestMeshServiceInEverySearchForm(t *testing.T) {
	k := startKubeDNS(t)
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}})
	addr := serve(t, p, client)

	for _, c := range []struct {
		name  string
		want  []string
		cname string // the CNAME target, when a search domain was taken off
	}{
		{name: "reviews.", want: []string{"10.96.0.10"}},
		{name: "reviews.mesh.", want: []string{"10.96.0.10"}},
		{name: "reviews.mesh.svc.", want: []string{"10.96.0.10"}},
		{name: "reviews.mesh.svc.cluster.local.", want: []string{"10.96.0.10"}},
		{name: "REVIEWS.Mesh.svc.cluster.local.", want: []string{"10.96.0.10"}},
		// glibc with ndots:5 tries "reviews.mesh" in the pod's search
		// domains first.
		{name: "reviews.mesh.mesh.svc.cluster.local.", want: []string{"10.96.0.10"}, cname: "reviews.mesh."},
		{name: "reviews.mesh.svc.cluster.local.", want: []string{"10.96.0.10"}},
		{name: "ratings.other.svc.cluster.local.", want: []string{"10.96.0.20"}},
		{name: "ratings.other.", want: []string{"10.96.0.20"}},
		{name: "ratings.other.mesh.svc.cluster.local.", want: []string{"10.96.0.20"}, cname: "ratings.other."},
		{name: "ratings.other.svc.cluster.local.", want: []string{"10.96.0.20"}},
		{name: "dual.mesh.", want: []string{"10.96.0.11"}},
		{name: "db.mesh.svc.cluster.local.", want: []string{"10.0.0.1", "10.0.0.2", "10.0.0.3"}}, // headless: ready endpoints
	} {
		for _, network := range []string{"udp", "tcp"} {
			resp := ask(t, network, addr, c.name, dns.TypeA, 0)
			if resp.Rcode != dns.RcodeSuccess || !resp.Authoritative || !resp.RecursionAvailable {
				t.Errorf("%s %s: rcode %s aa %v ra %v, want NOERROR, authoritative, recursion available",
					network, c.name, dns.RcodeToString[resp.Rcode], resp.Authoritative, resp.RecursionAvailable)
			}
			if got := addrsOf(resp); !slices.Equal(got, c.want) {
				t.Errorf("%s %s: %v, want %v", network, c.name, got, c.want)
			}
			owner := c.name
			if c.cname != "" {
				cn, ok := resp.Answer[0].(*dns.CNAME)
				if !ok || cn.Hdr.Name != c.name || cn.Target != c.cname {
					t.Errorf("%s %s: first answer %v, want CNAME to %s", network, c.name, resp.Answer[0], c.cname)
				}
				owner = c.cname
			}
			for _, rr := range resp.Answer {
				if rr.Header().Ttl != TTL {
					t.Errorf("%s %s: TTL %d, want %d", network, c.name, rr.Header().Ttl, TTL)
				}
				if _, ok := rr.(*dns.A); ok && rr.Header().Name != owner {
					t.Errorf("%s %s: A record of %s, want %s", network, c.name, rr.Header().Name, owner)
				}
			}
		}
	}
	if q := k.queries(); len(q) > 0 {
		t.Errorf("the upstream was asked %v, want nothing: names of the mesh are answered locally", q)
	}
}

// TestNamesNotTheClientsAreForwarded: a ServiceEntry exported to its own
// namespace is answered only to that namespace's pods; another pod's
// query goes upstream, as if the mesh had no such host. Likewise a
// short name of another namespace's service, a headless ServiceEntry,
// and a pod's hostname under a headless service (ztunnel forwards those).
func TestNamesNotTheClientsAreForwarded(t *testing.T) {
	k := startKubeDNS(t)
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}})
	addr := serve(t, p, client)
	otherAddr := serve(t, p, otherClient)

	resp := ask(t, "udp", addr, "api.example.com.", dns.TypeA, 0)
	if got := addrsOf(resp); resp.Authoritative || !slices.Equal(got, []string{"192.0.2.53"}) {
		t.Errorf("api.example.com from namespace mesh: %v (aa %v), want upstream's 192.0.2.53", got, resp.Authoritative)
	}
	resp = ask(t, "udp", otherAddr, "api.example.com.", dns.TypeA, 0)
	if got := addrsOf(resp); !resp.Authoritative || !slices.Equal(got, []string{apiVIP.String()}) {
		t.Errorf("api.example.com from namespace other: %v (aa %v), want the mesh's %s", got, resp.Authoritative, apiVIP)
	}
	for _, name := range []string{"ratings.", "ext.example.net.", "pod-0.db.mesh.svc.cluster.local."} {
		before := len(k.queries())
		resp = ask(t, "udp", addr, name, dns.TypeA, 0)
		if resp.Authoritative || len(k.queries()) != before+1 {
			t.Errorf("%s: aa %v, upstream asked %d times, want it forwarded", name, resp.Authoritative, len(k.queries())-before)
		}
	}
}

// TestWildcardHost: a ServiceEntry host *.wild.example.com answers any
// name under it, at any depth, but not the domain itself.
func TestWildcardHost(t *testing.T) {
	k := startKubeDNS(t)
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}})
	addr := serve(t, p, client)
	for _, name := range []string{"foo.wild.example.com.", "a.b.wild.example.com.", "foo.wild.example.com.mesh.svc.cluster.local."} {
		resp := ask(t, "udp", addr, name, dns.TypeA, 0)
		if got := addrsOf(resp); !resp.Authoritative || !slices.Equal(got, []string{wildVIP.String()}) {
			t.Errorf("%s: %v (aa %v), want %s from the mesh", name, got, resp.Authoritative, wildVIP)
		}
		if resp.Answer[0].Header().Name != name {
			t.Errorf("%s: record of %s, want the name asked", name, resp.Answer[0].Header().Name)
		}
	}
	if q := k.queries(); len(q) > 0 {
		t.Errorf("upstream asked %v", q)
	}
	resp := ask(t, "udp", addr, "wild.example.com.", dns.TypeA, 0)
	if got := addrsOf(resp); resp.Authoritative || !slices.Equal(got, []string{"192.0.2.77"}) {
		t.Errorf("wild.example.com: %v (aa %v), want the upstream's answer", got, resp.Authoritative)
	}
}

// TestAAAAOfIPv4OnlyService: a service with only IPv4 VIPs has no AAAA:
// NODATA (NOERROR, no answer, authoritative), never NXDOMAIN, which would
// make the client give up the A records too; a dual-stack one has its
// IPv6 VIP.
func TestAAAAOfIPv4OnlyService(t *testing.T) {
	k := startKubeDNS(t)
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}})
	addr := serve(t, p, client)
	for _, c := range []struct {
		name string
		want []string
	}{
		{"reviews.mesh.svc.cluster.local.", nil},
		{"reviews.mesh.mesh.svc.cluster.local.", nil},
		{"dual.mesh.svc.cluster.local.", []string{dualVIP6.String()}},
		{"db.mesh.svc.cluster.local.", []string{"fd00::1"}},
	} {
		resp := ask(t, "udp", addr, c.name, dns.TypeAAAA, 0)
		if resp.Rcode != dns.RcodeSuccess || !resp.Authoritative || !slices.Equal(addrsOf(resp), c.want) {
			t.Errorf("AAAA %s: %s aa %v %v, want NOERROR authoritative %v", c.name, dns.RcodeToString[resp.Rcode], resp.Authoritative, addrsOf(resp), c.want)
		}
		if c.want == nil && len(resp.Answer) != 0 {
			t.Errorf("AAAA %s: answers %v, want none", c.name, resp.Answer)
		}
	}
	if q := k.queries(); len(q) > 0 {
		t.Errorf("upstream asked %v", q)
	}
}

// TestOtherTypesOfMeshNamesForwarded: as ztunnel, the mesh answers A and
// AAAA only; MX, TXT, SRV... of a service's name go upstream.
func TestOtherTypesOfMeshNamesForwarded(t *testing.T) {
	k := startKubeDNS(t)
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}})
	addr := serve(t, p, client)
	resp := ask(t, "udp", addr, "reviews.mesh.svc.cluster.local.", dns.TypeMX, 0)
	if resp.Authoritative || len(resp.Answer) != 1 || resp.Answer[0].Header().Rrtype != dns.TypeMX {
		t.Errorf("MX: %v, want the upstream's MX", resp)
	}
	if q := k.queries(); !slices.Equal(q, []string{"udp reviews.mesh.svc.cluster.local. MX"}) {
		t.Errorf("upstream asked %v", q)
	}
}
