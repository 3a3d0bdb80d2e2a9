package workload

import "cmp"

// Scope is one level of where a workload runs that a client and a
// service endpoint may share: istiod's load_balancing scopes.
type Scope uint8

const (
	ScopeRegion Scope = iota + 1
	ScopeZone
	ScopeSubzone
	ScopeNode
	ScopeCluster
	ScopeNetwork
)

// String is the scope as ztunnel's config dump names it.
func (s Scope) String() string {
	switch s {
	case ScopeRegion:
		return "Region"
	case ScopeZone:
		return "Zone"
	case ScopeSubzone:
		return "Subzone"
	case ScopeNode:
		return "Node"
	case ScopeCluster:
		return "Cluster"
	case ScopeNetwork:
		return "Network"
	}
	return "Unknown"
}

// Routing is a service's preference for endpoints close to the client
// (istiod's load_balancing, which it derives from a Service's
// trafficDistribution: PreferClose ranks by network, region and zone,
// PreferSameNode down to the node). Endpoints are ranked by Rank. Without
// Strict (mode FAILOVER) the best-ranked endpoints serve, and the next
// rank takes over where none of those can (see the tunnel's balancer);
// with Strict only endpoints sharing every scope serve, none if there is
// no such endpoint.
type Routing struct {
	Scopes []Scope
	Strict bool
}

// noLocality stands in for an endpoint's unknown workload.
var noLocality Workload

// Rank is how many of r's scopes, in order, ep shares with the client:
// counting stops at the first scope not shared, so a zone counts only
// within a shared region, as ztunnel ranks. The network is always shared:
// the sources keep only endpoints on the agent's own network. An endpoint
// that is no known workload has its node's locality (Site), as a
// hostNetwork pod's, which istiod ranks by its workload; failing that,
// none: it shares a scope only with a client that has none either.
func (r *Routing) Rank(client *Workload, ep Endpoint) int {
	w := cmp.Or(ep.Workload, ep.Site, &noLocality)
	node := ep.Node
	if node == "" {
		node = w.Node
	}
	rank := 0
	for _, s := range r.Scopes {
		var shared bool
		switch s {
		case ScopeRegion:
			shared = client.Region == w.Region
		case ScopeZone:
			shared = client.Zone == w.Zone
		case ScopeSubzone:
			shared = client.Subzone == w.Subzone
		case ScopeNode:
			shared = client.Node == node
		case ScopeCluster:
			shared = client.Cluster == w.Cluster
		case ScopeNetwork:
			shared = true
		}
		if !shared {
			break
		}
		rank++
	}
	return rank
}
