package kubeobj

import (
	"cmp"
	"fmt"
	"maps"
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Translate turns objs into the mesh model, deciding each pod's enrollment
// with cfg (see selection.Decide). Objects it cannot use are left out and
// reported in the returned errors, each naming the object: pods and
// services with malformed addresses and unusable endpoint addresses; pods
// whose RuntimeClass is unknown or whose address cannot be a pod's stay
// in, not enrolled, with the error. A pod left out for a malformed address
// (*selection.PodAddrError) is a malformed object, not a pod that left:
// a source keeps its last good version (LastGood) or refuses the objects.
func Translate(objs Objects, cfg selection.Config) (source.Snapshot, []error) {
	snap := source.Snapshot{
		PeerAuthentications:   objs.PeerAuthentications,
		AuthorizationPolicies: objs.AuthorizationPolicies,
		Workloads:             make([]*workload.Workload, 0, len(objs.Pods)),
		Services:              make([]*workload.Service, 0, len(objs.Services)),
	}
	var errs []error
	namespaces := make(map[string]*corev1.Namespace, len(objs.Namespaces))
	for i := range objs.Namespaces {
		ns := &objs.Namespaces[i]
		namespaces[ns.Name] = ns
		if ns.Labels[selection.DataplaneModeLabel] == selection.DataplaneModeAmbient {
			snap.AmbientNamespaces = append(snap.AmbientNamespaces, ns.Name)
		}
	}
	slices.Sort(snap.AmbientNamespaces)
	localities := make(map[string]Locality, len(objs.Nodes))
	for i := range objs.Nodes {
		localities[objs.Nodes[i].Name] = NodeLocality(objs.Nodes[i].Labels)
	}
	lookup := objs.HandlerLookup()
	for i := range objs.Pods {
		pod := &objs.Pods[i]
		w, err := Pod(cfg, namespaces[pod.Namespace], pod, lookup)
		if err != nil {
			errs = append(errs, err)
		}
		if w != nil {
			localities[w.Node].Set(w)
			snap.Workloads = append(snap.Workloads, w)
		}
	}
	byName := make(map[string]*workload.Service, len(objs.Services))
	for i := range objs.Services {
		svc := &objs.Services[i]
		s, err := Service(svc)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if s.Routing, err = Routing(svc, namespaces[svc.Namespace]); err != nil {
			errs = append(errs, err)
		}
		snap.Services = append(snap.Services, s)
		byName[s.String()] = s
	}
	errs = append(errs, addEndpoints(byName, objs.EndpointSlices)...)
	addWaypoints(&snap, objs, namespaces)
	return snap, errs
}

// Pod translates one pod, deciding its enrollment. The error is a
// malformed address (a *selection.PodAddrError: the pod is left out, w is
// nil, and the caller should keep what it had of the pod) or a selection
// problem (the pod stays, not enrolled).
func Pod(cfg selection.Config, ns *corev1.Namespace, pod *corev1.Pod, lookup selection.HandlerLookup) (*workload.Workload, error) {
	addrs, err := selection.PodAddrs(pod)
	if err != nil {
		return nil, err
	}
	// A hostNetwork pod's addresses are the node's, and a finished pod's
	// may already belong to a new pod: neither is the pod's to index.
	if pod.Spec.HostNetwork || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		addrs = nil
	}
	// Nor is an address of no one host (Decide leaves such a pod out of
	// the mesh): indexed, 169.254.169.254 was the pod's, and a pod there
	// with a waypoint label took every meshed pod's connections to the
	// cloud metadata server to its waypoint. The xDS source rejects such
	// a workload.
	addrs = slices.DeleteFunc(addrs, func(a netip.Addr) bool { return selection.CheckPodAddr(a) != nil })
	dec := selection.Decide(cfg, ns, pod, lookup)
	w := &workload.Workload{
		Name:           pod.Name,
		Namespace:      pod.Namespace,
		UID:            PodUID(pod),
		ServiceAccount: cmp.Or(pod.Spec.ServiceAccountName, "default"),
		Node:           pod.Spec.NodeName,
		Addrs:          addrs,
		Labels:         pod.Labels,
		Enrolled:       dec.Enrolled,
		Reason:         dec.Reason,
		BypassInbound:  dec.BypassInbound,
		DNSCapture:     dec.DNSCapture,
		Pending:        dec.Pending,
		Undecided:      dec.Undecided,
		Redirected:     pod.Annotations[selection.RedirectionAnnotation] == "enabled",
		Terminating:    pod.DeletionTimestamp != nil,
		ContainerPorts: namedPorts(pod),
	}
	w.WorkloadName, _, w.WorkloadType = WorkloadMeta(pod)
	w.CanonicalName, w.CanonicalRevision = workload.CanonicalService(pod.Labels, w.WorkloadName)
	return w, dec.Err
}

