package xds

import (
	"net/netip"
	"testing"
	"time"

	"istio.io/istio/pkg/workloadapi"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source/nodepods"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestClientRefusesAddressesOfRejectedResources: a workload or service
// istiod sends that the client rejects, and of which it holds no accepted
// version, left nothing at its addresses: connections to them went out as
// to an address of no workload, in plaintext (passthrough), though istiod
// meant them for the mesh (an HBONE pod behind a waypoint, a service's
// VIP). Now a stand-in holds its addresses and connections to them are
// refused until istiod sends a version that translates or removes it. A
// rejected update of a resource held keeps the accepted version, and an
// address another workload or service has stays theirs.
func TestClientRefusesAddressesOfRejectedResources(t *testing.T) {
	h := startClient(t, nil)
	st, _ := h.accept()
	good := wlAddr("Kubernetes//Pod/shop/good", "good", "10.1.0.5", nil)
	web := svcAddr("web", "10.96.0.10", 80, 8080)
	// A newer istiod's value the agent does not know: rejected whole.
	future := wlAddr("Kubernetes//Pod/shop/future", "future", "10.1.0.7", nil)
	future.GetWorkload().TunnelProtocol = workloadapi.TunnelProtocol(7)
	futureSvc := svcAddr("future", "10.96.5.5", 80, 8080)
	futureSvc.GetService().Visibility = workloadapi.Service_Visibility(7)
	// Rejected at an address a workload istiod sent has: that one keeps it.
	squatter := wlAddr("Kubernetes//Pod/shop/squatter", "squatter", "10.1.0.5", nil)
	squatter.GetWorkload().TunnelProtocol = workloadapi.TunnelProtocol(7)
	ack := send(t, st, TypeAddress, "n1", nil,
		resource(t, "Kubernetes//Pod/shop/good", "v1", TypeAddress, good),
		resource(t, "shop/web.shop.svc.cluster.local", "v1", TypeAddress, web),
		resource(t, "Kubernetes//Pod/shop/future", "v1", TypeAddress, future),
		resource(t, "shop/future.shop.svc.cluster.local", "v1", TypeAddress, futureSvc),
		resource(t, "Kubernetes//Pod/shop/squatter", "v1", TypeAddress, squatter))
	if ack.GetErrorDetail() == nil {
		t.Fatal("no NACK for the rejected resources")
	}
	send(t, st, TypeAuthorization, "n2", nil)
	// A rejected update of a workload held keeps its accepted version.
	goodV2 := wlAddr("Kubernetes//Pod/shop/good", "good", "10.1.0.9", nil)
	goodV2.GetWorkload().TunnelProtocol = workloadapi.TunnelProtocol(7)
	send(t, st, TypeAddress, "n3", nil, resource(t, "Kubernetes//Pod/shop/good", "v2", TypeAddress, goodV2))

	dirOf := func(s *Snapshot) *workload.Directory {
		t.Helper()
		snap, _ := merge(nodepods.State{}, s, "node-x", selection.Config{}, nil)
		dir, errs := workload.NewDirectory(snap.Workloads, snap.Services)
		if len(errs) > 0 {
			t.Fatalf("directory: %v", errs)
		}
		return dir
	}
	refused := func(dir *workload.Directory, addr string) bool {
		svc, ok := dir.ServiceByVIPFor(netip.MustParseAddr(addr), "shop")
		return ok && svc.Contested && len(svc.Endpoints) == 0
	}
	// The last snapshot, once the client has published what it applied.
	latest := func() *Snapshot {
		s := h.next()
		for {
			select {
			case s = <-h.updates:
			case <-time.After(300 * time.Millisecond):
				return s
			}
		}
	}
	dir := dirOf(latest())
	for _, a := range []string{"10.1.0.7", "10.96.5.5"} {
		if !refused(dir, a) {
			w, isW := dir.ByAddr(netip.MustParseAddr(a))
			t.Errorf("%s, an address of a rejected resource istiod holds no accepted version of: not refused (workload %v %v): connections to it leave in plaintext", a, w, isW)
		}
	}
	if w, ok := dir.ByAddr(netip.MustParseAddr("10.1.0.5")); !ok || w.Name != "good" || refused(dir, "10.1.0.5") {
		t.Errorf("10.1.0.5: workload %v %v, refused %v; want the accepted workload good, its address not taken by the rejected one", w, ok, refused(dir, "10.1.0.5"))
	}
	if refused(dir, "10.1.0.9") {
		t.Error("10.1.0.9, the address of a rejected update of a held workload, is refused: the held version stays in force instead")
	}
	if svc, ok := dir.ServiceByVIPFor(netip.MustParseAddr("10.96.0.10"), "shop"); !ok || svc.Contested {
		t.Errorf("10.96.0.10: %v %v, want the accepted service", svc, ok)
	}

	// istiod sends a version that translates, and removes the service.
	send(t, st, TypeAddress, "n4", []string{"shop/future.shop.svc.cluster.local"},
		resource(t, "Kubernetes//Pod/shop/future", "v2", TypeAddress, wlAddr("Kubernetes//Pod/shop/future", "future", "10.1.0.7", nil)))
	dir = dirOf(latest())
	if w, ok := dir.ByAddr(netip.MustParseAddr("10.1.0.7")); !ok || w.Name != "future" || refused(dir, "10.1.0.7") {
		t.Errorf("10.1.0.7 after a good version: %v %v; want the workload", w, ok)
	}
	if _, ok := dir.ServiceByVIPFor(netip.MustParseAddr("10.96.5.5"), "shop"); ok {
		t.Error("10.96.5.5 still held after istiod removed the rejected service")
	}
}
