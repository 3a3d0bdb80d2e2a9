package xds

import (
	"errors"
	"log/slog"
	"net/netip"
	"strings"
	"testing"

	"istio.io/istio/pkg/workloadapi"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/internal/syncbuf"
	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
	"github.com/redirector-mesh/redirector/pkg/source/nodepods"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestMergeIntoDirectory: local pods come from the node's watch, the rest
// from istiod; remote workloads are enrolled exactly when istiod says
// HBONE; a Service and a ServiceEntry get their VIPs and per-workload
// target ports; policies arrive compiled, with the workloads' selections.
func TestMergeIntoDirectory(t *testing.T) {
	local := webOnNodeA()
	svcKey := "shop/web.shop.svc.cluster.local"
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		// web-1 is local: istiod's copy only adds its policy selection.
		{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", Addresses: [][]byte{netip.MustParseAddr("10.1.0.5").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, AuthorizationPolicies: []string{"istio-system/istio_converted_static_strict"},
			Services: map[string]*workloadapi.PortList{svcKey: {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}}}},
		{Uid: "K//Pod/shop/web-2", Name: "web-2", Namespace: "shop", Node: "node-b", ServiceAccount: "web", Addresses: [][]byte{netip.MustParseAddr("10.2.0.5").AsSlice()},
			WorkloadName: "web", CanonicalName: "web-svc", CanonicalRevision: "v2",
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE,
			Services:       map[string]*workloadapi.PortList{svcKey: {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 9090}}}}},
		// A ServiceEntry endpoint at web-2's address is web-2.
		{Uid: "K/networking.istio.io/ServiceEntry/shop/external/10.2.0.5", Name: "external", Namespace: "shop", Addresses: [][]byte{netip.MustParseAddr("10.2.0.5").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_NONE},
		{Uid: "K//Pod/legacy/db", Name: "db", Namespace: "legacy", Node: "node-b", Addresses: [][]byte{netip.MustParseAddr("10.2.0.6").AsSlice()},
			Services: map[string]*workloadapi.PortList{"shop/db.example.com": {Ports: []*workloadapi.Port{{ServicePort: 5432, TargetPort: 15432}}}}},
	})
	services := map[string]*Service{}
	for _, x := range []*workloadapi.Service{
		{Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local", Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.0.10").AsSlice()}},
			Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}},
		{Name: "external", Namespace: "shop", Hostname: "db.example.com", Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("240.1.1.1").AsSlice()}},
			Ports: []*workloadapi.Port{{ServicePort: 5432}}},
	} {
		s, err := translateService(x)
		if err != nil {
			t.Fatal(err)
		}
		services[s.Key()] = s
	}
	strict := &policy.Compiled{Name: "istio_converted_static_strict", Namespace: "istio-system", Scope: policy.ScopeWorkloadSelector, Action: policy.ActionDeny,
		Groups: []policy.Group{{Clauses: []policy.Clause{{Matches: []policy.Match{{NotPrincipals: []policy.StringMatch{{Kind: policy.MatchPresence}}}}}}}}}
	mesh := buildSnapshot(workloads, services, map[string]*policy.Compiled{strict.Key(): strict}, "")

	before, errs := merge(local, nil, "node-a", selection.Config{}, nil)
	if before.Compiled == nil || before.Compiled.Synced || len(before.Workloads) != 1 || len(errs) > 0 {
		t.Fatalf("before istiod: %d workloads, compiled %+v, errors %v; want the local pod and an unsynced policy set", len(before.Workloads), before.Compiled, errs)
	}

	snap, errs := merge(local, mesh, "node-a", selection.Config{}, nil)
	dir, dirErrs := workload.NewDirectory(snap.Workloads, snap.Services)
	if errs = append(errs, dirErrs...); len(errs) > 0 {
		t.Fatalf("build: %v", errs)
	}
	if w, ok := dir.Pod("shop", "web-1"); !ok || !w.Enrolled || w.UID != "u1" {
		t.Errorf("local pod: %+v (from the node's watch, enrolled by its namespace)", w)
	}
	if w, ok := dir.ByAddr(netip.MustParseAddr("10.2.0.5")); !ok || w.Name != "web-2" || !w.Enrolled || w.Identity("cluster.local") != "spiffe://cluster.local/ns/shop/sa/web" {
		t.Errorf("remote HBONE workload: %+v", w)
	} else if w.WorkloadName != "web" || w.CanonicalName != "web-svc" || w.CanonicalRevision != "v2" {
		t.Errorf("remote workload names: workload %q canonical %q/%q, want istiod's web, web-svc/v2", w.WorkloadName, w.CanonicalName, w.CanonicalRevision)
	}
	if w, ok := dir.ByAddr(netip.MustParseAddr("10.2.0.6")); !ok || w.Enrolled {
		t.Errorf("remote plaintext workload: %+v, want known and not enrolled", w)
	}
	svc, ok := dir.ServiceByVIP(netip.MustParseAddr("10.96.0.10"))
	if !ok || len(svc.Endpoints) != 2 {
		t.Fatalf("service web: %+v", svc)
	}
	for _, ep := range svc.Endpoints {
		want := map[string]int32{"10.1.0.5": 8080, "10.2.0.5": 9090}[ep.Addr.String()]
		if ep.Ports["80"] != want || !ep.Ready || ep.Workload == nil {
			t.Errorf("endpoint %s: port 80 -> %d ready=%v, want %d", ep.Addr, ep.Ports["80"], ep.Ready, want)
		}
	}
	if se, ok := dir.ServiceByVIP(netip.MustParseAddr("240.1.1.1")); !ok || len(se.Endpoints) != 1 || se.Endpoints[0].Ports["5432"] != 15432 {
		t.Errorf("service entry: %+v", se)
	}
	if got := snap.Compiled.Selected["shop/web-1"]; !snap.Compiled.Synced || len(got) != 1 || got[0] != strict.Key() {
		t.Errorf("compiled set: synced=%v, web-1 selects %v", snap.Compiled.Synced, got)
	}
	if v := snap.Compiled.Authorize(policy.Target{Namespace: "shop", Port: 8080}, "shop/web-1", policy.Peer{}); v.Allowed {
		t.Errorf("plaintext to web-1 under STRICT allowed")
	}
}

