package kubeobj

import (
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/pkg/selection"
)

// The Trim functions return a copy of an object with only the fields
// translation (Pod, Service, Endpoints, Translate) and the selection rules
// read, and the resourceVersion an informer's cache compares. A cluster-wide
// cache of 20k pods then holds names, labels, addresses and port names, not
// container specs, statuses, volumes and managed fields. They live here,
// next to the code that reads the fields, so the two change together
// (TestTrimmedTranslatesAlike checks they agree). They accept objects
// already trimmed, and return them unchanged.

// podAnnotations are the only annotations translation reads.
var podAnnotations = []string{
	selection.SidecarStatusAnnotation,
	selection.BypassInboundAnnotation,
	selection.RedirectionAnnotation,
}

// TrimPod keeps of pod what Pod reads: identity, labels, the annotations
// the selection rules and the redirection mark use, the controller
// reference (WorkloadMeta), node, service account, hostNetwork, runtime
// class, named container ports, phase and addresses.
func TrimPod(pod *corev1.Pod) *corev1.Pod {
	out := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID, ResourceVersion: pod.ResourceVersion,
			GenerateName: pod.GenerateName, Labels: pod.Labels, DeletionTimestamp: pod.DeletionTimestamp,
			Annotations: keep(pod.Annotations, podAnnotations...),
		},
		Spec: corev1.PodSpec{
			NodeName: pod.Spec.NodeName, ServiceAccountName: pod.Spec.ServiceAccountName,
			HostNetwork: pod.Spec.HostNetwork, RuntimeClassName: pod.Spec.RuntimeClassName,
			InitContainers: namedPortsOnly(pod.Spec.InitContainers),
			Containers:     namedPortsOnly(pod.Spec.Containers),
		},
		Status: corev1.PodStatus{Phase: pod.Status.Phase, PodIP: pod.Status.PodIP, PodIPs: pod.Status.PodIPs},
	}
	// WorkloadMeta follows the first controller reference only.
	for _, ref := range pod.OwnerReferences {
		if ref.Controller != nil && *ref.Controller {
			out.OwnerReferences = []metav1.OwnerReference{{Kind: ref.Kind, Name: ref.Name, Controller: ref.Controller}}
			break
		}
	}
	return out
}

// namedPortsOnly keeps the containers that have named ports, with those
// ports' names and numbers only (namedPorts reads nothing else).
func namedPortsOnly(cs []corev1.Container) []corev1.Container {
	var out []corev1.Container
	for _, c := range cs {
		var ports []corev1.ContainerPort
		for _, p := range c.Ports {
			if p.Name != "" {
				ports = append(ports, corev1.ContainerPort{Name: p.Name, ContainerPort: p.ContainerPort})
			}
		}
		if ports != nil {
			out = append(out, corev1.Container{Ports: ports})
		}
	}
	return out
}

// TrimService keeps of svc what Service reads: its cluster IPs and ports.
func TrimService(svc *corev1.Service) *corev1.Service {
	out := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: svc.Name, Namespace: svc.Namespace, UID: svc.UID, ResourceVersion: svc.ResourceVersion},
		Spec:       corev1.ServiceSpec{ClusterIP: svc.Spec.ClusterIP, ClusterIPs: svc.Spec.ClusterIPs},
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
// address type, each endpoint's first address (the one used) and ready
// condition, and the ports.
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
			out.Endpoints[i] = discoveryv1.Endpoint{Conditions: discoveryv1.EndpointConditions{Ready: ep.Conditions.Ready}}
			if len(ep.Addresses) > 0 {
				out.Endpoints[i].Addresses = ep.Addresses[:1:1]
			}
		}
	}
	return out
}

// TrimNamespace keeps of ns its name and the dataplane-mode label, all the
// selection rules and Translate read.
func TrimNamespace(ns *corev1.Namespace) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns.Name, UID: ns.UID, ResourceVersion: ns.ResourceVersion,
		Labels: keep(ns.Labels, selection.DataplaneModeLabel)}}
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
