package tunnel

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// waypointDir is a namespace with a waypoint: the waypoint pod and its
// service (HBONE port 15008, as istiod's waypoint Service has it), a pod
// "server" that uses it for workload traffic, a service "web" that uses it
// for service traffic, a service "plain" without one in front of the same
// pod, and pods without one.
func waypointDir(t *testing.T, wp *workload.Waypoint) *workload.Directory {
	t.Helper()
	client := podObj("mesh", "client", "client", "10.1.0.1", nil)
	server := podObj("mesh", "server", "server", "10.1.0.2", nil)
	server.Waypoint = wp
	other := podObj("mesh", "other", "other", "10.1.0.3", nil)
	waypoint := podObj("mesh", "waypoint-6f7b", "waypoint", "10.1.0.9", nil)
	waypoint.Addrs = append(waypoint.Addrs, netip.MustParseAddr("fd00::9"))
	waypoint.Enrolled = false // as Istio's waypoints: dataplane-mode none
	// Same identity as the waypoint, another address: not the waypoint.
	imposter := podObj("mesh", "imposter", "waypoint", "10.1.0.8", nil)
	web := &workload.Service{Name: "web", Namespace: "mesh", Hostname: "web.mesh.svc.cluster.local", Waypoint: wp,
		VIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.1")},
		Ports:     []workload.ServicePort{{Name: "http", Port: 80, TargetPort: 8080}},
		Endpoints: []workload.Endpoint{{Addr: netip.MustParseAddr("10.1.0.2"), Ready: true}, {Addr: netip.MustParseAddr("10.1.0.3"), Ready: true}}}
	plain := &workload.Service{Name: "plain", Namespace: "mesh", Hostname: "plain.mesh.svc.cluster.local",
		VIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.2")},
		Ports:     []workload.ServicePort{{Name: "http", Port: 80, TargetPort: 8080}},
		Endpoints: []workload.Endpoint{{Addr: netip.MustParseAddr("10.1.0.2"), Ready: true}}}
	wpSvc := &workload.Service{Name: "waypoint", Namespace: "mesh", Hostname: "waypoint.mesh.svc.cluster.local",
		VIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.9")},
		Ports:     []workload.ServicePort{{Name: "mesh", Port: 15008}, {Name: "status", Port: 15021}},
		Endpoints: []workload.Endpoint{{Addr: netip.MustParseAddr("10.1.0.9"), Ready: true, Ports: map[string]int32{"mesh": 15008, "status": 15021}}}}
	dir, errs := workload.NewDirectory([]*workload.Workload{client, server, other, waypoint, imposter}, []*workload.Service{web, plain, wpSvc})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	return dir
}

var byHost = &workload.Waypoint{Namespace: "mesh", Hostname: "waypoint.mesh.svc.cluster.local", HBONEPort: 15008}

// Which waypoint applies, as ztunnel's build_request decides: the
// service's for a VIP, the workload's for its address, none for a VIP
// whose service has none (whatever the endpoint's), and none for the
// waypoint's own traffic.
func TestWaypointOf(t *testing.T) {
	dir := waypointDir(t, byHost)
	var idx waypointIndex
	for _, tc := range []struct {
		name, src, dst string
		want           string // "" none, "service" or "workload"
	}{
		{"service VIP with a waypoint", "10.1.0.1", "10.96.0.1", "service"},
		{"pod address with a waypoint", "10.1.0.1", "10.1.0.2", "workload"},
		{"pod without a waypoint", "10.1.0.1", "10.1.0.3", ""},
		{"VIP without a waypoint, endpoint with one", "10.1.0.1", "10.96.0.2", ""},
		{"from the waypoint to the pod", "10.1.0.9", "10.1.0.2", ""},
		{"from the waypoint to the VIP", "10.1.0.9", "10.96.0.1", ""},
		{"same identity as the waypoint, other address", "10.1.0.8", "10.1.0.2", "workload"},
		{"unknown destination", "10.1.0.1", "192.0.2.1", ""},
	} {
		got := waypointOf(dir, &idx, mustPod(t, dir, tc.src), netip.MustParseAddr(tc.dst))
		switch {
		case tc.want == "" && got != nil:
			t.Errorf("%s: routed through waypoint %s, want direct", tc.name, waypointName(got.wp))
		case tc.want != "" && got == nil:
			t.Errorf("%s: direct, want through the waypoint", tc.name)
		case tc.want == "service" && (got.svc == nil || got.svc.Name != "web"):
			t.Errorf("%s: service %v, want web", tc.name, got.svc)
		case tc.want == "workload" && got.svc != nil:
			t.Errorf("%s: service %v, want none (workload-addressed)", tc.name, got.svc)
		}
	}
}

