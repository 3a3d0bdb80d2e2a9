package kubeobj

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

func pod(ns, name, node string, ips ...string) corev1.Pod {
	p := corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID("uid-" + name), Labels: map[string]string{"app": name}},
		Spec:       corev1.PodSpec{NodeName: node},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning},
	}
	for _, ip := range ips {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	if len(ips) > 0 {
		p.Status.PodIP = ips[0]
	}
	return p
}

func ambientNamespace(name string) corev1.Namespace {
	return corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}
}

func addr(s string) netip.Addr { return netip.MustParseAddr(s) }

func names(ws []*workload.Workload) string {
	var out []string
	for _, w := range ws {
		out = append(out, w.String())
	}
	return strings.Join(out, " ")
}

func wantErrors(t *testing.T, errs []error, want ...string) {
	t.Helper()
	if len(errs) != len(want) {
		t.Fatalf("got %d errors %v, want %d: %q", len(errs), errs, len(want), want)
	}
	for i, err := range errs {
		if err.Error() != want[i] {
			t.Errorf("error %d = %q, want %q", i, err, want[i])
		}
	}
}

func TestBuildWorkloads(t *testing.T) {
	web := pod("shop", "web", "node-a", "10.0.0.5", "fd00::5")
	web.Spec.ServiceAccountName = "web-sa"
	web.Annotations = map[string]string{selection.BypassInboundAnnotation: "true"}
	web.Spec.InitContainers = []corev1.Container{{Name: "proxy", RestartPolicy: new(corev1.ContainerRestartPolicyAlways), Ports: []corev1.ContainerPort{{Name: "admin", ContainerPort: 9000}}}}
	web.Spec.Containers = []corev1.Container{
		{Name: "app", Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}, {ContainerPort: 9090}}},
		{Name: "other", Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8081}}},
	}
	db := pod("shop", "db", "node-b", "10.0.1.7")
	db.Labels[selection.DataplaneModeLabel] = "none"
	legacy := pod("legacy", "app", "node-a", "10.0.0.9")
	snap := Objects{
		Namespaces: []corev1.Namespace{ambientNamespace("shop"), {ObjectMeta: metav1.ObjectMeta{Name: "legacy"}}},
		Pods:       []corev1.Pod{web, db, legacy},
	}
	d, errs := build(snap, selection.Config{})
	wantErrors(t, errs)

	w, ok := d.ByAddr(addr("10.0.0.5"))
	if !ok {
		t.Fatal("ByAddr(10.0.0.5) not found")
	}
	if w.Name != "web" || w.Namespace != "shop" || w.UID != "uid-web" || w.ServiceAccount != "web-sa" || w.Node != "node-a" ||
		w.Labels["app"] != "web" || !w.Enrolled || !w.BypassInbound || !strings.HasPrefix(w.Reason, "namespace label") {
		t.Errorf("workload = %+v", w)
	}
	if !slices.Equal(w.Addrs, []netip.Addr{addr("10.0.0.5"), addr("fd00::5")}) {
		t.Errorf("Addrs = %v", w.Addrs)
	}
	if want := map[string]int32{"admin": 9000, "http": 8080}; !mapsEqual(w.ContainerPorts, want) {
		t.Errorf("ContainerPorts = %v, want %v (first container wins, a sidecar's kept, unnamed ports left out)", w.ContainerPorts, want)
	}
	if w.Identity("cluster.local") != "spiffe://cluster.local/ns/shop/sa/web-sa" {
		t.Errorf("Identity = %s", w.Identity("cluster.local"))
	}
	for _, a := range []string{"fd00::5", "::ffff:10.0.0.5"} {
		if got, ok := d.ByAddr(addr(a)); !ok || got != w {
			t.Errorf("ByAddr(%s) = %v, %v; want shop/web", a, got, ok)
		}
	}
	if _, ok := d.ByAddr(addr("10.9.9.9")); ok {
		t.Error("ByAddr(unknown) found something")
	}

	dbw, _ := d.Pod("shop", "db")
	if dbw == nil || dbw.Enrolled || dbw.Reason != "pod label istio.io/dataplane-mode=none" || dbw.ServiceAccount != "default" ||
		dbw.Identity("td") != "spiffe://td/ns/shop/sa/default" || dbw.ContainerPorts != nil {
		t.Errorf("db = %+v", dbw)
	}
	if lw, _ := d.Pod("legacy", "app"); lw == nil || lw.Enrolled {
		t.Errorf("legacy/app = %+v, want not enrolled", lw)
	}
	if _, ok := d.Pod("shop", "nope"); ok {
		t.Error("Pod(shop/nope) found")
	}

	if got := names(d.All()); got != "legacy/app shop/db shop/web" {
		t.Errorf("All() = %s", got)
	}
	local := d.LocalPods("node-a")
	if got := names(local); got != "legacy/app shop/web" {
		t.Errorf("LocalPods(node-a) = %s", got)
	}
	local[0] = nil
	if got := names(d.LocalPods("node-a")); got != "legacy/app shop/web" {
		t.Errorf("LocalPods changed after the caller wrote to its result: %s", got)
	}
	if got := d.LocalPods("node-z"); len(got) != 0 {
		t.Errorf("LocalPods(node-z) = %v", got)
	}
}

