package xds

import (
	"net/netip"
	"testing"

	"istio.io/istio/pkg/workloadapi"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestMergeHostNetworkEndpointsRanked: a hostNetwork pod's endpoint is at
// its node's address, which the directory gives no workload, so its
// endpoint lost istiod's workload, and with it its node and locality. A
// node-local (internalTrafficPolicy: Local, istiod's STRICT by NODE)
// service served by a hostNetwork daemon on this node (a node-local DNS
// cache) was refused to every pod, its only endpoint not "on the client's
// node"; a PreferClose one ranked a hostNetwork endpoint in the client's
// zone below every other zone's pods. ztunnel ranks them by their
// workload's node and locality, as now.
func TestMergeHostNetworkEndpointsRanked(t *testing.T) {
	loc := func(zone string) *workloadapi.Locality { return &workloadapi.Locality{Region: "r1", Zone: zone} }
	ports := func(key string) map[string]*workloadapi.PortList {
		return map[string]*workloadapi.PortList{key: {Ports: []*workloadapi.Port{{ServicePort: 53}}}}
	}
	dnsKey, cacheKey := "kube-system/dns.kube-system.svc.cluster.local", "shop/cache.shop.svc.cluster.local"
	workloads := translateWorkloads(t, []*workloadapi.Workload{
		{Uid: "K//Pod/shop/web-1", Name: "web-1", Namespace: "shop", Node: "node-a", Addresses: [][]byte{netip.MustParseAddr("10.1.0.5").AsSlice()},
			TunnelProtocol: workloadapi.TunnelProtocol_HBONE, Locality: loc("a"), ClusterId: "c1"},
		// node-a's hostNetwork DNS cache, the node-local DNS service's
		// only endpoint for node-a's pods.
		{Uid: "K//Pod/kube-system/dns-a", Name: "dns-a", Namespace: "kube-system", Node: "node-a", Addresses: [][]byte{netip.MustParseAddr("10.0.0.10").AsSlice()},
			NetworkMode: workloadapi.NetworkMode_HOST_NETWORK, Status: workloadapi.WorkloadStatus_HEALTHY, Locality: loc("a"), ClusterId: "c1", Services: ports(dnsKey)},
		// cache: hostNetwork in the client's zone, a pod in another.
		{Uid: "K//Pod/shop/cache-b", Name: "cache-b", Namespace: "shop", Node: "node-b", Addresses: [][]byte{netip.MustParseAddr("10.0.0.20").AsSlice()},
			NetworkMode: workloadapi.NetworkMode_HOST_NETWORK, Status: workloadapi.WorkloadStatus_HEALTHY, Locality: loc("a"), ClusterId: "c1", Services: ports(cacheKey)},
		{Uid: "K//Pod/shop/cache-c", Name: "cache-c", Namespace: "shop", Node: "node-c", Addresses: [][]byte{netip.MustParseAddr("10.3.0.5").AsSlice()},
			Status: workloadapi.WorkloadStatus_HEALTHY, Locality: loc("b"), ClusterId: "c1", Services: ports(cacheKey)},
	})
	services := map[string]*Service{}
	for _, x := range []*workloadapi.Service{
		{Name: "dns", Namespace: "kube-system", Hostname: "dns.kube-system.svc.cluster.local", Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.0.10").AsSlice()}},
			Ports: []*workloadapi.Port{{ServicePort: 53}}, LoadBalancing: &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_STRICT, RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_NODE}}},
		{Name: "cache", Namespace: "shop", Hostname: "cache.shop.svc.cluster.local", Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.0.20").AsSlice()}},
			Ports: []*workloadapi.Port{{ServicePort: 53}}, LoadBalancing: &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_FAILOVER,
				RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_NETWORK, workloadapi.LoadBalancing_REGION, workloadapi.LoadBalancing_ZONE}}},
	} {
		s, err := translateService(x)
		if err != nil {
			t.Fatal(err)
		}
		services[s.Key()] = s
	}
	local := webOnNodeA()
	local.Namespaces = append(local.Namespaces, corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kube-system"}})
	local.Pods = append(local.Pods, corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "dns-a", Namespace: "kube-system", UID: "dns"},
		Spec:   corev1.PodSpec{NodeName: "node-a", HostNetwork: true},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.0.0.10", PodIPs: []corev1.PodIP{{IP: "10.0.0.10"}}}})
	snap, _ := merge(local, buildSnapshot(workloads, services, nil, ""), "node-a", selection.Config{}, nil)
	dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
	client, ok := dir.Pod("shop", "web-1")
	if !ok {
		t.Fatal("shop/web-1 is not in the directory")
	}
	ranks := func(vip string) map[string]int {
		svc, ok := dir.ServiceByVIP(netip.MustParseAddr(vip))
		if !ok {
			t.Fatalf("no service at %s", vip)
		}
		out := map[string]int{}
		for _, ep := range svc.Endpoints {
			out[ep.Addr.String()] = svc.Routing.Rank(client, ep)
		}
		return out
	}
	if got := ranks("10.96.0.10"); got["10.0.0.10"] != 1 {
		t.Errorf("node-local dns: ranks %v, want this node's hostNetwork endpoint 10.0.0.10 at rank 1 (STRICT by NODE)", got)
	}
	if got := ranks("10.96.0.20"); got["10.0.0.20"] != 3 || got["10.3.0.5"] != 2 {
		t.Errorf("cache: ranks %v, want the hostNetwork endpoint in the client's zone (10.0.0.20) at 3, the other zone's pod at 2", got)
	}
}

