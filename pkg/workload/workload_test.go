package workload

import (
	"net/netip"
	"sync"
	"testing"
)

func addr(s string) netip.Addr { return netip.MustParseAddr(s) }

func TestStore(t *testing.T) {
	var s Store
	empty := s.Load()
	if _, ok := empty.ByAddr(addr("10.0.0.1")); ok || len(empty.All()) != 0 || len(empty.LocalPods("n")) != 0 || len(empty.Services()) != 0 {
		t.Fatal("empty directory is not empty")
	}
	if _, ok := empty.ServiceByVIP(addr("10.96.0.1")); ok {
		t.Fatal("empty directory has a service")
	}

	d1, _ := NewDirectory([]*Workload{{Namespace: "a", Name: "one", Node: "n", Addrs: []netip.Addr{addr("10.0.0.1")}}}, nil)
	d2, _ := NewDirectory([]*Workload{{Namespace: "a", Name: "two", Node: "n", Addrs: []netip.Addr{addr("10.0.0.1")}}}, nil)
	s.Set(d1)
	if s.Load() != d1 {
		t.Fatal("Load() after Set(d1) is not d1")
	}

	// Readers racing a writer see one whole directory or the other.
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 1000 {
				w, ok := s.Load().ByAddr(addr("10.0.0.1"))
				if !ok || (w.Name != "one" && w.Name != "two") {
					t.Errorf("ByAddr = %v, %v", w, ok)
					return
				}
			}
		})
	}
	for i := range 1000 {
		s.Set([]*Directory{d1, d2}[i%2])
	}
	wg.Wait()
}

// TestDirectoryAddressConflict: where two workloads claim one address, the
// one that is not terminating keeps it (a terminating pod's address may be
// a new pod's already), then the enrolled one: a stale or lying object
// that is not in the mesh, first by name, must not turn connections to a
// meshed pod into plaintext passthrough (an enrolled one fails closed if
// wrong: HBONE to a pod that does not answer it).
func TestDirectoryAddressConflict(t *testing.T) {
	a := []netip.Addr{addr("10.0.0.5")}
	for _, tt := range []struct {
		name       string
		ws         []*Workload
		want, lost string
	}{
		{"enrolled over not, whatever the names", []*Workload{
			{Namespace: "a", Name: "stale", Addrs: a},
			{Namespace: "b", Name: "web", Addrs: a, Enrolled: true},
		}, "b/web", "a/stale"},
		{"captured by its node over neither", []*Workload{
			{Namespace: "a", Name: "stale", Addrs: a},
			{Namespace: "b", Name: "web", Addrs: a, Redirected: true},
		}, "b/web", "a/stale"},
		{"enrolled over captured by its node", []*Workload{
			{Namespace: "a", Name: "leaving", Addrs: a, Redirected: true},
			{Namespace: "b", Name: "web", Addrs: a, Enrolled: true},
		}, "b/web", "a/leaving"},
		{"not terminating over terminating", []*Workload{
			{Namespace: "a", Name: "old", Addrs: a, Enrolled: true, Terminating: true},
			{Namespace: "b", Name: "new", Addrs: a},
		}, "b/new", "a/old"},
		{"else the first by name", []*Workload{
			{Namespace: "b", Name: "two", Addrs: a, Enrolled: true},
			{Namespace: "a", Name: "one", Addrs: a, Enrolled: true},
		}, "a/one", "b/two"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d, errs := NewDirectory(tt.ws, nil)
			if w, ok := d.ByAddr(a[0]); !ok || w.String() != tt.want {
				t.Errorf("ByAddr = %v, want %s", w, tt.want)
			}
			want := "pod " + tt.lost + ": address 10.0.0.5 already belongs to pod " + tt.want
			if len(errs) != 1 || errs[0].Error() != want {
				t.Errorf("errors = %v, want %q", errs, want)
			}
		})
	}
}