func TestBuildAddressProblems(t *testing.T) {
	bad := pod("shop", "bad", "n", "10.0.0.1", "10.0.0.999")
	first := pod("shop", "a", "n", "10.0.0.2")
	second := pod("shop", "b", "n", "10.0.0.2", "fd00::b")
	done := pod("shop", "done", "n", "10.0.0.3")
	done.Status.Phase = corev1.PodSucceeded
	reuser := pod("shop", "new", "n", "10.0.0.3")
	host1 := pod("shop", "host1", "n", "192.168.1.10")
	host1.Spec.HostNetwork = true
	host2 := pod("shop", "host2", "n", "192.168.1.10")
	host2.Spec.HostNetwork = true
	noIP := pod("shop", "pending", "n")
	kata := pod("shop", "kata", "n", "10.0.0.4")
	kata.Spec.RuntimeClassName = new("kata")

	snap := Objects{
		Namespaces: []corev1.Namespace{ambientNamespace("shop")},
		// Out of order on purpose: the first by name keeps a shared address.
		Pods: []corev1.Pod{second, bad, first, reuser, done, host1, host2, noIP, kata},
	}
	d, errs := build(snap, selection.Config{SkipRuntimeClasses: []string{"kata-qemu"}})
	wantErrors(t, errs,
		`pod shop/bad: status.podIPs[1].ip: bad IP "10.0.0.999": ParseAddr("10.0.0.999"): IPv4 field has value >255`,
		`pod shop/kata: unknown runtime class "kata"`,
		`pod shop/b: address 10.0.0.2 already belongs to pod shop/a`,
	)
	if got := names(d.All()); got != "shop/a shop/b shop/done shop/host1 shop/host2 shop/kata shop/new shop/pending" {
		t.Errorf("All() = %s (a pod with a bad IP is left out)", got)
	}
	for a, want := range map[string]string{"10.0.0.2": "a", "fd00::b": "b", "10.0.0.3": "new", "10.0.0.4": "kata"} {
		if w, ok := d.ByAddr(addr(a)); !ok || w.Name != want {
			t.Errorf("ByAddr(%s) = %v, want shop/%s", a, w, want)
		}
	}
	for _, a := range []string{"192.168.1.10", "10.0.0.1"} {
		if w, ok := d.ByAddr(addr(a)); ok {
			t.Errorf("ByAddr(%s) = %v, want none", a, w)
		}
	}
	if w, _ := d.Pod("shop", "kata"); w.Enrolled {
		t.Errorf("shop/kata enrolled with an unknown runtime class")
	}
	if w, _ := d.Pod("shop", "pending"); w.Enrolled || w.Reason != "pod has no IP yet" {
		t.Errorf("shop/pending = %+v", w)
	}
}

