package policy

import (
	"iter"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// Target is the destination of a connection: the pod being reached.
type Target struct {
	Namespace string
	Labels    map[string]string
	Port      uint16
	// Addr is the pod address the client dialled. Only `when` conditions on
	// destination.ip read it; leave it zero if unknown and such conditions
	// will not match.
	Addr netip.Addr
}

// Peer is the source of a connection.
type Peer struct {
	// Principal is the verified SPIFFE ID without the spiffe:// prefix, as
	// Istio writes principals: "cluster.local/ns/shop/sa/web" (a leading
	// spiffe:// is tolerated and dropped).
	Principal string
	// Namespace is the namespace of the verified identity; if empty it is
	// read from Principal.
	Namespace string
	// Addr is the source address; an IPv4-mapped IPv6 address is treated as
	// the IPv4 address it carries.
	Addr netip.Addr
	// Authenticated is true when the connection arrived over mTLS and
	// Principal is verified. When false, Principal and Namespace are
	// ignored: principals, namespaces and serviceAccounts never match and
	// their not- forms always do (as in ztunnel).
	Authenticated bool
}

// Verdict is the outcome of Authorize.
type Verdict struct {
	Allowed bool
	// Reason says why, for logs and metrics labels.
	Reason string
	// Policy is "namespace/name" of the policy that decided, or "" when
	// no single policy did (no policy applies, or no ALLOW matched).
	Policy string
}

// l4WhenKeys are the `when` keys a node tunnel can decide, as in ztunnel.
var l4WhenKeys = []string{"source.ip", "source.namespace", "source.principal", "destination.ip", "destination.port"}

// Authorize decides whether src may connect to dst, with Istio's
// AuthorizationPolicy semantics as the node's L4 proxy (ztunnel) applies
// them.
//
// Which policies apply: those in rootNamespace ("" means istio-system),
// whose selector matches dst's labels in any namespace, and those in
// dst.Namespace whose selector matches (no selector: every pod there). A
// pod with no labels is matched by every selector, as istiod attaches
// every selector policy of those namespaces to it.
// Policies with targetRef(s) belong to waypoints and gateways, and AUDIT
// and CUSTOM are not enforced at L4; all three are skipped. So are
// dry-run policies (annotation istio.io/dry-run true, see DryRun), which
// istiod does not hand ztunnel to enforce. An ALLOW policy whose selector
// is present but has no labels (`selector: {}`) is skipped too: istiod
// gives it workload-selector scope and no workload lists it, so ztunnel
// never applies it; applying it here could admit what the other ALLOW
// policies of a pod do not. A DENY policy with such a selector denies
// in the whole scope instead, as the author can have meant: denying more
// than ztunnel is safe, less is not.
//
// Order: if any applicable DENY rule matches, deny. Otherwise, if any ALLOW
// policy applies, allow only if one of its rules matches. Otherwise allow.
// A rule matches when each of from (any entry), to (any entry) and every
// when condition matches; within an entry every field present must match.
//
// Fields only an L7 proxy can decide (hosts, methods, paths, their not-
// forms, requestPrincipals, remoteIpBlocks, when keys other than
// source.ip/namespace/principal and destination.ip/port), and
// trustDomains/notTrustDomains, which istiod leaves out of ztunnel's
// policies, are handled so that not enforcing them can only deny more,
// never allow more: an ALLOW
// rule using any of them never matches; a DENY rule is applied as if they
// were absent (a DENY whose only conditions are L7 then denies everything it
// selects). ztunnel states the same intent; note that ztunnel 1.30 in fact
// lets such an L7-only DENY rule match nothing, which this code does not
// copy.
//
// Invalid policies (see Validate) fail closed: an invalid DENY policy, or
// one with an unknown action, denies everything it selects; an invalid
// ALLOW policy still counts as an applicable ALLOW but admits nothing.
func Authorize(aps []AuthorizationPolicy, rootNamespace string, dst Target, src Peer) Verdict {
	return authorize(func(yield func(*AuthorizationPolicy) bool) {
		for i := range aps {
			if !yield(&aps[i]) {
				return
			}
		}
	}, rootNamespace, dst, src)
}

// authorize is Authorize over aps in order; an Index passes only the
// policies of the root namespace and dst's.
func authorize(aps iter.Seq[*AuthorizationPolicy], rootNamespace string, dst Target, src Peer) Verdict {
	if rootNamespace == "" {
		rootNamespace = DefaultRootNamespace
	}
	c := newConn(dst, src)

	var allows []*AuthorizationPolicy
	for ap := range aps {
		if notEnforced(ap) || !appliesTo(ap, rootNamespace, dst) {
			continue
		}
		switch ap.Spec.Action {
		case ActionAudit, ActionCustom:
			continue
		case "", ActionAllow:
			allows = append(allows, ap)
			continue
		}
		// DENY, or an unknown action, which is read as DENY everything.
		if err := validate(ap); err != nil {
			return Verdict{Reason: "denied by an invalid policy (fails closed): " + err.Error(), Policy: key(ap)}
		}
		for r := range ap.Spec.Rules {
			if ruleMatches(&ap.Spec.Rules[r], ActionDeny, ap.Namespace, &c) {
				return Verdict{Reason: "denied by DENY policy " + key(ap) + " rule " + strconv.Itoa(r), Policy: key(ap)}
			}
		}
	}

	if len(allows) == 0 {
		return Verdict{Allowed: true, Reason: "no ALLOW policy applies"}
	}
	var names applicableNames
	for _, ap := range allows {
		if validate(ap) != nil {
			names.add(key(ap) + " (invalid)")
			continue
		}
		for r := range ap.Spec.Rules {
			if ruleMatches(&ap.Spec.Rules[r], ActionAllow, ap.Namespace, &c) {
				return Verdict{Allowed: true, Reason: "allowed by ALLOW policy " + key(ap) + " rule " + strconv.Itoa(r), Policy: key(ap)}
			}
		}
		names.add(key(ap))
	}
	return Verdict{Reason: "no ALLOW policy matched (applicable: " + names.String() + ")"}
}

// maxNamedPolicies bounds the policies a refusal's reason names: a pod
// selected by thousands of ALLOW policies made every refused connection
// build a reason naming them all (160 KB at 10k), though a log line
// keeps its first 512 bytes.
const maxNamedPolicies = 20

// applicableNames collects the names a refusal's reason lists, at most
// maxNamedPolicies and a count of the rest.
type applicableNames struct {
	names []string
	more  int
}

func (n *applicableNames) add(name string) {
	if len(n.names) < maxNamedPolicies {
		n.names = append(n.names, name)
		return
	}
	n.more++
}

func (n *applicableNames) String() string {
	s := strings.Join(n.names, ", ")
	if n.more > 0 {
		s += " and " + strconv.Itoa(n.more) + " more"
	}
	return s
}

func key(ap *AuthorizationPolicy) string { return ap.Namespace + "/" + ap.Name }

// notEnforced reports the policies istiod never has ztunnel enforce,
// wherever they are: dry-run ones, and ALLOW policies with a selector
// without matchLabels (workload-selector scope that no workload lists).
func notEnforced(ap *AuthorizationPolicy) bool {
	return ap.DryRun() || ap.SelectsNoWorkload()
}

// SelectsNoWorkload reports an ALLOW policy whose selector has no
// matchLabels at all (`selector: {}`): istiod gives it workload-selector
// scope with a nil label selector, which no workload lists, so ztunnel
// never applies it. An empty but present `matchLabels: {}` is another
// thing: istiod decodes it as an empty map, which selects every workload
// in the policy's scope (every one in the mesh from the root namespace),
// so such a policy applies, ALLOW and DENY alike.
func (ap *AuthorizationPolicy) SelectsNoWorkload() bool {
	allow := ap.Spec.Action == "" || ap.Spec.Action == ActionAllow
	return allow && ap.Spec.Selector != nil && ap.Spec.Selector.MatchLabels == nil
}

// DryRunAnnotation marks a policy that is only to be logged, not enforced.
const DryRunAnnotation = "istio.io/dry-run"

// DryRun reports whether ap is a dry-run policy, read as istiod reads it:
// the annotation parsed by strconv.ParseBool; a value that does not parse
// leaves the policy enforced.
func (ap *AuthorizationPolicy) DryRun() bool {
	v, err := strconv.ParseBool(ap.Annotations[DryRunAnnotation])
	return err == nil && v
}

func appliesTo(ap *AuthorizationPolicy, rootNamespace string, dst Target) bool {
	if ap.Spec.TargetRef != nil || len(ap.Spec.TargetRefs) > 0 {
		return false
	}
	if ap.Namespace != rootNamespace && ap.Namespace != dst.Namespace {
		return false
	}
	if ap.Spec.Selector != nil && len(dst.Labels) == 0 {
		// A pod without labels takes every selector policy of its scope:
		// istiod lists them all for it (its label filter does not filter
		// on a nil map), and ztunnel enforces what a workload lists. The
		// API server keeps no empty label map, so none is "no labels" too.
		return true
	}
	return selects(ap.Spec.Selector, dst.Labels)
}

// conn is a connection in the form rules are matched against.
type conn struct {
	principal, namespace, serviceAccount string // empty unless authenticated
	src, dst                             netip.Addr
	port                                 uint16
}

func newConn(dst Target, src Peer) conn {
	c := conn{src: src.Addr.Unmap().WithZone(""), dst: dst.Addr.Unmap().WithZone(""), port: dst.Port}
	if !src.Authenticated || src.Principal == "" {
		return c
	}
	c.principal = strings.TrimPrefix(src.Principal, "spiffe://")
	c.namespace = src.Namespace
	// <trust-domain>/ns/<namespace>/sa/<service-account>
	if parts := strings.Split(c.principal, "/"); len(parts) == 5 && parts[1] == "ns" && parts[3] == "sa" {
		if c.namespace == "" {
			c.namespace = parts[2]
		}
		if c.namespace == parts[2] {
			c.serviceAccount = parts[4]
		}
	}
	return c
}

// ruleMatches reports whether rule r of a policy in namespace policyNS with
// the given action matches c; see Authorize for the L7 treatment.
func ruleMatches(r *Rule, action Action, policyNS string, c *conn) bool {
	if action == ActionAllow && usesL7(r) {
		return false
	}
	if len(r.From) > 0 && !slices.ContainsFunc(r.From, func(f From) bool { return sourceMatches(f.Source, action, policyNS, c) }) {
		return false
	}
	if len(r.To) > 0 && !slices.ContainsFunc(r.To, func(t To) bool { return operationMatches(t.Operation, c) }) {
		return false
	}
	for i := range r.When {
		if !conditionMatches(&r.When[i], action, c) {
			return false
		}
	}
	return true
}

// UsesL7 reports whether r uses a field only an L7 proxy can decide (see
// Authorize): as part of an ALLOW policy it never matches.
func (r *Rule) UsesL7() bool { return usesL7(r) }

func usesL7(r *Rule) bool {
	for _, f := range r.From {
		if s := f.Source; s != nil && len(s.RequestPrincipals)+len(s.NotRequestPrincipals)+len(s.RemoteIPBlocks)+len(s.NotRemoteIPBlocks)+
			len(s.TrustDomains)+len(s.NotTrustDomains) > 0 {
			return true
		}
	}
	for _, t := range r.To {
		if o := t.Operation; o != nil && len(o.Hosts)+len(o.NotHosts)+len(o.Methods)+len(o.NotMethods)+len(o.Paths)+len(o.NotPaths) > 0 {
			return true
		}
	}
	for _, w := range r.When {
		if !slices.Contains(l4WhenKeys, w.Key) {
			return true
		}
	}
	return false
}

// sourceMatches ignores L7 fields; a nil source (invalid) matches nothing.
func sourceMatches(s *Source, action Action, policyNS string, c *conn) bool {
	if s == nil {
		return false
	}
	return matchList(s.Principals, s.NotPrincipals, func(p string) bool { return matchString(p, c.principal) }) &&
		matchList(s.Namespaces, s.NotNamespaces, func(p string) bool { return matchString(p, c.namespace) }) &&
		matchList(s.ServiceAccounts, s.NotServiceAccounts, func(p string) bool { return matchServiceAccount(p, policyNS, c) }) &&
		matchIPList(s.IPBlocks, s.NotIPBlocks, action, c.src)
}

// operationMatches ignores L7 fields; a nil operation (invalid) matches
// nothing.
func operationMatches(o *Operation, c *conn) bool {
	if o == nil {
		return false
	}
	return matchList(o.Ports, o.NotPorts, func(p string) bool { return matchPort(p, c.port) })
}

// conditionMatches decides one `when` entry; keys that are not L4 are
// ignored (they only reach here in DENY rules).
func conditionMatches(w *Condition, action Action, c *conn) bool {
	var pred func(string) bool
	switch w.Key {
	case "source.ip":
		return matchIPList(w.Values, w.NotValues, action, c.src)
	case "source.namespace":
		pred = func(v string) bool { return matchString(v, c.namespace) }
	case "source.principal":
		pred = func(v string) bool { return matchString(v, c.principal) }
	case "destination.ip":
		return matchIPList(w.Values, w.NotValues, action, c.dst)
	case "destination.port":
		pred = func(v string) bool { return matchPort(v, c.port) }
	default:
		return true
	}
	return matchList(w.Values, w.NotValues, pred)
}

// matchList is Istio's rule for a field and its not- form: if the positive
// list is present one entry must match, and no entry of the negative list
// may match.
func matchList(pos, neg []string, match func(string) bool) bool {
	if len(pos) > 0 && !slices.ContainsFunc(pos, match) {
		return false
	}
	return !slices.ContainsFunc(neg, match)
}

// matchString matches Istio's string patterns: "*" is any non-empty value
// (for principals and namespaces: any authenticated peer), "*suffix" and
// "prefix*" match by suffix and prefix, anything else exactly. An empty
// value (no identity) matches nothing.
func matchString(pattern, v string) bool {
	switch {
	case v == "":
		return false
	case pattern == "*":
		return true
	case strings.HasPrefix(pattern, "*"):
		return strings.HasSuffix(v, pattern[1:])
	case strings.HasSuffix(pattern, "*"):
		return strings.HasPrefix(v, pattern[:len(pattern)-1])
	default:
		return pattern == v
	}
}

// matchServiceAccount matches "namespace/name", or "name" meaning a service
// account in the policy's own namespace.
func matchServiceAccount(v, policyNS string, c *conn) bool {
	if c.serviceAccount == "" {
		return false
	}
	ns, sa, ok := strings.Cut(v, "/")
	if !ok {
		ns, sa = policyNS, v
	}
	return ns == c.namespace && sa == c.serviceAccount
}

// matchIPList is matchList for address blocks of a rule with action.
// ztunnel matches a peer by its IPv4 address, so a block written
// IPv4-mapped (::ffff:a.b.c.d/104) matches no IPv4 peer there. Its
// writer meant the IPv4 block it carries; that reading is taken only where
// it refuses more than ztunnel: a positive block of a DENY rule, a negative
// block of an ALLOW rule. Elsewhere (a positive ALLOW block, a negative
// DENY block) the block matches no IPv4 peer, as in ztunnel, or an ALLOW
// of ::ffff:0:0/96 would admit every IPv4 client.
func matchIPList(pos, neg []string, action Action, a netip.Addr) bool {
	deny := action != ActionAllow
	return matchList(pos, nil, func(b string) bool { return matchIP(b, a, deny) }) &&
		!slices.ContainsFunc(neg, func(b string) bool { return matchIP(b, a, !deny) })
}

// matchIP matches a CIDR or single address, reading a mapped block as the
// IPv4 block it carries if unmap is set; malformed blocks match nothing
// (Validate reports them).
func matchIP(block string, a netip.Addr, unmap bool) bool {
	p, err := parseIPBlock(block, unmap)
	return err == nil && a.IsValid() && p.Contains(a)
}

// parseIPBlock parses a CIDR or a single address. With unmap, a block
// written IPv4-mapped (::ffff:a.b.c.d, a prefix of 96 bits or more) is the
// IPv4 block it carries (see matchIPList); the xDS source reads istiod's
// bytes for such a block the same way.
func parseIPBlock(block string, unmap bool) (netip.Prefix, error) {
	var p netip.Prefix
	if strings.Contains(block, "/") {
		var err error
		if p, err = netip.ParsePrefix(block); err != nil {
			return netip.Prefix{}, err
		}
	} else {
		a, err := netip.ParseAddr(block)
		if err != nil {
			return netip.Prefix{}, err
		}
		if a.Zone() != "" {
			return netip.Prefix{}, errZone
		}
		p = netip.PrefixFrom(a, a.BitLen())
	}
	if a := p.Addr(); unmap && a.Is4In6() && p.Bits() >= 96 {
		p = netip.PrefixFrom(a.Unmap(), p.Bits()-96)
	}
	return p, nil
}

func matchPort(s string, port uint16) bool {
	p, err := parsePort(s)
	return err == nil && p == port
}

func parsePort(s string) (uint16, error) {
	n, err := strconv.ParseUint(s, 10, 16)
	if err != nil || n == 0 {
		return 0, errPort
	}
	return uint16(n), nil
}
