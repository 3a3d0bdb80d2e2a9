package xds

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/miekg/dns"
	"istio.io/istio/pkg/workloadapi"

	"github.com/redirector-mesh/redirector/pkg/dnsproxy"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// headlessKey is the headless service of these tests, webKey a service
// with VIPs that the same pods serve, farKey one whose only VIP is on
// another network (not headless: istiod gave it an address).
const (
	headlessKey = "db/db.db.svc.cluster.local"
	webKey      = "db/web.db.svc.cluster.local"
	farKey      = "db/far.db.svc.cluster.local"
)

// dualStackMesh is a headless service of ip_families families and its
// pods on node-b: db-0 dual-stack IPv4 first, db-1 dual-stack IPv6 first
// (a pod's first address is its primary family's), db-2 IPv4 only; all
// three also serve webKey (VIPs 10.96.2.1, fd00:96::2:1) and farKey (a VIP
// on network west), merged as node-a's agent, on the default network,
// sees them.
func dualStackMesh(t *testing.T, families workloadapi.IPFamilies) *workload.Directory {
	t.Helper()
	serves := map[string]*workloadapi.PortList{}
	for _, key := range []string{headlessKey, webKey, farKey} {
		serves[key] = &workloadapi.PortList{Ports: []*workloadapi.Port{{ServicePort: 5432, TargetPort: 15432}}}
	}
	pod := func(name string, addrs ...string) *workloadapi.Workload {
		w := &workloadapi.Workload{Uid: "K//Pod/db/" + name, Name: name, Namespace: "db", Node: "node-b",
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, Services: serves}
		for _, a := range addrs {
			w.Addresses = append(w.Addresses, netip.MustParseAddr(a).AsSlice())
		}
		return w
	}
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		pod("db-0", "10.2.0.7", "fd00:2::7"),
		pod("db-1", "fd00:2::8", "10.2.0.8"),
		pod("db-2", "10.2.0.9"),
	})
	ports := []*workloadapi.Port{{ServicePort: 5432, TargetPort: 15432}}
	vip := func(a, network string) *workloadapi.NetworkAddress {
		return &workloadapi.NetworkAddress{Address: netip.MustParseAddr(a).AsSlice(), Network: network}
	}
	services := map[string]*Service{}
	for _, x := range []*workloadapi.Service{
		{Name: "db", Namespace: "db", Hostname: "db.db.svc.cluster.local", Ports: ports, IpFamilies: families},
		{Name: "web", Namespace: "db", Hostname: "web.db.svc.cluster.local", Ports: ports, IpFamilies: workloadapi.IPFamilies_DUAL,
			Addresses: []*workloadapi.NetworkAddress{vip("10.96.2.1", ""), vip("fd00:96::2:1", "")}},
		{Name: "far", Namespace: "db", Hostname: "far.db.svc.cluster.local", Ports: ports, IpFamilies: workloadapi.IPFamilies_DUAL,
			Addresses: []*workloadapi.NetworkAddress{vip("10.97.2.1", "west")}},
	} {
		s, err := translateService(x)
		if err != nil {
			t.Fatal(err)
		}
		services[s.Key()] = s
	}
	snap, errs := merge(webOnNodeA(), buildSnapshot(workloads, services, nil, ""), "node-a", selection.Config{}, nil)
	dir, dirErrs := workload.NewDirectory(snap.Workloads, snap.Services)
	if errs = append(errs, dirErrs...); len(errs) > 0 {
		t.Fatalf("build: %v", errs)
	}
	return dir
}

// serviceNamed is dir's service namespace/name.
func serviceNamed(t *testing.T, dir *workload.Directory, namespace, name string) *workload.Service {
	t.Helper()
	for _, s := range dir.Services() {
		if s.Namespace == namespace && s.Name == name {
			return s
		}
	}
	t.Fatalf("no service %s/%s in the directory", namespace, name)
	return nil
}

// endpointsOf lists s's endpoints as "address pod", sorted by address.
func endpointsOf(t *testing.T, s *workload.Service) []string {
	t.Helper()
	var out []string
	for _, ep := range s.Endpoints {
		pod := "<none>"
		if ep.Workload != nil {
			pod = ep.Workload.Name
		}
		if tp, ok := ep.TargetPort(s.Ports[0]); !ok || tp != 15432 || !ep.Ready {
			t.Errorf("%s: endpoint %s: target port %d (%v), ready %v; want 15432, ready", s.Name, ep.Addr, tp, ok, ep.Ready)
		}
		out = append(out, ep.Addr.String()+" "+pod)
	}
	return out
}