// TestMergeKeepsLocalPodWithMalformedAddress: this node's pod whose
// address stops parsing in the node's watch keeps its last good version
// (enrolled, at its old address), as a malformed Workload from istiod keeps
// its previous version (the client NACKs it); istiod's copy of the pod
// does not stand in. Before, the pod left the snapshot and was unenrolled.
func TestMergeKeepsLocalPodWithMalformedAddress(t *testing.T) {
	state := func(ip string) nodepods.State {
		return nodepods.State{
			Namespaces: []corev1.Namespace{{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}},
			Pods: []corev1.Pod{{
				ObjectMeta: metav1.ObjectMeta{Name: "web-1", Namespace: "shop", UID: "u1"},
				Spec:       corev1.PodSpec{NodeName: "node-a"},
				Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}},
			}},
		}
	}
	x, err := translateWorkload(&workloadapi.Workload{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a",
		Addresses: [][]byte{netip.MustParseAddr("10.1.0.5").AsSlice()}, TunnelProtocol: workloadapi.TunnelProtocol_HBONE})
	if err != nil {
		t.Fatal(err)
	}
	mesh := buildSnapshot(map[string]*Workload{x.UID: x}, nil, nil, "")
	var last kubeobj.LastGood
	if _, errs := merge(state("10.1.0.5"), mesh, "node-a", selection.Config{}, &last); len(errs) > 0 {
		t.Fatal(errs)
	}
	for _, bad := range []string{"10.1.0.300", "10.1.0.05", "fe80::1%eth0", ""} {
		snap, errs := merge(state(bad), mesh, "node-a", selection.Config{}, &last)
		if len(errs) != 1 || !strings.Contains(errs[0].Error(), `pod shop/web-1: status.podIPs[0].ip: bad IP "`+bad+`"`) {
			t.Errorf("%q: errors %v, want one naming the pod and field", bad, errs)
		}
		if len(snap.Workloads) != 1 || snap.Workloads[0].UID != "u1" || !snap.Workloads[0].Enrolled || snap.Workloads[0].Addrs[0] != netip.MustParseAddr("10.1.0.5") {
			t.Errorf("%q: workloads %+v, want the local pod's last good version", bad, snap.Workloads)
		}
	}
}

// TestMergeKeepsEnrolledPodWhoseNamespaceLeavesView: a local pod whose
// namespace the node's watch no longer has (the API server removes a
// namespace only after its pods, so the view lags) is Undecided; an
// enrolled one keeps its enrollment, logged, rather than being detached
// and its traffic leaving the mesh.
func TestMergeKeepsEnrolledPodWhoseNamespaceLeavesView(t *testing.T) {
	cfg := selection.Config{NamespaceViewLags: true}
	pod := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web-1", Namespace: "shop", UID: "u1"}, Spec: corev1.PodSpec{NodeName: "node-a"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.1.0.5", PodIPs: []corev1.PodIP{{IP: "10.1.0.5"}}}}
	ns := corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}
	var last kubeobj.LastGood
	if snap, _ := merge(nodepods.State{Namespaces: []corev1.Namespace{ns}, Pods: []corev1.Pod{pod}}, nil, "node-a", cfg, &last); len(snap.Workloads) != 1 || !snap.Workloads[0].Enrolled {
		t.Fatalf("workloads %+v, want web-1 enrolled", snap.Workloads)
	}
	fresh := pod
	fresh.Name, fresh.UID = "web-2", "u2"
	snap, errs := merge(nodepods.State{Pods: []corev1.Pod{pod, fresh}}, nil, "node-a", cfg, &last)
	if len(snap.Workloads) != 2 || !snap.Workloads[0].Enrolled || snap.Workloads[0].Undecided != "" {
		t.Errorf("namespace out of view: workloads %+v, want web-1 still enrolled", snap.Workloads)
	}
	if len(snap.Workloads) == 2 && (snap.Workloads[1].Enrolled || snap.Workloads[1].Undecided == "") {
		t.Errorf("namespace out of view: web-2 %+v, want undecided (never enrolled)", snap.Workloads[1])
	}
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), "shop/web-1") || !strings.Contains(errs[0].Error(), "last good version") {
		t.Errorf("errors %v, want one naming web-1 and saying it is kept", errs)
	}
}

// TestMergeLocalPodsOwnTheirAddressesAndSelection: an istiod workload
// listing a local pod's address besides one of its own does not take the
// local pod's address (before, the directory gave it to whichever sorted
// first by name, so inbound to the local pod was decided with the other
// workload's namespace and policies); a same-named workload elsewhere
// (a ServiceEntry, a pod of another node) does not replace the local
// pod's policy selection; and a local pod istiod has not described is
// refused, not served without its workload-selector policies.
func TestMergeLocalPodsOwnTheirAddressesAndSelection(t *testing.T) {
	local := nodepods.State{
		Namespaces: []corev1.Namespace{{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}},
		Pods: []corev1.Pod{
			{
				ObjectMeta: metav1.ObjectMeta{Name: "web-1", Namespace: "shop", UID: "u1"},
				Spec:       corev1.PodSpec{NodeName: "node-a", ServiceAccountName: "web"},
				Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.1.0.5", PodIPs: []corev1.PodIP{{IP: "10.1.0.5"}}},
			},
			{
				ObjectMeta: metav1.ObjectMeta{Name: "new", Namespace: "shop", UID: "u2"},
				Spec:       corev1.PodSpec{NodeName: "node-a", ServiceAccountName: "web"},
				Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.1.0.6", PodIPs: []corev1.PodIP{{IP: "10.1.0.6"}}},
			},
		},
	}
	deny := &policy.Compiled{Name: "deny-all", Namespace: "shop", Scope: policy.ScopeWorkloadSelector, Action: policy.ActionDeny, Groups: []policy.Group{{}}}
	allow := &policy.Compiled{Name: "allow-all", Namespace: "shop", Scope: policy.ScopeWorkloadSelector, Action: policy.ActionAllow, Groups: []policy.Group{{}}}
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", Addresses: [][]byte{netip.MustParseAddr("10.1.0.5").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, AuthorizationPolicies: []string{deny.Key()}},
		// Same name: a ServiceEntry's endpoint and a pod of another cluster.
		{Uid: "K/networking.istio.io/ServiceEntry/shop/web-1/240.0.0.1", Name: "web-1", Namespace: "shop", Addresses: [][]byte{netip.MustParseAddr("240.0.0.1").AsSlice()},
			AuthorizationPolicies: []string{allow.Key()}},
		{Uid: "K2//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-z", Addresses: [][]byte{netip.MustParseAddr("10.9.0.5").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, AuthorizationPolicies: []string{allow.Key()}},
		// A remote pod claiming web-1's address besides its own, sorting
		// before it by namespace.
		{Uid: "K//Pod/aaa/evil", Name: "evil", Namespace: "aaa", Node: "node-b", ServiceAccount: "evil",
			Addresses:      [][]byte{netip.MustParseAddr("10.1.0.5").AsSlice(), netip.MustParseAddr("10.2.0.9").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE},
	})
	mesh := buildSnapshot(workloads, nil, map[string]*policy.Compiled{deny.Key(): deny, allow.Key(): allow}, "")
	snap, errs := merge(local, mesh, "node-a", selection.Config{}, nil)
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), "aaa/evil") || !strings.Contains(errs[0].Error(), "10.1.0.5") || !strings.Contains(errs[0].Error(), "shop/web-1") {
		t.Errorf("errors %v, want one naming aaa/evil, the address and shop/web-1", errs)
	}
	dir, dirErrs := workload.NewDirectory(snap.Workloads, snap.Services)
	if w, ok := dir.ByAddr(netip.MustParseAddr("10.1.0.5")); !ok || w.UID != "u1" {
		t.Errorf("10.1.0.5 belongs to %v (errors %v), want the local pod", w, dirErrs)
	}
	if w, ok := dir.ByAddr(netip.MustParseAddr("10.2.0.9")); !ok || w.Name != "evil" {
		t.Errorf("10.2.0.9 belongs to %v, want evil (its own address)", w)
	}
	if got := snap.Compiled.Selected["shop/web-1"]; len(got) != 1 || got[0] != deny.Key() {
		t.Errorf("web-1 selects %v, want istiod's copy of this node's pod: %s", got, deny.Key())
	}
	dst := policy.Target{Namespace: "shop", Port: 80}
	peer := policy.Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/web"}
	if v := snap.Compiled.Authorize(dst, "shop/web-1", peer); v.Allowed {
		t.Errorf("web-1 under its DENY allowed: %s", v.Reason)
	}
	if v := snap.Compiled.Authorize(dst, "shop/new", peer); v.Allowed || !strings.Contains(v.Reason, "shop/new") {
		t.Errorf("a local pod istiod has not described: allowed=%v (%s)", v.Allowed, v.Reason)
	}
}