func TestBuildServices(t *testing.T) {
	web1 := pod("shop", "web-1", "n", "10.0.0.5")
	web2 := pod("shop", "web-2", "n", "10.0.0.6")
	web := corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web"},
		Spec: corev1.ServiceSpec{
			ClusterIP:  "10.96.0.10",
			ClusterIPs: []string{"10.96.0.10", "fd00:96::10"},
			Selector:   map[string]string{"app": "web"},
			Ports: []corev1.ServicePort{
				{Name: "http", Port: 80, TargetPort: intstr.FromString("http")},
				{Name: "dns", Port: 53, TargetPort: intstr.FromInt32(5353), Protocol: corev1.ProtocolUDP},
			},
		},
	}
	headless := corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "db"},
		Spec:       corev1.ServiceSpec{ClusterIP: "None", Ports: []corev1.ServicePort{{Port: 5432}}},
	}
	external := corev1.Service{ // no selector: endpoints come from a hand-made slice
		ObjectMeta: metav1.ObjectMeta{Namespace: "ext", Name: "legacy"},
		Spec:       corev1.ServiceSpec{ClusterIP: "10.96.0.20", Ports: []corev1.ServicePort{{Port: 443}}},
	}
	badVIP := corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "bad"}, Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.300"}}
	metadataVIP := corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "metadata"}, Spec: corev1.ServiceSpec{ClusterIPs: []string{"10.96.0.77", "169.254.169.254"}}}
	dupVIP := corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "zz"}, Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.10"}}

	slice := func(ns, name, svc string, typ discoveryv1.AddressType, ports []discoveryv1.EndpointPort, eps ...discoveryv1.Endpoint) discoveryv1.EndpointSlice {
		return discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
			AddressType: typ, Ports: ports, Endpoints: eps,
		}
	}
	ep := func(ready *bool, addrs ...string) discoveryv1.Endpoint {
		return discoveryv1.Endpoint{Addresses: addrs, Conditions: discoveryv1.EndpointConditions{Ready: ready}}
	}
	port := func(name string, n int32) discoveryv1.EndpointPort {
		return discoveryv1.EndpointPort{Name: &name, Port: &n}
	}
	endpointSlices := []discoveryv1.EndpointSlice{
		slice("shop", "web-a", "web", discoveryv1.AddressTypeIPv4, []discoveryv1.EndpointPort{port("http", 8080), port("dns", 5353)},
			ep(nil, "10.0.0.5"), ep(new(true), "10.0.0.6"), ep(nil, "10.0.0.bad"), ep(nil)),
		// 10.0.0.6 also here, with another port set and not ready: merged.
		slice("shop", "web-b", "web", discoveryv1.AddressTypeIPv4, []discoveryv1.EndpointPort{port("metrics", 9090), {Name: new("nil-port")}},
			ep(new(false), "10.0.0.6")),
		slice("shop", "web-fqdn", "web", discoveryv1.AddressTypeFQDN, nil, ep(nil, "example.com")),
		slice("shop", "orphan", "gone", discoveryv1.AddressTypeIPv4, nil, ep(nil, "10.0.0.99")),
		slice("ext", "legacy-1", "legacy", discoveryv1.AddressTypeIPv4, []discoveryv1.EndpointPort{{Port: new(int32(443))}},
			ep(new(true), "192.0.2.10", "192.0.2.11")),
		slice("other", "web-x", "web", discoveryv1.AddressTypeIPv4, nil, ep(nil, "10.0.0.77")), // same service name, other namespace
	}
	snap := Objects{
		Pods:           []corev1.Pod{web1, web2},
		Services:       []corev1.Service{web, headless, external, badVIP, metadataVIP, dupVIP},
		EndpointSlices: endpointSlices,
	}
	d, errs := build(snap, selection.Config{})
	wantErrors(t, errs,
		`service shop/bad: spec.clusterIP: bad IP "10.96.0.300"`,
		`service shop/metadata: spec.clusterIPs[1]: bad IP "169.254.169.254": address 169.254.169.254 is link-local: not the address of one host in the cluster`,
		`endpointslice shop/web-a: bad address "10.0.0.bad"`,
		`service shop/zz: cluster IP 10.96.0.10 already belongs to service shop/web: left out`,
	)

	var got []string
	for _, s := range d.Services() {
		got = append(got, s.String())
	}
	// shop/zz stays, without the VIP shop/web has.
	if strings.Join(got, " ") != "ext/legacy shop/db shop/web shop/zz" {
		t.Errorf("Services() = %v", got)
	}
	if s, ok := d.ServiceByVIP(addr("10.96.0.10")); !ok || s.Name != "web" {
		t.Errorf("10.96.0.10 is %v, want shop/web's", s)
	}

	s, ok := d.ServiceByVIP(addr("fd00:96::10"))
	if !ok || s.Name != "web" {
		t.Fatalf("ServiceByVIP(fd00:96::10) = %v, %v", s, ok)
	}
	if s2, _ := d.ServiceByVIP(addr("::ffff:10.96.0.10")); s2 != s {
		t.Errorf("ServiceByVIP(v4-mapped) = %v", s2)
	}
	if !slices.Equal(s.VIPs, []netip.Addr{addr("10.96.0.10"), addr("fd00:96::10")}) {
		t.Errorf("VIPs = %v", s.VIPs)
	}
	wantPorts := []workload.ServicePort{
		{Name: "http", Port: 80, TargetPortName: "http", Protocol: "TCP"},
		{Name: "dns", Port: 53, TargetPort: 5353, Protocol: "UDP"},
	}
	if !slices.Equal(s.Ports, wantPorts) {
		t.Errorf("Ports = %+v", s.Ports)
	}
	if s.Hostname != "web.shop.svc.cluster.local" {
		t.Errorf("Hostname = %s", s.Hostname)
	}

	if len(s.Endpoints) != 2 {
		t.Fatalf("Endpoints = %+v, want 2", s.Endpoints)
	}
	e5, e6 := s.Endpoints[0], s.Endpoints[1]
	if e5.Addr != addr("10.0.0.5") || !e5.Ready || e5.Workload == nil || e5.Workload.Name != "web-1" ||
		!mapsEqual(e5.Ports, map[string]int32{"http": 8080, "dns": 5353}) {
		t.Errorf("endpoint 10.0.0.5 = %+v", e5)
	}
	if e6.Addr != addr("10.0.0.6") || !e6.Ready || e6.Workload == nil || e6.Workload.Name != "web-2" ||
		!mapsEqual(e6.Ports, map[string]int32{"http": 8080, "dns": 5353, "metrics": 9090}) {
		t.Errorf("endpoint 10.0.0.6 = %+v (slices merged: ports united, ready if any)", e6)
	}

	legacy, ok := d.ServiceByVIP(addr("10.96.0.20"))
	if !ok || len(legacy.Endpoints) != 1 {
		t.Fatalf("ext/legacy = %+v", legacy)
	}
	if e := legacy.Endpoints[0]; e.Addr != addr("192.0.2.10") || e.Workload != nil || !e.Ready || !mapsEqual(e.Ports, map[string]int32{"": 443}) {
		t.Errorf("ext/legacy endpoint = %+v", e)
	}

	for _, svc := range d.Services() {
		if svc.Name == "db" && (len(svc.VIPs) != 0 || len(svc.Endpoints) != 0) {
			t.Errorf("headless shop/db = %+v", svc)
		}
	}
	if _, ok := d.ServiceByVIP(addr("10.96.0.99")); ok {
		t.Error("ServiceByVIP(unknown) found")
	}
}