// MirrorPodAnnotation marks a mirror pod: the API's copy of a static pod,
// which the kubelet runs from a file. Its value is the static pod's hash.
const MirrorPodAnnotation = "kubernetes.io/config.mirror"

// PodUID is the UID the agent keys pod by: its own, except for a mirror pod,
// which gets none (so it is keyed by namespace/name, as Istio matches pods).
// The API server gives a mirror pod a UID of its own, while the kubelet, the
// runtime, the CNI plugin (K8S_POD_UID) and the pod's cgroup know the static
// pod by another, its hash: matched against the API's, the static pod's CNI
// ADD was taken for an earlier pod of its name, and the pod never started.
// The annotation's value is not taken as the UID: anyone who may create a
// pod can write it, so it could be another pod's key.
func PodUID(pod *corev1.Pod) string {
	if _, ok := pod.Annotations[MirrorPodAnnotation]; ok {
		return ""
	}
	return string(pod.UID)
}

func namedPorts(pod *corev1.Pod) map[string]int32 {
	var ports map[string]int32
	for _, p := range targetPorts(pod) {
		if ports == nil {
			ports = map[string]int32{}
		}
		ports[p.Name] = p.ContainerPort
	}
	return ports
}

// targetPorts are the pod's ports a Service's named targetPort may name,
// found as Kubernetes' FindPort and istiod's FindPortName find them: named
// TCP ports, of the containers first, then of the sidecars (init
// containers restarted always); the first of a name only. An init
// container that runs to completion serves nothing, and a UDP or SCTP port
// is no target of a TCP service port (only TCP is meshed): until 8
// December both were taken, an init container's first, so one shadowed
// the app's port of its name, and either was dialled where Kubernetes said
// the pod serves no such port (its EndpointSlice leaves the port out,
// which is when the map is read, Endpoint.TargetPort).
func targetPorts(pod *corev1.Pod) []corev1.ContainerPort {
	var out []corev1.ContainerPort
	sidecars := slices.DeleteFunc(slices.Clone(pod.Spec.InitContainers), func(c corev1.Container) bool {
		return c.RestartPolicy == nil || *c.RestartPolicy != corev1.ContainerRestartPolicyAlways
	})
	for _, c := range slices.Concat(pod.Spec.Containers, sidecars) {
		for _, p := range c.Ports {
			if p.Name == "" || p.Protocol != "" && p.Protocol != corev1.ProtocolTCP ||
				slices.ContainsFunc(out, func(q corev1.ContainerPort) bool { return q.Name == p.Name }) {
				continue
			}
			out = append(out, corev1.ContainerPort{Name: p.Name, ContainerPort: p.ContainerPort})
		}
	}
	return out
}

// Service translates a Service, without endpoints.
func Service(svc *corev1.Service) (*workload.Service, error) {
	s := &workload.Service{Name: svc.Name, Namespace: svc.Namespace, Hostname: workload.ClusterHostname(svc.Name, svc.Namespace),
		NodeLocal: derefOr(svc.Spec.InternalTrafficPolicy, "") == corev1.ServiceInternalTrafficPolicyLocal}
	for _, f := range clusterIPs(svc) {
		if f.value == corev1.ClusterIPNone {
			continue
		}
		a, err := netip.ParseAddr(f.value)
		if err != nil || a.Zone() != "" {
			return nil, fmt.Errorf("service %s: %s: bad IP %q", s, f.name, f.value)
		}
		// A VIP of no one host (169.254.169.254, the cloud metadata
		// server, above all) would send every meshed pod's connections
		// to it to this service's endpoints. The API server never
		// allocates one; the xDS source refuses them too.
		if err := selection.CheckPodAddr(a); err != nil {
			return nil, fmt.Errorf("service %s: %s: bad IP %q: %w", s, f.name, f.value, err)
		}
		s.VIPs = append(s.VIPs, a.Unmap())
	}
	for _, p := range svc.Spec.Ports {
		sp := workload.ServicePort{Name: p.Name, Port: p.Port, Protocol: string(cmp.Or(p.Protocol, corev1.ProtocolTCP)), AppProtocol: derefOr(p.AppProtocol, "")}
		if p.TargetPort.Type == intstr.String {
			sp.TargetPortName = p.TargetPort.StrVal
		} else {
			sp.TargetPort = p.TargetPort.IntVal
		}
		s.Ports = append(s.Ports, sp)
	}
	return s, nil
}

// clusterIPs are the service's spec.clusterIPs, or spec.clusterIP when
// that list is empty, each with the field it is in.
func clusterIPs(svc *corev1.Service) []struct{ name, value string } {
	var out []struct{ name, value string }
	for i, ip := range svc.Spec.ClusterIPs {
		out = append(out, struct{ name, value string }{fmt.Sprintf("spec.clusterIPs[%d]", i), ip})
	}
	if len(out) == 0 && svc.Spec.ClusterIP != "" {
		out = append(out, struct{ name, value string }{"spec.clusterIP", svc.Spec.ClusterIP})
	}
	return out
}