// TestDirectoryVIPConflictKeepsTheRest: a service whose VIP another
// service (first by namespace and name) already has loses that VIP only.
// Before, it was left out whole: a tenant's object at one of kube-dns's
// VIPs took its other VIPs and its endpoints out of the directory too.
func TestDirectoryVIPConflictKeepsTheRest(t *testing.T) {
	ep := Endpoint{Addr: addr("10.1.0.53"), Ready: true}
	d, errs := NewDirectory(nil, []*Service{
		{Namespace: "default", Name: "evil", VIPs: []netip.Addr{addr("10.96.0.10")}},
		{Namespace: "kube-system", Name: "kube-dns", VIPs: []netip.Addr{addr("10.96.0.10"), addr("fd00::a")}, Endpoints: []Endpoint{ep}},
	})
	if len(errs) != 1 || errs[0].Error() != "service kube-system/kube-dns: cluster IP 10.96.0.10 already belongs to service default/evil: left out" {
		t.Errorf("errors %v", errs)
	}
	s, ok := d.ServiceByVIP(addr("fd00::a"))
	if !ok || s.Name != "kube-dns" || len(s.VIPs) != 1 || len(s.Endpoints) != 1 {
		t.Errorf("fd00::a is %+v, want kube-dns with its endpoint and that VIP only", s)
	}
}

