// Package source delivers the cluster state the agent acts on: namespaces,
// pods, services, endpoint slices and mesh policies. Every source (a watched
// file, the Kubernetes API) hands out complete snapshots, so consumers diff
// desired against actual state instead of replaying events.
package source

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	nodev1 "k8s.io/api/node/v1"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

// Snapshot is the whole state a source knows at one moment. Consumers must
// treat it as read-only: it may be shared between them.
type Snapshot struct {
	Namespaces     []corev1.Namespace
	Pods           []corev1.Pod
	Services       []corev1.Service
	EndpointSlices []discoveryv1.EndpointSlice
	// RuntimeClasses map a pod's runtimeClassName to its handler, which
	// SKIP_RUNTIME_CLASSES names.
	RuntimeClasses        []nodev1.RuntimeClass
	PeerAuthentications   []policy.PeerAuthentication
	AuthorizationPolicies []policy.AuthorizationPolicy
	// Compiled, when set (the xDS source), is istiod's compiled
	// authorization, used instead of the two policy lists above.
	Compiled *policy.CompiledSet
}

// Source watches cluster state and calls update with a fresh snapshot after
// every change (and once at start). Run blocks until ctx is done or the source
// fails beyond repair.
//
// A source never fails open: what it cannot read in full (an unreachable API
// server, a failed list, a manifest with a parse error or cut short) it does
// not deliver, so the consumer keeps the last good snapshot, with every pod's
// enrollment and every policy. Such errors are logged and counted in Metrics;
// they never stop the source. What each source can and cannot detect is in
// its package documentation.
type Source interface {
	Run(ctx context.Context, update func(Snapshot)) error
}

// HandlerLookup returns the RuntimeClass handler of a class name, from the
// snapshot's RuntimeClasses.
func (s Snapshot) HandlerLookup() func(className string) (string, bool) {
	handlers := make(map[string]string, len(s.RuntimeClasses))
	for _, rc := range s.RuntimeClasses {
		handlers[rc.Name] = rc.Handler
	}
	return func(className string) (string, bool) {
		h, ok := handlers[className]
		return h, ok
	}
}
