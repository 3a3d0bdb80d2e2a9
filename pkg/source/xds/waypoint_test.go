package xds

import (
	"net/netip"
	"testing"

	"istio.io/istio/pkg/workloadapi"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/selection"
)

// This node's pods come from the API server, but their waypoints from
// istiod: before, a local pod's waypoint was lost, and traffic to its
// address from this node skipped the waypoint.
func TestMergeKeepsLocalWaypoints(t *testing.T) {
	local := webOnNodeA()
	gw := &workloadapi.GatewayAddress{HboneMtlsPort: 15008, Destination: &workloadapi.GatewayAddress_Hostname{
		Hostname: &workloadapi.NamespacedHostname{Namespace: "shop", Hostname: "waypoint.shop.svc.cluster.local"}}}
	workloads := map[string]*Workload{}
	for _, x := range []*workloadapi.Workload{
		{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", Addresses: [][]byte{netip.MustParseAddr("10.1.0.5").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, Waypoint: gw},
		// A ServiceEntry workload of the same name keeps its own (none).
		{Uid: "K/networking.istio.io/ServiceEntry/shop/web-1/240.0.0.1", Name: "web-1", Namespace: "shop", Addresses: [][]byte{netip.MustParseAddr("240.0.0.1").AsSlice()}},
	} {
		w, err := translateWorkload(x)
		if err != nil {
			t.Fatal(err)
		}
		workloads[x.Uid] = w
	}
	mesh := buildSnapshot(workloads, map[string]*Service{}, map[string]*policy.Compiled{}, "")
	snap, errs := merge(local, mesh, "node-a", selection.Config{}, nil)
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	for _, w := range snap.Workloads {
		switch {
		case w.UID == "u1" && (w.Waypoint == nil || w.Waypoint.Hostname != "waypoint.shop.svc.cluster.local" || w.Waypoint.HBONEPort != 15008):
			t.Errorf("local pod's waypoint %+v, want istiod's", w.Waypoint)
		case w.UID != "u1" && w.Waypoint != nil:
			t.Errorf("workload %s (%s) got waypoint %+v", w, w.UID, w.Waypoint)
		}
	}
}
