package xds

import "github.com/redirector-mesh/redirector/pkg/workload"

// localWaypoints gives this node's pods (local, built from the API server's
// objects, named in localNames) the waypoints istiod sent for them: only
// istiod resolves the Gateway an istio.io/use-waypoint label names, and
// without it traffic to a local pod's address would skip its waypoint.
func localWaypoints(local []*workload.Workload, mesh []*Workload, localNames map[string]bool) {
	waypoints := map[string]*workload.Waypoint{}
	for _, w := range mesh {
		if key := w.Namespace + "/" + w.Name; w.Waypoint != nil && isPod(w) && localNames[key] {
			waypoints[key] = w.Waypoint
		}
	}
	if len(waypoints) == 0 {
		return
	}
	for _, w := range local {
		if wp, ok := waypoints[w.String()]; ok {
			w.Waypoint = wp
		}
	}
}