// TestMergeOtherNetworks: in a multi-network mesh the same address can
// be a different host on each network. Workloads istiod puts on another
// network than the agent's do not enter the directory (a west pod at an
// east plaintext workload's address does not make traffic to it HBONE
// with the west pod's identity), are no service's endpoints, and VIPs on
// other networks are left out. A local pod that istiod puts on another
// network means the agent's NETWORK disagrees with istiod: that pod is
// refused inbound with both networks named, not served as if all were
// well.
func TestMergeOtherNetworks(t *testing.T) {
	local := webOnNodeA()
	svcKey := "shop/web.shop.svc.cluster.local"
	ports := map[string]*workloadapi.PortList{svcKey: {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}}}
	build := func(localNetwork string) *Snapshot {
		workloads := map[string]*Workload{}
		for _, x := range []*workloadapi.Workload{
			{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", Network: localNetwork, Addresses: [][]byte{netip.MustParseAddr("10.1.0.5").AsSlice()},
				TunnelProtocol: workloadapi.TunnelProtocol_HBONE, Services: ports},
			{Uid: "K//Pod/shop/web-2", Name: "web-2", Namespace: "shop", Node: "node-b", Network: "east", Addresses: [][]byte{netip.MustParseAddr("10.2.0.5").AsSlice()},
				TunnelProtocol: workloadapi.TunnelProtocol_HBONE, Services: ports},
			// A plaintext VM on the east network at 10.2.0.9, and a pod of
			// the west network's cluster at the same address.
			{Uid: "K/networking.istio.io/WorkloadEntry/shop/vm", Name: "vm", Namespace: "shop", Network: "east", Addresses: [][]byte{netip.MustParseAddr("10.2.0.9").AsSlice()},
				TunnelProtocol: workloadapi.TunnelProtocol_NONE},
			{Uid: "W//Pod/aaa/web-west", Name: "web-west", Namespace: "aaa", Node: "west-1", Network: "west", ServiceAccount: "web",
				Addresses:      [][]byte{netip.MustParseAddr("10.2.0.9").AsSlice(), netip.MustParseAddr("10.3.0.1").AsSlice()},
				TunnelProtocol: workloadapi.TunnelProtocol_HBONE, Services: ports},
		} {
			w, err := translateWorkload(x)
			if err != nil {
				t.Fatal(err)
			}
			workloads[x.Uid] = w
		}
		svc, err := translateService(&workloadapi.Service{Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local",
			Addresses: []*workloadapi.NetworkAddress{
				{Network: "east", Address: netip.MustParseAddr("10.96.0.10").AsSlice()},
				{Network: "west", Address: netip.MustParseAddr("10.97.0.10").AsSlice()},
			},
			Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}})
		if err != nil {
			t.Fatal(err)
		}
		return buildSnapshot(workloads, map[string]*Service{svc.Key(): svc}, nil, "east")
	}

	mesh := build("east")
	if mesh.OtherNetwork != 1 {
		t.Errorf("OtherNetwork = %d, want 1 (web-west)", mesh.OtherNetwork)
	}
	snap, errs := merge(local, mesh, "node-a", selection.Config{}, nil)
	if len(errs) > 0 {
		t.Fatalf("merge: %v", errs)
	}
	dir, dirErrs := workload.NewDirectory(snap.Workloads, snap.Services)
	if len(dirErrs) > 0 {
		t.Fatalf("directory: %v", dirErrs)
	}
	if w, ok := dir.ByAddr(netip.MustParseAddr("10.2.0.9")); !ok || w.Name != "vm" || w.Enrolled {
		t.Errorf("10.2.0.9 is %+v, want the east VM, plaintext", w)
	}
	if w, ok := dir.ByAddr(netip.MustParseAddr("10.3.0.1")); ok {
		t.Errorf("10.3.0.1 is %s on network west, want unknown here", w)
	}
	if _, ok := dir.Pod("aaa", "web-west"); ok {
		t.Error("web-west (network west) is in the directory")
	}
	if _, ok := dir.ServiceByVIP(netip.MustParseAddr("10.97.0.10")); ok {
		t.Error("the west VIP 10.97.0.10 is in the directory")
	}
	svc, ok := dir.ServiceByVIP(netip.MustParseAddr("10.96.0.10"))
	if !ok {
		t.Fatal("the east VIP 10.96.0.10 is not in the directory")
	}
	var eps []string
	for _, ep := range svc.Endpoints {
		eps = append(eps, ep.Addr.String())
	}
	if strings.Join(eps, ",") != "10.1.0.5,10.2.0.5" {
		t.Errorf("endpoints %v, want the two east pods", eps)
	}
	if _, unknown := snap.Compiled.Unknown["shop/web-1"]; unknown {
		t.Errorf("web-1 unknown: %s", snap.Compiled.Unknown["shop/web-1"])
	}

	// istiod puts this node's pod on west: the agent's NETWORK is wrong.
	snap, errs = merge(local, build("west"), "node-a", selection.Config{}, nil)
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), `network "west"`) || !strings.Contains(errs[0].Error(), `network "east"`) {
		t.Errorf("errors %v, want one naming both networks", errs)
	}
	peer := policy.Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/web"}
	if v := snap.Compiled.Authorize(policy.Target{Namespace: "shop", Port: 8080}, "shop/web-1", peer); v.Allowed || !strings.Contains(v.Reason, "network") {
		t.Errorf("inbound to web-1 with NETWORK disagreeing: allowed=%v (%s), want refused naming the network", v.Allowed, v.Reason)
	}
}

