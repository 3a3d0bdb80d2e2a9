package admin

import (
	"net/netip"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestZtunnelDumpRemoteWorkloadCluster: a remote cluster's workload (its
// cluster_id from istiod in workload.Workload.Cluster) is dumped with its
// cluster, in clusterId and its uid, as ztunnel dumps it, and a service's
// endpoint names it by that uid. Before, every workload was dumped as the
// agent's cluster's.
func TestZtunnelDumpRemoteWorkloadCluster(t *testing.T) {
	local := &workload.Workload{Name: "client", Namespace: "mesh", UID: "u1", Addrs: []netip.Addr{netip.MustParseAddr("10.1.0.1")}}
	remote := &workload.Workload{Name: "server", Namespace: "mesh", UID: "u2", Cluster: "east", Addrs: []netip.Addr{netip.MustParseAddr("10.2.0.1")}}
	svc := &workload.Service{Name: "server", Namespace: "mesh", Hostname: "server.mesh.svc.cluster.local", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.1")},
		Ports: []workload.ServicePort{{Name: "http", Port: 80, TargetPort: 8080}}, Endpoints: []workload.Endpoint{{Addr: remote.Addrs[0], Ready: true}}}
	dir, errs := workload.NewDirectory([]*workload.Workload{local, remote}, []*workload.Service{svc})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	want := map[string][2]string{"client": {"west", "west//Pod/mesh/client"}, "server": {"east", "east//Pod/mesh/server"}}
	for _, w := range ZtunnelWorkloads(dir, "west", "", "cluster.local") {
		if got := [2]string{w.ClusterID, w.UID}; got != want[w.Name] {
			t.Errorf("workload %s: clusterId and uid %v, want %v", w.Name, got, want[w.Name])
		}
	}
	for _, s := range ZtunnelServices(dir, "west", "") {
		for _, e := range s.Endpoints {
			if e.WorkloadUID != "east//Pod/mesh/server" {
				t.Errorf("service %s: endpoint workloadUid %q, want east//Pod/mesh/server", s.Name, e.WorkloadUID)
			}
		}
	}
}