func TestEndpointNotReady(t *testing.T) {
	svc := corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "s"}, Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.1"}}
	es := discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "a", Name: "s-1", Labels: map[string]string{discoveryv1.LabelServiceName: "s"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{"10.0.0.1"}, Conditions: discoveryv1.EndpointConditions{Ready: new(false)}}},
	}
	d, errs := build(Objects{Services: []corev1.Service{svc}, EndpointSlices: []discoveryv1.EndpointSlice{es}}, selection.Config{})
	wantErrors(t, errs)
	s, _ := d.ServiceByVIP(addr("10.96.0.1"))
	if len(s.Endpoints) != 1 || s.Endpoints[0].Ready {
		t.Errorf("endpoints = %+v, want one not ready", s.Endpoints)
	}
}

func mapsEqual(a, b map[string]int32) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// build translates objs and indexes the result, as the agent does, with
// the errors of both steps.
func build(objs Objects, cfg selection.Config) (*workload.Directory, []error) {
	snap, errs := Translate(objs, cfg)
	d, dirErrs := workload.NewDirectory(snap.Workloads, snap.Services)
	return d, append(errs, dirErrs...)
}

// TestEndpointAddressOfNoHost: an EndpointSlice address that is no one
// host's (loopback, unspecified, link-local, multicast, 0.0.0.0/8,
// broadcast) is left out with an error naming the slice and the address, as
// the API server refuses it and the xDS source rejects it: from a manifest
// (the file source validates no spec field) a service's connections went
// to the client pod's own loopback or to 169.254.169.254, the cloud
// metadata server, through the tunnel.
func TestEndpointAddressOfNoHost(t *testing.T) {
	svc := corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "s"}, Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.1"}}
	for _, bad := range []string{"127.0.0.1", "169.254.169.254", "0.0.0.0", "::1", "fe80::1", "224.0.0.1", "::ffff:127.0.0.1"} {
		t.Run(bad, func(t *testing.T) {
			es := discoveryv1.EndpointSlice{
				ObjectMeta:  metav1.ObjectMeta{Namespace: "a", Name: "s-1", Labels: map[string]string{discoveryv1.LabelServiceName: "s"}},
				AddressType: discoveryv1.AddressTypeIPv4,
				Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{bad}}, {Addresses: []string{"10.0.0.1"}}},
			}
			d, errs := build(Objects{Services: []corev1.Service{svc}, EndpointSlices: []discoveryv1.EndpointSlice{es}}, selection.Config{})
			if len(errs) != 1 || !strings.Contains(errs[0].Error(), "endpointslice a/s-1") || !strings.Contains(errs[0].Error(), bad) {
				t.Fatalf("errors = %v, want one naming endpointslice a/s-1 and %s", errs, bad)
			}
			s, _ := d.ServiceByVIP(addr("10.96.0.1"))
			if len(s.Endpoints) != 1 || s.Endpoints[0].Addr != addr("10.0.0.1") {
				t.Errorf("endpoints = %+v, want only 10.0.0.1", s.Endpoints)
			}
		})
	}
}