// TestMergeWorkloadAddressesBeforeVIPs: the tunnel looks a destination up
// as a VIP before as a workload's address, so a service istiod sent with
// a VIP at a pod's address (a ServiceEntry's addresses are anyone's to
// write in their namespace) took the traffic meant for that pod, this
// node's pods included, to the service's endpoints: a plaintext one here.
// Such a VIP is now left out, named in an error; the service keeps its
// other VIPs, and a VIP at one of its own endpoints (a VM's) stays.
func TestMergeWorkloadAddressesBeforeVIPs(t *testing.T) {
	local := webOnNodeA()
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", Addresses: [][]byte{netip.MustParseAddr("10.1.0.5").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE},
		{Uid: "K//Pod/shop/web-2", Name: "web-2", Namespace: "shop", Node: "node-b", Addresses: [][]byte{netip.MustParseAddr("10.2.0.5").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE},
		{Uid: "K/networking.istio.io/ServiceEntry/evil/grab/10.9.9.9", Name: "grab", Namespace: "evil", Addresses: [][]byte{netip.MustParseAddr("10.9.9.9").AsSlice()},
			Services: map[string]*workloadapi.PortList{"evil/grab.example": {Ports: []*workloadapi.Port{{ServicePort: 80}}}}},
		// Also an endpoint of grab, at web-2's address: not web-2.
		{Uid: "K/networking.istio.io/ServiceEntry/evil/grab/10.2.0.5", Name: "grab", Namespace: "evil", Addresses: [][]byte{netip.MustParseAddr("10.2.0.5").AsSlice()},
			Services: map[string]*workloadapi.PortList{"evil/grab.example": {Ports: []*workloadapi.Port{{ServicePort: 80}}}}},
		// A VM whose ServiceEntry names its address as the VIP.
		{Uid: "K/networking.istio.io/ServiceEntry/vm/db/10.5.0.1", Name: "db", Namespace: "vm", Addresses: [][]byte{netip.MustParseAddr("10.5.0.1").AsSlice()},
			Services: map[string]*workloadapi.PortList{"vm/db.example": {Ports: []*workloadapi.Port{{ServicePort: 5432, TargetPort: 15432}}}}},
	})
	grab, err := translateService(&workloadapi.Service{Name: "grab", Namespace: "evil", Hostname: "grab.example",
		Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.1.0.5").AsSlice()}, {Address: netip.MustParseAddr("10.2.0.5").AsSlice()}, {Address: netip.MustParseAddr("240.9.9.9").AsSlice()}},
		Ports:     []*workloadapi.Port{{ServicePort: 80}}})
	if err != nil {
		t.Fatal(err)
	}
	db, err := translateService(&workloadapi.Service{Name: "db", Namespace: "vm", Hostname: "db.example",
		Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.5.0.1").AsSlice()}}, Ports: []*workloadapi.Port{{ServicePort: 5432}}})
	if err != nil {
		t.Fatal(err)
	}
	mesh := buildSnapshot(workloads, map[string]*Service{grab.Key(): grab, db.Key(): db}, nil, "")
	snap, errs := merge(local, mesh, "node-a", selection.Config{}, nil)
	if len(errs) != 2 || !strings.Contains(errs[0].Error(), "evil/grab.example lists VIP 10.1.0.5, an address of workload shop/web-1, which does not serve it") ||
		!strings.Contains(errs[1].Error(), "VIP 10.2.0.5, an address of workload shop/web-2, which does not serve it") {
		t.Errorf("errors %v, want the two VIPs at workloads' addresses named", errs)
	}
	dir, dirErrs := workload.NewDirectory(snap.Workloads, snap.Services)
	for _, a := range []string{"10.1.0.5", "10.2.0.5"} {
		if svc, ok := dir.ServiceByVIP(netip.MustParseAddr(a)); ok {
			t.Errorf("%s is a VIP of %s, want the workload's address", a, svc)
		}
		if w, ok := dir.ByAddr(netip.MustParseAddr(a)); !ok || !w.Enrolled {
			t.Errorf("%s: workload %v (errors %v), want the enrolled pod", a, w, dirErrs)
		}
	}
	if svc, ok := dir.ServiceByVIP(netip.MustParseAddr("240.9.9.9")); !ok || len(svc.Endpoints) != 2 {
		t.Errorf("the service's own VIP: %v", svc)
	}
	if svc, ok := dir.ServiceByVIP(netip.MustParseAddr("10.5.0.1")); !ok || svc.Name != "db" {
		t.Errorf("a VIP at the service's own endpoint: %v, want it kept", svc)
	}
	for _, svc := range mesh.Services {
		if svc.Name == "grab" && len(svc.VIPs) != 3 {
			t.Errorf("istiod's snapshot was modified: %v", svc.VIPs)
		}
	}
	m := NewMetrics(nil)
	m.setAddressConflicts(countConflicts(append(errs, errors.New("another error"))))
	expectMetric(t, m, "redirector_xds_address_conflicts", 2)
}

// TestMergeSharedVIPs: a VIP two services list goes, as in ztunnel, to
// the one istiod marks canonical, else to the one shaped like a Kubernetes
// Service, else to none (the cluster's service proxy decides); a NamespaceOnly
// service competes with nobody outside its namespace and is reached only
// from it. Before, the directory gave a VIP to the first service by
// namespace and name and dropped the other service whole: a tenant's
// ServiceEntry in "default" at kube-dns's cluster IP took the cluster's
// DNS to its own endpoint, and kube-dns's IPv6 VIP went with it.
func TestMergeSharedVIPs(t *testing.T) {
	dnsVIP, dnsVIP6, tenantVIP, fought := netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("fd00::a"), netip.MustParseAddr("10.96.0.20"), netip.MustParseAddr("10.96.0.99")
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/kube-system/coredns-1", Name: "coredns-1", Namespace: "kube-system", Node: "node-b", Addresses: [][]byte{netip.MustParseAddr("10.2.0.53").AsSlice()},
			Services: map[string]*workloadapi.PortList{"kube-system/kube-dns.kube-system.svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 53}}}}},
		{Uid: "K/networking.istio.io/ServiceEntry/default/evil/203.0.113.5", Name: "evil", Namespace: "default", Addresses: [][]byte{netip.MustParseAddr("203.0.113.5").AsSlice()},
			Services: map[string]*workloadapi.PortList{
				"default/evil.example":                    {Ports: []*workloadapi.Port{{ServicePort: 53}}},
				"default/mimic.default.svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 53}}},
				"default/local.example":                   {Ports: []*workloadapi.Port{{ServicePort: 53}}},
			}},
	})
	vips := func(as ...netip.Addr) (out []*workloadapi.NetworkAddress) {
		for _, a := range as {
			out = append(out, &workloadapi.NetworkAddress{Address: a.AsSlice()})
		}
		return out
	}
	dnsPort := []*workloadapi.Port{{ServicePort: 53}}
	services := map[string]*Service{}
	for _, x := range []*workloadapi.Service{
		// A VIP listed twice is one claim.
		{Name: "kube-dns", Namespace: "kube-system", Hostname: "kube-dns.kube-system.svc.cluster.local", Canonical: true,
			Addresses: vips(dnsVIP, dnsVIP6, dnsVIP), Ports: dnsPort},
		// A ServiceEntry at kube-dns's VIP, and at a VIP of its own.
		{Name: "evil", Namespace: "default", Hostname: "evil.example", Addresses: vips(dnsVIP, tenantVIP), Ports: dnsPort},
		// Named like a Kubernetes Service of its own namespace, at
		// kube-dns's IPv6 VIP: kube-dns is istiod's canonical one.
		{Name: "mimic", Namespace: "default", Hostname: "mimic.default.svc.cluster.local", Addresses: vips(dnsVIP6), Ports: dnsPort},
		// Exported to its own namespace only, at kube-dns's VIP: for
		// clients in default only, and competing with no one else.
		{Name: "local", Namespace: "default", Hostname: "local.example", Addresses: vips(dnsVIP), Ports: dnsPort, Visibility: workloadapi.Service_NAMESPACE},
		// Two entries that nothing tells apart.
		{Name: "one", Namespace: "a", Hostname: "one.example", Addresses: vips(fought), Ports: dnsPort},
		{Name: "two", Namespace: "b", Hostname: "two.example", Addresses: vips(fought), Ports: dnsPort},
	} {
		svc, err := translateService(x)
		if err != nil {
			t.Fatal(err)
		}
		services[svc.Key()] = svc
	}
	mesh := buildSnapshot(workloads, services, nil, "")
	snap, errs := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	want := []string{
		"istiod's services a/one.example, b/two.example all list VIP 10.96.0.99: no service keeps it: connections to it go to the address, where the cluster's service proxy knows the real owner",
		"istiod's services default/evil.example, kube-system/kube-dns.kube-system.svc.cluster.local all list VIP 10.96.0.10: it stays istiod's canonical service's, kube-system/kube-dns.kube-system.svc.cluster.local",
		"istiod's services default/mimic.default.svc.cluster.local, kube-system/kube-dns.kube-system.svc.cluster.local all list VIP fd00::a: it stays istiod's canonical service's, kube-system/kube-dns.kube-system.svc.cluster.local",
	}
	if got := errorStrings(errs); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("errors:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if n := countConflicts(errs); n != 3 {
		t.Errorf("%d address conflicts counted, want 3", n)
	}
	dir, dirErrs := workload.NewDirectory(snap.Workloads, snap.Services)
	if len(dirErrs) != 0 {
		t.Errorf("directory errors %v", dirErrs)
	}
	for _, vip := range []netip.Addr{dnsVIP, dnsVIP6} {
		if svc, ok := dir.ServiceByVIPFor(vip, "shop"); !ok || svc.Name != "kube-dns" || len(svc.Endpoints) != 1 || svc.Endpoints[0].Addr != netip.MustParseAddr("10.2.0.53") {
			t.Errorf("%s from shop is %v, want kube-dns with coredns behind it", vip, svc)
		}
	}
	if svc, ok := dir.ServiceByVIPFor(dnsVIP, "default"); !ok || svc.Name != "local" {
		t.Errorf("%s from default is %v, want default's own NamespaceOnly entry", dnsVIP, svc)
	}
	// Nothing tells the owner apart: the address goes to the cluster's service
	// proxy, which knows the real one; no entry's endpoints are reached.
	if svc, ok := dir.ServiceByVIPFor(fought, "shop"); ok {
		t.Errorf("%s is %+v, want no service's", fought, svc)
	}
	if svc, ok := dir.ServiceByVIP(tenantVIP); !ok || svc.Name != "evil" {
		t.Errorf("the entry's own VIP %s is %v, want it kept", tenantVIP, svc)
	}
	for _, svc := range mesh.Services {
		if svc.Name == "kube-dns" && len(svc.VIPs) != 3 {
			t.Errorf("istiod's snapshot was modified: %v", svc.VIPs)
		}
	}
}

