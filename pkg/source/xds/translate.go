package xds

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// translateAddress turns an istio.workload.Address into a *Workload or a
// *Service. Anything the agent could not use correctly is an error naming
// the field, which the client sends back in the NACK.
func translateAddress(a *workloadapi.Address) (any, error) {
	switch t := a.GetType().(type) {
	case *workloadapi.Address_Workload:
		w, err := translateWorkload(t.Workload)
		if err != nil {
			return nil, err // an untyped nil: callers test the value
		}
		return w, nil
	case *workloadapi.Address_Service:
		s, err := translateService(t.Service)
		if err != nil {
			return nil, err
		}
		return s, nil
	}
	return nil, errors.New("address is neither a workload nor a service")
}

// rejectedAddress is the stand-in for a, which does not translate: its
// name and the addresses of it that are a host's own (meshAddr), nil when
// there is none or the name is unknown. A workload that is not known to
// have addresses of its own (network mode other than STANDARD: a node's
// addresses) stands for none: refusing a node's address would cut pods off
// whatever else runs there. A service's ranges are left out.
func rejectedAddress(a *workloadapi.Address) *Rejected {
	var r *Rejected
	switch t := a.GetType().(type) {
	case *workloadapi.Address_Workload:
		x := t.Workload
		if x.GetUid() == "" || x.GetNetworkMode() != workloadapi.NetworkMode_STANDARD {
			return nil
		}
		r = &Rejected{Name: x.GetUid(), Namespace: x.GetNamespace()}
		for _, b := range x.GetAddresses()[:min(len(x.GetAddresses()), MaxWorkloadAddresses)] {
			if ip, err := meshAddr(b); err == nil {
				r.Addrs, r.networks = append(r.Addrs, ip), append(r.networks, x.GetNetwork())
			}
		}
	case *workloadapi.Address_Service:
		x := t.Service
		if x.GetNamespace() == "" || x.GetHostname() == "" {
			return nil
		}
		r = &Rejected{Name: x.GetNamespace() + "/" + x.GetHostname(), Namespace: x.GetNamespace()}
		for _, na := range x.GetAddresses() {
			if _, isRange, err := meshCIDR(na); err != nil || isRange {
				continue
			}
			if ip, err := meshAddr(na.GetAddress()); err == nil {
				r.Addrs, r.networks = append(r.Addrs, ip), append(r.networks, na.GetNetwork())
			}
		}
	}
	if r == nil || len(r.Addrs) == 0 {
		return nil
	}
	return r
}