// TestEndpointSlicePortOutOfRange: the API server leaves an EndpointSlice's
// port numbers unchecked (only names and protocols are), so a hand-made
// slice may say 65616, or -65456, for a port. Cut to 16 bits that was port
// 80, where the tunnel dialled the endpoint, while an admission policy, kube-proxy
// and anyone reading the slice saw another number. Such a port is reported
// naming the slice and the port, and served by no endpoint of the slice
// (not the service's targetPort either: the slice said where it is).
func TestEndpointSlicePortOutOfRange(t *testing.T) {
	svc := corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "s"}, Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.1",
		Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}}}
	name := "http"
	for _, bad := range []int32{65536 + 80, -65536 + 80} {
		t.Run(strconv.Itoa(int(bad)), func(t *testing.T) {
			es := discoveryv1.EndpointSlice{
				ObjectMeta:  metav1.ObjectMeta{Namespace: "a", Name: "s-1", Labels: map[string]string{discoveryv1.LabelServiceName: "s"}},
				AddressType: discoveryv1.AddressTypeIPv4,
				Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &bad}},
				Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{"10.0.0.1"}}},
			}
			d, errs := build(Objects{Services: []corev1.Service{svc}, EndpointSlices: []discoveryv1.EndpointSlice{es}}, selection.Config{})
			if len(errs) != 1 || !strings.Contains(errs[0].Error(), "endpointslice a/s-1") || !strings.Contains(errs[0].Error(), strconv.Itoa(int(bad))) {
				t.Fatalf("errors = %v, want one naming endpointslice a/s-1 and %d", errs, bad)
			}
			s, _ := d.ServiceByVIP(addr("10.96.0.1"))
			if len(s.Endpoints) != 1 {
				t.Fatalf("endpoints = %+v, want 10.0.0.1", s.Endpoints)
			}
			if p, ok := s.Endpoints[0].TargetPort(s.Ports[0]); ok {
				t.Errorf("port http served on %d, want not served", p)
			}
		})
	}
}

