package xds

import (
	"net/netip"
	"strings"
	"testing"

	"istio.io/istio/pkg/workloadapi"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
	"github.com/redirector-mesh/redirector/pkg/source/nodepods"
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

// TestMergeHonestEndpointsResolve: endpoints that name their pod, in
// meshes where nothing lies, resolve to that pod (or, for a hostNetwork
// pod, at no workload's address, are dialled as istiod says) rather than
// being refused as unresolved. Three were refused once endpoints named
// their pods (they had been dialled before, the second in plain TCP though
// istiod said HBONE):
//   - a second cluster's hostNetwork pod named like this cluster's (a
//     StatefulSet's, on the same network): the directory looked only at
//     the first workload of the name, which had another uid;
//   - another cluster's pod on a node named like this one (hostnames,
//     alike in two clusters): merge took it for one of this node's pods
//     the node's watch had not seen, and left it out;
//   - a new pod given a deleted pod's address (its sandbox gone, its
//     object still there, which istiod marks unhealthy): the deleted pod
//     kept the address by name, so the new pod's endpoints, once it was
//     ready, were refused until the old object went.
//
// And what already resolved stays so: this node's hostNetwork pod, a
// mirror (static) pod the node's watch keys by no uid, a dual-stack pod.
func TestMergeHonestEndpointsResolve(t *testing.T) {
	const web = "shop/web.shop.svc.cluster.local"
	addr := func(s ...string) [][]byte {
		var out [][]byte
		for _, x := range s {
			out = append(out, netip.MustParseAddr(x).AsSlice())
		}
		return out
	}
	serves := func(target uint32) map[string]*workloadapi.PortList {
		return map[string]*workloadapi.PortList{web: {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: target}}}}
	}
	hbone, plain := workloadapi.TunnelProtocol_HBONE, workloadapi.TunnelProtocol_NONE
	hostNet := workloadapi.NetworkMode_HOST_NETWORK
	healthy, unhealthy := workloadapi.WorkloadStatus_HEALTHY, workloadapi.WorkloadStatus_UNHEALTHY
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		// A hostNetwork StatefulSet pod of one name in two clusters.
		{Uid: "K//Pod/shop/kafka-0", Name: "kafka-0", Namespace: "shop", Node: "node-b", ClusterId: "K", Addresses: addr("192.168.0.2"),
			NetworkMode: hostNet, TunnelProtocol: plain, Status: healthy, Services: serves(8001)},
		{Uid: "K2//Pod/shop/kafka-0", Name: "kafka-0", Namespace: "shop", Node: "node-z", ClusterId: "K2", Addresses: addr("192.168.9.2"),
			NetworkMode: hostNet, TunnelProtocol: plain, Status: healthy, Services: serves(8002)},
		// Pods of another cluster on its node named node-a.
		{Uid: "K2//Pod/shop/web-z", Name: "web-z", Namespace: "shop", Node: "node-a", ClusterId: "K2", Addresses: addr("10.9.0.5"),
			TunnelProtocol: hbone, Status: healthy, Services: serves(8003)},
		{Uid: "K2//Pod/shop/agent-z", Name: "agent-z", Namespace: "shop", Node: "node-a", ClusterId: "K2", Addresses: addr("192.168.9.1"),
			NetworkMode: hostNet, TunnelProtocol: plain, Status: healthy, Services: serves(8004)},
		// node-b's deleted pod, whose address a new pod has now.
		{Uid: "K//Pod/shop/a-old", Name: "a-old", Namespace: "shop", Node: "node-b", ClusterId: "K", Addresses: addr("10.2.0.9"),
			TunnelProtocol: hbone, Status: unhealthy, Services: serves(8005)},
		{Uid: "K//Pod/shop/b-new", Name: "b-new", Namespace: "shop", Node: "node-b", ClusterId: "K", Addresses: addr("10.2.0.9"),
			TunnelProtocol: hbone, Status: healthy, Services: serves(8006)},
		// istiod's copies of node-a's pods: hostNetwork, mirror,
		// dual-stack.
		{Uid: "K//Pod/shop/agent-a", Name: "agent-a", Namespace: "shop", Node: "node-a", ClusterId: "K", Addresses: addr("192.168.0.1"),
			NetworkMode: hostNet, TunnelProtocol: plain, Status: healthy, Services: serves(8007)},
		{Uid: "K//Pod/shop/static-node-a", Name: "static-node-a", Namespace: "shop", Node: "node-a", ClusterId: "K", Addresses: addr("10.1.0.9"),
			TunnelProtocol: plain, Status: healthy, Services: serves(8008)},
		{Uid: "K//Pod/shop/ds", Name: "ds", Namespace: "shop", Node: "node-a", ClusterId: "K", Addresses: addr("10.1.0.6", "fd00::6"),
			TunnelProtocol: hbone, Status: healthy, Services: serves(8009)},
	})
	svc, err := translateService(&workloadapi.Service{Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local",
		Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.0.10").AsSlice()}},
		Ports:     []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}})
	if err != nil {
		t.Fatal(err)
	}
	mesh := buildSnapshot(workloads, map[string]*Service{svc.Key(): svc}, nil, "")
	mesh.Cluster = "K"
	running := func(name, uid string, hostNetwork bool, annotations map[string]string, ips ...string) corev1.Pod {
		p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "shop", UID: types.UID(uid), Annotations: annotations},
			Spec: corev1.PodSpec{NodeName: "node-a", HostNetwork: hostNetwork}, Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ips[0]}}
		for _, ip := range ips {
			p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
		}
		return p
	}
	local := nodepods.State{
		Namespaces: []corev1.Namespace{{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}},
		Pods: []corev1.Pod{
			running("agent-a", "u-agent", true, nil, "192.168.0.1"),
			running("static-node-a", "u-api-mirror", false, map[string]string{kubeobj.MirrorPodAnnotation: "hash"}, "10.1.0.9"),
			running("ds", "u-ds", false, nil, "10.1.0.6", "fd00::6"),
		},
	}
	snap, _ := merge(local, mesh, "node-a", selection.Config{}, nil)
	dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
	got, ok := dir.ServiceByVIP(netip.MustParseAddr("10.96.0.10"))
	if !ok {
		t.Fatal("no service shop/web")
	}
	const noWorkload = "(none: dialled as istiod says)"
	want := map[uint16]string{ // the endpoint's target port -> the uid it resolves to
		8001: noWorkload,           // this cluster's hostNetwork kafka-0
		8002: noWorkload,           // the other cluster's
		8003: "K2//Pod/shop/web-z", // another cluster's pod on its node-a: HBONE, as itself
		8004: noWorkload,           // another cluster's hostNetwork pod on its node-a
		8005: "",                   // the deleted pod: its address is the new pod's
		8006: "K//Pod/shop/b-new",  // the new pod at that address
		8007: noWorkload,           // this node's hostNetwork pod
		8008: "",                   // this node's mirror pod (keyed by no uid): empty uid
		8009: "u-ds",               // this node's dual-stack pod
	}
	for _, ep := range got.Endpoints {
		port := uint16(ep.Ports["80"])
		w, ok := want[port]
		if !ok {
			t.Errorf("unexpected endpoint %s:%d", ep.Addr, port)
			continue
		}
		delete(want, port)
		switch {
		case port == 8005:
			if !ep.Unresolved || ep.Workload != nil {
				t.Errorf("endpoint %s:%d (the deleted pod): workload %v, unresolved %v; want unresolved", ep.Addr, port, ep.Workload, ep.Unresolved)
			}
		case ep.Unresolved:
			t.Errorf("endpoint %s:%d of %s/%s refused as unresolved, want %s", ep.Addr, port, ep.PodNamespace, ep.PodName, w)
		case w == noWorkload && ep.Workload != nil:
			t.Errorf("endpoint %s:%d resolves to %s, want no workload (a node's address)", ep.Addr, port, ep.Workload)
		case w != noWorkload && (ep.Workload == nil || ep.Workload.UID != w):
			t.Errorf("endpoint %s:%d resolves to %v, want %s", ep.Addr, port, ep.Workload, w)
		}
	}
	for port := range want {
		t.Errorf("no endpoint on port %d", port)
	}
	// The other cluster's pods are nobody's on this node: not this node's
	// pods to capture.
	for _, w := range dir.LocalPods("node-a") {
		if w.Cluster == "K2" {
			t.Errorf("another cluster's pod %s (%s) listed as this node's", w, w.UID)
		}
	}
}