// A waypoint resolves to its instances' HBONE addresses and identities,
// in the caller's IP family; one that cannot be resolved is an error of
// its kind, never a direct route.
func TestWaypointHops(t *testing.T) {
	tun := newTestTunnel(t, nil)
	v4, v6 := netip.MustParseAddr("10.1.0.2"), netip.MustParseAddr("fd00::2")
	for _, tc := range []struct {
		name string
		wp   *workload.Waypoint
		dst  netip.Addr
		want string // hop address, or the error kind
	}{
		{"by host name", byHost, v4, "10.1.0.9:15008"},
		{"by host name, IPv6 caller", byHost, v6, "[fd00::9]:15008"},
		{"port 0 means the default", &workload.Waypoint{Namespace: "mesh", Hostname: "waypoint.mesh.svc.cluster.local"}, v4, "10.1.0.9:15008"},
		{"by the service VIP", &workload.Waypoint{Addr: netip.MustParseAddr("10.96.0.9"), HBONEPort: 15008}, v4, "10.1.0.9:15008"},
		{"by the pod address", &workload.Waypoint{Addr: netip.MustParseAddr("10.1.0.9"), HBONEPort: 15008}, v6, "10.1.0.9:15008"},
		{"host name of another namespace", &workload.Waypoint{Namespace: "other", Hostname: "waypoint.mesh.svc.cluster.local", HBONEPort: 15008}, v4, "unknown"},
		{"unknown host name", &workload.Waypoint{Namespace: "mesh", Hostname: "gone.mesh.svc.cluster.local", HBONEPort: 15008}, v4, "unknown"},
		{"unknown address", &workload.Waypoint{Addr: netip.MustParseAddr("10.1.0.77"), HBONEPort: 15008}, v4, "unknown"},
		{"service without the HBONE port", &workload.Waypoint{Namespace: "mesh", Hostname: "waypoint.mesh.svc.cluster.local", HBONEPort: 15009}, v4, "no endpoint"},
	} {
		dir := waypointDir(t, tc.wp)
		hops, err := tun.waypointHops(dir, tc.wp, nil, tc.dst)
		switch tc.want {
		case "unknown":
			if !errors.Is(err, errWaypointUnknown) {
				t.Errorf("%s: %v %v, want errWaypointUnknown", tc.name, hops, err)
			}
		case "no endpoint":
			if !errors.Is(err, errWaypointNoEndpoint) {
				t.Errorf("%s: %v %v, want errWaypointNoEndpoint", tc.name, hops, err)
			}
		default:
			if err != nil || len(hops) == 0 || hops[0].addr.String() != tc.want {
				t.Errorf("%s: %v %v, want first hop %s", tc.name, hops, err, tc.want)
			}
		}
	}
	// The identity checked is the waypoint workload's.
	hops, _ := tun.waypointHops(waypointDir(t, byHost), byHost, nil, v4)
	if got := tun.identityOf(hops[0].w).String(); got != "spiffe://cluster.local/ns/mesh/sa/waypoint" {
		t.Errorf("waypoint identity %s", got)
	}
	// Endpoints not ready, or whose workload is unknown: nothing to send to.
	dir := waypointDir(t, byHost)
	svcs := dir.Services()
	for i, s := range svcs {
		if s.Name == "waypoint" {
			c := *s
			c.Endpoints = []workload.Endpoint{{Addr: netip.MustParseAddr("10.1.0.9"), Ready: false}, {Addr: netip.MustParseAddr("10.1.0.50"), Ready: true}}
			svcs[i] = &c
		}
	}
	dir, _ = workload.NewDirectory(dir.All(), svcs)
	if hops, err := tun.waypointHops(dir, byHost, nil, v4); !errors.Is(err, errWaypointNoEndpoint) {
		t.Errorf("no ready endpoint with a known workload: %v %v, want errWaypointNoEndpoint", hops, err)
	}
	// An IPv6 caller, the waypoint pod terminating and its IPv6 address a
	// new pod's in the directory: that address is not the waypoint's to
	// dial, and its IPv4 one is taken.
	all := waypointDir(t, byHost).All()
	for i, w := range all {
		if w.Name == "waypoint-6f7b" {
			c := *w
			c.Terminating = true
			all[i] = &c
		}
	}
	dir, _ = workload.NewDirectory(append(all, podObj("mesh", "new", "new", "fd00::9", nil)), waypointDir(t, byHost).Services())
	if hops, err := tun.waypointHops(dir, byHost, nil, v6); err != nil || len(hops) == 0 || hops[0].addr.String() != "10.1.0.9:15008" {
		t.Errorf("waypoint whose IPv6 address is another's: %v %v, want first hop 10.1.0.9:15008", hops, err)
	}
}

