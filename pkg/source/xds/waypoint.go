package xds

import "github.com/redirector-mesh/redirector/pkg/workload"

// localWaypoints gives this node's pods (local, built from the API server's
// objects) the waypoints istiod sent for them (copies, from localCopies):
// only istiod resolves the Gateway an istio.io/use-waypoint label names,
// and without it traffic to a local pod's address would skip its waypoint.
// A pod with no single copy keeps none.
func localWaypoints(local []*workload.Workload, copies map[string][]*Workload) {
	for _, w := range local {
		if c := copies[w.String()]; len(c) == 1 && c[0].Waypoint != nil {
			w.Waypoint = c[0].Waypoint
		}
	}
}
