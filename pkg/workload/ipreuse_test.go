package workload

import (
	"net/netip"
	"testing"
)

// TestEndpointAtReusedAddressNotGivenToNewPod: a service endpoint names
// its pod (an EndpointSlice's targetRef), but the directory gives the
// endpoint's address to another workload: the pod left and its address
// went to a new pod (the slice, watched apart from pods, lags; a
// publishNotReadyAddresses service lists a pod until its object is
// deleted, after its sandbox freed the address). Before, the endpoint
// was resolved by address alone: the service's connections were sent to
// the new pod (another namespace and service account), whose identity the
// client then required and got, and the new pod's inbound connections
// were counted under the service. Now such an endpoint is unresolved, and
// not dialled.
func TestEndpointAtReusedAddressNotGivenToNewPod(t *testing.T) {
	a := netip.MustParseAddr("10.0.0.5")
	old := &Workload{UID: "uid-old", Namespace: "shop", Name: "web-0", ServiceAccount: "web", Addrs: []netip.Addr{a}, Enrolled: true, Terminating: true}
	intruder := &Workload{UID: "uid-new", Namespace: "other", Name: "job-1", ServiceAccount: "job", Addrs: []netip.Addr{a}, Enrolled: true}
	plainNew := &Workload{UID: "uid-plain", Namespace: "other", Name: "plain", Addrs: []netip.Addr{a}}
	for _, tt := range []struct {
		name string
		pods []*Workload
		ep   Endpoint
	}{
		{"slice names the old pod, which is terminating", []*Workload{old, intruder},
			Endpoint{Addr: a, Ready: true, PodNamespace: "shop", PodName: "web-0"}},
		{"slice names the old pod, which is gone", []*Workload{intruder},
			Endpoint{Addr: a, Ready: true, PodNamespace: "shop", PodName: "web-0"}},
		{"slice names the old pod, the address went to a pod outside the mesh", []*Workload{plainNew},
			Endpoint{Addr: a, Ready: true, PodNamespace: "shop", PodName: "web-0"}},
	} {
		svc := &Service{Namespace: "shop", Name: "web", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.1")}, Endpoints: []Endpoint{tt.ep}}
		d, _ := NewDirectory(tt.pods, []*Service{svc})
		got, ok := d.ServiceByVIP(svc.VIPs[0])
		if !ok {
			t.Fatalf("%s: service not found", tt.name)
		}
		ep := got.Endpoints[0]
		if ep.Workload != nil {
			t.Errorf("%s: endpoint resolved to %s (identity %s), the workload now at its address; want none", tt.name, ep.Workload, ep.Workload.Identity("cluster.local"))
		}
		if !ep.Unresolved {
			t.Errorf("%s: endpoint not unresolved: it would be dialled", tt.name)
		}
		for _, w := range tt.pods {
			if s := d.selecting[w]; len(s) > 0 {
				t.Errorf("%s: %s counted as an endpoint of %s", tt.name, w, s[0])
			}
		}
	}

	// The pod the endpoint names, at its address, still resolves, and so
	// does an endpoint that names none.
	cur := &Workload{UID: "uid-cur", Namespace: "shop", Name: "web-0", Addrs: []netip.Addr{a}, Enrolled: true}
	for _, ep := range []Endpoint{
		{Addr: a, Ready: true, PodNamespace: "shop", PodName: "web-0"},
		{Addr: a, Ready: true},
	} {
		svc := &Service{Namespace: "shop", Name: "web", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.1")}, Endpoints: []Endpoint{ep}}
		d, _ := NewDirectory([]*Workload{cur}, []*Service{svc})
		got, _ := d.ServiceByVIP(svc.VIPs[0])
		if e := got.Endpoints[0]; e.Workload != cur || e.Unresolved {
			t.Errorf("endpoint %+v of the pod at its address: workload %v, unresolved %v; want the pod", ep, e.Workload, e.Unresolved)
		}
	}
}