// TestMergeHostNetworkPodsNotIndexed: istiod sends a hostNetwork pod at its
// node's address with network_mode HOST_NETWORK. Indexed, that address (a
// whole node's: kubelet, node ports, every hostNetwork daemon) was one such
// pod, the first by name, and connections to it took that pod's waypoint.
// The address is now nobody's, stays claimed against VIPs, and the pod
// stays an endpoint of its service there.
func TestMergeHostNetworkPodsNotIndexed(t *testing.T) {
	nodeB := netip.MustParseAddr("10.0.0.20")
	waypoint := &workloadapi.GatewayAddress{Destination: &workloadapi.GatewayAddress_Address{Address: &workloadapi.NetworkAddress{Address: netip.MustParseAddr("10.2.9.9").AsSlice()}}, HboneMtlsPort: 15008}
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/agents/exporter-b", Name: "exporter-b", Namespace: "agents", Node: "node-b", Addresses: [][]byte{nodeB.AsSlice()},
			NetworkMode: workloadapi.NetworkMode_HOST_NETWORK, Waypoint: waypoint, Status: workloadapi.WorkloadStatus_HEALTHY,
			Services: map[string]*workloadapi.PortList{"agents/exporter.agents.svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 9100}}}}},
		{Uid: "K//Pod/kube-system/kube-proxy-b", Name: "kube-proxy-b", Namespace: "kube-system", Node: "node-b", Addresses: [][]byte{nodeB.AsSlice()},
			NetworkMode: workloadapi.NetworkMode_HOST_NETWORK},
		// This node's own: its address is claimed too.
		{Uid: "K//Pod/kube-system/kube-proxy-a", Name: "kube-proxy-a", Namespace: "kube-system", Node: "node-a", Addresses: [][]byte{netip.MustParseAddr("10.0.0.10").AsSlice()},
			NetworkMode: workloadapi.NetworkMode_HOST_NETWORK},
	})
	exporter, err := translateService(&workloadapi.Service{Name: "exporter", Namespace: "agents", Hostname: "exporter.agents.svc.cluster.local",
		Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.0.30").AsSlice()}}, Ports: []*workloadapi.Port{{ServicePort: 9100}}})
	if err != nil {
		t.Fatal(err)
	}
	grab, err := translateService(&workloadapi.Service{Name: "grab", Namespace: "evil", Hostname: "grab.example",
		Addresses: []*workloadapi.NetworkAddress{{Address: nodeB.AsSlice()}, {Address: netip.MustParseAddr("10.0.0.10").AsSlice()}}, Ports: []*workloadapi.Port{{ServicePort: 10250}}})
	if err != nil {
		t.Fatal(err)
	}
	mesh := buildSnapshot(workloads, map[string]*Service{exporter.Key(): exporter, grab.Key(): grab}, nil, "")
	snap, errs := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	if len(errs) != 2 || !strings.Contains(errs[0].Error(), "evil/grab.example lists VIP 10.0.0.20, an address of workload agents/exporter-b") ||
		!strings.Contains(errs[1].Error(), "evil/grab.example lists VIP 10.0.0.10, an address of workload kube-system/kube-proxy-a") {
		t.Errorf("errors %v, want the VIPs at node-a's and node-b's addresses refused", errs)
	}
	dir, dirErrs := workload.NewDirectory(snap.Workloads, snap.Services)
	if len(dirErrs) != 0 {
		t.Errorf("directory errors %v", dirErrs)
	}
	if w, ok := dir.ByAddr(nodeB); ok {
		t.Errorf("node-b's address %s is indexed as %s", nodeB, w)
	}
	if svc, ok := dir.ServiceByVIP(nodeB); ok {
		t.Errorf("node-b's address %s is a VIP of %s", nodeB, svc)
	}
	if _, ok := dir.Pod("agents", "exporter-b"); !ok {
		t.Error("the hostNetwork pod is not in the directory")
	}
	svc, ok := dir.ServiceByVIP(netip.MustParseAddr("10.96.0.30"))
	if !ok || len(svc.Endpoints) != 1 || svc.Endpoints[0].Addr != nodeB || !svc.Endpoints[0].Ready || svc.Endpoints[0].Workload != nil {
		t.Errorf("exporter service %v, want one ready endpoint at %s with no meshed workload", svc, nodeB)
	}

	bad := &workloadapi.Workload{Uid: "K//Pod/a/b", Name: "b", Namespace: "a", NetworkMode: workloadapi.NetworkMode(9)}
	if _, err := translateWorkload(bad); err == nil || !strings.Contains(err.Error(), "network mode 9 is not supported") {
		t.Errorf("unknown network mode: %v", err)
	}
}

// translateWorkloads translates istiod's workloads, by uid, failing the
// test on an error.
func translateWorkloads(t *testing.T, xs []*workloadapi.Workload) map[string]*Workload {
	t.Helper()
	out := make(map[string]*Workload, len(xs))
	for _, x := range xs {
		w, err := translateWorkload(x)
		if err != nil {
			t.Fatal(err)
		}
		out[x.Uid] = w
	}
	return out
}

func errorStrings(errs []error) []string {
	out := make([]string, 0, len(errs))
	for _, err := range errs {
		out = append(out, err.Error())
	}
	return out
}

// webOnNodeA is node-a's pods: shop/web-1 (uid u1, service account web)
// at 10.1.0.5 in an ambient namespace.
func webOnNodeA() nodepods.State {
	return nodepods.State{
		Namespaces: []corev1.Namespace{{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}},
		Pods: []corev1.Pod{{
			ObjectMeta: metav1.ObjectMeta{Name: "web-1", Namespace: "shop", UID: "u1"},
			Spec:       corev1.PodSpec{NodeName: "node-a", ServiceAccountName: "web"},
			Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.1.0.5", PodIPs: []corev1.PodIP{{IP: "10.1.0.5"}}},
		}},
	}
}

// TestReportNewLogsPersistingErrorsOnce: merge's errors were logged at
// every snapshot, so conflicts that persist (a tenant's ServiceEntries
// with VIPs at others' addresses: thousands, maybe) were logged again
// several times a second. Each is now logged when it appears.
func TestReportNewLogsPersistingErrorsOnce(t *testing.T) {
	var logs syncbuf.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	a, b := errors.New("conflict a"), errors.New("conflict b")
	seen := reportNew(log, nil, []error{a})
	seen = reportNew(log, seen, []error{a, b})
	seen = reportNew(log, seen, []error{a, b})
	reportNew(log, seen, []error{b})
	if na, nb := strings.Count(logs.String(), "conflict a"), strings.Count(logs.String(), "conflict b"); na != 1 || nb != 1 {
		t.Errorf("logged a %d times, b %d times, want once each:\n%s", na, nb, logs.String())
	}
}

// TestMergeAddressGoesToTheMeshedClaimant: two of istiod's workloads at
// one address (a pod's stale copy beside the one now there, a lying
// object) are settled as ztunnel settles them and as the directory does
// for every other source: a pod before anything else, then the one that
// takes HBONE, then the first by name. Before, merge gave the address to
// the first by namespace and name alone, so a plaintext claimant named
// before an HBONE pod made every connection to that pod plaintext
// passthrough (where the HBONE one, if wrong, fails closed).
func TestMergeAddressGoesToTheMeshedClaimant(t *testing.T) {
	shared, seAddr := netip.MustParseAddr("10.2.0.7"), netip.MustParseAddr("10.3.0.9")
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/aaa/stale", Name: "stale", Namespace: "aaa", Node: "node-b", Addresses: [][]byte{shared.AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_NONE},
		{Uid: "K//Pod/shop/web-3", Name: "web-3", Namespace: "shop", Node: "node-b", Addresses: [][]byte{shared.AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE},
		// Not pods: a plaintext ServiceEntry endpoint named first, a
		// meshed WorkloadEntry.
		{Uid: "K/networking.istio.io/ServiceEntry/aaa/plain/10.3.0.9", Name: "plain", Namespace: "aaa", Addresses: [][]byte{seAddr.AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_NONE},
		{Uid: "K/networking.istio.io/WorkloadEntry/vm/db", Name: "db", Namespace: "vm", Addresses: [][]byte{seAddr.AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE},
	})
	mesh := buildSnapshot(workloads, nil, nil, "")
	for range 3 { // the same answer every time
		snap, _ := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
		dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
		if w, ok := dir.ByAddr(shared); !ok || w.Name != "web-3" || !w.Enrolled {
			t.Errorf("%s: %v, want the HBONE pod shop/web-3", shared, w)
		}
		if w, ok := dir.ByAddr(seAddr); !ok || w.Name != "db" || !w.Enrolled {
			t.Errorf("%s: %v, want the HBONE WorkloadEntry vm/db", seAddr, w)
		}
	}
}

// TestMergeNamedTargetPortOnlyPerEndpoint: istiod sends a Kubernetes
// Service's named targetPort as target port 0 and resolves it per pod,
// leaving the port out of the list of a pod that declares no port of that
// name (as Kubernetes leaves such a pod out of the port's endpoints); the
// service's target port 0 then means "only where a workload says", and
// ztunnel skips an endpoint without its own port. Before, 0 was read as
// the service port, and such a pod was sent the service's connections on
// the service port number, a port it never offered for the service.
func TestMergeNamedTargetPortOnlyPerEndpoint(t *testing.T) {
	svcKey := "shop/web.shop.svc.cluster.local"
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/shop/web-2", Name: "web-2", Namespace: "shop", Node: "node-b", Addresses: [][]byte{netip.MustParseAddr("10.2.0.5").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE,
			Services:       map[string]*workloadapi.PortList{svcKey: {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}, {ServicePort: 9000, TargetPort: 9000}}}}},
		// An old version without the named port: only 9000 is its.
		{Uid: "K//Pod/shop/web-old", Name: "web-old", Namespace: "shop", Node: "node-b", Addresses: [][]byte{netip.MustParseAddr("10.2.0.6").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE,
			Services:       map[string]*workloadapi.PortList{svcKey: {Ports: []*workloadapi.Port{{ServicePort: 9000, TargetPort: 9000}}}}},
	})
	web, err := translateService(&workloadapi.Service{Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local",
		Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.0.10").AsSlice()}},
		Ports:     []*workloadapi.Port{{ServicePort: 80, TargetPort: 0}, {ServicePort: 9000, TargetPort: 9000}}})
	if err != nil {
		t.Fatal(err)
	}
	mesh := buildSnapshot(workloads, map[string]*Service{web.Key(): web}, nil, "")
	snap, _ := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
	svc, ok := dir.ServiceByVIP(netip.MustParseAddr("10.96.0.10"))
	if !ok || len(svc.Endpoints) != 2 {
		t.Fatalf("service: %+v", svc)
	}
	want := map[string]map[int32]int{ // endpoint -> service port -> target, -1: does not serve it
		"10.2.0.5": {80: 8080, 9000: 9000},
		"10.2.0.6": {80: -1, 9000: 9000},
	}
	for _, ep := range svc.Endpoints {
		for _, sp := range svc.Ports {
			got := -1
			if tp, ok := ep.TargetPort(sp); ok {
				got = int(tp)
			}
			if w := want[ep.Addr.String()][sp.Port]; got != w {
				t.Errorf("endpoint %s, service port %d: target %d, want %d (-1: not served)", ep.Addr, sp.Port, got, w)
			}
		}
	}
}

