// Package workload is the directory the tunnel and the reconciler ask "who
// is at this address?" and "what is behind this service VIP?". A Directory is
// built from one source.Snapshot and never changes afterwards, so readers
// share it without locks; a Store swaps in the next one.
package workload

import (
	"net/netip"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// Workload is one pod as the mesh sees it. Treat it as read-only.
type Workload struct {
	Name      string
	Namespace string
	UID       string
	// ServiceAccount is "default" when the pod names none, as Kubernetes
	// would have it; it is the SPIFFE identity's last part.
	ServiceAccount string
	Node           string
	Addrs          []netip.Addr
	Labels         map[string]string
	// WorkloadName is the owning workload as Istio names it (the
	// Deployment, StatefulSet, ... ; see WorkloadMeta), WorkloadType
	// ztunnel's type for it (deployment, cronjob, job or pod), and
	// CanonicalName and CanonicalRevision the pod's canonical service (see
	// CanonicalService): the names Istio's telemetry groups by.
	WorkloadName      string
	WorkloadType      string
	CanonicalName     string
	CanonicalRevision string
	// Region and Zone are the pod's locality, when its source knows it
	// (istiod's xDS does; the agent's own sources read no Nodes).
	Region, Zone string
	// Enrolled, Reason and BypassInbound are the selection decision.
	Enrolled      bool
	Reason        string
	BypassInbound bool
	// ContainerPorts maps named container ports to their numbers, to
	// resolve a Service's named targetPort.
	ContainerPorts map[string]int32
}

// Identity is the workload's SPIFFE ID in trustDomain.
func (w *Workload) Identity(trustDomain string) string {
	return "spiffe://" + trustDomain + "/ns/" + w.Namespace + "/sa/" + w.ServiceAccount
}

// String is namespace/name, for logs.
func (w *Workload) String() string { return w.Namespace + "/" + w.Name }

// Service is a Kubernetes Service with its endpoints. Treat it as read-only.
type Service struct {
	Name      string
	Namespace string
	// VIPs are the cluster IPs; empty for a headless service.
	VIPs      []netip.Addr
	Ports     []ServicePort
	Endpoints []Endpoint
}

// ServicePort is one spec.ports entry.
type ServicePort struct {
	Name       string
	Port       int32
	TargetPort intstr.IntOrString
	Protocol   corev1.Protocol
}

// Endpoint is one address behind a service, from its EndpointSlices.
type Endpoint struct {
	Addr netip.Addr
	// Ports maps the slice's port names ("" for an unnamed port) to the
	// port numbers on this endpoint.
	Ports map[string]int32
	Ready bool
	// Workload is the pod at Addr, or nil if it is not a pod we know.
	Workload *Workload
}

// Hostname is the service's cluster DNS name, name.namespace.svc.<domain>;
// domain defaults to "cluster.local".
func (s *Service) Hostname(domain string) string {
	if domain == "" {
		domain = "cluster.local"
	}
	return s.Name + "." + s.Namespace + ".svc." + domain
}

// String is namespace/name, for logs.
func (s *Service) String() string { return s.Namespace + "/" + s.Name }
