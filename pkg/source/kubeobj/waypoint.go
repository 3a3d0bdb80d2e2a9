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
	// GatewayManagedLabel is on the Service (and pods) Istio's gateway
	// controller makes for a waypoint or an east-west gateway, saying
	// which controller made it.
	GatewayManagedLabel = "gateway.istio.io/managed"
)

// Values of GatewayManagedLabel whose Services istiod gives no waypoint.
const (
	managedByMeshController     = "istio.io-mesh-controller"
	managedByEastWestController = "istio.io-eastwest-controller"
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
// The labels are read as istiod reads them (GetUseWaypoint): the object's
// own istio.io/use-waypoint decides whenever it is there, an empty value
// too, and so does its istio.io/use-waypoint-namespace; only an object
// without the label takes its namespace's. An empty name, or an empty
// namespace, names no waypoint. Read by value, an empty label fell back
// to the namespace's waypoint where istiod gives none.
//
// These objects have no Gateway: a waypoint is named by its Service (the
// one Istio's gateway controller creates, with the Gateway's name), and is
// used only if that Service exists (istiod likewise ignores a label naming
// no Gateway). Its istio.io/waypoint-for label says what it takes, as on
// the Gateway: "service" (the default) for traffic to service VIPs,
// "workload" for traffic to pod addresses, "all", or "none". As in istiod,
// a waypoint has no waypoint: a pod that is an instance of any waypoint of
// its namespace (its gateway-name label names one) gets none, nor does a
// Service Istio's gateway controller made for a waypoint or an east-west
// gateway (gateway.istio.io/managed), nor a waypoint's own Service.
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
	if r.isWaypoint(ns, self, labels) {
		return nil
	}
	name, wns, named := useWaypoint(labels, ns)
	if !named {
		name, wns, named = useWaypoint(r.Namespace(ns), ns)
	}
	if !named || name == "" || name == "none" || wns == "" {
		return nil
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

// useWaypoint is the waypoint labels names, as istiod's GetUseWaypoint
// reads them: named says the use-waypoint label is there, whatever its
// value; the namespace is the use-waypoint-namespace label's value when
// that is there (empty too), else defaultNS.
func useWaypoint(labels map[string]string, defaultNS string) (name, ns string, named bool) {
	if name, named = labels[UseWaypointLabel]; !named {
		return "", "", false
	}
	ns, set := labels[UseWaypointNamespaceLabel]
	if !set {
		ns = defaultNS
	}
	return name, ns, true
}

// isWaypoint says the object is a waypoint's or a gateway's, which istiod
// gives no waypoint: a Service its gateway controller made for one, or a
// pod that is an instance of a waypoint of its namespace.
func (r WaypointRules) isWaypoint(ns, self string, labels map[string]string) bool {
	if self != "" {
		switch labels[GatewayManagedLabel] {
		case managedByMeshController, managedByEastWestController:
			return true
		}
		return false
	}
	gw := labels[GatewayNameLabel]
	if gw == "" {
		return false
	}
	_, ok := r.Service(ns, gw)
	return ok
}

// WaypointLabels are the labels waypoint rules read, on Services and
// namespaces: what trimmed objects must keep.
var WaypointLabels = []string{UseWaypointLabel, UseWaypointNamespaceLabel, WaypointForLabel, GatewayNameLabel, GatewayManagedLabel}

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