// A connection whose waypoint cannot be resolved is reset and counted,
// before any dial: it must not go to the service's endpoints directly.
// Before waypoints were routed, it went straight to an endpoint.
func TestWaypointUnresolvedFailsClosed(t *testing.T) {
	var logs bytes.Buffer
	tun := newTestTunnel(t, &logs)
	gone := &workload.Waypoint{Namespace: "mesh", Hostname: "gone.mesh.svc.cluster.local", HBONEPort: 15008}
	tun.Update(&State{Dir: waypointDir(t, gone)})
	p := testPod(tun, "uid-client", netip.MustParseAddr("10.1.0.1"))
	for _, dst := range []string{"10.96.0.1:80", "10.1.0.2:8080"} {
		c := newFakeConn(dst, "10.1.0.1:40000")
		p.handleOutbound(c)
		if !c.closed.Load() {
			t.Errorf("%s: connection left open", dst)
		}
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.failClosed.WithLabelValues(reasonWaypointUnknown)); got != 2 {
		t.Errorf("fail_closed{%s} = %v, want 2", reasonWaypointUnknown, got)
	}
	if !strings.Contains(logs.String(), "its waypoint cannot be resolved") || !strings.Contains(logs.String(), "mesh/gone.mesh.svc.cluster.local") {
		t.Errorf("refusal not logged with the waypoint's name:\n%s", logs.String())
	}
}

// The access log says when the destination was a waypoint.
func TestWaypointAccessLogField(t *testing.T) {
	var logs bytes.Buffer
	m := NewMetrics(nil)
	m.SetAccessLog(slog.New(slog.NewTextHandler(&syncWriter{w: &logs}, nil)))
	dir := waypointDir(t, byHost)
	m.open(connInfo{reporter: "source", src: mustPod(t, dir, "10.1.0.1"), dst: mustPod(t, dir, "10.1.0.9"), waypoint: true,
		hboneAddr: netip.MustParseAddrPort("10.96.0.1:80")}, "").close(context.Background(), 1, 2, nil)
	if !strings.Contains(logs.String(), "dst.waypoint=true") || !strings.Contains(logs.String(), "dst.hbone_addr=10.96.0.1:80") {
		t.Errorf("access log lacks the waypoint fields:\n%s", logs.String())
	}
}