func translateWorkload(x *workloadapi.Workload) (*Workload, error) {
	if x.GetUid() == "" || x.GetName() == "" || x.GetNamespace() == "" {
		return nil, fmt.Errorf("workload %q (%s/%s): uid, name and namespace are required", x.GetUid(), x.GetNamespace(), x.GetName())
	}
	if err := validateIdentity(x); err != nil {
		return nil, fmt.Errorf("workload %s: %w", x.GetUid(), err)
	}
	if n := len(x.GetAddresses()); n > MaxWorkloadAddresses {
		return nil, fmt.Errorf("workload %s: %d addresses, at most %d", x.GetUid(), n, MaxWorkloadAddresses)
	}
	w := &Workload{
		Workload: workload.Workload{
			Name:              x.GetName(),
			Namespace:         x.GetNamespace(),
			UID:               x.GetUid(),
			ServiceAccount:    cmp.Or(x.GetServiceAccount(), "default"),
			Node:              x.GetNode(),
			WorkloadName:      x.GetWorkloadName(),
			WorkloadType:      strings.ToLower(x.GetWorkloadType().String()),
			CanonicalName:     x.GetCanonicalName(),
			CanonicalRevision: x.GetCanonicalRevision(),
			Region:            x.GetLocality().GetRegion(),
			Zone:              x.GetLocality().GetZone(),
			Subzone:           x.GetLocality().GetSubzone(),
			Cluster:           x.GetClusterId(),
		},
		// istiod leaves out the default trust domain.
		TrustDomain: cmp.Or(x.GetTrustDomain(), "cluster.local"),
		Network:     x.GetNetwork(),
		Healthy:     x.GetStatus() == workloadapi.WorkloadStatus_HEALTHY,
		Policies:    x.GetAuthorizationPolicies(),
	}
	switch x.GetTunnelProtocol() {
	case workloadapi.TunnelProtocol_HBONE:
		w.Enrolled, w.Reason = true, "istiod: tunnel protocol HBONE"
	case workloadapi.TunnelProtocol_NONE, workloadapi.TunnelProtocol_LEGACY_ISTIO_MTLS:
		// A sidecar's Istio mTLS is not spoken here: not an HBONE peer.
		w.Reason = "istiod: tunnel protocol " + x.GetTunnelProtocol().String()
	default:
		return nil, fmt.Errorf("workload %s: tunnel protocol %s is not supported (HBONE or NONE)", x.GetUid(), x.GetTunnelProtocol())
	}
	switch x.GetNetworkMode() {
	case workloadapi.NetworkMode_STANDARD:
	case workloadapi.NetworkMode_HOST_NETWORK:
		w.HostNetwork = true
	default:
		return nil, fmt.Errorf("workload %s: network mode %s is not supported (STANDARD or HOST_NETWORK)", x.GetUid(), x.GetNetworkMode())
	}
	for i, b := range x.GetAddresses() {
		a, err := meshAddr(b)
		if err != nil {
			return nil, fmt.Errorf("workload %s: address %d: %w", x.GetUid(), i, err)
		}
		w.Addrs = append(w.Addrs, a)
	}
	var err error
	if w.Waypoint, err = translateGateway(x.GetWaypoint()); err != nil {
		return nil, fmt.Errorf("workload %s: waypoint: %w", x.GetUid(), err)
	}
	for key, list := range x.GetServices() {
		if w.Services == nil {
			w.Services = make(map[string][]PortMap, len(x.GetServices()))
		}
		for _, p := range list.GetPorts() {
			if p.GetServicePort() == 0 || p.GetServicePort() > 65535 || p.GetTargetPort() > 65535 {
				return nil, fmt.Errorf("workload %s: service %s: port %d -> %d out of range", x.GetUid(), key, p.GetServicePort(), p.GetTargetPort())
			}
			w.Services[key] = append(w.Services[key], PortMap{ServicePort: uint16(p.GetServicePort()), TargetPort: uint16(p.GetTargetPort())})
		}
	}
	return w, nil
}

// MaxWorkloadAddresses bounds a workload's addresses: a pod has one per
// address family, a WorkloadEntry one. Without a bound one resource could
// claim any number of addresses in the directory.
const MaxWorkloadAddresses = 16

// validateIdentity checks what the workload's SPIFFE ID
// (spiffe://<trust domain>/ns/<namespace>/sa/<service account>) and its
// policy key (namespace/name) are built from: with a separator or an
// empty segment in them, the ID or key would name something else.
func validateIdentity(x *workloadapi.Workload) error {
	if errs := validation.IsDNS1123Label(x.GetNamespace()); len(errs) > 0 {
		return fmt.Errorf("namespace %q: %s", x.GetNamespace(), errs[0])
	}
	if strings.Contains(x.GetName(), "/") {
		return fmt.Errorf("name %q: contains '/'", x.GetName())
	}
	if sa := x.GetServiceAccount(); sa != "" {
		if errs := validation.IsDNS1123Subdomain(sa); len(errs) > 0 {
			return fmt.Errorf("service_account %q: %s", sa, errs[0])
		}
	}
	if td := x.GetTrustDomain(); td != "" && !validTrustDomain(td) {
		return fmt.Errorf("trust_domain %q: want lowercase letters, digits, '.', '-' and '_' (SPIFFE)", td)
	}
	return nil
}