// TestPodAddressOfNoHostNotIndexed: a pod whose status holds an address of
// no one host (the API server takes what a kubelet reports; a manifest holds
// anything) is not enrolled, and that address is not indexed as the pod's:
// indexed, a pod at 169.254.169.254 whose namespace names a waypoint took
// every meshed pod's connections to the cloud metadata server to that
// waypoint (the tunnel looks a destination's waypoint up by address). Its
// other address stays its own. The xDS source rejects such a workload.
func TestPodAddressOfNoHostNotIndexed(t *testing.T) {
	ns := corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{
		selection.DataplaneModeLabel: selection.DataplaneModeAmbient, "istio.io/use-waypoint": "wp"}}}
	wp := corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "wp", Labels: map[string]string{"istio.io/waypoint-for": "all"}},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.20", Ports: []corev1.ServicePort{{Port: 15008}}}}
	for _, bad := range []string{"169.254.169.254", "127.0.0.1", "0.0.0.0", "224.0.0.1", "fe80::1"} {
		t.Run(bad, func(t *testing.T) {
			p := pod("shop", "web", "n2", bad)
			if strings.Contains(bad, ":") {
				p = pod("shop", "web", "n2", "10.0.0.5", bad)
			}
			d, errs := build(Objects{Namespaces: []corev1.Namespace{ns}, Pods: []corev1.Pod{p}, Services: []corev1.Service{wp}}, selection.Config{})
			if len(errs) != 1 || !strings.Contains(errs[0].Error(), "pod shop/web") || !strings.Contains(errs[0].Error(), bad) {
				t.Errorf("errors = %v, want one naming pod shop/web and %s", errs, bad)
			}
			if w, ok := d.ByAddr(addr(bad)); ok {
				t.Errorf("%s is indexed as %s's (waypoint %+v)", bad, w, w.Waypoint)
			}
			if w, ok := d.ByAddr(addr("10.0.0.5")); strings.Contains(bad, ":") && (!ok || w.Name != "web" || w.Enrolled) {
				t.Errorf("10.0.0.5: %v %v, want web, not enrolled", w, ok)
			}
		})
	}
}

