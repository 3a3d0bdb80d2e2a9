// Package workload is the mesh model the tunnel, the policy engine and the
// node agent read: workloads, services, their endpoints and waypoints, in
// the project's own types. Every source (a manifest file, the Kubernetes
// API, istiod's workload xDS) translates into them, so no Kubernetes or
// Istio API type reaches the data plane's Go side.
//
// A Directory indexes one snapshot of the model ("who is at this
// address?", "what is behind this VIP?") and never changes afterwards, so
// readers share it without locks; a Store swaps in the next one.
package workload

import (
	"net/netip"
	"slices"
)

// Workload is one pod (or, from istiod, a ServiceEntry or VM workload) as
// the mesh sees it. Treat it as read-only.
type Workload struct {
	Name      string
	Namespace string
	UID       string
	// ServiceAccount is "default" when the pod names none, as Kubernetes
	// would have it; it is the SPIFFE identity's last part.
	ServiceAccount string
	Node           string
	// Addrs are the workload's own addresses; empty for a hostNetwork pod
	// (it shares the node's) and a finished one (a new pod may have them).
	Addrs  []netip.Addr
	Labels map[string]string
	// WorkloadName is the owning workload as Istio names it (the
	// Deployment, StatefulSet, ... ), WorkloadType ztunnel's type for it
	// (deployment, cronjob, job or pod), and CanonicalName and
	// CanonicalRevision the pod's canonical service (see CanonicalService):
	// the names Istio's telemetry groups by.
	WorkloadName      string
	WorkloadType      string
	CanonicalName     string
	CanonicalRevision string
	// Region, Zone and Subzone are the pod's locality, and Cluster the
	// cluster it runs in, when its source knows them (istiod's xDS sends
	// them, from the node's topology labels; the Kubernetes and file
	// sources read those labels from Nodes, and know no Cluster).
	// Services with a Routing preference rank endpoints by them.
	Region, Zone, Subzone string
	Cluster               string
	// Enrolled says the workload is in the mesh and takes HBONE: for this
	// node's pods, the selection decision (Reason says which rule decided,
	// BypassInbound turns inbound capture off); for other workloads, what
	// their source says of them.
	Enrolled      bool
	Reason        string
	BypassInbound bool
	// DNSCapture is the pod's own choice about DNS capture (annotation
	// ambient.istio.io/dns-capture); unset follows the node's setting.
	DNSCapture Choice
	// Pending is set on a pod the rules select but whose address its
	// source does not know yet (see selection.Decision.Pending): the
	// reason it is enrolled under once the CNI plugin reports its
	// addresses.
	Pending string
	// Undecided is set on a pod the agent cannot judge yet (its namespace
	// or, selected, its runtime not in the agent's view yet; see
	// selection.Decision.Undecided): its CNI ADD fails, so it never starts
	// unmeshed.
	Undecided string
	// Redirected says the pod carries ambient.istio.io/redirection=enabled
	// as its source last read it, and Terminating that it is being deleted;
	// the node agent keeps the annotation true to what is attached.
	Redirected  bool
	Terminating bool
	// ContainerPorts maps named container ports to their numbers, to
	// resolve a Service's named targetPort.
	ContainerPorts map[string]int32
	// Waypoint, if set, is where traffic to this workload goes first.
	Waypoint *Waypoint
}

// Choice is a pod's own answer to a node-wide setting.
type Choice int8

const (
	ChoiceUnset Choice = iota // follows the node's setting
	ChoiceOn
	ChoiceOff
)

// Or is the choice, or def when it is unset.
func (c Choice) Or(def bool) bool {
	switch c {
	case ChoiceOn:
		return true
	case ChoiceOff:
		return false
	}
	return def
}

// TakesHBONE says whether connections to w must go over HBONE, never in
// plain TCP: w is enrolled, or its node records it captured (Redirected,
// the annotation its node agent writes once the capture is on and removes
// once it is off). istiod decides a pod's tunnel protocol by that
// annotation alone; this agent's own rules can lag or differ for another
// node's pod (its namespace not yet in the agent's view, a label just
// removed that its node has not acted on, nodes with other settings), and
// sending plaintext to a captured pod puts its traffic on the network
// unencrypted. HBONE to a pod that turns out not to be captured fails
// closed instead.
func (w *Workload) TakesHBONE() bool { return w.Enrolled || w.Redirected }