// validTrustDomain: the characters the SPIFFE specification allows in a
// trust domain name.
func validTrustDomain(td string) bool {
	if len(td) > 255 {
		return false
	}
	for _, r := range td {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '.' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}

func translateService(x *workloadapi.Service) (*Service, error) {
	if x.GetName() == "" || x.GetNamespace() == "" || x.GetHostname() == "" {
		return nil, fmt.Errorf("service %s/%s (%q): name, namespace and hostname are required", x.GetNamespace(), x.GetName(), x.GetHostname())
	}
	s := &Service{Service: workload.Service{Name: x.GetName(), Namespace: x.GetNamespace(), Hostname: x.GetHostname()}, Canonical: x.GetCanonical()}
	switch x.GetVisibility() {
	case workloadapi.Service_PUBLIC:
	case workloadapi.Service_NAMESPACE:
		s.NamespaceOnly = true
	default:
		// Read as public, it could take other namespaces' traffic.
		return nil, fmt.Errorf("service %s: visibility %s is not supported (PUBLIC or NAMESPACE)", s.Key(), x.GetVisibility())
	}
	for i, na := range x.GetAddresses() {
		if p, ok, err := meshCIDR(na); err != nil {
			return nil, fmt.Errorf("service %s: address %d: %w", s.Key(), i, err)
		} else if ok {
			s.CIDRs = append(s.CIDRs, p)
			s.cidrNetworks = append(s.cidrNetworks, na.GetNetwork())
			continue
		}
		a, err := meshAddr(na.GetAddress())
		if err != nil {
			return nil, fmt.Errorf("service %s: address %d: %w", s.Key(), i, err)
		}
		s.VIPs = append(s.VIPs, a)
		s.vipNetworks = append(s.vipNetworks, na.GetNetwork())
	}
	for _, p := range x.GetPorts() {
		if p.GetServicePort() == 0 || p.GetServicePort() > 65535 || p.GetTargetPort() > 65535 {
			return nil, fmt.Errorf("service %s: port %d -> %d out of range", s.Key(), p.GetServicePort(), p.GetTargetPort())
		}
		sp := int32(p.GetServicePort())
		// The target port here is the service's default; a workload's
		// own map (its endpoint ports) wins where it has one. 0 is a
		// named targetPort istiod resolved per workload: a workload
		// without it in its map does not serve the port (PerEndpoint).
		port := workload.ServicePort{Name: portName(sp), Port: sp, TargetPort: int32(p.GetTargetPort()), PerEndpoint: p.GetTargetPort() == 0, Protocol: "TCP"}
		if ap := p.GetAppProtocol(); ap != workloadapi.AppProtocol_UNKNOWN {
			port.AppProtocol = ap.String()
		}
		s.Ports = append(s.Ports, port)
	}
	var err error
	if s.families, err = translateFamilies(x.GetIpFamilies()); err != nil {
		return nil, fmt.Errorf("service %s: %w", s.Key(), err)
	}
	if s.Waypoint, err = translateGateway(x.GetWaypoint()); err != nil {
		return nil, fmt.Errorf("service %s: waypoint: %w", s.Key(), err)
	}
	if err := translateLoadBalancing(x.GetLoadBalancing(), s); err != nil {
		return nil, fmt.Errorf("service %s: %w", s.Key(), err)
	}
	return s, nil
}

// translateFamilies checks a service's ip_families: a Kubernetes
// Service's spec.ipFamilies (istiod sends AUTOMATIC for a ServiceEntry),
// which decide the families a headless one is answered in (hasFamily).
// AUTOMATIC is both, as ztunnel reads it (no family is left out). A value
// the agent does not know is an error, as ztunnel refuses it: read as
// either, it could answer a family the service does not have.
func translateFamilies(f workloadapi.IPFamilies) (workloadapi.IPFamilies, error) {
	switch f {
	case workloadapi.IPFamilies_AUTOMATIC, workloadapi.IPFamilies_DUAL, workloadapi.IPFamilies_IPV4_ONLY, workloadapi.IPFamilies_IPV6_ONLY:
		return f, nil
	}
	return 0, fmt.Errorf("ip_families %s is not supported (AUTOMATIC, IPV4_ONLY, IPV6_ONLY or DUAL)", f)
}

// translateLoadBalancing reads a service's load_balancing into s: which
// endpoints may serve it, in what order of preference, or whether it
// routes at all. Mode FAILOVER ranks endpoints by the routing preferences
// and STRICT also leaves out those not sharing every scope (Routing); an
// unspecified mode balances over all, as ztunnel does. A mode, scope or
// health policy the agent does not know is an error: balancing as if it
// were not there sends connections where istiod says they must not go.
func translateLoadBalancing(lb *workloadapi.LoadBalancing, s *Service) error {
	if lb == nil {
		return nil
	}
	switch lb.GetHealthPolicy() {
	case workloadapi.LoadBalancing_ONLY_HEALTHY:
	case workloadapi.LoadBalancing_ALLOW_ALL:
		s.allowUnhealthy = true
	default:
		return fmt.Errorf("load_balancing health_policy %s is not supported (ONLY_HEALTHY or ALLOW_ALL)", lb.GetHealthPolicy())
	}
	switch lb.GetMode() {
	case workloadapi.LoadBalancing_UNSPECIFIED_MODE:
	case workloadapi.LoadBalancing_PASSTHROUGH:
		s.passthrough = true
	case workloadapi.LoadBalancing_FAILOVER, workloadapi.LoadBalancing_STRICT:
		r := &workload.Routing{Strict: lb.GetMode() == workloadapi.LoadBalancing_STRICT}
		for _, x := range lb.GetRoutingPreference() {
			scope, ok := scopes[x]
			if !ok {
				return fmt.Errorf("load_balancing routing_preference %s is not supported (REGION, ZONE, SUBZONE, NODE, CLUSTER or NETWORK)", x)
			}
			if slices.Contains(r.Scopes, scope) {
				return fmt.Errorf("load_balancing routing_preference lists %s twice", x)
			}
			r.Scopes = append(r.Scopes, scope)
			// Every endpoint must be on the client's node, and the
			// clients are this node's pods (internalTrafficPolicy:
			// Local): the others are left out of the node's copy.
			if r.Strict && scope == workload.ScopeNode {
				s.nodeLocal = true
			}
		}
		if len(r.Scopes) > 0 {
			s.Routing = r
		}
	default:
		return fmt.Errorf("load_balancing mode %s is not supported (FAILOVER, STRICT or PASSTHROUGH)", lb.GetMode())
	}
	return nil
}

// scopes maps istiod's load_balancing scopes to the model's.
var scopes = map[workloadapi.LoadBalancing_Scope]workload.Scope{
	workloadapi.LoadBalancing_REGION:  workload.ScopeRegion,
	workloadapi.LoadBalancing_ZONE:    workload.ScopeZone,
	workloadapi.LoadBalancing_SUBZONE: workload.ScopeSubzone,
	workloadapi.LoadBalancing_NODE:    workload.ScopeNode,
	workloadapi.LoadBalancing_CLUSTER: workload.ScopeCluster,
	workloadapi.LoadBalancing_NETWORK: workload.ScopeNetwork,
}

// meshAddr parses an address istiod gives a workload, a service or a
// waypoint. Only a unicast address that means one host across the cluster
// is one: a loopback, unspecified, multicast, broadcast or link-local
// address (169.254.169.254, the cloud metadata server, above all) as a
// ServiceEntry's VIP would have every meshed pod's traffic to it sent to
// that entry's endpoints, and as a workload's it is no pod's.
func meshAddr(b []byte) (netip.Addr, error) {
	a, ok := netip.AddrFromSlice(b)
	if !ok {
		return netip.Addr{}, fmt.Errorf("%d bytes, want 4 or 16", len(b))
	}
	a = a.Unmap()
	if err := selection.CheckPodAddr(a); err != nil {
		return netip.Addr{}, err
	}
	return a, nil
}

// meshCIDR reads a service address istiod sends with a prefix length (a
// ServiceEntry's CIDR address) as a range; ok is false for a host address
// (no length, or the family's full one). A range is refused where it holds
// an address of no one host (see meshAddr: 169.254.0.0/16 would take the
// cloud metadata server's connections, 0.0.0.0/0 everything's) or is
// written IPv4-mapped (which family it means is not known).
func meshCIDR(na *workloadapi.NetworkAddress) (netip.Prefix, bool, error) {
	if na.Length == nil {
		return netip.Prefix{}, false, nil
	}
	a, ok := netip.AddrFromSlice(na.GetAddress())
	if !ok {
		return netip.Prefix{}, false, fmt.Errorf("%d bytes, want 4 or 16", len(na.GetAddress()))
	}
	if n := na.GetLength(); n > uint32(a.BitLen()) {
		return netip.Prefix{}, false, fmt.Errorf("prefix length %d of %s, at most %d", n, a, a.BitLen())
	} else if n == uint32(a.BitLen()) {
		return netip.Prefix{}, false, nil
	}
	if a.Is4In6() {
		return netip.Prefix{}, false, fmt.Errorf("range %s/%d is written IPv4-mapped", a, na.GetLength())
	}
	p := netip.PrefixFrom(a, int(na.GetLength())).Masked()
	for _, n := range noHostRanges {
		if n.Overlaps(p) {
			return netip.Prefix{}, false, fmt.Errorf("range %s holds %s, addresses of no one host", p, n)
		}
	}
	return p, true, nil
}

// noHostRanges are the ranges of addresses that mean no one host across
// the cluster (selection.CheckPodAddr's).
var noHostRanges = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"), netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("224.0.0.0/4"), netip.MustParsePrefix("255.255.255.255/32"),
	netip.MustParsePrefix("::/128"), netip.MustParsePrefix("::1/128"), netip.MustParsePrefix("::ffff:0.0.0.0/96"),
	netip.MustParsePrefix("fe80::/10"), netip.MustParsePrefix("ff00::/8"),
}