// addEndpoints joins slices to services by the kubernetes.io/service-name
// label (SliceService), so services without a selector but with hand-made
// slices work too, and sets each service's endpoints (see Endpoints).
func addEndpoints(services map[string]*workload.Service, list []discoveryv1.EndpointSlice) []error {
	bySvc := map[*workload.Service][]*discoveryv1.EndpointSlice{}
	var order []*workload.Service // first seen first, so errors come in list order
	for i := range list {
		svc := services[SliceService(&list[i])]
		if svc == nil {
			continue
		}
		if bySvc[svc] == nil {
			order = append(order, svc)
		}
		bySvc[svc] = append(bySvc[svc], &list[i])
	}
	var errs []error
	for _, svc := range order {
		var sliceErrs []error
		svc.Endpoints, sliceErrs = Endpoints(bySvc[svc])
		errs = append(errs, sliceErrs...)
	}
	return errs
}

// SliceService is the namespace/name of the service an EndpointSlice
// belongs to, from its kubernetes.io/service-name label.
func SliceService(es *discoveryv1.EndpointSlice) string {
	return es.Namespace + "/" + es.Labels[discoveryv1.LabelServiceName]
}

// Endpoints translates the EndpointSlices of one service into its
// endpoints, sorted by address. An address in several slices (slices are
// cut by port set, and overlap while they are rebalanced) becomes one
// endpoint with the union of their ports, ready if any slice says so. FQDN
// slices are left out; an unusable address is left out and reported. The
// endpoints of one slice share one Ports map (copied on a merge): 20k
// endpoints cost the ports of their slices, not 20k maps.
func Endpoints(list []*discoveryv1.EndpointSlice) ([]workload.Endpoint, []error) {
	var errs []error
	type merging struct {
		e   *workload.Endpoint
		own bool // e.Ports is e's own, not its first slice's shared map
	}
	merged := map[netip.Addr]*merging{}
	for _, es := range list {
		if es.AddressType == discoveryv1.AddressTypeFQDN {
			continue
		}
		ports := make(map[string]int32, len(es.Ports))
		for _, p := range es.Ports {
			if p.Port == nil {
				continue
			}
			// The API server checks no slice's port numbers. One no
			// port has stays in the map, so that no endpoint of the
			// slice serves it (workload.Endpoint.TargetPort): cut to 16
			// bits it was another port.
			if n := *p.Port; n < 1 || n > 65535 {
				errs = append(errs, fmt.Errorf("endpointslice %s/%s: port %q: %d is not a port number (1-65535); not served", es.Namespace, es.Name, derefOr(p.Name, ""), n))
			}
			ports[derefOr(p.Name, "")] = *p.Port
		}
		for _, ep := range es.Endpoints {
			if len(ep.Addresses) == 0 {
				continue
			}
			// Addresses of one endpoint are fungible; the API lets
			// consumers use the first.
			a, err := netip.ParseAddr(ep.Addresses[0])
			if err != nil || a.Zone() != "" {
				errs = append(errs, fmt.Errorf("endpointslice %s/%s: bad address %q", es.Namespace, es.Name, ep.Addresses[0]))
				continue
			}
			// An address of no one host (loopback, link-local such as
			// the metadata server's, unspecified, multicast), which the
			// API server refuses and the xDS source rejects: the tunnel
			// would dial it from the client pod.
			if err := selection.CheckPodAddr(a); err != nil {
				errs = append(errs, fmt.Errorf("endpointslice %s/%s: %w", es.Namespace, es.Name, err))
				continue
			}
			a = a.Unmap()
			m := merged[a]
			if m == nil {
				m = &merging{e: &workload.Endpoint{Addr: a, Ports: ports, Node: derefOr(ep.NodeName, "")}}
				if r := ep.TargetRef; r != nil && r.Kind == "Pod" && r.Name != "" {
					m.e.PodNamespace, m.e.PodName = cmp.Or(r.Namespace, es.Namespace), r.Name
				}
				merged[a] = m
			} else {
				if !m.own {
					m.e.Ports, m.own = maps.Clone(m.e.Ports), true
				}
				maps.Copy(m.e.Ports, ports)
			}
			// A nil ready condition means unknown, which the API says
			// to treat as ready.
			m.e.Ready = m.e.Ready || ep.Conditions.Ready == nil || *ep.Conditions.Ready
		}
	}
	if len(merged) == 0 {
		return nil, errs
	}
	out := make([]workload.Endpoint, 0, len(merged))
	for _, m := range merged {
		out = append(out, *m.e)
	}
	slices.SortFunc(out, func(a, b workload.Endpoint) int { return a.Addr.Compare(b.Addr) })
	return out, errs
}

func derefOr[T any](p *T, def T) T {
	if p == nil {
		return def
	}
	return *p
}