// TestMergeServiceLoadBalancing: istiod's load_balancing on a service
// says more than a preference, and was ignored:
//   - health_policy ALLOW_ALL (publishNotReadyAddresses): endpoints not
//     ready serve too; read as ONLY_HEALTHY, the peers of a StatefulSet
//     that find each other through such a service before they are ready
//     (etcd, ZooKeeper) were refused as "no ready endpoint";
//   - mode STRICT with NODE (internalTrafficPolicy: Local): only endpoints
//     on the client's node, this node, serve; balanced over every node, a
//     pod's data for its node's agent went to other nodes' agents;
//   - mode PASSTHROUGH (a ServiceEntry with resolution NONE): connections
//     go to the address called, not to the entry's endpoints; as a
//     service, every meshed connection to such an entry's addresses was
//     refused, or taken to its endpoints;
//
// and a mode or a scope the agent does not know, or a scope listed twice,
// rejects the service (the client NACKs it, naming the field), rather than
// balancing as if it were not there.
func TestMergeServiceLoadBalancing(t *testing.T) {
	peersKey, localKey, extKey := "db/peers.db.svc.cluster.local", "obs/agent.obs.svc.cluster.local", "shop/ext.example.com"
	port := func(svcKey string) map[string]*workloadapi.PortList {
		return map[string]*workloadapi.PortList{svcKey: {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}}}
	}
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/db/db-0", Name: "db-0", Namespace: "db", Node: "node-b", Addresses: [][]byte{netip.MustParseAddr("10.2.0.10").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, Status: workloadapi.WorkloadStatus_UNHEALTHY, Services: port(peersKey)},
		{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", Addresses: [][]byte{netip.MustParseAddr("10.1.0.5").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, Services: port(localKey)},
		{Uid: "K//Pod/obs/agent-b", Name: "agent-b", Namespace: "obs", Node: "node-b", Addresses: [][]byte{netip.MustParseAddr("10.2.0.11").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, Services: port(localKey)},
		{Uid: "K/networking.istio.io/ServiceEntry/shop/ext/10.9.0.1", Name: "ext", Namespace: "shop", Addresses: [][]byte{netip.MustParseAddr("10.9.0.1").AsSlice()},
			Services: port(extKey)},
	})
	services := map[string]*Service{}
	for _, x := range []*workloadapi.Service{
		{Name: "peers", Namespace: "db", Hostname: "peers.db.svc.cluster.local", Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.1.1").AsSlice()}},
			Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}, LoadBalancing: &workloadapi.LoadBalancing{HealthPolicy: workloadapi.LoadBalancing_ALLOW_ALL}},
		{Name: "agent", Namespace: "obs", Hostname: "agent.obs.svc.cluster.local", Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.1.2").AsSlice()}},
			Ports:         []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}},
			LoadBalancing: &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_STRICT, RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_NODE}}},
		{Name: "ext", Namespace: "shop", Hostname: "ext.example.com", Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("203.0.113.7").AsSlice()}},
			Ports: []*workloadapi.Port{{ServicePort: 80}}, LoadBalancing: &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_PASSTHROUGH, HealthPolicy: workloadapi.LoadBalancing_ALLOW_ALL}},
	} {
		s, err := translateService(x)
		if err != nil {
			t.Fatal(err)
		}
		services[s.Key()] = s
	}
	mesh := buildSnapshot(workloads, services, nil, "")
	snap, _ := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
	if svc, ok := dir.ServiceByVIP(netip.MustParseAddr("10.96.1.1")); !ok || len(svc.Endpoints) != 1 || !svc.Endpoints[0].Ready {
		t.Errorf("ALLOW_ALL: %+v, want db-0 a ready endpoint though istiod marks it unhealthy", svc)
	}
	if svc, ok := dir.ServiceByVIP(netip.MustParseAddr("10.96.1.2")); !ok || len(svc.Endpoints) != 1 || svc.Endpoints[0].Addr != netip.MustParseAddr("10.1.0.5") {
		t.Errorf("STRICT NODE: %+v, want only this node's endpoint 10.1.0.5", svc)
	}
	if svc, ok := dir.ServiceByVIP(netip.MustParseAddr("203.0.113.7")); ok {
		t.Errorf("PASSTHROUGH: 203.0.113.7 is a VIP of %s, want connections to go to the address", svc)
	}

	for _, tc := range []struct {
		name string
		lb   *workloadapi.LoadBalancing
		want string
	}{
		{"unknown mode", &workloadapi.LoadBalancing{Mode: 9}, "load_balancing mode 9"},
		{"unknown health policy", &workloadapi.LoadBalancing{HealthPolicy: 7}, "load_balancing health_policy 7"},
		{"STRICT by unknown scope", &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_STRICT, RoutingPreference: []workloadapi.LoadBalancing_Scope{12}}, "routing_preference 12"},
		{"FAILOVER by unspecified scope", &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_FAILOVER, RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_UNSPECIFIED_SCOPE}}, "routing_preference UNSPECIFIED_SCOPE"},
		{"FAILOVER by zone twice", &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_FAILOVER, RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_ZONE, workloadapi.LoadBalancing_REGION, workloadapi.LoadBalancing_ZONE}}, "lists ZONE twice"},
	} {
		_, err := translateService(&workloadapi.Service{Name: "x", Namespace: "shop", Hostname: "x.shop.svc.cluster.local", LoadBalancing: tc.lb})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error naming %q", tc.name, err, tc.want)
		}
	}
}

