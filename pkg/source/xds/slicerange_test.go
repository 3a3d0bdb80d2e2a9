package xds

import (
	"net/netip"
	"strings"
	"testing"

	"istio.io/istio/pkg/workloadapi"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestMergeRangeKeptOverEndpointSliceAddress: istiod turns an endpoint of
// a selector-less Service's hand-made EndpointSlice (a database outside
// the cluster) into a workload marked HOST_NETWORK, as it does a
// hostNetwork pod, since it knows nothing of the host there. A range
// holding a node's address is left out (it would take connections to the
// kubelets), and the slice's address was taken for one: an egress
// ServiceEntry over 203.0.113.0/24 with a waypoint was left out whole as
// soon as any Service's EndpointSlice listed an address in it, and every
// meshed pod's connections to the range went straight out, past the
// waypoint's policy. Only a pod's HOST_NETWORK address is a node's; a
// hostNetwork pod's still spares the node (TestMergeCIDRSparesNodeAddresses).
func TestMergeRangeKeptOverEndpointSliceAddress(t *testing.T) {
	l24 := uint32(24)
	db := netip.MustParseAddr("203.0.113.5")
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K/discovery.k8s.io/EndpointSlice/shop/legacy-db-x7k2p/203.0.113.5", Name: "legacy-db-x7k2p", Namespace: "shop", Addresses: [][]byte{db.AsSlice()},
			NetworkMode: workloadapi.NetworkMode_HOST_NETWORK, Status: workloadapi.WorkloadStatus_HEALTHY,
			Services: map[string]*workloadapi.PortList{"shop/legacy-db.shop.svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 5432, TargetPort: 5432}}}}},
		{Uid: "K//Pod/egress/waypoint-1", Name: "waypoint-1", Namespace: "egress", Node: "node-b", Addresses: [][]byte{netip.MustParseAddr("10.2.0.9").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE,
			Services:       map[string]*workloadapi.PortList{"egress/waypoint.egress.svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 15008, TargetPort: 15008}}}}},
	})
	services := map[string]*Service{}
	for _, x := range []*workloadapi.Service{
		{Name: "partners", Namespace: "egress", Hostname: "partners.example",
			Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("203.0.113.0").AsSlice(), Length: &l24}},
			Ports:     []*workloadapi.Port{{ServicePort: 5432, TargetPort: 5432}},
			Waypoint: &workloadapi.GatewayAddress{HboneMtlsPort: 15008, Destination: &workloadapi.GatewayAddress_Hostname{
				Hostname: &workloadapi.NamespacedHostname{Namespace: "egress", Hostname: "waypoint.egress.svc.cluster.local"}}},
			LoadBalancing: &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_PASSTHROUGH}},
		{Name: "legacy-db", Namespace: "shop", Hostname: "legacy-db.shop.svc.cluster.local",
			Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.0.40").AsSlice()}}, Ports: []*workloadapi.Port{{ServicePort: 5432, TargetPort: 5432}}},
		{Name: "waypoint", Namespace: "egress", Hostname: "waypoint.egress.svc.cluster.local",
			Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.0.41").AsSlice()}}, Ports: []*workloadapi.Port{{ServicePort: 15008, TargetPort: 15008}}},
	} {
		s, err := translateService(x)
		if err != nil {
			t.Fatal(err)
		}
		services[s.Key()] = s
	}
	mesh := buildSnapshot(workloads, services, nil, "")
	snap, errs := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	for _, err := range errs {
		if strings.Contains(err.Error(), "203.0.113.0/24") {
			t.Errorf("the egress range was left out: %v", err)
		}
	}
	dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
	for _, a := range []string{"203.0.113.9", "203.0.113.5"} {
		if svc, ok := dir.ServiceByVIPFor(netip.MustParseAddr(a), "shop"); !ok || svc.Name != "partners" || svc.Waypoint == nil {
			t.Errorf("%s: %v, want the egress entry's range, through its waypoint", a, svc)
		}
	}
	// The selector-less Service still reaches its endpoint.
	if svc, ok := dir.ServiceByVIP(netip.MustParseAddr("10.96.0.40")); !ok || len(svc.Endpoints) != 1 || svc.Endpoints[0].Addr != db {
		t.Errorf("legacy-db: %+v", svc)
	}
}
