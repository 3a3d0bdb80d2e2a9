package kubeobj

import (
	"slices"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/redirector-mesh/redirector/pkg/selection"
)

// NewCompactPod and the Trim functions keep of an object only the fields
// translation (Pod, Service, Endpoints, Translate) and the selection rules
// read, and the resourceVersion an informer's cache compares. A cluster-wide
// cache of 20k pods then holds names, labels, addresses and port names, not
// container specs, statuses, volumes and managed fields. They live here,
// next to the code that reads the fields, so the two change together
// (TestTrimmedTranslatesAlike checks they agree). Trimming a trimmed object
// changes nothing.

// podAnnotations are the only annotations translation reads.
var podAnnotations = []string{
	selection.SidecarStatusAnnotation,
	selection.BypassInboundAnnotation,
	selection.DNSCaptureAnnotation,
	selection.RedirectionAnnotation,
	MirrorPodAnnotation,
}

// CompactPod is what the Kubernetes source caches of a pod: the fields
// Pod reads (identity, labels, the annotations the selection rules and the
// redirection mark use, the controller reference WorkloadMeta follows,
// node, service account, hostNetwork, runtime class, named container
// ports, phase and addresses), in about a quarter of a corev1.Pod's memory
// (a corev1.Pod struct alone is 1.2 kB, each container 400 bytes more).
// It is a metav1.Object, so informer stores and indexes key it as the pod.
type CompactPod struct {
	metav1.ObjectMeta
	NodeName           string
	ServiceAccountName string
	HostNetwork        bool
	RuntimeClassName   *string
	// NamedPorts are the ports a named targetPort may name (targetPorts).
	NamedPorts []corev1.ContainerPort
	Phase      corev1.PodPhase
	PodIP      string
	PodIPs     []corev1.PodIP
}

// NewCompactPod keeps of pod what Pod reads.
func NewCompactPod(pod *corev1.Pod) *CompactPod {
	c := &CompactPod{
		ObjectMeta: metav1.ObjectMeta{
			Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID, ResourceVersion: pod.ResourceVersion,
			GenerateName: pod.GenerateName, Labels: pod.Labels, DeletionTimestamp: pod.DeletionTimestamp,
			Annotations: keep(pod.Annotations, podAnnotations...),
		},
		NodeName: pod.Spec.NodeName, ServiceAccountName: pod.Spec.ServiceAccountName,
		HostNetwork: pod.Spec.HostNetwork, RuntimeClassName: pod.Spec.RuntimeClassName,
		Phase: pod.Status.Phase, PodIP: pod.Status.PodIP, PodIPs: pod.Status.PodIPs,
	}
	c.NamedPorts = targetPorts(pod)
	// WorkloadMeta follows the first controller reference only.
	for _, ref := range pod.OwnerReferences {
		if ref.Controller != nil && *ref.Controller {
			c.OwnerReferences = []metav1.OwnerReference{{Kind: ref.Kind, Name: ref.Name, Controller: ref.Controller}}
			break
		}
	}
	return c
}

// Pod returns the pod as Pod reads it: a new corev1.Pod holding the kept
// fields (sharing their maps and slices: treat it as read-only).
func (c *CompactPod) Pod() *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: c.ObjectMeta,
		Spec: corev1.PodSpec{NodeName: c.NodeName, ServiceAccountName: c.ServiceAccountName,
			HostNetwork: c.HostNetwork, RuntimeClassName: c.RuntimeClassName},
		Status: corev1.PodStatus{Phase: c.Phase, PodIP: c.PodIP, PodIPs: c.PodIPs},
	}
	if c.NamedPorts != nil {
		p.Spec.Containers = []corev1.Container{{Ports: c.NamedPorts}}
	}
	return p
}

// GetObjectKind implements runtime.Object (a CompactPod carries no kind).
func (c *CompactPod) GetObjectKind() schema.ObjectKind { return schema.EmptyObjectKind }

// DeepCopyObject implements runtime.Object.
func (c *CompactPod) DeepCopyObject() runtime.Object {
	out := *c
	c.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	if c.RuntimeClassName != nil {
		out.RuntimeClassName = new(*c.RuntimeClassName)
	}
	out.NamedPorts = slices.Clone(c.NamedPorts)
	out.PodIPs = slices.Clone(c.PodIPs)
	return &out
}

