package xds

import (
	"net/netip"
	"strings"
	"testing"

	"istio.io/istio/pkg/workloadapi"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestMergeEndpointIsTheWorkloadIstiodNames: istiod names each service
// endpoint's workload, and where the directory gives the endpoint's
// address to another workload (two live pods at one address: a stale
// object and the pod there now, or a lie; istiod marks a pod being deleted
// unhealthy, so both are ready endpoints), the endpoint is not that other
// workload: it is unresolved, refused and the next endpoint tried, as the
// Kubernetes source refuses an EndpointSlice endpoint whose targetRef is
// not the pod at its address. Before, the endpoint was resolved by address
// alone, and the service's connections were dialled as the address's
// owner: with its identity required (another namespace's, its service
// account), or in plain TCP where the owner was outside the mesh, and the
// owner's inbound connections were counted under the service. A pod of
// this node that istiod describes before the node's watch has it was
// dialled in plain TCP, as an address of no workload, though istiod says
// it takes HBONE.
//
// What stays: the endpoint of istiod's copy of a local pod is the local
// pod (the directory has it under the API's uid, not istiod's), and a
// ServiceEntry's or WorkloadEntry's endpoint at a pod's address is that
// pod, as ztunnel ranks pods first at an address.
func TestMergeEndpointIsTheWorkloadIstiodNames(t *testing.T) {
	const web = "shop/web.shop.svc.cluster.local"
	addr := func(s string) [][]byte { return [][]byte{netip.MustParseAddr(s).AsSlice()} }
	// Each workload serves port 80 on a port of its own, which tells
	// the endpoints apart whatever the directory resolves them to.
	serves := func(target uint32, key string) map[string]*workloadapi.PortList {
		return map[string]*workloadapi.PortList{key: {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: target}}}}
	}
	hbone, plain := workloadapi.TunnelProtocol_HBONE, workloadapi.TunnelProtocol_NONE
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		// istiod's copy of node-a's shop/web-1 (the local pod, uid u1).
		{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", ClusterId: "K", Addresses: addr("10.1.0.5"),
			TunnelProtocol: hbone, Services: serves(8081, web)},
		// A pod of another node at its own address.
		{Uid: "K//Pod/shop/web-2", Name: "web-2", Namespace: "shop", Node: "node-b", ClusterId: "K", Addresses: addr("10.2.0.5"),
			TunnelProtocol: hbone, Services: serves(8082, web)},
		// Two pods of other nodes at 10.2.0.7: aaa/stale keeps it (both
		// pods, both HBONE, first by name); the service names web-3.
		{Uid: "K//Pod/aaa/stale", Name: "stale", Namespace: "aaa", ServiceAccount: "batch", Node: "node-c", ClusterId: "K", Addresses: addr("10.2.0.7"),
			TunnelProtocol: hbone},
		{Uid: "K//Pod/shop/web-3", Name: "web-3", Namespace: "shop", Node: "node-b", ClusterId: "K", Addresses: addr("10.2.0.7"),
			TunnelProtocol: hbone, Services: serves(8083, web)},
		// At 10.2.0.8 the meshed pod keeps the address; the service
		// names the plaintext one.
		{Uid: "K//Pod/aaa/meshed", Name: "meshed", Namespace: "aaa", Node: "node-c", ClusterId: "K", Addresses: addr("10.2.0.8"),
			TunnelProtocol: hbone},
		{Uid: "K//Pod/shop/web-4", Name: "web-4", Namespace: "shop", Node: "node-b", ClusterId: "K", Addresses: addr("10.2.0.8"),
			TunnelProtocol: plain, Services: serves(8084, web)},
		// A pod of another node listing this node's pod's address: the
		// address stays the local pod's.
		{Uid: "K//Pod/shop/web-5", Name: "web-5", Namespace: "shop", Node: "node-b", ClusterId: "K", Addresses: addr("10.1.0.5"),
			TunnelProtocol: hbone, Services: serves(8085, web)},
		// The same StatefulSet pod in two clusters of the network at one
		// address: this cluster's keeps it; the service names the other.
		{Uid: "K//Pod/shop/web-6", Name: "web-6", Namespace: "shop", Node: "node-b", ClusterId: "K", Addresses: addr("10.2.0.9"),
			TunnelProtocol: hbone},
		{Uid: "K2//Pod/shop/web-6", Name: "web-6", Namespace: "shop", Node: "node-z", ClusterId: "K2", Addresses: addr("10.2.0.9"),
			TunnelProtocol: hbone, Services: serves(8086, web)},
		// A pod of this node that the node's watch has not seen yet.
		{Uid: "K//Pod/shop/web-7", Name: "web-7", Namespace: "shop", Node: "node-a", ClusterId: "K", Addresses: addr("10.1.0.7"),
			TunnelProtocol: hbone, Services: serves(8087, web)},
		// A ServiceEntry's endpoint and a WorkloadEntry at pods' addresses.
		{Uid: "K/networking.istio.io/ServiceEntry/shop/ext/10.2.0.5", Name: "ext", Namespace: "shop", ClusterId: "K", Addresses: addr("10.2.0.5"),
			TunnelProtocol: plain, Services: serves(9001, "shop/ext.example.com")},
		{Uid: "K/networking.istio.io/WorkloadEntry/shop/vm", Name: "vm", Namespace: "shop", ClusterId: "K", Addresses: addr("10.1.0.5"),
			TunnelProtocol: plain, Services: serves(9002, "shop/ext.example.com")},
	})
	services := map[string]*Service{}
	for _, x := range []*workloadapi.Service{
		{Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local", Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.0.10").AsSlice()}},
			Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}},
		{Name: "ext", Namespace: "shop", Hostname: "ext.example.com", Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("240.1.1.1").AsSlice()}},
			Ports: []*workloadapi.Port{{ServicePort: 80}}},
	} {
		s, err := translateService(x)
		if err != nil {
			t.Fatal(err)
		}
		services[s.Key()] = s
	}
	mesh := buildSnapshot(workloads, services, nil, "")
	mesh.Cluster = "K"
	snap, errs := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	for _, want := range []string{"10.2.0.7", "10.2.0.8", "10.2.0.9", "10.1.0.5"} {
		if !containsError(errs, "address "+want) {
			t.Errorf("no address conflict reported for %s: %v", want, errs)
		}
	}
	dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)

	type want struct {
		uid        string // the directory workload the endpoint resolves to; "" none
		unresolved bool
	}
	check := func(vip string, wants map[string]want) {
		t.Helper()
		svc, ok := dir.ServiceByVIP(netip.MustParseAddr(vip))
		if !ok {
			t.Fatalf("no service at %s", vip)
		}
		got := map[string]want{}
		for _, ep := range svc.Endpoints {
			uid := ""
			if ep.Workload != nil {
				uid = ep.Workload.UID
			}
			got[netip.AddrPortFrom(ep.Addr, uint16(ep.Ports["80"])).String()] = want{uid, ep.Unresolved}
		}
		for k, w := range wants {
			if g, ok := got[k]; !ok {
				t.Errorf("%s: no endpoint %s (have %v)", vip, k, got)
			} else if g != w {
				t.Errorf("%s: endpoint %s resolves to %q (unresolved %v), want %q (unresolved %v)", vip, k, g.uid, g.unresolved, w.uid, w.unresolved)
			}
		}
		if len(got) != len(wants) {
			t.Errorf("%s: endpoints %v, want %v", vip, got, wants)
		}
	}
	check("10.96.0.10", map[string]want{
		"10.1.0.5:8081": {"u1", false},                // istiod's copy of the local pod: the local pod
		"10.2.0.5:8082": {"K//Pod/shop/web-2", false}, // a pod at its own address
		"10.2.0.7:8083": {"", true},                   // not aaa/stale (another namespace and service account)
		"10.2.0.8:8084": {"", true},                   // not aaa/meshed
		"10.1.0.5:8085": {"", true},                   // not this node's shop/web-1
		"10.2.0.9:8086": {"", true},                   // another cluster's pod of the name: not this cluster's
		"10.1.0.7:8087": {"", true},                   // this node's, not seen by the node's watch yet: not plaintext
	})
	check("240.1.1.1", map[string]want{
		"10.2.0.5:9001": {"K//Pod/shop/web-2", false}, // the ServiceEntry's endpoint at web-2's address is web-2
		"10.1.0.5:9002": {"u1", false},                // the WorkloadEntry at the local pod's address is the local pod
	})

	// The address's owner is not counted an endpoint of the service it
	// does not serve (the destination side names inbound connections'
	// service by it).
	for _, a := range []string{"10.2.0.7", "10.2.0.8", "10.2.0.9"} {
		owner, ok := dir.ByAddr(netip.MustParseAddr(a))
		if !ok {
			t.Fatalf("no workload at %s", a)
		}
		if s := dir.ServicesOf(owner); len(s) > 0 {
			t.Errorf("%s (at %s) counted as an endpoint of %s", owner, a, s[0])
		}
	}
}

func containsError(errs []error, sub string) bool {
	for _, err := range errs {
		if strings.Contains(err.Error(), sub) {
			return true
		}
	}
	return false
}