func translateGateway(g *workloadapi.GatewayAddress) (*workload.Waypoint, error) {
	if g == nil {
		return nil, nil
	}
	if g.GetHboneMtlsPort() > 65535 {
		return nil, fmt.Errorf("hbone port %d out of range", g.GetHboneMtlsPort())
	}
	out := &workload.Waypoint{HBONEPort: uint16(g.GetHboneMtlsPort())}
	switch d := g.GetDestination().(type) {
	case *workloadapi.GatewayAddress_Address:
		a, err := meshAddr(d.Address.GetAddress())
		if err != nil {
			return nil, err
		}
		out.Addr = a
	case *workloadapi.GatewayAddress_Hostname:
		if d.Hostname.GetHostname() == "" {
			return nil, errors.New("empty hostname")
		}
		if d.Hostname.GetNamespace() == "" {
			// ztunnel looks the exact namespace/hostname up and finds
			// nothing; resolved in any namespace, a tenant's service of
			// that host name would become another namespace's waypoint.
			return nil, fmt.Errorf("hostname %q names no namespace", d.Hostname.GetHostname())
		}
		out.Namespace, out.Hostname = d.Hostname.GetNamespace(), d.Hostname.GetHostname()
	default:
		return nil, errors.New("neither an address nor a hostname")
	}
	return out, nil
}

