package kubeobj

import (
	corev1 "k8s.io/api/core/v1"

	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// The labels Istio ambient users put on a namespace, Service or Pod to send
// its traffic through a waypoint, and the one on the waypoint saying what
// traffic it takes.
const (
	UseWaypointLabel          = "istio.io/use-waypoint"
	UseWaypointNamespaceLabel = "istio.io/use-waypoint-namespace"
	WaypointForLabel          = "istio.io/waypoint-for"
	// GatewayNameLabel is on a waypoint's own pods and Service, naming
	// its Gateway.
	GatewayNameLabel = "gateway.networking.k8s.io/gateway-name"
)

// waypointHBONEPort is the port waypoints take HBONE on (the Gateway's
// "mesh" listener).
const waypointHBONEPort = 15008

// addWaypoints gives services and pods the waypoint their istio.io/use-waypoint
// labels name, as istiod does: the object's own label, else its
// namespace's; "none" opts an object out of its namespace's; the waypoint
// is in istio.io/use-waypoint-namespace, else the object's namespace.
//
// These objects have no Gateway: a waypoint is named by its Service (the
// one Istio's gateway controller creates, with the Gateway's name), and is
// used only if that Service exists (istiod likewise ignores a label naming
// no Gateway). Its istio.io/waypoint-for label says what it takes, as on
// the Gateway: "service" (the default) for traffic to service VIPs,
// "workload" for traffic to pod addresses, "all", or "none". The waypoint's
// own Service and pods never get it.
func addWaypoints(snap *source.Snapshot, objs Objects, namespaces map[string]*corev1.Namespace) {
	svcs := make(map[string]*corev1.Service, len(objs.Services))
	for i := range objs.Services {
		svcs[objs.Services[i].Namespace+"/"+objs.Services[i].Name] = &objs.Services[i]
	}
	// resolve returns the waypoint that labels (else the namespace's)
	// name for the object self of ns, if it takes traffic of kind
	// ("service" or "workload") and is not self.
	resolve := func(ns, self string, labels map[string]string, kind string) *workload.Waypoint {
		name, wns := labels[UseWaypointLabel], labels[UseWaypointNamespaceLabel]
		if name == "" {
			if n := namespaces[ns]; n != nil {
				name, wns = n.Labels[UseWaypointLabel], n.Labels[UseWaypointNamespaceLabel]
			}
		}
		if name == "" || name == "none" {
			return nil
		}
		if wns == "" {
			wns = ns
		}
		wp := svcs[wns+"/"+name]
		if wp == nil || wns == ns && (self == name || labels[GatewayNameLabel] == name) {
			return nil
		}
		switch wp.Labels[WaypointForLabel] {
		case "", "service":
			if kind != "service" {
				return nil
			}
		case "workload":
			if kind != "workload" {
				return nil
			}
		case "all":
		default: // "none", or a value Istio does not define
			return nil
		}
		return &workload.Waypoint{Namespace: wns, Hostname: workload.ClusterHostname(name, wns), HBONEPort: waypointHBONEPort}
	}
	for _, s := range snap.Services {
		if obj := svcs[s.String()]; obj != nil {
			s.Waypoint = resolve(s.Namespace, s.Name, obj.Labels, "service")
		}
	}
	for _, w := range snap.Workloads {
		w.Waypoint = resolve(w.Namespace, "", w.Labels, "workload")
	}
}
