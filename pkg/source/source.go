// Package source delivers the mesh state the agent acts on, in the
// project's own model: workloads, services with their endpoints, and mesh
// policies. Every source (a watched manifest file, the Kubernetes API,
// istiod's workload xDS) translates what it reads into it and hands out
// complete snapshots, so consumers diff desired against actual state
// instead of replaying events.
package source

import (
	"context"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Snapshot is the whole state a source knows at one moment. Consumers must
// treat it, and everything it points to, as read-only: it may be shared
// between them and with the source.
type Snapshot struct {
	// Workloads are every workload the source knows; this node's pods
	// among them carry their enrollment decision.
	Workloads []*workload.Workload
	// Services carry their endpoints (NewDirectory links them to
	// workloads by address).
	Services []*workload.Service
	// AmbientNamespaces are the namespaces labelled
	// istio.io/dataplane-mode=ambient, sorted: the CNI plugin's hint for
	// when the agent is down.
	AmbientNamespaces     []string
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