// translateAuthorization compiles an istio.security.Authorization for
// pkg/policy. Whatever would change what the policy matches if ignored
// (an unknown scope or action, an empty string match, a malformed address
// or port) is an error: a policy is applied exactly or not at all.
func translateAuthorization(x *security.Authorization) (*policy.Compiled, error) {
	if x.GetName() == "" || x.GetNamespace() == "" {
		return nil, fmt.Errorf("authorization %s/%s: name and namespace are required", x.GetNamespace(), x.GetName())
	}
	key := x.GetNamespace() + "/" + x.GetName()
	if path := unknownField(x.ProtoReflect(), ""); path != "" {
		return nil, fmt.Errorf("authorization %s: %s: this agent does not know what it means", key, path)
	}
	if len(x.GetExtensions()) > 0 {
		return nil, fmt.Errorf("authorization %s: extensions (%s) are not supported", key, x.GetExtensions()[0].GetName())
	}
	p := &policy.Compiled{Name: x.GetName(), Namespace: x.GetNamespace(), DryRun: x.GetDryRun()}
	switch x.GetScope() {
	case security.Scope_GLOBAL:
		p.Scope = policy.ScopeGlobal
	case security.Scope_NAMESPACE:
		p.Scope = policy.ScopeNamespace
	case security.Scope_WORKLOAD_SELECTOR:
		p.Scope = policy.ScopeWorkloadSelector
	default:
		return nil, fmt.Errorf("authorization %s: unknown scope %d", key, x.GetScope())
	}
	switch x.GetAction() {
	case security.Action_ALLOW:
		p.Action = policy.ActionAllow
	case security.Action_DENY:
		p.Action = policy.ActionDeny
	default:
		return nil, fmt.Errorf("authorization %s: unknown action %d", key, x.GetAction())
	}
	for gi, g := range x.GetGroups() {
		var group policy.Group
		for ri, r := range g.GetRules() {
			var clause policy.Clause
			for mi, m := range r.GetMatches() {
				cm, err := translateMatch(m, p.Action)
				if err != nil {
					return nil, fmt.Errorf("authorization %s: group %d rule %d match %d: %w", key, gi, ri, mi, err)
				}
				clause.Matches = append(clause.Matches, cm)
			}
			group.Clauses = append(group.Clauses, clause)
		}
		p.Groups = append(p.Groups, group)
	}
	return p, nil
}

