// Package kubeobj is the Kubernetes side of the file and Kubernetes
// sources: the objects they read (namespaces, pods, services, endpoint
// slices, runtime classes, Istio policies) and their translation into the
// mesh model (pkg/workload, pkg/policy), where Istio ambient's selection
// rules decide each pod's enrollment. Nothing past this package sees a
// Kubernetes type.
package kubeobj

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	nodev1 "k8s.io/api/node/v1"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

// Objects is the whole state an object source read at one moment. Treat it
// as read-only: it may share memory with the source's cache.
type Objects struct {
	Namespaces     []corev1.Namespace
	Pods           []corev1.Pod
	Services       []corev1.Service
	EndpointSlices []discoveryv1.EndpointSlice
	// Nodes give their pods a locality (their topology labels), which
	// Services with a trafficDistribution rank endpoints by.
	Nodes []corev1.Node
	// RuntimeClasses map a pod's runtimeClassName to its handler, which
	// SKIP_RUNTIME_CLASSES names.
	RuntimeClasses        []nodev1.RuntimeClass
	PeerAuthentications   []policy.PeerAuthentication
	AuthorizationPolicies []policy.AuthorizationPolicy
}

// ObjectSource watches Kubernetes objects (a manifest file, the API server)
// and calls update with all of them after every change, with the same
// never-fail-open contract as source.Source.
type ObjectSource interface {
	Run(ctx context.Context, update func(Objects)) error
}

// HandlerLookup returns the RuntimeClass handler of a class name, from the
// objects' RuntimeClasses.
func (o Objects) HandlerLookup() func(className string) (string, bool) {
	handlers := make(map[string]string, len(o.RuntimeClasses))
	for _, rc := range o.RuntimeClasses {
		handlers[rc.Name] = rc.Handler
	}
	return func(className string) (string, bool) {
		h, ok := handlers[className]
		return h, ok
	}
}
