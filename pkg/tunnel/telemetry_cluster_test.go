package tunnel

import (
	"context"
	"net/netip"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestRemoteWorkloadsLabelledWithTheirCluster: in a multi-cluster mesh
// istiod sends the workloads of every cluster, each with its cluster_id
// (workload.Workload.Cluster). ztunnel labels a connection's source_cluster
// and destination_cluster with the workload's cluster; the agent labelled
// every workload with its own CLUSTER_ID, so Kiali's graph, which places
// nodes by those labels, showed the remote cluster's workloads in the
// local one and the traffic between clusters as local.
func TestRemoteWorkloadsLabelledWithTheirCluster(t *testing.T) {
	m := NewMetrics(nil)
	m.SetCluster("west")
	local := &workload.Workload{Name: "client", Namespace: "mesh", ServiceAccount: "client", Addrs: []netip.Addr{netip.MustParseAddr("10.1.0.1")}}
	remote := &workload.Workload{Name: "server", Namespace: "mesh", ServiceAccount: "server", Cluster: "east", Addrs: []netip.Addr{netip.MustParseAddr("10.2.0.1")}}
	dir, errs := workload.NewDirectory([]*workload.Workload{local, remote}, nil)
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	m.setLive(dir)
	c := connInfo{reporter: "source", src: local, dst: remote, secure: true,
		srcID: identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"},
		dstID: identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server"}}
	l := m.labels(c)
	if l["source_cluster"] != "west" || l["destination_cluster"] != "east" {
		t.Errorf("source_cluster %q, destination_cluster %q: want west (the agent's, the source knows no other) and east (the remote workload's)",
			l["source_cluster"], l["destination_cluster"])
	}
	m.open(c, "").close(context.Background(), 1, 1, nil)
	if n := testutil.ToFloat64(m.connsClosed.With(l)); n != 1 {
		t.Errorf("istio_tcp_connections_closed_total with the remote cluster: %v, want 1", n)
	}
}