// TestMergeLocalPodWithoutCopyTakesNodeLocality: istiod gives a pod its
// node's locality, so this node's pods share one; but a local pod only took
// it from its own copy, and one istiod had not sent yet (a pod just
// started) or sent twice had none: its connections to a PreferClose
// service were balanced over every zone. It now takes the locality this
// node's other copies agree on; when they disagree (a node relabelled, seen
// half-way), it keeps none.
func TestMergeLocalPodWithoutCopyTakesNodeLocality(t *testing.T) {
	addrs := map[string]string{"web-1": "10.1.0.5", "web-3": "10.1.0.7"}
	copyOf := func(name, uid, zone string) *workloadapi.Workload {
		return &workloadapi.Workload{Uid: "K//Pod/shop/" + name, Name: name, Namespace: "shop", Node: "node-a",
			Addresses: [][]byte{netip.MustParseAddr(addrs[name]).AsSlice()}, TunnelProtocol: workloadapi.TunnelProtocol_HBONE,
			Locality: &workloadapi.Locality{Region: "r1", Zone: zone, Subzone: "s1"}, ClusterId: "c1"}
	}
	local := webOnNodeA()
	fresh := local.Pods[0]
	fresh.Name, fresh.UID = "web-2", "u2"
	fresh.Status.PodIP, fresh.Status.PodIPs = "10.1.0.6", []corev1.PodIP{{IP: "10.1.0.6"}}
	third := fresh
	third.Name, third.UID = "web-3", "u3"
	third.Status.PodIP, third.Status.PodIPs = "10.1.0.7", []corev1.PodIP{{IP: "10.1.0.7"}}
	local.Pods = append(local.Pods, fresh, third)
	for _, tc := range []struct {
		name   string
		copies []*workloadapi.Workload
		want   string // web-2's region/zone/subzone/cluster
	}{
		{"istiod has not sent web-2 yet", []*workloadapi.Workload{copyOf("web-1", "u1", "a"), copyOf("web-3", "u3", "a")}, "r1/a/s1/c1"},
		{"the copies disagree", []*workloadapi.Workload{copyOf("web-1", "u1", "a"), copyOf("web-3", "u3", "b")}, "///"},
	} {
		workloads := translateWorkloads(t, tc.copies)
		snap, _ := merge(local, buildSnapshot(workloads, map[string]*Service{}, nil, ""), "node-a", selection.Config{}, nil)
		dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
		w, ok := dir.Pod("shop", "web-2")
		if !ok {
			t.Fatalf("%s: shop/web-2 is not in the directory", tc.name)
		}
		if got := w.Region + "/" + w.Zone + "/" + w.Subzone + "/" + w.Cluster; got != tc.want {
			t.Errorf("%s: web-2's locality %s, want %s", tc.name, got, tc.want)
		}
	}
}