func TestEndpointTargetPort(t *testing.T) {
	pod := &Workload{ContainerPorts: map[string]int32{"http": 8080}}
	for _, tc := range []struct {
		name string
		port ServicePort
		ep   Endpoint
		want uint16
		ok   bool
	}{
		{"slice port of the same name wins", ServicePort{Name: "web", Port: 80, TargetPort: 9999}, Endpoint{Ports: map[string]int32{"web": 8081}}, 8081, true},
		{"numeric targetPort", ServicePort{Port: 80, TargetPort: 9090}, Endpoint{}, 9090, true},
		{"no targetPort means port", ServicePort{Port: 80}, Endpoint{}, 80, true},
		{"named targetPort via container ports", ServicePort{Port: 80, TargetPortName: "http"}, Endpoint{Workload: pod}, 8080, true},
		{"named targetPort the pod lacks", ServicePort{Port: 80, TargetPortName: "grpc"}, Endpoint{Workload: pod}, 0, false},
		{"named targetPort, unknown pod", ServicePort{Port: 80, TargetPortName: "http"}, Endpoint{}, 0, false},
	} {
		got, ok := tc.ep.TargetPort(tc.port)
		if got != tc.want || ok != tc.ok {
			t.Errorf("%s: got %d %v, want %d %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}

// TestEndpointTargetPortOutOfRange: a port number no TCP port has (over
// 65535, or negative) is served nowhere. Converted to 16 bits it named
// another port: a targetPort of 65616, an endpoint port of 65616 or a
// container port of 65616 sent the service's connections to port 80.
func TestEndpointTargetPortOutOfRange(t *testing.T) {
	for _, tc := range []struct {
		name string
		port ServicePort
		ep   Endpoint
	}{
		{"targetPort over 65535", ServicePort{Port: 80, TargetPort: 65536 + 80}, Endpoint{}},
		{"negative targetPort", ServicePort{Port: 80, TargetPort: -1}, Endpoint{}},
		{"service port over 65535", ServicePort{Port: 65536 + 80}, Endpoint{}},
		{"endpoint port over 65535", ServicePort{Name: "web", Port: 80}, Endpoint{Ports: map[string]int32{"web": 65536 + 80}}},
		{"negative endpoint port", ServicePort{Name: "web", Port: 80}, Endpoint{Ports: map[string]int32{"web": -1}}},
		{"container port over 65535", ServicePort{Port: 80, TargetPortName: "http"}, Endpoint{Workload: &Workload{ContainerPorts: map[string]int32{"http": 65536 + 80}}}},
	} {
		if got, ok := tc.ep.TargetPort(tc.port); ok {
			t.Errorf("%s: served on port %d, want not served", tc.name, got)
		}
	}
}

// TestEndpointTargetPortPerEndpoint: a port served only where an endpoint
// says (istiod's target port 0) is not served by an endpoint without its
// own port for it, whatever its container ports.
func TestEndpointTargetPortPerEndpoint(t *testing.T) {
	port := ServicePort{Name: "80", Port: 80, PerEndpoint: true}
	pod := &Workload{ContainerPorts: map[string]int32{"80": 8080, "http": 8080}}
	if tp, ok := (Endpoint{Ports: map[string]int32{"80": 8081}, Workload: pod}).TargetPort(port); !ok || tp != 8081 {
		t.Errorf("endpoint with its own port: %d %v, want 8081", tp, ok)
	}
	if tp, ok := (Endpoint{Workload: pod}).TargetPort(port); ok {
		t.Errorf("endpoint without its own port: %d, want none", tp)
	}
}

// TestServiceByVIPForRanges: a range (CIDR) is consulted after the VIPs
// and never at a workload's address; the longest range holding the
// address wins, the client's namespace's NamespaceOnly ones first,
// another namespace's never, and two services tying at the longest range
// leave the address to itself.
func TestServiceByVIPForRanges(t *testing.T) {
	pfx := netip.MustParsePrefix
	wide := &Service{Name: "wide", Namespace: "a", CIDRs: []netip.Prefix{pfx("10.0.0.0/8")}}
	narrow := &Service{Name: "narrow", Namespace: "a", CIDRs: []netip.Prefix{pfx("10.1.0.0/16")}}
	twinA := &Service{Name: "twin-a", Namespace: "a", CIDRs: []netip.Prefix{pfx("10.2.0.0/16")}}
	twinB := &Service{Name: "twin-b", Namespace: "b", CIDRs: []netip.Prefix{pfx("10.2.0.0/16")}}
	own := &Service{Name: "own", Namespace: "c", NamespaceOnly: true, CIDRs: []netip.Prefix{pfx("10.3.0.0/24")}}
	vip := &Service{Name: "vip", Namespace: "a", VIPs: []netip.Addr{addr("10.1.0.1")}}
	pod := &Workload{Name: "p", Namespace: "a", Addrs: []netip.Addr{addr("10.1.0.2")}}
	dir, errs := NewDirectory([]*Workload{pod}, []*Service{wide, narrow, twinA, twinB, own, vip})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	for _, tc := range []struct{ dst, ns, want string }{
		{"10.9.0.1", "a", "wide"},
		{"10.1.7.7", "a", "narrow"},
		{"10.1.0.1", "a", "vip"},
		{"10.1.0.2", "a", ""}, // the pod's
		{"10.2.0.1", "a", ""}, // a tie
		{"10.3.0.1", "c", "own"},
		{"10.3.0.1", "d", "wide"},
		{"11.0.0.1", "a", ""},
	} {
		got := ""
		if s, ok := dir.ServiceByVIPFor(addr(tc.dst), tc.ns); ok {
			got = s.Name
		}
		if got != tc.want {
			t.Errorf("%s from %s: %q, want %q", tc.dst, tc.ns, got, tc.want)
		}
	}
}

// TestTakesHBONE: a workload is dialled over HBONE when it is enrolled or
// its node records it captured (Redirected), as istiod decides by that
// annotation; only a workload that is neither is dialled in plain TCP.
func TestTakesHBONE(t *testing.T) {
	for _, tt := range []struct {
		w    Workload
		want bool
	}{
		{Workload{}, false},
		{Workload{Enrolled: true}, true},
		{Workload{Redirected: true}, true},
		{Workload{Redirected: true, Terminating: true}, true}, // captured until its netns is gone
		{Workload{Enrolled: true, Redirected: true}, true},
	} {
		if got := tt.w.TakesHBONE(); got != tt.want {
			t.Errorf("%+v: TakesHBONE() = %v, want %v", tt.w, got, tt.want)
		}
	}
}

// TestEndpointUnresolved: an endpoint that names a pod the directory does
// not know, or knows as meshed but not at the endpoint's address, is
// unresolved (the source has not seen the pod yet, and it may be meshed);
// one naming a pod known outside the mesh, or no pod, is not. A pod named
// by uid as well is only the workload of that uid.
func TestEndpointUnresolved(t *testing.T) {
	a := netip.MustParseAddr("10.0.0.5")
	for _, tt := range []struct {
		name string
		pods []*Workload
		ep   Endpoint
		want bool
	}{
		{"no pod named", nil, Endpoint{Addr: a}, false},
		{"pod unseen", nil, Endpoint{Addr: a, PodNamespace: "shop", PodName: "web"}, true},
		{"pod at the address", []*Workload{{Namespace: "shop", Name: "web", Addrs: []netip.Addr{a}, Enrolled: true}},
			Endpoint{Addr: a, PodNamespace: "shop", PodName: "web"}, false},
		{"pod outside the mesh, no address (hostNetwork)", []*Workload{{Namespace: "shop", Name: "web"}},
			Endpoint{Addr: a, PodNamespace: "shop", PodName: "web"}, false},
		{"meshed pod, its address not seen yet", []*Workload{{Namespace: "shop", Name: "web", Enrolled: true}},
			Endpoint{Addr: a, PodNamespace: "shop", PodName: "web"}, true},
		{"pod its node records captured, address not seen yet", []*Workload{{Namespace: "shop", Name: "web", Redirected: true}},
			Endpoint{Addr: a, PodNamespace: "shop", PodName: "web"}, true},
		{"same name, other namespace", []*Workload{{Namespace: "other", Name: "web"}},
			Endpoint{Addr: a, PodNamespace: "shop", PodName: "web"}, true},
		// istiod names an endpoint's pod by uid too, alike for pods of
		// one name in several clusters.
		{"pod at the address, named by its uid", []*Workload{{UID: "K//Pod/shop/web", Namespace: "shop", Name: "web", Addrs: []netip.Addr{a}, Enrolled: true}},
			Endpoint{Addr: a, PodNamespace: "shop", PodName: "web", PodUID: "K//Pod/shop/web"}, false},
		{"a pod of the name at the address, with another uid", []*Workload{{UID: "K//Pod/shop/web", Namespace: "shop", Name: "web", Addrs: []netip.Addr{a}, Enrolled: true}},
			Endpoint{Addr: a, PodNamespace: "shop", PodName: "web", PodUID: "K2//Pod/shop/web"}, true},
		{"a pod of the name outside the mesh, no address, with another uid", []*Workload{{UID: "K//Pod/shop/web", Namespace: "shop", Name: "web"}},
			Endpoint{Addr: a, PodNamespace: "shop", PodName: "web", PodUID: "K2//Pod/shop/web"}, true},
	} {
		svc := &Service{Namespace: "shop", Name: "web", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.1")}, Endpoints: []Endpoint{tt.ep}}
		d, errs := NewDirectory(tt.pods, []*Service{svc})
		if len(errs) > 0 {
			t.Fatal(errs)
		}
		got, ok := d.ServiceByVIP(svc.VIPs[0])
		if !ok {
			t.Fatalf("%s: service not found", tt.name)
		}
		if got := got.Endpoints[0].Unresolved; got != tt.want {
			t.Errorf("%s: Unresolved = %v, want %v", tt.name, got, tt.want)
		}
	}
}

// TestEndpointNamedAmongWorkloadsOfOneName: an endpoint at no workload's
// address (a hostNetwork pod's, at its node's) that names its pod by uid
// is that pod, wherever it sorts among the workloads of its name: istiod
// names pods of several clusters alike, and a ServiceEntry's workloads
// after the entry. Before, only the first of the name was looked at, and
// the endpoint of a second cluster's hostNetwork pod (a StatefulSet's,
// named alike in both) was refused as a pod the directory does not know,
// where it had been dialled in plain TCP as istiod says.
func TestEndpointNamedAmongWorkloadsOfOneName(t *testing.T) {
	node := netip.MustParseAddr("10.0.9.2")
	kafka := func(uid string, enrolled bool) *Workload {
		return &Workload{UID: uid, Namespace: "shop", Name: "kafka-0", Enrolled: enrolled}
	}
	entry := &Workload{UID: "K/networking.istio.io/ServiceEntry/shop/kafka-0/10.7.0.1", Namespace: "shop", Name: "kafka-0", Addrs: []netip.Addr{netip.MustParseAddr("10.7.0.1")}}
	for _, tt := range []struct {
		name string
		pods []*Workload
		uid  string
		want bool // Unresolved
	}{
		{"the first of the name", []*Workload{kafka("K//Pod/shop/kafka-0", false), kafka("K2//Pod/shop/kafka-0", false)}, "K//Pod/shop/kafka-0", false},
		{"the second of the name, another cluster's", []*Workload{kafka("K//Pod/shop/kafka-0", false), kafka("K2//Pod/shop/kafka-0", false)}, "K2//Pod/shop/kafka-0", false},
		{"after an entry of the name", []*Workload{entry, kafka("K//Pod/shop/kafka-0", false)}, "K//Pod/shop/kafka-0", false},
		{"the second of the name, meshed, no address seen", []*Workload{kafka("K//Pod/shop/kafka-0", false), kafka("K2//Pod/shop/kafka-0", true)}, "K2//Pod/shop/kafka-0", true},
		{"no workload of the uid", []*Workload{kafka("K//Pod/shop/kafka-0", false), entry}, "K3//Pod/shop/kafka-0", true},
	} {
		ep := Endpoint{Addr: node, PodNamespace: "shop", PodName: "kafka-0", PodUID: tt.uid}
		svc := &Service{Namespace: "shop", Name: "kafka", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.1")}, Endpoints: []Endpoint{ep}}
		d, _ := NewDirectory(tt.pods, []*Service{svc})
		got, _ := d.ServiceByVIP(svc.VIPs[0])
		if e := got.Endpoints[0]; e.Unresolved != tt.want || e.Workload != nil {
			t.Errorf("%s: Unresolved = %v (workload %v), want %v", tt.name, e.Unresolved, e.Workload, tt.want)
		}
	}
}