// Identity is the workload's SPIFFE ID in trustDomain.
func (w *Workload) Identity(trustDomain string) string {
	return "spiffe://" + trustDomain + "/ns/" + w.Namespace + "/sa/" + w.ServiceAccount
}

// Key identifies the pod to the loader and the tunnel: its uid, or
// namespace/name for a manifest pod without one.
func (w *Workload) Key() string {
	if w.UID != "" {
		return w.UID
	}
	return w.Namespace + "/" + w.Name
}

// String is namespace/name, for logs.
func (w *Workload) String() string { return w.Namespace + "/" + w.Name }

// Service is a Kubernetes Service or a ServiceEntry with its endpoints.
// Treat it as read-only.
type Service struct {
	Name      string
	Namespace string
	// Hostname is the name clients use: name.namespace.svc.<domain> for a
	// Kubernetes Service, the declared host of a ServiceEntry.
	Hostname string
	// VIPs are the virtual addresses; empty for a headless service.
	VIPs []netip.Addr
	// CIDRs are address ranges the service takes connections to (a
	// ServiceEntry's CIDR addresses): an address in one that is no VIP
	// and no workload's goes to the service (see
	// Directory.ServiceByVIPFor).
	CIDRs     []netip.Prefix
	Ports     []ServicePort
	Endpoints []Endpoint
	// Waypoint, if set, is where traffic to this service goes first.
	Waypoint *Waypoint
	// NamespaceOnly: only clients in the service's own namespace reach it
	// at its VIPs (a ServiceEntry exported to ".": istiod's visibility
	// NAMESPACE); for the others the VIPs are not its.
	NamespaceOnly bool
	// Contested marks a stand-in for a VIP that services claim and none
	// can be told the owner of (see the xDS source's sharedVIPs): it has
	// no ports and no endpoints, and connections to it are refused rather
	// than sent in plaintext to the address as if it were no service's.
	Contested bool
	// Rejected marks a Contested stand-in for a workload or service its
	// source rejected and holds no accepted version of (the xDS client
	// NACKed istiod's first version): its addresses are refused rather
	// than reached in plaintext as addresses of no workload.
	Rejected bool
	// NodeLocal: a client reaches only the endpoints on its own node
	// (Kubernetes' internalTrafficPolicy: Local), none if its node has
	// none, as kube-proxy routes it. The node agent keeps those (see
	// NodeLocalServices); the xDS source's istiod says so per node.
	NodeLocal bool
	// Routing, if set, prefers (or, Strict, requires) endpoints sharing
	// the client's locality.
	Routing *Routing
}

// NodeLocalServices returns services as clients on node reach them: a
// NodeLocal service with only its endpoints on node (a copy), the others
// as they are.
func NodeLocalServices(services []*Service, node string) []*Service {
	out := services
	cloned := false
	for i, s := range services {
		if !s.NodeLocal {
			continue
		}
		if !cloned {
			out, cloned = slices.Clone(services), true
		}
		c := *s
		c.Endpoints = slices.DeleteFunc(slices.Clone(s.Endpoints), func(ep Endpoint) bool { return ep.Node != node })
		out[i] = &c
	}
	return out
}

// ServicePort is one port of a service.
type ServicePort struct {
	Name string
	Port int32
	// TargetPort is the endpoints' port for this one, 0 meaning Port;
	// TargetPortName names a container port instead (Kubernetes' named
	// targetPort), resolved per endpoint.
	TargetPort     int32
	TargetPortName string
	// PerEndpoint: only the endpoints' own ports (Endpoint.Ports) say
	// where this port is served, and an endpoint without one does not
	// serve it. istiod sends a named targetPort as 0, without the name,
	// and resolves it per workload, leaving the port out for a pod with
	// no port of that name (as Kubernetes leaves such a pod out of the
	// port's endpoints; ztunnel skips it).
	PerEndpoint bool
	// Protocol is TCP, UDP or SCTP ("" means TCP); only TCP is meshed.
	Protocol string
	// AppProtocol is the declared application protocol, when known.
	AppProtocol string
}

