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

// WaypointRules give services and pods the waypoint their
// istio.io/use-waypoint labels name, as istiod does: the object's own
// label, else its namespace's; "none" opts an object out of its
// namespace's; the waypoint is in istio.io/use-waypoint-namespace, else the
// object's namespace.
//
// These objects have no Gateway: a waypoint is named by its Service (the
// one Istio's gateway controller creates, with the Gateway's name), and is
// used only if that Service exists (istiod likewise ignores a label naming
// no Gateway). Its istio.io/waypoint-for label says what it takes, as on
// the Gateway: "service" (the default) for traffic to service VIPs,
// "workload" for traffic to pod addresses, "all", or "none". The waypoint's
// own Service and pods never get it.
type WaypointRules struct {
	// Service returns the labels of the Service namespace/name, and
	// whether it exists.
	Service func(namespace, name string) (map[string]string, bool)
	// Namespace returns the labels of a namespace (nil if unknown).
	Namespace func(name string) map[string]string
}

// Traffic kinds a waypoint may take.
const (
	WaypointForService  = "service"
	WaypointForWorkload = "workload"
)

// For returns the waypoint for the object self (a Service's name; "" for
// a pod) of namespace ns with labels, for traffic of kind, or nil.
func (r WaypointRules) For(ns, self string, labels map[string]string, kind string) *workload.Waypoint {
	name, wns := labels[UseWaypointLabel], labels[UseWaypointNamespaceLabel]
	if name == "" {
		if nl := r.Namespace(ns); nl != nil {
			name, wns = nl[UseWaypointLabel], nl[UseWaypointNamespaceLabel]
		}
	}
	if name == "" || name == "none" {
		return nil
	}
	if wns == "" {
		wns = ns
	}
	wpLabels, ok := r.Service(wns, name)
	if !ok || wns == ns && (self == name || labels[GatewayNameLabel] == name) {
		return nil
	}
	switch wpLabels[WaypointForLabel] {
	case "", WaypointForService:
		if kind != WaypointForService {
			return nil
		}
	case WaypointForWorkload:
		if kind != WaypointForWorkload {
			return nil
		}
	case "all":
	default: // "none", or a value Istio does not define
		return nil
	}
	return &workload.Waypoint{Namespace: wns, Hostname: workload.ClusterHostname(name, wns), HBONEPort: waypointHBONEPort}
}

// WaypointLabels are the labels waypoint rules read, on Services and
// namespaces: what trimmed objects must keep.
var WaypointLabels = []string{UseWaypointLabel, UseWaypointNamespaceLabel, WaypointForLabel, GatewayNameLabel}

// addWaypoints gives the snapshot's services and pods their waypoints.
func addWaypoints(snap *source.Snapshot, objs Objects, namespaces map[string]*corev1.Namespace) {
	svcs := make(map[string]*corev1.Service, len(objs.Services))
	for i := range objs.Services {
		svcs[objs.Services[i].Namespace+"/"+objs.Services[i].Name] = &objs.Services[i]
	}
	rules := WaypointRules{
		Service: func(ns, name string) (map[string]string, bool) {
			s, ok := svcs[ns+"/"+name]
			if !ok {
				return nil, false
			}
			return s.Labels, true
		},
		Namespace: func(name string) map[string]string {
			if n := namespaces[name]; n != nil {
				return n.Labels
			}
			return nil
		},
	}
	for _, s := range snap.Services {
		if obj := svcs[s.String()]; obj != nil {
			s.Waypoint = rules.For(s.Namespace, s.Name, obj.Labels, WaypointForService)
		}
	}
	for _, w := range snap.Workloads {
		w.Waypoint = rules.For(w.Namespace, "", w.Labels, WaypointForWorkload)
	}
}
