package xds

import (
	"net/netip"
	"strings"
	"testing"

	"istio.io/istio/pkg/workloadapi"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestMergeKeepsWorkloadsNamedLikeLocalPods: istiod's workloads are
// named by their object, not unique: a WorkloadEntry, a ServiceEntry's
// endpoints or a pod of another cluster can bear a local pod's
// namespace/name. Only istiod's copy of the local pod (a pod of this
// cluster) stands aside for the pod the node's watch has; the others are
// other hosts at their own addresses. Before, every istiod workload of
// that name was left out of the directory, so this node's connections to
// an HBONE VM (or another cluster's StatefulSet pod of the same name)
// went out in plaintext, as to an address of no workload; and the local
// pod does not take their policy selection.
func TestMergeKeepsWorkloadsNamedLikeLocalPods(t *testing.T) {
	deny := &policy.Compiled{Name: "deny-all", Namespace: "shop", Scope: policy.ScopeWorkloadSelector, Action: policy.ActionDeny, Groups: []policy.Group{{}}}
	addr := func(s string) [][]byte { return [][]byte{netip.MustParseAddr(s).AsSlice()} }
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		// istiod's copy of node-a's shop/web-1, with no policy of its own.
		{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", ClusterId: "K", Addresses: addr("10.1.0.5"),
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE},
		// A VM of the same name, meshed (HBONE), selected by a DENY.
		{Uid: "K/networking.istio.io/WorkloadEntry/shop/web-1", Name: "web-1", Namespace: "shop", ClusterId: "K", Addresses: addr("10.50.0.1"),
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, AuthorizationPolicies: []string{deny.Key()},
			Services: map[string]*workloadapi.PortList{"shop/vm.example.com": {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}}}},
		// A ServiceEntry's endpoint named after the entry.
		{Uid: "K/networking.istio.io/ServiceEntry/shop/web-1/10.50.0.2", Name: "web-1", Namespace: "shop", ClusterId: "K", Addresses: addr("10.50.0.2")},
		// The same StatefulSet's pod in another cluster of the network.
		{Uid: "K2//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-z", ClusterId: "K2", Addresses: addr("10.9.0.5"),
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE},
	})
	vm, err := translateService(&workloadapi.Service{Name: "vm", Namespace: "shop", Hostname: "vm.example.com",
		Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("240.0.0.10").AsSlice()}}, Ports: []*workloadapi.Port{{ServicePort: 80}}})
	if err != nil {
		t.Fatal(err)
	}
	mesh := buildSnapshot(workloads, map[string]*Service{vm.Key(): vm}, map[string]*policy.Compiled{deny.Key(): deny}, "")
	mesh.Cluster = "K"
	snap, errs := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	if len(errs) > 0 {
		t.Fatalf("merge: %v", errs)
	}
	dir, dirErrs := workload.NewDirectory(snap.Workloads, snap.Services)
	if len(dirErrs) > 0 {
		t.Fatalf("directory: %v", dirErrs)
	}
	for a, want := range map[string]string{
		"10.1.0.5":  "u1", // the local pod, from the node's watch
		"10.50.0.1": "K/networking.istio.io/WorkloadEntry/shop/web-1",
		"10.50.0.2": "K/networking.istio.io/ServiceEntry/shop/web-1/10.50.0.2",
		"10.9.0.5":  "K2//Pod/shop/web-1",
	} {
		w, ok := dir.ByAddr(netip.MustParseAddr(a))
		if !ok || w.UID != want {
			t.Errorf("%s belongs to %v, want %s", a, w, want)
		}
	}
	if w, ok := dir.ByAddr(netip.MustParseAddr("10.50.0.1")); ok && !w.Enrolled {
		t.Errorf("the HBONE VM is not enrolled: connections to it would go out in plaintext")
	}
	// The VM as its ServiceEntry's endpoint: dialled over HBONE, not as
	// an endpoint of no workload (plain TCP).
	if svc, ok := dir.ServiceByVIP(netip.MustParseAddr("240.0.0.10")); !ok || len(svc.Endpoints) != 1 || svc.Endpoints[0].Workload == nil || !svc.Endpoints[0].Workload.TakesHBONE() {
		t.Errorf("service vm.example.com: %+v, want the VM as an HBONE endpoint", svc)
	}
	if w, ok := dir.Pod("shop", "web-1"); !ok || w.UID != "u1" {
		t.Errorf("pod shop/web-1 is %v, want the local pod", w)
	}
	// The VM's DENY is not the local pod's.
	if got := snap.Compiled.Selected["shop/web-1"]; len(got) != 0 {
		t.Errorf("local pod shop/web-1 selects %v, want its own copy's selection (none)", got)
	}
	peer := policy.Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/web"}
	if v := snap.Compiled.Authorize(policy.Target{Namespace: "shop", Port: 80}, "shop/web-1", peer); !v.Allowed {
		t.Errorf("local pod refused: %s", v.Reason)
	}
}

