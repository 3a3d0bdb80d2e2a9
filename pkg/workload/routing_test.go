package workload

import (
	"net/netip"
	"testing"
)

// TestRankEndpointWithoutWorkload: an endpoint at an address that is no
// workload's (a hostNetwork pod's, at its node's address, as an
// EndpointSlice lists it with its nodeName) ranks by its node's locality,
// which a workload on that node gives (Endpoint.Site); one whose node is
// not known keeps no locality.
func TestRankEndpointWithoutWorkload(t *testing.T) {
	client := &Workload{Namespace: "shop", Name: "web", Node: "node-a", Region: "r1", Zone: "a", Addrs: []netip.Addr{netip.MustParseAddr("10.1.0.5")}}
	onB := &Workload{Namespace: "shop", Name: "other-b", Node: "node-b", Region: "r1", Zone: "a", Addrs: []netip.Addr{netip.MustParseAddr("10.2.0.5")}}
	bare := &Workload{Namespace: "shop", Name: "bare-c", Node: "node-c"} // a node without locality labels
	svc := &Service{Namespace: "shop", Name: "cache", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.20")},
		Routing: &Routing{Scopes: []Scope{ScopeNetwork, ScopeRegion, ScopeZone, ScopeSubzone, ScopeNode}},
		Endpoints: []Endpoint{
			{Addr: netip.MustParseAddr("10.0.0.10"), Node: "node-a"}, // hostNetwork on the client's node
			{Addr: netip.MustParseAddr("10.0.0.20"), Node: "node-b"}, // hostNetwork in the client's zone
			{Addr: netip.MustParseAddr("10.0.0.30"), Node: "node-c"},
			{Addr: netip.MustParseAddr("10.0.0.40"), Node: "node-x"}, // no workload known there
		}}
	dir, errs := NewDirectory([]*Workload{client, onB, bare}, []*Service{svc})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	got, _ := dir.ServiceByVIP(svc.VIPs[0])
	want := map[string]int{"10.0.0.10": 5, "10.0.0.20": 4, "10.0.0.30": 1, "10.0.0.40": 1}
	for _, ep := range got.Endpoints {
		if r := got.Routing.Rank(client, ep); r != want[ep.Addr.String()] {
			t.Errorf("endpoint %s on %s: rank %d, want %d", ep.Addr, ep.Node, r, want[ep.Addr.String()])
		}
	}
}