// Endpoint is one address behind a service.
type Endpoint struct {
	Addr netip.Addr
	// Ports maps the service's port names to the port numbers on this
	// endpoint, where the source resolved them (EndpointSlices do; istiod
	// does per workload).
	Ports map[string]int32
	Ready bool
	// Node is the node the endpoint is on, where the source says (an
	// EndpointSlice's nodeName); NodeLocal services are served only by
	// endpoints of the client's node.
	Node string
	// Workload is the workload at Addr, or nil if it is not one we know.
	// NewDirectory fills it in.
	Workload *Workload
	// PodNamespace and PodName name the pod the endpoint is, where the
	// source says (an EndpointSlice endpoint's targetRef, the pod istiod
	// lists as the endpoint's workload).
	PodNamespace, PodName string
	// PodUID, if set, is the named pod's uid as the directory's workload
	// for it carries it: a workload of that namespace and name with
	// another uid is not the pod (istiod names pods of several clusters
	// alike).
	PodUID string
	// Unresolved says the endpoint names a pod the directory does not
	// know, or knows as meshed but not at Addr: the source has not seen
	// the pod (or its address) yet, as an EndpointSlice and its Pod are
	// watched apart. Such an endpoint may be a meshed pod, so it is not
	// dialled in plain TCP. It is also set, and Workload left nil, when
	// the directory gives Addr to another workload than the pod named (the
	// named pod left and its address was reused; two live pods claim the
	// address, and the other keeps it): such an endpoint is not dialled at
	// all. NewDirectory fills it in.
	Unresolved bool
	// Site stands in for Workload's locality where Workload is nil but
	// Node is known (a hostNetwork pod's endpoint, at its node's address,
	// which is no workload's): a workload on that node, whose region,
	// zone, subzone and cluster are the endpoint's. NewDirectory fills it
	// in; Routing.Rank reads it.
	Site *Workload
}

// TargetPort resolves the port ep serves a service port on: the
// endpoint's own port of the same name first (an EndpointSlice's already
// holds the resolved targetPort, istiod's per-workload map likewise), else
// a named targetPort among the endpoint workload's container ports, else
// the numeric targetPort (0: the service port) unless the port is served
// only where an endpoint says (PerEndpoint). Not ok: ep does not serve the
// port, or the port it names is no TCP port (see tcpPort).
func (ep Endpoint) TargetPort(port ServicePort) (uint16, bool) {
	if p, ok := ep.Ports[port.Name]; ok && p != 0 {
		return tcpPort(p)
	}
	if port.PerEndpoint {
		return 0, false
	}
	if port.TargetPortName != "" {
		if ep.Workload != nil {
			if p, ok := ep.Workload.ContainerPorts[port.TargetPortName]; ok && p != 0 {
				return tcpPort(p)
			}
		}
		return 0, false
	}
	if port.TargetPort != 0 {
		return tcpPort(port.TargetPort)
	}
	return tcpPort(port.Port)
}

// tcpPort is p as a port number, not ok outside 1-65535: cut to 16 bits,
// 65616 was port 80, so a number no port has sent connections to another.
func tcpPort(p int32) (uint16, bool) {
	if p < 1 || p > 65535 {
		return 0, false
	}
	return uint16(p), true
}

// Waypoint is a waypoint proxy: an address or a service hostname, and the
// port it takes HBONE on.
type Waypoint struct {
	Addr      netip.Addr
	Namespace string
	Hostname  string
	HBONEPort uint16
}

// ClusterHostname is a Kubernetes Service's DNS name in the cluster,
// name.namespace.svc.cluster.local.
func ClusterHostname(name, namespace string) string {
	return name + "." + namespace + ".svc.cluster.local"
}

// String is namespace/name, for logs.
func (s *Service) String() string { return s.Namespace + "/" + s.Name }