// TestMergeLocalCopyIsOfThisCluster: a pod of another cluster with a local
// pod's name, on a node of the same name (EKS names nodes by their
// address, alike in clusters on overlapping networks), is not istiod's copy of the local pod: before, the two
// made the local pod's selection ambiguous and its inbound was refused,
// and the other cluster's pod alone stood in for it with its own
// policies. With only another cluster's copy, the pod is refused with
// both clusters named, as for a NETWORK that disagrees.
func TestMergeLocalCopyIsOfThisCluster(t *testing.T) {
	deny := &policy.Compiled{Name: "deny-all", Namespace: "shop", Scope: policy.ScopeWorkloadSelector, Action: policy.ActionDeny, Groups: []policy.Group{{}}}
	addr := func(s string) [][]byte { return [][]byte{netip.MustParseAddr(s).AsSlice()} }
	own := &workloadapi.Workload{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", ClusterId: "K", Addresses: addr("10.1.0.5"),
		TunnelProtocol: workloadapi.TunnelProtocol_HBONE, AuthorizationPolicies: []string{deny.Key()}}
	other := &workloadapi.Workload{Uid: "K2//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", ClusterId: "K2", Addresses: addr("10.9.0.5"),
		TunnelProtocol: workloadapi.TunnelProtocol_HBONE}
	policies := map[string]*policy.Compiled{deny.Key(): deny}
	peer := policy.Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/web"}
	dst := policy.Target{Namespace: "shop", Port: 80}

	mesh := buildSnapshot(translateWorkloads(t, []*workloadapi.Workload{own, other}), nil, policies, "")
	mesh.Cluster = "K"
	snap, errs := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	if len(errs) > 0 {
		t.Fatalf("merge: %v", errs)
	}
	if why, ok := snap.Compiled.Unknown["shop/web-1"]; ok {
		t.Fatalf("local pod unknown: %s", why)
	}
	if v := snap.Compiled.Authorize(dst, "shop/web-1", peer); v.Allowed || v.Policy != deny.Key() {
		t.Errorf("local pod under its copy's DENY: allowed=%v (%s)", v.Allowed, v.Reason)
	}

	mesh = buildSnapshot(translateWorkloads(t, []*workloadapi.Workload{other}), nil, policies, "")
	mesh.Cluster = "K"
	snap, errs = merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	if v := snap.Compiled.Authorize(dst, "shop/web-1", peer); v.Allowed || !strings.Contains(v.Reason, `"K2"`) || !strings.Contains(v.Reason, "CLUSTER_ID") {
		t.Errorf("only another cluster's copy: allowed=%v (%s), want refused naming the clusters", v.Allowed, v.Reason)
	}
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), "CLUSTER_ID") {
		t.Errorf("errors %v, want one naming CLUSTER_ID", errs)
	}
}

// TestMergeVIPNamedLikeTheWorkloadAtIt: a VIP at a workload's address is
// kept only when that workload is one of the service's endpoints, and
// that was told by namespace/name: a ServiceEntry names its endpoints
// after itself, so one named like a pod of its namespace, with the pod's
// address as its VIP and as an endpoint, passed for serving it. The
// pod's connections (this node's or another's) then went to the entry:
// its other endpoints (a host of its author's) took a share of them, and
// its waypoint all. The endpoint must be the claimant itself (istiod's copy
// for a local pod); a VM's entry keeps the VM's address as its VIP.
func TestMergeVIPNamedLikeTheWorkloadAtIt(t *testing.T) {
	addr := func(s string) [][]byte { return [][]byte{netip.MustParseAddr(s).AsSlice()} }
	grab := func(name string) *workloadapi.Workload {
		return &workloadapi.Workload{Uid: "K/networking.istio.io/ServiceEntry/shop/" + name + "/10.66.0.1", Name: name, Namespace: "shop", Addresses: addr("10.66.0.1"),
			Services: map[string]*workloadapi.PortList{"shop/" + name + ".example": {Ports: []*workloadapi.Port{{ServicePort: 80}}}}}
	}
	at := func(name, ip string) *workloadapi.Workload {
		return &workloadapi.Workload{Uid: "K/networking.istio.io/ServiceEntry/shop/" + name + "/" + ip, Name: name, Namespace: "shop", Addresses: addr(ip),
			Services: map[string]*workloadapi.PortList{"shop/" + name + ".example": {Ports: []*workloadapi.Port{{ServicePort: 80}}}}}
	}
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", ClusterId: "K", Addresses: addr("10.1.0.5"),
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE,
			// istiod's copy of the local pod serves an entry at its own address.
			Services: map[string]*workloadapi.PortList{"shop/self.example": {Ports: []*workloadapi.Port{{ServicePort: 80}}}}},
		{Uid: "K//Pod/shop/web-2", Name: "web-2", Namespace: "shop", Node: "node-b", ClusterId: "K", Addresses: addr("10.2.0.5"),
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE},
		// Entries named like the pods, at their addresses and elsewhere.
		at("web-1", "10.1.0.5"), grab("web-1"), at("web-2", "10.2.0.5"), grab("web-2"),
		// A VM whose entry names its address as the VIP.
		at("vm", "10.5.0.1"),
	})
	services := map[string]*Service{}
	for name, vip := range map[string]string{"web-1": "10.1.0.5", "web-2": "10.2.0.5", "vm": "10.5.0.1", "self": "10.1.0.5"} {
		s, err := translateService(&workloadapi.Service{Name: name, Namespace: "shop", Hostname: name + ".example",
			Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr(vip).AsSlice()}}, Ports: []*workloadapi.Port{{ServicePort: 80}}})
		if err != nil {
			t.Fatal(err)
		}
		services[s.Key()] = s
	}
	mesh := buildSnapshot(workloads, services, nil, "")
	mesh.Cluster = "K"
	snap, _ := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
	for _, a := range []string{"10.1.0.5", "10.2.0.5"} {
		if svc, ok := dir.ServiceByVIP(netip.MustParseAddr(a)); ok && svc.Name != "self" {
			t.Errorf("pod address %s is a VIP of %s, which its author named like the pod", a, svc)
		}
	}
	if svc, ok := dir.ServiceByVIP(netip.MustParseAddr("10.1.0.5")); !ok || svc.Name != "self" {
		t.Errorf("10.1.0.5: %v, want the entry the local pod's copy serves", svc)
	}
	if svc, ok := dir.ServiceByVIP(netip.MustParseAddr("10.5.0.1")); !ok || svc.Name != "vm" {
		t.Errorf("a VIP at the entry's own endpoint: %v, want it kept", svc)
	}
}