// TestMergeCIDRAddresses: a ServiceEntry's address may be a CIDR, which
// istiod sends as the range's first address with a prefix length; ztunnel
// takes a connection to any address in it (that no VIP has) to the
// service, its waypoint first: an egress waypoint's policy for a range
// holds only so. Before, the length was ignored and the range's first
// address became a host VIP: connections to the rest of the range went
// straight out, past the waypoint. A workload's address stays the
// workload's (as for host VIPs), the longest prefix wins, a range that
// holds addresses of no one host (link-local: the cloud metadata server)
// rejects the service, and a range on another network is left out.
func TestMergeCIDRAddresses(t *testing.T) {
	cidr := func(p string, network string) *workloadapi.NetworkAddress {
		pr := netip.MustParsePrefix(p)
		l := uint32(pr.Bits())
		return &workloadapi.NetworkAddress{Address: pr.Addr().AsSlice(), Length: &l, Network: network}
	}
	egress := &workloadapi.GatewayAddress{Destination: &workloadapi.GatewayAddress_Hostname{Hostname: &workloadapi.NamespacedHostname{Namespace: "egress", Hostname: "waypoint.egress.svc.cluster.local"}}, HboneMtlsPort: 15008}
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/shop/web-2", Name: "web-2", Namespace: "shop", Node: "node-b", Addresses: [][]byte{netip.MustParseAddr("10.20.0.7").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE},
	})
	services := map[string]*Service{}
	for _, x := range []*workloadapi.Service{
		{Name: "partners", Namespace: "egress", Hostname: "partners.example", Addresses: []*workloadapi.NetworkAddress{cidr("10.20.0.0/16", ""), cidr("10.30.0.0/16", "far")},
			Ports: []*workloadapi.Port{{ServicePort: 443, TargetPort: 443}}, Waypoint: egress},
		{Name: "one-partner", Namespace: "egress", Hostname: "one.partners.example", Addresses: []*workloadapi.NetworkAddress{cidr("10.20.9.0/24", "")},
			Ports: []*workloadapi.Port{{ServicePort: 443, TargetPort: 443}}, Waypoint: egress},
		{Name: "exact", Namespace: "shop", Hostname: "exact.example", Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.20.1.1").AsSlice()}},
			Ports: []*workloadapi.Port{{ServicePort: 443, TargetPort: 443}}},
	} {
		s, err := translateService(x)
		if err != nil {
			t.Fatal(err)
		}
		services[s.Key()] = s
	}
	mesh := buildSnapshot(workloads, services, nil, "")
	snap, errs := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	dir, dirErrs := workload.NewDirectory(snap.Workloads, snap.Services)
	if errs = append(errs, dirErrs...); len(errs) > 0 {
		t.Errorf("errors: %v", errs)
	}
	for _, tc := range []struct{ dst, want string }{
		{"10.20.5.5", "partners"},
		{"10.20.0.0", "partners"},
		{"10.20.9.9", "one-partner"}, // the longer prefix
		{"10.20.1.1", "exact"},       // a VIP first
		{"10.20.0.7", ""},            // a workload's address stays its
		{"10.30.0.1", ""},            // on another network
		{"10.21.0.1", ""},
	} {
		got := ""
		if svc, ok := dir.ServiceByVIPFor(netip.MustParseAddr(tc.dst), "shop"); ok {
			got = svc.Name
		}
		if got != tc.want {
			t.Errorf("%s: service %q, want %q", tc.dst, got, tc.want)
		}
	}
	for _, bad := range []string{"169.254.0.0/16", "160.0.0.0/4", "fc00::/6", "0.0.0.0/0", "127.0.0.0/8", "fe80::/10", "::/0", "::ffff:10.0.0.0/104", "10.20.0.0/33"} {
		pr, err := netip.ParsePrefix(bad)
		var na *workloadapi.NetworkAddress
		if err != nil { // not a prefix netip takes: a length past the family's
			l := uint32(33)
			na = &workloadapi.NetworkAddress{Address: netip.MustParseAddr("10.20.0.0").AsSlice(), Length: &l}
		} else {
			l := uint32(pr.Bits())
			na = &workloadapi.NetworkAddress{Address: pr.Addr().AsSlice(), Length: &l}
		}
		if _, err := translateService(&workloadapi.Service{Name: "x", Namespace: "evil", Hostname: "x.example", Addresses: []*workloadapi.NetworkAddress{na}}); err == nil {
			t.Errorf("CIDR %s accepted, want the service rejected", bad)
		}
	}
}