// TestMergeHeadlessDualStackEndpoints: with SOURCE=xds a headless
// service's endpoint carried its workload's first address only, so a
// dual-stack pod behind one was answered in its primary family only (an
// IPv6-first pod not over A, an IPv4-first one not over AAAA), and an
// IPv4-only service answered its IPv6-first pods' IPv6 addresses over
// nothing at all. Each endpoint workload is now listed at its first
// address of each family the service has (ip_families; AUTOMATIC is both,
// as ztunnel reads it), as ztunnel answers and as the Kubernetes source's
// EndpointSlices list it. A service with VIPs keeps one endpoint per
// workload, at its first address (it is dialled through them), also when
// its only VIP is on another network.
func TestMergeHeadlessDualStackEndpoints(t *testing.T) {
	both := []string{"10.2.0.7 db-0", "10.2.0.8 db-1", "10.2.0.9 db-2", "fd00:2::7 db-0", "fd00:2::8 db-1"}
	onePerPod := []string{"10.2.0.7 db-0", "10.2.0.9 db-2", "fd00:2::8 db-1"}
	for _, tc := range []struct {
		families workloadapi.IPFamilies
		want     []string
	}{
		{workloadapi.IPFamilies_DUAL, both},
		{workloadapi.IPFamilies_AUTOMATIC, both},
		{workloadapi.IPFamilies_IPV4_ONLY, []string{"10.2.0.7 db-0", "10.2.0.8 db-1", "10.2.0.9 db-2"}},
		{workloadapi.IPFamilies_IPV6_ONLY, []string{"fd00:2::7 db-0", "fd00:2::8 db-1"}},
	} {
		t.Run(tc.families.String(), func(t *testing.T) {
			dir := dualStackMesh(t, tc.families)
			if got := endpointsOf(t, serviceNamed(t, dir, "db", "db")); !slices.Equal(got, tc.want) {
				t.Errorf("headless endpoints: %v, want %v", got, tc.want)
			}
			for _, name := range []string{"web", "far"} {
				if got := endpointsOf(t, serviceNamed(t, dir, "db", name)); !slices.Equal(got, onePerPod) {
					t.Errorf("%s (VIPs) endpoints: %v, want one per pod at its first address %v", name, got, onePerPod)
				}
			}
			// Inbound, the tunnel names the service of a connection to a
			// pod among the services it is an endpoint of.
			if db0, ok := dir.Pod("db", "db-0"); !ok || !slices.ContainsFunc(dir.ServicesOf(db0), func(s *workload.Service) bool { return s.Name == "db" }) {
				t.Errorf("db-0 (%v) is no endpoint of db in the directory", ok)
			}
		})
	}
}

// TestTranslateServiceRejectsUnknownFamilies: an ip_families value the
// agent does not know is refused, as ztunnel refuses it: read as either
// family, a headless service could be answered in one it has not.
func TestTranslateServiceRejectsUnknownFamilies(t *testing.T) {
	_, err := translateService(&workloadapi.Service{Name: "x", Namespace: "db", Hostname: "x.db.svc.cluster.local", IpFamilies: 7})
	if err == nil || !strings.Contains(err.Error(), "ip_families 7") {
		t.Errorf("ip_families 7: %v, want an error naming it", err)
	}
}

// TestDNSAnswersHeadlessDualStackFromXDS: the DNS proxy, answering from
// the directory the xDS source builds, answers a dual-stack headless
// service's A and AAAA queries with its pods' addresses of that family,
// within the service's families (NODATA for a family it has not).
func TestDNSAnswersHeadlessDualStackFromXDS(t *testing.T) {
	client := &workload.Workload{Namespace: "db", Name: "app", UID: "app"}
	for _, tc := range []struct {
		families workloadapi.IPFamilies
		a, aaaa  []string
	}{
		{workloadapi.IPFamilies_DUAL, []string{"10.2.0.7", "10.2.0.8", "10.2.0.9"}, []string{"fd00:2::7", "fd00:2::8"}},
		{workloadapi.IPFamilies_AUTOMATIC, []string{"10.2.0.7", "10.2.0.8", "10.2.0.9"}, []string{"fd00:2::7", "fd00:2::8"}},
		{workloadapi.IPFamilies_IPV4_ONLY, []string{"10.2.0.7", "10.2.0.8", "10.2.0.9"}, nil},
		{workloadapi.IPFamilies_IPV6_ONLY, nil, []string{"fd00:2::7", "fd00:2::8"}},
	} {
		t.Run(tc.families.String(), func(t *testing.T) {
			dir := dualStackMesh(t, tc.families)
			p, err := dnsproxy.New(dnsproxy.Config{}, func() *workload.Directory { return dir }, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, q := range []struct {
				qtype uint16
				want  []string
			}{{dns.TypeA, tc.a}, {dns.TypeAAAA, tc.aaaa}} {
				req := new(dns.Msg).SetQuestion("db.db.svc.cluster.local.", q.qtype)
				b, err := req.Pack()
				if err != nil {
					t.Fatal(err)
				}
				resp := new(dns.Msg)
				if err := resp.Unpack(p.Answer(context.Background(), client, "udp", b, nil)); err != nil {
					t.Fatalf("%s: answer does not parse: %v", dns.TypeToString[q.qtype], err)
				}
				var got []string
				for _, rr := range resp.Answer {
					switch rr := rr.(type) {
					case *dns.A:
						got = append(got, rr.A.String())
					case *dns.AAAA:
						got = append(got, rr.AAAA.String())
					}
				}
				slices.Sort(got)
				if resp.Rcode != dns.RcodeSuccess || !resp.Authoritative || !slices.Equal(got, q.want) {
					t.Errorf("%s: %s authoritative %v %v, want NOERROR authoritative %v", dns.TypeToString[q.qtype],
						dns.RcodeToString[resp.Rcode], resp.Authoritative, got, q.want)
				}
			}
		})
	}
}
