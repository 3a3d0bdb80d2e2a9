package policy

import (
	"cmp"
	"iter"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// Compiled is an authorization policy in the form istiod compiles
// AuthorizationPolicy and PeerAuthentication into for ztunnel
// (istio.security.Authorization): what applies where is already decided
// (Scope, and per workload the policy keys the workload lists), and the
// rules are plain matches. A source translates the wire form into this
// type, so nothing here knows protobuf.
//
// Groups are OR-ed; the clauses of a group are AND-ed; the matches of a
// clause are OR-ed; within a match every field present must match, and
// the values of one field are OR-ed. A group without clauses matches every
// connection (an empty rule); a policy without groups matches none (an
// ALLOW policy with no rules admits nothing).
//
// Two shapes are ambiguous: a match with no condition (istiod sends one
// when every value of a from, to or when entry was dropped, and ztunnel
// skips it) and a clause with no match. Both are read the way that can
// only deny more: in an ALLOW they match nothing, in a DENY everything.
type Compiled struct {
	Name      string
	Namespace string
	Scope     Scope
	// Action is ActionAllow or ActionDeny.
	Action Action
	// DryRun policies are not enforced.
	DryRun bool
	Groups []Group
}

// Scope says which workloads a Compiled policy applies to.
type Scope int

// Scopes, as istiod sets them: a policy in the root namespace without a
// selector is global, one in another namespace without a selector applies
// to that namespace, and one with a selector applies to the workloads that
// list its key (namespace/name).
const (
	ScopeGlobal Scope = iota
	ScopeNamespace
	ScopeWorkloadSelector
)

// String names the scope as istiod's enum does, for logs.
func (s Scope) String() string {
	switch s {
	case ScopeGlobal:
		return "GLOBAL"
	case ScopeNamespace:
		return "NAMESPACE"
	case ScopeWorkloadSelector:
		return "WORKLOAD_SELECTOR"
	}
	return "Scope(" + strconv.Itoa(int(s)) + ")"
}

// Group is one rule of the original policy: all its clauses must match.
type Group struct {
	Clauses []Clause
}

// Clause matches if any of its matches does.
type Clause struct {
	Matches []Match
}

// Match is a conjunction of conditions on the connection. Empty fields
// are not checked.
type Match struct {
	Namespaces, NotNamespaces           []StringMatch
	ServiceAccounts, NotServiceAccounts []ServiceAccountRef
	Principals, NotPrincipals           []StringMatch
	SourceIPs, NotSourceIPs             []netip.Prefix
	DestinationIPs, NotDestinationIPs   []netip.Prefix
	DestinationPorts                    []uint16
	NotDestinationPorts                 []uint16
}

// StringMatchKind is how a StringMatch compares.
type StringMatchKind int

// String match kinds. Presence matches any non-empty value: for
// principals and namespaces, any authenticated peer (so NotPrincipals:
// [Presence] is istiod's way of saying "plaintext", which is how STRICT
// arrives).
const (
	MatchExact StringMatchKind = iota
	MatchPrefix
	MatchSuffix
	MatchPresence
)

// StringMatch is one value pattern.
type StringMatch struct {
	Kind  StringMatchKind
	Value string
}

// ServiceAccountRef names a service account in a namespace.
type ServiceAccountRef struct {
	Namespace, Name string
}

// Key is namespace/name, as workloads list the policies selecting them.
func (p *Compiled) Key() string { return p.Namespace + "/" + p.Name }

// AuthorizeCompiled decides whether src may connect to dst under compiled
// policies, as ztunnel does: the policies that apply are the global ones,
// those of dst's namespace with namespace scope, and those whose keys dst's
// workload lists (selected); dry-run policies are skipped. Any matching
// DENY denies; otherwise, if any ALLOW applies, one must match; with no
// ALLOW policy the connection is allowed.
func AuthorizeCompiled(ps []*Compiled, dst Target, selected []string, src Peer) Verdict {
	keys := make(map[string]bool, len(selected))
	for _, k := range selected {
		keys[k] = true
	}
	return decideCompiled(func(yield func(*Compiled) bool) {
		for _, p := range ps {
			if p.appliesTo(dst.Namespace, keys) && !yield(p) {
				return
			}
		}
	}, dst, src)
}

// decideCompiled decides a connection under ps, the policies that apply
// to its destination, in order.
func decideCompiled(ps iter.Seq[*Compiled], dst Target, src Peer) Verdict {
	c := newConn(dst, src)
	var allows []*Compiled
	for p := range ps {
		if p.DryRun {
			continue
		}
		if p.Action != ActionDeny {
			allows = append(allows, p)
			continue
		}
		if g, ok := p.matches(&c); ok {
			return Verdict{Reason: "denied by DENY policy " + p.Key() + " rule " + strconv.Itoa(g), Policy: p.Key()}
		}
	}
	if len(allows) == 0 {
		return Verdict{Allowed: true, Reason: "no ALLOW policy applies"}
	}
	var names applicableNames
	for _, p := range allows {
		if g, ok := p.matches(&c); ok {
			return Verdict{Allowed: true, Reason: "allowed by ALLOW policy " + p.Key() + " rule " + strconv.Itoa(g), Policy: p.Key()}
		}
		names.add(p.Key())
	}
	return Verdict{Reason: "no ALLOW policy matched (applicable: " + names.String() + ")"}
}

func (p *Compiled) appliesTo(namespace string, selected map[string]bool) bool {
	switch p.Scope {
	case ScopeGlobal:
		return true
	case ScopeNamespace:
		return p.Namespace == namespace
	default:
		return selected[p.Key()]
	}
}

// matches returns the index of the first group that matches c.
func (p *Compiled) matches(c *conn) (int, bool) {
	deny := p.Action == ActionDeny
	for i := range p.Groups {
		if groupMatches(&p.Groups[i], deny, c) {
			return i, true
		}
	}
	return 0, false
}

// groupMatches: deny says how to read the ambiguous shapes (see Compiled).
func groupMatches(g *Group, deny bool, c *conn) bool {
	for i := range g.Clauses {
		ms := g.Clauses[i].Matches
		if len(ms) == 0 {
			if deny {
				continue
			}
			return false
		}
		if !slices.ContainsFunc(ms, func(m Match) bool {
			if m.empty() {
				return deny
			}
			return m.matches(c)
		}) {
			return false
		}
	}
	return true
}

// empty reports a match without any condition.
func (m *Match) empty() bool {
	return len(m.Namespaces)+len(m.NotNamespaces)+len(m.ServiceAccounts)+len(m.NotServiceAccounts)+
		len(m.Principals)+len(m.NotPrincipals)+len(m.SourceIPs)+len(m.NotSourceIPs)+
		len(m.DestinationIPs)+len(m.NotDestinationIPs)+len(m.DestinationPorts)+len(m.NotDestinationPorts) == 0
}

func (m *Match) matches(c *conn) bool {
	return matchAny(m.Namespaces, m.NotNamespaces, func(s StringMatch) bool { return s.matches(c.namespace) }) &&
		matchAny(m.Principals, m.NotPrincipals, func(s StringMatch) bool { return s.matches(c.principal) }) &&
		matchAny(m.ServiceAccounts, m.NotServiceAccounts, func(r ServiceAccountRef) bool {
			return c.serviceAccount != "" && r.Namespace == c.namespace && r.Name == c.serviceAccount
		}) &&
		matchAny(m.SourceIPs, m.NotSourceIPs, func(p netip.Prefix) bool { return c.src.IsValid() && p.Contains(c.src) }) &&
		matchAny(m.DestinationIPs, m.NotDestinationIPs, func(p netip.Prefix) bool { return c.dst.IsValid() && p.Contains(c.dst) }) &&
		matchAny(m.DestinationPorts, m.NotDestinationPorts, func(p uint16) bool { return p == c.port })
}

// matchAny: some of pos (if any) and none of neg.
func matchAny[T any](pos, neg []T, match func(T) bool) bool {
	if len(pos) > 0 && !slices.ContainsFunc(pos, match) {
		return false
	}
	return !slices.ContainsFunc(neg, match)
}

// matches compares v; an empty value (no identity) matches nothing.
func (s StringMatch) matches(v string) bool {
	if v == "" {
		return false
	}
	switch s.Kind {
	case MatchPresence:
		return true
	case MatchPrefix:
		return strings.HasPrefix(v, s.Value)
	case MatchSuffix:
		return strings.HasSuffix(v, s.Value)
	default:
		return s.Value == v
	}
}

// SortCompiled orders policies by key, so evaluation and dumps do not
// depend on arrival order.
func SortCompiled(ps []*Compiled) {
	slices.SortFunc(ps, func(a, b *Compiled) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
}

// CompiledSet is everything a control plane (istiod) said about
// authorization: the policies, and per workload (namespace/name) the keys
// of the workload-selector policies that select it. The tunnel uses it in
// place of the hand-written policy types when a source delivers one.
type CompiledSet struct {
	// Synced is false until the control plane's first answer: then
	// nothing is known about STRICT or DENY policies, and every inbound
	// connection is refused rather than admitted on a guess.
	Synced   bool
	Policies []*Compiled
	// Selected maps namespace/name of a workload to its policy keys.
	Selected map[string][]string
	// Unknown maps namespace/name of a workload whose selection is not
	// known (the control plane has not described it, or described it
	// ambiguously) to why: its workload-selector policies, a DENY among
	// them maybe, cannot be applied, so connections to it are refused.
	Unknown map[string]string
	// Unresolved names policies the control plane sent that could not be
	// held in any form (not decodable, an unknown scope, over a limit):
	// whom they apply to is unknown, so every connection is refused while
	// there are any.
	Unresolved []string
}

// ConvertedPeerAuthn reports whether name is one istiod gives the
// policies it converts PeerAuthentications into: DENY rules that each
// match only a peer without mTLS. istiod names them
// converted_peer_authentication_<name> (model.GetAmbientPolicyConfigName)
// and its static STRICT policy istio_converted_static_strict; '_' is not
// allowed in a Kubernetes name, so no AuthorizationPolicy takes either.
func ConvertedPeerAuthn(name string) bool {
	return strings.HasPrefix(name, "converted_peer_authentication_") || strings.HasPrefix(name, "istio_converted_")
}

// Authorize decides a connection to the workload namespace/name (see
// AuthorizeCompiled). Whatever the set cannot decide exactly fails closed:
// an unresolved policy, a workload whose selection is unknown, or a
// selected policy the set does not hold.
//
// It indexes the set first, as much work as deciding every connection
// against it used to be: a caller deciding many connections against one
// set keeps an Index of it (NewIndex) instead.
func (s *CompiledSet) Authorize(dst Target, workload string, src Peer) Verdict {
	return NewIndex(s, nil, nil, "").Authorize(dst, workload, src)
}

// authorize is Authorize with the set's policies indexed by x.
func (s *CompiledSet) authorize(x *Index, dst Target, workload string, src Peer) Verdict {
	if !s.Synced {
		return Verdict{Reason: "no policies from the control plane yet (fails closed)"}
	}
	if len(s.Unresolved) > 0 {
		return Verdict{Reason: "policies from the control plane could not be applied, scope unknown (fails closed): " + strings.Join(s.Unresolved, ", "), Policy: s.Unresolved[0]}
	}
	if why, ok := s.Unknown[workload]; ok {
		return Verdict{Reason: "policies selecting " + workload + " are unknown (fails closed): " + why}
	}
	selected := s.Selected[workload]
	for _, k := range selected {
		if x.holds(k) {
			continue
		}
		_, name, _ := strings.Cut(k, "/")
		if ConvertedPeerAuthn(name) && src.Authenticated {
			// istiod's conversion of a PeerAuthentication only ever
			// denies peers without mTLS, and istiod lists some such
			// policy it never sends (a workload PERMISSIVE with a STRICT
			// port under a STRICT mesh policy): ztunnel skips it. Failing
			// closed for an mTLS peer would refuse the pod's every
			// connection; plaintext ones stay refused.
			continue
		}
		return Verdict{Reason: "policy " + k + " selects " + workload + " but was not received or not applied (fails closed)", Policy: k}
	}
	return decideCompiled(x.applicableCompiled(dst.Namespace, selected), dst, src)
}