// TestMergeCIDRSparesNodeAddresses: a range holding a node's address (a
// hostNetwork pod's, which the directory does not index) would take
// connections to that node, its kubelet and hostNetwork pods, to the
// entry's endpoints, as a VIP there would; such a range is left out,
// named in an error, and the service keeps the rest.
func TestMergeCIDRSparesNodeAddresses(t *testing.T) {
	nodeB := netip.MustParseAddr("10.0.0.20")
	l16, l24 := uint32(16), uint32(24)
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/kube-system/kube-proxy-b", Name: "kube-proxy-b", Namespace: "kube-system", Node: "node-b", Addresses: [][]byte{nodeB.AsSlice()},
			NetworkMode: workloadapi.NetworkMode_HOST_NETWORK},
	})
	grab, err := translateService(&workloadapi.Service{Name: "grab", Namespace: "evil", Hostname: "grab.example",
		Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.0.0.0").AsSlice(), Length: &l16}, {Address: netip.MustParseAddr("10.50.0.0").AsSlice(), Length: &l24}},
		Ports:     []*workloadapi.Port{{ServicePort: 10250, TargetPort: 10250}}})
	if err != nil {
		t.Fatal(err)
	}
	mesh := buildSnapshot(workloads, map[string]*Service{grab.Key(): grab}, nil, "")
	snap, errs := merge(webOnNodeA(), mesh, "node-a", selection.Config{}, nil)
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), "10.0.0.0/16") || !strings.Contains(errs[0].Error(), "kube-system/kube-proxy-b") {
		t.Errorf("errors %v, want the range holding node-b's address named", errs)
	}
	dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
	if svc, ok := dir.ServiceByVIPFor(nodeB, "shop"); ok {
		t.Errorf("node-b's address %s goes to %s", nodeB, svc)
	}
	if svc, ok := dir.ServiceByVIPFor(netip.MustParseAddr("10.50.0.9"), "shop"); !ok || svc.Name != "grab" {
		t.Errorf("the other range: %v, want kept", svc)
	}
}

// TestSourceNamespaceViewLags: the node's pod watcher watches namespaces,
// so a local pod whose namespace it has not seen yet is Undecided (its CNI
// ADD is retried), not out (selection.Config.NamespaceViewLags).
func TestSourceNamespaceViewLags(t *testing.T) {
	if s := NewSource(nil, nil, "node-a", selection.Config{}, nil); !s.selection.NamespaceViewLags {
		t.Error("the xDS source's selection does not take a missing namespace for one not seen yet")
	}
}