// TrimService keeps of svc what Service, Routing and the waypoint rules
// read: its cluster IPs, ports, internal traffic policy, traffic
// distribution (field and annotation) and waypoint labels.
func TrimService(svc *corev1.Service) *corev1.Service {
	out := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: svc.Name, Namespace: svc.Namespace, UID: svc.UID, ResourceVersion: svc.ResourceVersion,
			Labels: keep(svc.Labels, WaypointLabels...), Annotations: keepDistribution(svc.Annotations)},
		Spec: corev1.ServiceSpec{ClusterIP: svc.Spec.ClusterIP, ClusterIPs: svc.Spec.ClusterIPs, InternalTrafficPolicy: svc.Spec.InternalTrafficPolicy,
			TrafficDistribution: svc.Spec.TrafficDistribution},
	}
	if svc.Spec.Ports != nil {
		out.Spec.Ports = make([]corev1.ServicePort, len(svc.Spec.Ports))
		for i, p := range svc.Spec.Ports {
			out.Spec.Ports[i] = corev1.ServicePort{Name: p.Name, Port: p.Port, Protocol: p.Protocol, AppProtocol: p.AppProtocol, TargetPort: p.TargetPort}
		}
	}
	return out
}

// TrimEndpointSlice keeps of es what Endpoints reads: its service label,
// address type, each endpoint's first address (the one used), ready
// condition, node and pod (targetRef), and the ports.
func TrimEndpointSlice(es *discoveryv1.EndpointSlice) *discoveryv1.EndpointSlice {
	out := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: es.Name, Namespace: es.Namespace, UID: es.UID, ResourceVersion: es.ResourceVersion,
			Labels: keep(es.Labels, discoveryv1.LabelServiceName)},
		AddressType: es.AddressType,
		Ports:       es.Ports,
	}
	if es.Endpoints != nil {
		out.Endpoints = make([]discoveryv1.Endpoint, len(es.Endpoints))
		for i, ep := range es.Endpoints {
			out.Endpoints[i] = discoveryv1.Endpoint{Conditions: discoveryv1.EndpointConditions{Ready: ep.Conditions.Ready}, NodeName: ep.NodeName}
			if r := ep.TargetRef; r != nil && r.Kind == "Pod" {
				// The slice's namespace is the pod's when the reference
				// names none (Endpoints): not kept twice.
				ref := &corev1.ObjectReference{Kind: "Pod", Namespace: r.Namespace, Name: r.Name}
				if ref.Namespace == es.Namespace {
					ref.Namespace = ""
				}
				out.Endpoints[i].TargetRef = ref
			}
			if len(ep.Addresses) > 0 {
				out.Endpoints[i].Addresses = ep.Addresses[:1:1]
			}
		}
	}
	return out
}

// TrimNamespace keeps of ns its name, the dataplane-mode label, the
// waypoint labels and the traffic-distribution annotation, all the
// selection, waypoint and routing rules read.
func TrimNamespace(ns *corev1.Namespace) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns.Name, UID: ns.UID, ResourceVersion: ns.ResourceVersion,
		Labels:      keep(ns.Labels, append([]string{selection.DataplaneModeLabel}, WaypointLabels...)...),
		Annotations: keepDistribution(ns.Annotations)}}
}

// TrimNodeMeta keeps of a Node's metadata (the Kubernetes source watches
// no more of Nodes) its name and locality labels, all translation reads
// of a Node.
func TrimNodeMeta(n *metav1.PartialObjectMetadata) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{TypeMeta: n.TypeMeta, ObjectMeta: metav1.ObjectMeta{Name: n.Name, UID: n.UID, ResourceVersion: n.ResourceVersion,
		Labels: keep(n.Labels, localityLabels...)}}
}

// keepDistribution returns of m the traffic-distribution annotation, as
// much of it as Routing reads (a tenant's value may be 256 KiB, and the
// Kubernetes source caches every Service on every node).
func keepDistribution(m map[string]string) map[string]string {
	out := keep(m, TrafficDistributionAnnotation)
	if v, ok := out[TrafficDistributionAnnotation]; ok && clipDistribution(v) != v {
		out = map[string]string{TrafficDistributionAnnotation: clipDistribution(v)}
	}
	return out
}

// keep returns the entries of m under keys (nil if none; m itself if it
// has nothing else).
func keep(m map[string]string, keys ...string) map[string]string {
	var out map[string]string
	for _, k := range keys {
		if v, ok := m[k]; ok {
			if out == nil {
				out = make(map[string]string, len(keys))
			}
			out[k] = v
		}
	}
	if len(out) == len(m) {
		return m
	}
	return out
}

// DropManagedFields strips metadata.managedFields before objects enter an informer's cache
// (a cache.TransformFunc): nothing here reads them, and they are a large part of every
// object's memory.
func DropManagedFields(obj any) (any, error) {
	if m, err := meta.Accessor(obj); err == nil {
		m.SetManagedFields(nil)
	}
	return obj, nil
}