// TestInternalTrafficPolicyLocal: a Service with internalTrafficPolicy:
// Local (a node-local DNS cache, a log collector) is routed by kube-proxy
// only to the client's node's endpoints, and by ztunnel likewise (istiod
// sends it STRICT by NODE). The Kubernetes and file sources ignored the
// field, so meshed clients were balanced over every node's endpoints, and
// a client on a node with none was sent to another node rather than
// refused. Each endpoint now carries its slice's nodeName, and the node
// agent keeps a node-local service's endpoints of its own node only.
func TestInternalTrafficPolicyLocal(t *testing.T) {
	local := corev1.ServiceInternalTrafficPolicyLocal
	svc := corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "node-dns"},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.53", InternalTrafficPolicy: &local,
			Ports: []corev1.ServicePort{{Name: "dns-tcp", Port: 53, TargetPort: intstr.FromInt32(53)}}},
	}
	cluster := corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "any-node"},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.54", Ports: []corev1.ServicePort{{Port: 80}}}}
	ep := func(addr, node string) discoveryv1.Endpoint {
		e := discoveryv1.Endpoint{Addresses: []string{addr}}
		if node != "" {
			e.NodeName = &node
		}
		return e
	}
	slice := func(name, svc string, eps ...discoveryv1.Endpoint) discoveryv1.EndpointSlice {
		return discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: name,
			Labels: map[string]string{discoveryv1.LabelServiceName: svc}}, AddressType: discoveryv1.AddressTypeIPv4, Endpoints: eps}
	}
	objs := Objects{
		Services: []corev1.Service{*TrimService(&svc), *TrimService(&cluster)},
		EndpointSlices: []discoveryv1.EndpointSlice{
			*TrimEndpointSlice(&[]discoveryv1.EndpointSlice{slice("node-dns-1", "node-dns", ep("10.1.0.5", "node-a"), ep("10.2.0.5", "node-b"), ep("10.3.0.5", ""))}[0]),
			*TrimEndpointSlice(&[]discoveryv1.EndpointSlice{slice("any-node-1", "any-node", ep("10.1.0.6", "node-a"), ep("10.2.0.6", "node-b"))}[0]),
		},
	}
	snap, errs := Translate(objs, selection.Config{})
	if len(errs) != 0 {
		t.Fatal(errs)
	}
	addrs := func(s *workload.Service) []string {
		var out []string
		for _, e := range s.Endpoints {
			out = append(out, e.Addr.String()+"@"+e.Node)
		}
		return out
	}
	for node, want := range map[string][2][]string{
		"node-a": {{"10.1.0.5@node-a"}, {"10.1.0.6@node-a", "10.2.0.6@node-b"}},
		"node-b": {{"10.2.0.5@node-b"}, {"10.1.0.6@node-a", "10.2.0.6@node-b"}},
		"node-c": {nil, {"10.1.0.6@node-a", "10.2.0.6@node-b"}},
	} {
		got := workload.NodeLocalServices(snap.Services, node)
		for i, s := range got {
			if w := want[i]; !slices.Equal(addrs(s), w) {
				t.Errorf("on %s, service %s has endpoints %v, want %v", node, s, addrs(s), w)
			}
		}
	}
	if n := len(snap.Services[0].Endpoints); n != 3 {
		t.Errorf("NodeLocalServices changed the snapshot's service: %d endpoints left, want 3", n)
	}
}

// TestMirrorPodKeyedByName: a mirror pod (a static pod's copy in the API)
// is keyed by namespace/name, without the API's UID: the kubelet, the
// runtime and the CNI plugin know the static pod by its hash, another UID,
// so matched by the API's, its CNI ADD was taken for an earlier pod of its
// name and refused until the pod gave up (Istio matches pods by name and
// meshes them). The annotation's value is not taken as the key: anyone
// creating a pod can write it.
func TestMirrorPodKeyedByName(t *testing.T) {
	ns := ambientNamespace("edge")
	p := pod("edge", "probe-node-a", "node-a", "10.0.0.9")
	p.Annotations = map[string]string{MirrorPodAnnotation: "uid-plain"}
	w, err := Pod(selection.Config{}, &ns, &p, nil)
	if err != nil || w == nil {
		t.Fatalf("Pod: %v, %v", w, err)
	}
	if !w.Enrolled || w.UID != "" || w.Key() != "edge/probe-node-a" {
		t.Errorf("mirror pod: enrolled %v, uid %q, key %q; want enrolled, no uid, keyed edge/probe-node-a", w.Enrolled, w.UID, w.Key())
	}
	plain := pod("edge", "plain", "node-a", "10.0.0.10")
	if w, _ := Pod(selection.Config{}, &ns, &plain, nil); w.UID != "uid-plain" || w.Key() != "uid-plain" {
		t.Errorf("plain pod: uid %q, key %q; want its own uid", w.UID, w.Key())
	}
}