func translateMatch(m *security.Match, action policy.Action) (policy.Match, error) {
	var out policy.Match
	var err error
	if len(m.GetExtensions()) > 0 {
		return out, fmt.Errorf("extensions (%s) are not supported", m.GetExtensions()[0].GetName())
	}
	strs := []struct {
		name string
		in   []*security.StringMatch
		out  *[]policy.StringMatch
	}{
		{"namespaces", m.GetNamespaces(), &out.Namespaces},
		{"not_namespaces", m.GetNotNamespaces(), &out.NotNamespaces},
		{"principals", m.GetPrincipals(), &out.Principals},
		{"not_principals", m.GetNotPrincipals(), &out.NotPrincipals},
	}
	for _, s := range strs {
		if *s.out, err = translateStrings(s.in); err != nil {
			return out, fmt.Errorf("%s: %w", s.name, err)
		}
	}
	for _, sa := range m.GetServiceAccounts() {
		out.ServiceAccounts = append(out.ServiceAccounts, policy.ServiceAccountRef{Namespace: sa.GetNamespace(), Name: sa.GetServiceAccount()})
	}
	for _, sa := range m.GetNotServiceAccounts() {
		out.NotServiceAccounts = append(out.NotServiceAccounts, policy.ServiceAccountRef{Namespace: sa.GetNamespace(), Name: sa.GetServiceAccount()})
	}
	// ztunnel matches an IPv4 peer against an IPv4-mapped prefix as IPv6:
	// never. Its writer meant the IPv4 prefix it carries, and that reading
	// is taken where it refuses more: positive prefixes of a DENY, negative
	// ones of an ALLOW (as pkg/policy reads such blocks).
	deny := action != policy.ActionAllow
	ips := []struct {
		name  string
		in    []*security.Address
		out   *[]netip.Prefix
		unmap bool
	}{
		{"source_ips", m.GetSourceIps(), &out.SourceIPs, deny},
		{"not_source_ips", m.GetNotSourceIps(), &out.NotSourceIPs, !deny},
		{"destination_ips", m.GetDestinationIps(), &out.DestinationIPs, deny},
		{"not_destination_ips", m.GetNotDestinationIps(), &out.NotDestinationIPs, !deny},
	}
	for _, s := range ips {
		for _, a := range s.in {
			ip, ok := netip.AddrFromSlice(a.GetAddress())
			if !ok || int(a.GetLength()) > ip.BitLen() {
				return out, fmt.Errorf("%s: %d address bytes with prefix length %d", s.name, len(a.GetAddress()), a.GetLength())
			}
			bits := int(a.GetLength())
			if s.unmap && ip.Is4In6() && bits >= 96 {
				ip, bits = ip.Unmap(), bits-96
			}
			*s.out = append(*s.out, netip.PrefixFrom(ip, bits).Masked())
		}
	}
	ports := []struct {
		name string
		in   []uint32
		out  *[]uint16
	}{
		{"destination_ports", m.GetDestinationPorts(), &out.DestinationPorts},
		{"not_destination_ports", m.GetNotDestinationPorts(), &out.NotDestinationPorts},
	}
	for _, s := range ports {
		for _, p := range s.in {
			if p == 0 || p > 65535 {
				return out, fmt.Errorf("%s: port %d out of range", s.name, p)
			}
			*s.out = append(*s.out, uint16(p))
		}
	}
	return out, nil
}

