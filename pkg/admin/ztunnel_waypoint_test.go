package admin

import (
	"encoding/json"
	"net/netip"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestZtunnelDumpWaypointAndHealth: a workload's and a service's waypoint
// are in the dump as ztunnel writes them ({"destination": "ns/hostname" or
// "network/ip", "hboneMtlsPort": N}), which is what istioctl ztunnel-config
// workloads and services look up for their WAYPOINT column; an endpoint's
// readiness is its status (ztunnel's Endpoint.status) and a workload that
// is an endpoint only while not ready is Unhealthy, which istioctl counts
// in the ENDPOINTS column (healthy/all). Before, neither waypoint was
// dumped (istioctl showed None for a workload whose traffic goes through a
// waypoint) and every workload was Healthy (istioctl showed 1/1 for a
// service whose one endpoint is not ready).
func TestZtunnelDumpWaypointAndHealth(t *testing.T) {
	wpSvc := &workload.Service{Name: "waypoint", Namespace: "mesh", Hostname: "waypoint.mesh.svc.cluster.local",
		VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.9")}, Ports: []workload.ServicePort{{Name: "mesh", Port: 15008}}}
	byHost := &workload.Waypoint{Namespace: "mesh", Hostname: "waypoint.mesh.svc.cluster.local", HBONEPort: 15008}
	byAddr := &workload.Waypoint{Addr: netip.MustParseAddr("10.96.0.9"), HBONEPort: 15008}
	ready := &workload.Workload{Name: "ready", Namespace: "mesh", UID: "u1", Addrs: []netip.Addr{netip.MustParseAddr("10.0.0.1")}, Enrolled: true, Waypoint: byHost}
	unready := &workload.Workload{Name: "unready", Namespace: "mesh", UID: "u2", Addrs: []netip.Addr{netip.MustParseAddr("10.0.0.2")}, Enrolled: true, Waypoint: byAddr}
	svc := &workload.Service{Name: "app", Namespace: "mesh", Hostname: "app.mesh.svc.cluster.local", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
		Ports: []workload.ServicePort{{Name: "http", Port: 80, TargetPort: 8080}}, Waypoint: byHost,
		Endpoints: []workload.Endpoint{
			{Addr: ready.Addrs[0], Ready: true, Ports: map[string]int32{"http": 8080}},
			{Addr: unready.Addrs[0], Ready: false, Ports: map[string]int32{"http": 8080}},
		}}
	dir, errs := workload.NewDirectory([]*workload.Workload{ready, unready}, []*workload.Service{wpSvc, svc})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	b, err := json.Marshal(map[string]any{"workloads": ZtunnelWorkloads(dir, "Kubernetes", "net1", "cluster.local"),
		"services": ZtunnelServices(dir, "Kubernetes", "net1")})
	if err != nil {
		t.Fatal(err)
	}
	var dump struct {
		Workloads []struct {
			Name, Status string
			Waypoint     *struct {
				Destination   string `json:"destination"`
				HBONEMtlsPort uint16 `json:"hboneMtlsPort"`
			} `json:"waypoint"`
		} `json:"workloads"`
		Services []struct {
			Name     string
			Waypoint *struct {
				Destination string `json:"destination"`
			} `json:"waypoint"`
			Endpoints map[string]struct {
				WorkloadUID string `json:"workloadUid"`
				Status      string `json:"status"`
			} `json:"endpoints"`
		} `json:"services"`
	}
	if err := json.Unmarshal(b, &dump); err != nil {
		t.Fatal(err)
	}
	want := map[string][2]string{"ready": {"mesh/waypoint.mesh.svc.cluster.local", "Healthy"}, "unready": {"net1/10.96.0.9", "Unhealthy"}}
	for _, w := range dump.Workloads {
		if w.Waypoint == nil || w.Waypoint.Destination != want[w.Name][0] || w.Waypoint.HBONEMtlsPort != 15008 || w.Status != want[w.Name][1] {
			t.Errorf("workload %s: waypoint %+v status %s, want {%s 15008} %s", w.Name, w.Waypoint, w.Status, want[w.Name][0], want[w.Name][1])
		}
	}
	for _, s := range dump.Services {
		switch s.Name {
		case "waypoint":
			if s.Waypoint != nil {
				t.Errorf("waypoint service has a waypoint: %+v", s.Waypoint)
			}
		case "app":
			if s.Waypoint == nil || s.Waypoint.Destination != "mesh/waypoint.mesh.svc.cluster.local" {
				t.Errorf("service app: waypoint %+v", s.Waypoint)
			}
			statuses := map[string]string{}
			for _, e := range s.Endpoints {
				statuses[e.WorkloadUID] = e.Status
			}
			if statuses["Kubernetes//Pod/mesh/ready"] != "Healthy" || statuses["Kubernetes//Pod/mesh/unready"] != "Unhealthy" {
				t.Errorf("service app: endpoint statuses %v", statuses)
			}
		}
	}
	if strings.Contains(string(b), `"waypoint":null`) {
		t.Errorf("a missing waypoint is written as null; ztunnel leaves it out: %s", b)
	}
}

// TestZtunnelServicePortsUnsetTarget: a service port with no targetPort
// (a manifest's; the API server fills it in) sends to the same port, and
// the dump says so; 0 in ztunnel's ports means a named target port,
// resolved per endpoint. Before, the dump wrote 0 for both.
func TestZtunnelServicePortsUnsetTarget(t *testing.T) {
	svc := &workload.Service{Name: "app", Namespace: "mesh", Hostname: "app.mesh.svc.cluster.local", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
		Ports: []workload.ServicePort{{Name: "same", Port: 80}, {Name: "named", Port: 81, TargetPortName: "http"}, {Name: "num", Port: 82, TargetPort: 8082}}}
	dir, _ := workload.NewDirectory(nil, []*workload.Service{svc})
	got := ZtunnelServices(dir, "Kubernetes", "")[0].Ports
	if got["80"] != 80 || got["81"] != 0 || got["82"] != 8082 {
		t.Errorf("ports %v, want 80->80, 81->0 (named), 82->8082", got)
	}
}

// TestZtunnelServiceLoadBalancer: a service's routing preference is in
// the dump as ztunnel writes it (istioctl reads loadBalancer), and a
// workload's subzone with its locality.
func TestZtunnelServiceLoadBalancer(t *testing.T) {
	near := &workload.Service{Name: "close", Namespace: "mesh", Hostname: "close.mesh.svc.cluster.local", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.11")},
		Routing: &workload.Routing{Scopes: []workload.Scope{workload.ScopeNetwork, workload.ScopeRegion, workload.ScopeZone}}}
	local := &workload.Service{Name: "local", Namespace: "mesh", Hostname: "local.mesh.svc.cluster.local", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.12")},
		Routing: &workload.Routing{Scopes: []workload.Scope{workload.ScopeNode}, Strict: true}}
	plain := &workload.Service{Name: "plain", Namespace: "mesh", Hostname: "plain.mesh.svc.cluster.local", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.13")}}
	// internalTrafficPolicy: Local from the Kubernetes source, shown as istiod sends it.
	itpLocal := &workload.Service{Name: "itp-local", Namespace: "mesh", Hostname: "itp-local.mesh.svc.cluster.local", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.14")}, NodeLocal: true}
	dir, _ := workload.NewDirectory(nil, []*workload.Service{near, local, plain, itpLocal})
	got := map[string]string{}
	for _, s := range ZtunnelServices(dir, "Kubernetes", "") {
		b, _ := json.Marshal(s.LoadBalancer)
		got[s.Name] = string(b)
	}
	want := map[string]string{
		"close":     `{"routingPreferences":["Network","Region","Zone"],"mode":"Failover"}`,
		"local":     `{"routingPreferences":["Node"],"mode":"Strict"}`,
		"plain":     `null`,
		"itp-local": `{"routingPreferences":["Node"],"mode":"Strict"}`,
	}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s: loadBalancer %s, want %s", name, got[name], w)
		}
	}
	if l := localityOf(&workload.Workload{Region: "r1", Zone: "a", Subzone: "rack7"}); l == nil || l.Subzone != "rack7" {
		t.Errorf("locality %+v, want the subzone rack7", l)
	}
}

// TestZtunnelWorkloadStateConnections: an Up pod's connections are in
// ztunnel's shape (inbound/outbound lists, an inbound originalDst null when
// no service is known); a Pending pod has none.
func TestZtunnelWorkloadStateConnections(t *testing.T) {
	up := &workload.Workload{Name: "up", Namespace: "mesh", UID: "u1", Enrolled: true}
	pending := &workload.Workload{Name: "pending", Namespace: "mesh", UID: "u2", Enrolled: true}
	got := ZtunnelWorkloadStates([]*workload.Workload{up, pending}, "cluster.local", func(w *workload.Workload) (bool, *ZtunnelConnections) {
		if w != up {
			return false, nil
		}
		return true, &ZtunnelConnections{
			Inbound:  []ZtunnelInboundConnection{{Src: "10.2.0.1:40001", ActualDst: "10.1.0.2:8080", Protocol: Protocol(false)}},
			Outbound: []ZtunnelOutboundConnection{},
		}
	})
	b, _ := json.Marshal(got)
	want := `{"u1":{"state":"Up","connections":{"inbound":[{"src":"10.2.0.1:40001","originalDst":null,"actualDst":"10.1.0.2:8080","protocol":"TCP"}],"outbound":[]},` +
		`"info":{"name":"up","namespace":"mesh","trustDomain":"cluster.local","serviceAccount":""}},` +
		`"u2":{"state":"Pending","info":{"name":"pending","namespace":"mesh","trustDomain":"cluster.local","serviceAccount":""}}}`
	if string(b) != want {
		t.Errorf("workloadState\n got %s\nwant %s", b, want)
	}
}

// TestZtunnelWorkloadStatesWithoutUID: pods without a UID (mirror pods,
// kubeobj.PodUID) are listed by namespace/name; before, all of them shared
// the key "" and the config dump showed one of them.
func TestZtunnelWorkloadStatesWithoutUID(t *testing.T) {
	a := &workload.Workload{Name: "a-node1", Namespace: "edge", Enrolled: true}
	b := &workload.Workload{Name: "b-node1", Namespace: "edge", Enrolled: true}
	got := ZtunnelWorkloadStates([]*workload.Workload{a, b}, "cluster.local", func(*workload.Workload) (bool, *ZtunnelConnections) { return false, nil })
	if len(got) != 2 || got["edge/a-node1"].Info.Name != "a-node1" || got["edge/b-node1"].Info.Name != "b-node1" {
		t.Errorf("workload states of two pods without a UID: %+v", got)
	}
}