// TestNamedTargetPortAsKubernetes: a Service's named targetPort resolves
// to a pod's port as Kubernetes' FindPort (the EndpointSlice controller's,
// for a TCP service port) and istiod's FindPortName resolve it, their
// answers written out here: named TCP ports of the containers, then of
// the sidecars (init containers restarted always), the first of a name.
// The map is read where a pod's EndpointSlice leaves the port out, which
// the controller does when it finds no such port: an init container that
// runs to completion and a UDP port of the name were taken until 8
// December, and the tunnel dialled them.
func TestNamedTargetPortAsKubernetes(t *testing.T) {
	always := new(corev1.ContainerRestartPolicyAlways)
	tcp := func(name string, port int32) corev1.ContainerPort {
		return corev1.ContainerPort{Name: name, ContainerPort: port, Protocol: corev1.ProtocolTCP}
	}
	for _, tc := range []struct {
		name       string
		init, main []corev1.Container
		port       string
		want       int32 // 0: no such port
	}{
		{"container", nil, []corev1.Container{{Ports: []corev1.ContainerPort{tcp("http", 8080)}}}, "http", 8080},
		{"protocol defaulted", nil, []corev1.Container{{Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}}}, "http", 8080},
		{"an init container's shadows nothing", []corev1.Container{{Ports: []corev1.ContainerPort{tcp("http", 9999)}}},
			[]corev1.Container{{Ports: []corev1.ContainerPort{tcp("http", 8080)}}}, "http", 8080},
		{"an init container's is none", []corev1.Container{{Ports: []corev1.ContainerPort{tcp("setup", 9999)}}}, nil, "setup", 0},
		{"a sidecar's", []corev1.Container{{RestartPolicy: always, Ports: []corev1.ContainerPort{tcp("admin", 15000)}}}, nil, "admin", 15000},
		{"containers before sidecars", []corev1.Container{{RestartPolicy: always, Ports: []corev1.ContainerPort{tcp("http", 15001)}}},
			[]corev1.Container{{Ports: []corev1.ContainerPort{tcp("http", 8080)}}}, "http", 8080},
		{"a UDP port is none", nil, []corev1.Container{{Ports: []corev1.ContainerPort{{Name: "dns", ContainerPort: 53, Protocol: corev1.ProtocolUDP}}}}, "dns", 0},
		{"an SCTP port is none", nil, []corev1.Container{{Ports: []corev1.ContainerPort{{Name: "sig", ContainerPort: 3868, Protocol: corev1.ProtocolSCTP}}}}, "sig", 0},
		{"the TCP port of a UDP port's name", nil, []corev1.Container{
			{Ports: []corev1.ContainerPort{{Name: "dns", ContainerPort: 53, Protocol: corev1.ProtocolUDP}}},
			{Ports: []corev1.ContainerPort{tcp("dns", 5353)}}}, "dns", 5353},
	} {
		p := pod("shop", "web", "n1", "10.0.0.5")
		p.Spec.InitContainers, p.Spec.Containers = tc.init, tc.main
		for _, compact := range []bool{false, true} {
			in := &p
			if compact {
				in = NewCompactPod(&p).Pod()
			}
			w, err := Pod(selection.Config{}, nil, in, nil)
			if err != nil {
				t.Fatal(err)
			}
			// The pod's EndpointSlice left the port out: the pod's ports decide.
			ep := workload.Endpoint{Addr: w.Addrs[0], Workload: w}
			got, ok := ep.TargetPort(workload.ServicePort{Name: "web", Port: 80, TargetPortName: tc.port})
			if tc.want == 0 && ok || tc.want != 0 && (!ok || int32(got) != tc.want) {
				t.Errorf("%s (compact %v): port %q resolves to %d, %v; want %d", tc.name, compact, tc.port, got, ok, tc.want)
			}
		}
	}
}