func translateStrings(in []*security.StringMatch) ([]policy.StringMatch, error) {
	var out []policy.StringMatch
	for _, s := range in {
		switch t := s.GetMatchType().(type) {
		case *security.StringMatch_Exact:
			out = append(out, policy.StringMatch{Kind: policy.MatchExact, Value: t.Exact})
		case *security.StringMatch_Prefix:
			out = append(out, policy.StringMatch{Kind: policy.MatchPrefix, Value: t.Prefix})
		case *security.StringMatch_Suffix:
			out = append(out, policy.StringMatch{Kind: policy.MatchSuffix, Value: t.Suffix})
		case *security.StringMatch_Presence:
			out = append(out, policy.StringMatch{Kind: policy.MatchPresence})
		default:
			return nil, errors.New("a string match without a match type")
		}
	}
	return out, nil
}

// failClosed is what stands in for a policy that cannot be translated but
// whose name, scope and action are known: a DENY matching every
// connection, or an ALLOW matching none (it still counts as an applicable
// ALLOW), so the error can only deny more. nil if even those are unknown.
func failClosed(x *security.Authorization) *policy.Compiled {
	if x.GetName() == "" || x.GetNamespace() == "" {
		return nil
	}
	p := &policy.Compiled{Name: x.GetName(), Namespace: x.GetNamespace(), DryRun: x.GetDryRun(), Action: policy.ActionDeny, Groups: []policy.Group{{}}}
	switch x.GetScope() {
	case security.Scope_GLOBAL:
		p.Scope = policy.ScopeGlobal
	case security.Scope_NAMESPACE:
		p.Scope = policy.ScopeNamespace
	case security.Scope_WORKLOAD_SELECTOR:
		p.Scope = policy.ScopeWorkloadSelector
	default:
		return nil
	}
	if x.GetAction() == security.Action_ALLOW {
		p.Action, p.Groups = policy.ActionAllow, nil
	}
	return p
}

// unknownField returns the path of the first field in m (or in a message
// below it) that the compiled-in schema does not know, "" if none. A
// newer istiod may add a condition to a policy; ignored, it would make an
// ALLOW admit more (or change what a DENY matches), so such a policy is
// not applied as written.
func unknownField(m protoreflect.Message, path string) string {
	if raw := m.GetUnknown(); len(raw) > 0 {
		return strings.TrimPrefix(path+".", ".") + fmt.Sprintf("unknown field %d", unknownNumber(raw))
	}
	var found string
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Kind() != protoreflect.MessageKind && fd.Kind() != protoreflect.GroupKind {
			return true
		}
		name := path + "." + string(fd.Name())
		switch {
		case fd.IsList():
			l := v.List()
			for i := range l.Len() {
				if found = unknownField(l.Get(i).Message(), fmt.Sprintf("%s[%d]", name, i)); found != "" {
					return false
				}
			}
		case fd.IsMap():
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				if fd.MapValue().Kind() == protoreflect.MessageKind {
					found = unknownField(mv.Message(), fmt.Sprintf("%s[%v]", name, k))
				}
				return found == ""
			})
		default:
			found = unknownField(v.Message(), name)
		}
		return found == ""
	})
	return found
}

// unknownNumber is the field number of the first field in raw.
func unknownNumber(raw protoreflect.RawFields) protowire.Number {
	n, _, _ := protowire.ConsumeTag(raw)
	return n
}
