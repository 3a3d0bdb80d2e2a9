package admin

import (
	"cmp"
	"crypto/x509"
	"encoding/pem"
	"math/big"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// The config dump's workloads, services, policies, certificates and
// workloadState sections have ztunnel's shape and field names (ztunnel's
// admin /config_dump, as istio.io/istio istioctl/pkg/writer/ztunnel/
// configdump reads it), so `istioctl ztunnel-config ... --file` and
// Kiali's ztunnel tab read the agent's dump unchanged.
const (
	SectionCertificates  = "certificates"  // []ZtunnelCerts
	SectionWorkloadState = "workloadState" // map[pod uid]ZtunnelWorkloadState
	// SectionMeshPolicies is the PeerAuthentications and
	// AuthorizationPolicies as the agent holds them (Policies), next to
	// ztunnel's converted view in "policies".
	SectionMeshPolicies = "meshPolicies"
)

// ZtunnelWorkload is one workload (pod), as ztunnel dumps it.
type ZtunnelWorkload struct {
	UID               string    `json:"uid"`
	WorkloadIPs       []string  `json:"workloadIps"`
	Protocol          string    `json:"protocol"` // HBONE when enrolled, else TCP
	Name              string    `json:"name"`
	Namespace         string    `json:"namespace"`
	ServiceAccount    string    `json:"serviceAccount"`
	WorkloadName      string    `json:"workloadName"`
	WorkloadType      string    `json:"workloadType"`
	CanonicalName     string    `json:"canonicalName"`
	CanonicalRevision string    `json:"canonicalRevision"`
	ClusterID         string    `json:"clusterId"`
	Network           string    `json:"network"`
	TrustDomain       string    `json:"trustDomain"`
	Locality          *Locality `json:"locality,omitempty"` // absent when unknown, as ztunnel
	Node              string    `json:"node"`
	Status            string    `json:"status"` // Healthy or Unhealthy
	Capacity          uint32    `json:"capacity"`
	// Waypoint is where the workload's traffic goes first, if anywhere.
	Waypoint *ZtunnelGatewayAddress `json:"waypoint,omitempty"`
}

// ZtunnelGatewayAddress is a waypoint as ztunnel dumps it: Destination is
// namespace/hostname or network/ip, which istioctl matches against the
// services for its WAYPOINT column.
type ZtunnelGatewayAddress struct {
	Destination   string `json:"destination"`
	HBONEMtlsPort uint16 `json:"hboneMtlsPort"`
}

func ztunnelWaypoint(wp *workload.Waypoint, network string) *ZtunnelGatewayAddress {
	if wp == nil {
		return nil
	}
	z := &ZtunnelGatewayAddress{HBONEMtlsPort: wp.HBONEPort}
	if wp.Addr.IsValid() {
		z.Destination = network + "/" + wp.Addr.String()
	} else {
		z.Destination = wp.Namespace + "/" + wp.Hostname
	}
	return z
}

// healthStatus is ztunnel's HealthStatus of a readiness.
func healthStatus(ready bool) string {
	if ready {
		return "Healthy"
	}
	return "Unhealthy"
}

// Locality is a workload's region, zone and subzone, written whole as
// ztunnel's Locality is.
type Locality struct {
	Region  string `json:"region"`
	Zone    string `json:"zone"`
	Subzone string `json:"subzone"`
}

func localityOf(w *workload.Workload) *Locality {
	if w.Region == "" && w.Zone == "" && w.Subzone == "" {
		return nil
	}
	return &Locality{Region: w.Region, Zone: w.Zone, Subzone: w.Subzone}
}

// ZtunnelService is one service, as ztunnel dumps it.
type ZtunnelService struct {
	Name            string                      `json:"name"`
	Namespace       string                      `json:"namespace"`
	Hostname        string                      `json:"hostname"`
	VIPs            []string                    `json:"vips"`               // network/ip
	CIDRVIPs        []string                    `json:"cidrVips,omitempty"` // network/prefix, as ztunnel
	Ports           map[string]uint16           `json:"ports"`              // service port -> target port (0: named, per endpoint)
	Endpoints       map[string]*ZtunnelEndpoint `json:"endpoints"`
	Waypoint        *ZtunnelGatewayAddress      `json:"waypoint,omitempty"`
	SubjectAltNames []string                    `json:"subjectAltNames"`
	IPFamilies      string                      `json:"ipFamilies"`
	LoadBalancer    *ZtunnelLoadBalancer        `json:"loadBalancer,omitempty"`
}

// ZtunnelLoadBalancer is a service's routing preference, as ztunnel dumps
// its load balancer: mode Failover or Strict, scopes in order.
type ZtunnelLoadBalancer struct {
	RoutingPreferences []string `json:"routingPreferences"`
	Mode               string   `json:"mode"`
}

func ztunnelLoadBalancer(s *workload.Service) *ZtunnelLoadBalancer {
	r := s.Routing
	if r == nil && s.NodeLocal {
		// internalTrafficPolicy: Local, as istiod sends it to ztunnel.
		r = &workload.Routing{Scopes: []workload.Scope{workload.ScopeNode}, Strict: true}
	}
	if r == nil {
		return nil
	}
	z := &ZtunnelLoadBalancer{RoutingPreferences: []string{}, Mode: "Failover"}
	if r.Strict {
		z.Mode = "Strict"
	}
	for _, scope := range r.Scopes {
		z.RoutingPreferences = append(z.RoutingPreferences, scope.String())
	}
	return z
}

// ZtunnelEndpoint is one endpoint of a ZtunnelService.
type ZtunnelEndpoint struct {
	WorkloadUID string            `json:"workloadUid"`
	Service     string            `json:"service"` // namespace/hostname
	Address     string            `json:"address"`
	Port        map[string]uint16 `json:"port"`
	Status      string            `json:"status"` // Healthy when ready, else Unhealthy
}

// ZtunnelPolicy is an AuthorizationPolicy converted as Istio hands it to
// ztunnel: rules are ORed, each rule's clauses ANDed, each clause's
// matches ORed.
type ZtunnelPolicy struct {
	Name      string                    `json:"name"`
	Namespace string                    `json:"namespace"`
	Scope     string                    `json:"scope"`  // Global, Namespace or WorkloadSelector
	Action    string                    `json:"action"` // Allow or Deny
	Rules     [][][]*ZtunnelPolicyMatch `json:"rules"`
	// DryRun marks a policy that is only logged, not enforced (Istio's
	// istio.io/dry-run annotation, which istiod sends ztunnel as dry_run);
	// written also when false, as ztunnel does.
	DryRun bool `json:"dryRun"`
}

// ZtunnelPolicyMatch is one match of a policy clause.
type ZtunnelPolicyMatch struct {
	Namespaces          []StringMatch `json:"namespaces,omitempty"`
	NotNamespaces       []StringMatch `json:"notNamespaces,omitempty"`
	Principals          []StringMatch `json:"principals,omitempty"`
	NotPrincipals       []StringMatch `json:"notPrincipals,omitempty"`
	SourceIps           []string      `json:"sourceIps,omitempty"`
	NotSourceIps        []string      `json:"notSourceIps,omitempty"`
	DestinationIps      []string      `json:"destinationIps,omitempty"`
	NotDestinationIps   []string      `json:"notDestinationIps,omitempty"`
	DestinationPorts    []uint16      `json:"destinationPorts,omitempty"`
	NotDestinationPorts []uint16      `json:"notDestinationPorts,omitempty"`
	ServiceAccounts     []SAMatch     `json:"serviceAccounts,omitempty"`
	NotServiceAccounts  []SAMatch     `json:"notServiceAccounts,omitempty"`
}

// SAMatch is ztunnel's service account match.
type SAMatch struct {
	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount"`
}

// StringMatch is ztunnel's string matcher; one field is set.
type StringMatch struct {
	Exact    string    `json:"Exact,omitempty"`
	Prefix   string    `json:"Prefix,omitempty"`
	Suffix   string    `json:"Suffix,omitempty"`
	Presence *struct{} `json:"Presence,omitempty"`
}

// ZtunnelCerts is one identity's certificates, as ztunnel dumps them.
type ZtunnelCerts struct {
	Identity  string        `json:"identity"`
	State     string        `json:"state"` // Available, Initializing or "Unavailable: <error>"
	CertChain []ZtunnelCert `json:"certChain"`
	RootCerts []ZtunnelCert `json:"rootCerts"`
}

// ZtunnelCert is one certificate: serial in decimal, times in RFC 3339.
type ZtunnelCert struct {
	PEM            string `json:"pem"`
	SerialNumber   string `json:"serialNumber"`
	ValidFrom      string `json:"validFrom"`
	ExpirationTime string `json:"expirationTime"`
}

// ZtunnelWorkloadState is a local pod's state, as ztunnel's in-pod mode
// dumps it.
type ZtunnelWorkloadState struct {
	State string `json:"state"` // Up when the tunnel serves the pod, else Pending
	// Connections are the pod's open connections while it is Up, which
	// istioctl ztunnel-config connections lists.
	Connections *ZtunnelConnections `json:"connections,omitempty"`
	Info        ZtunnelWorkloadInfo `json:"info"`
}

// ZtunnelConnections are a pod's open connections, as ztunnel's connection
// manager dumps them.
type ZtunnelConnections struct {
	Inbound  []ZtunnelInboundConnection  `json:"inbound"`
	Outbound []ZtunnelOutboundConnection `json:"outbound"`
}

// ZtunnelInboundConnection is one open inbound connection: addresses as
// ip:port, the protocol HBONE or TCP.
type ZtunnelInboundConnection struct {
	Src string `json:"src"`
	// OriginalDst is the host name of the service the connection is
	// counted under, null when none (ztunnel's dest_service).
	OriginalDst *string `json:"originalDst"`
	ActualDst   string  `json:"actualDst"`
	Protocol    string  `json:"protocol"`
}

// ZtunnelOutboundConnection is one open outbound connection: where the app
// connected (OriginalDst) and where the tunnel did (ActualDst).
type ZtunnelOutboundConnection struct {
	Src         string `json:"src"`
	OriginalDst string `json:"originalDst"`
	ActualDst   string `json:"actualDst"`
	Protocol    string `json:"protocol"`
}

// Protocol is ztunnel's name of a connection's protocol.
func Protocol(hbone bool) string {
	if hbone {
		return "HBONE"
	}
	return "TCP"
}

// ZtunnelWorkloadInfo names a local pod.
type ZtunnelWorkloadInfo struct {
	Name           string `json:"name"`
	Namespace      string `json:"namespace"`
	TrustDomain    string `json:"trustDomain"`
	ServiceAccount string `json:"serviceAccount"`
}

// ZtunnelUID is a workload's uid as Istio builds it:
// cluster//Pod/namespace/name, with the workload's own cluster (a remote
// workload's, from istiod), else cluster, the agent's.
func ZtunnelUID(cluster string, w *workload.Workload) string {
	return cmp.Or(w.Cluster, cluster) + "//Pod/" + w.Namespace + "/" + w.Name
}

// ZtunnelWorkloads converts every workload of dir; all are on network,
// the agent's (the directory holds no other).
//
// A workload's status is what its endpoints say: Unhealthy when services
// list it only as not ready (the pod's readiness, which istiod's status
// is; the xDS source's endpoints carry that status), Healthy otherwise,
// also when no service lists it and so its readiness is not known here.
func ZtunnelWorkloads(dir *workload.Directory, cluster, network, trustDomain string) []ZtunnelWorkload {
	listed, ready := map[*workload.Workload]bool{}, map[*workload.Workload]bool{}
	for _, s := range dir.Services() {
		for _, ep := range s.Endpoints {
			if ep.Workload != nil {
				listed[ep.Workload] = true
				ready[ep.Workload] = ready[ep.Workload] || ep.Ready
			}
		}
	}
	out := []ZtunnelWorkload{}
	for _, w := range dir.All() {
		z := ZtunnelWorkload{UID: ZtunnelUID(cluster, w), Protocol: "TCP", Name: w.Name, Namespace: w.Namespace,
			ServiceAccount: w.ServiceAccount, WorkloadName: cmp.Or(w.WorkloadName, w.Name), WorkloadType: cmp.Or(w.WorkloadType, workload.TypePod),
			CanonicalName: w.CanonicalName, CanonicalRevision: w.CanonicalRevision, ClusterID: cmp.Or(w.Cluster, cluster), Network: network, TrustDomain: trustDomain,
			Node: w.Node, Status: healthStatus(!listed[w] || ready[w]), Capacity: 1, WorkloadIPs: []string{}, Locality: localityOf(w),
			Waypoint: ztunnelWaypoint(w.Waypoint, network)}
		if w.Enrolled {
			z.Protocol = "HBONE"
		}
		for _, a := range w.Addrs {
			z.WorkloadIPs = append(z.WorkloadIPs, a.String())
		}
		out = append(out, z)
	}
	return out
}

// ZtunnelServices converts every service of dir; its VIPs are on network.
func ZtunnelServices(dir *workload.Directory, cluster, network string) []ZtunnelService {
	out := []ZtunnelService{}
	for _, s := range dir.Services() {
		z := ZtunnelService{Name: s.Name, Namespace: s.Namespace, Hostname: s.Hostname, VIPs: []string{},
			Ports: map[string]uint16{}, Endpoints: map[string]*ZtunnelEndpoint{}, SubjectAltNames: []string{}, Waypoint: ztunnelWaypoint(s.Waypoint, network),
			LoadBalancer: ztunnelLoadBalancer(s)}
		v4, v6 := false, false
		for _, vip := range s.VIPs {
			z.VIPs = append(z.VIPs, network+"/"+vip.String())
			v4, v6 = v4 || vip.Is4(), v6 || vip.Is6()
		}
		for _, p := range s.CIDRs {
			z.CIDRVIPs = append(z.CIDRVIPs, network+"/"+p.String())
		}
		z.IPFamilies = map[[2]bool]string{{true, false}: "IPv4", {false, true}: "IPv6", {true, true}: "Dual"}[[2]bool{v4, v6}]
		for _, p := range s.Ports {
			if p.Protocol != "" && p.Protocol != "TCP" {
				continue
			}
			// 0 for a named port, as ztunnel; an unset one is the port itself.
			tp := p.TargetPort
			if p.TargetPortName == "" && !p.PerEndpoint {
				tp = cmp.Or(tp, p.Port)
			}
			z.Ports[strconv.Itoa(int(p.Port))] = uint16(tp)
		}
		for _, ep := range s.Endpoints {
			uid := ""
			if ep.Workload != nil {
				uid = ZtunnelUID(cluster, ep.Workload)
			}
			e := &ZtunnelEndpoint{WorkloadUID: uid, Service: s.Namespace + "/" + z.Hostname, Address: "/" + ep.Addr.String(), Port: map[string]uint16{},
				Status: healthStatus(ep.Ready)}
			for _, p := range s.Ports {
				if tp, ok := ep.Ports[p.Name]; ok {
					e.Port[strconv.Itoa(int(p.Port))] = uint16(tp)
				}
			}
			z.Endpoints[uid+":"+e.Address] = e
		}
		out = append(out, z)
	}
	return out
}

// ZtunnelPolicies converts the AuthorizationPolicies the node's tunnel
// holds as istiod would send them to ztunnel: those with a targetRef belong
// to waypoints and an ALLOW whose selector has no matchLabels selects no
// workload, so both are left out; dry-run ones are listed, marked. An
// ALLOW rule using fields only an L7 proxy decides never matches, so it is
// left out too (as istiod does); a DENY rule keeps its L4 part, which is
// what is enforced.
//
// An invalid policy (policy.Validate: a field this agent does not know, a
// bad value) is listed as it is enforced, failing closed, not as written:
// an ALLOW with no rule (it admits nothing), and a DENY, or a policy with
// an unknown action, as a Deny with one rule of no clause (in ztunnel's
// reading, it matches every connection).
func ZtunnelPolicies(aps []policy.AuthorizationPolicy, rootNamespace string) []ZtunnelPolicy {
	out := []ZtunnelPolicy{}
	for _, ap := range aps {
		if ap.Spec.TargetRef != nil || len(ap.Spec.TargetRefs) > 0 || ap.SelectsNoWorkload() {
			continue
		}
		action := "Allow"
		switch ap.Spec.Action {
		case policy.ActionAllow, "":
		case policy.ActionAudit, policy.ActionCustom:
			continue // not enforced at L4
		default:
			action = "Deny" // DENY, or an unknown action, enforced as DENY everything
		}
		scope := "Namespace"
		switch {
		case ap.Spec.Selector != nil:
			scope = "WorkloadSelector"
		case ap.Namespace == rootNamespace:
			scope = "Global"
		}
		z := ZtunnelPolicy{Name: ap.Name, Namespace: ap.Namespace, Scope: scope, Action: action, Rules: [][][]*ZtunnelPolicyMatch{}, DryRun: ap.DryRun()}
		if policy.Validate(ap) != nil {
			if action == "Deny" {
				z.Rules = append(z.Rules, [][]*ZtunnelPolicyMatch{})
			}
			out = append(out, z)
			continue
		}
		for _, r := range ap.Spec.Rules {
			if action == "Allow" && r.UsesL7() {
				continue
			}
			z.Rules = append(z.Rules, ztunnelRule(r, ap.Namespace))
		}
		out = append(out, z)
	}
	return out
}

func ztunnelRule(r policy.Rule, policyNS string) [][]*ZtunnelPolicyMatch {
	clauses := [][]*ZtunnelPolicyMatch{}
	var from, to []*ZtunnelPolicyMatch
	for _, f := range r.From {
		if s := f.Source; s != nil {
			from = append(from, &ZtunnelPolicyMatch{Namespaces: stringMatches(s.Namespaces), NotNamespaces: stringMatches(s.NotNamespaces),
				Principals: stringMatches(s.Principals), NotPrincipals: stringMatches(s.NotPrincipals),
				SourceIps: s.IPBlocks, NotSourceIps: s.NotIPBlocks,
				ServiceAccounts: saMatches(s.ServiceAccounts, policyNS), NotServiceAccounts: saMatches(s.NotServiceAccounts, policyNS)})
		}
	}
	for _, t := range r.To {
		if o := t.Operation; o != nil {
			to = append(to, &ZtunnelPolicyMatch{DestinationPorts: ports(o.Ports), NotDestinationPorts: ports(o.NotPorts)})
		}
	}
	for _, c := range [][]*ZtunnelPolicyMatch{from, to} {
		if len(c) > 0 {
			clauses = append(clauses, c)
		}
	}
	for _, w := range r.When {
		m := &ZtunnelPolicyMatch{}
		switch w.Key {
		case "source.ip":
			m.SourceIps, m.NotSourceIps = w.Values, w.NotValues
		case "source.namespace":
			m.Namespaces, m.NotNamespaces = stringMatches(w.Values), stringMatches(w.NotValues)
		case "source.principal":
			m.Principals, m.NotPrincipals = stringMatches(w.Values), stringMatches(w.NotValues)
		case "destination.ip":
			m.DestinationIps, m.NotDestinationIps = w.Values, w.NotValues
		case "destination.port":
			m.DestinationPorts, m.NotDestinationPorts = ports(w.Values), ports(w.NotValues)
		default:
			continue
		}
		clauses = append(clauses, []*ZtunnelPolicyMatch{m})
	}
	return clauses
}

// stringMatches converts Istio's string patterns: "*" is presence,
// "x*" a prefix, "*x" a suffix, anything else exact.
func stringMatches(vs []string) []StringMatch {
	var out []StringMatch
	for _, v := range vs {
		switch {
		case v == "*":
			out = append(out, StringMatch{Presence: &struct{}{}})
		case strings.HasSuffix(v, "*"):
			out = append(out, StringMatch{Prefix: strings.TrimSuffix(v, "*")})
		case strings.HasPrefix(v, "*"):
			out = append(out, StringMatch{Suffix: strings.TrimPrefix(v, "*")})
		default:
			out = append(out, StringMatch{Exact: v})
		}
	}
	return out
}

// saMatches converts Istio's service accounts: namespace/name, or a bare
// name in the policy's namespace.
func saMatches(vs []string, policyNS string) []SAMatch {
	var out []SAMatch
	for _, v := range vs {
		ns, sa, ok := strings.Cut(v, "/")
		if !ok {
			ns, sa = policyNS, v
		}
		out = append(out, SAMatch{Namespace: ns, ServiceAccount: sa})
	}
	return out
}

func compiledSAs(refs []policy.ServiceAccountRef) []SAMatch {
	var out []SAMatch
	for _, r := range refs {
		out = append(out, SAMatch{Namespace: r.Namespace, ServiceAccount: r.Name})
	}
	return out
}

func ports(vs []string) []uint16 {
	var out []uint16
	for _, v := range vs {
		if p, err := strconv.ParseUint(v, 10, 16); err == nil {
			out = append(out, uint16(p))
		}
	}
	return out
}

// ZtunnelCertificates converts the cached certificates. The chain is the
// one presented (leaf first); the roots are the trust anchors that signed
// its last certificate, when known (roots may be nil).
func ZtunnelCertificates(rows []CertRow, roots []*x509.Certificate) []ZtunnelCerts {
	out := []ZtunnelCerts{}
	for _, r := range rows {
		z := ZtunnelCerts{Identity: r.Identity, CertChain: []ZtunnelCert{}, RootCerts: []ZtunnelCert{}}
		switch r.State {
		case "valid", "refreshing":
			z.State = "Available"
		case "pending":
			z.State = "Initializing"
		default:
			z.State = "Unavailable: " + cmp.Or(r.LastError, r.State)
		}
		var last *x509.Certificate
		for _, c := range r.Chain {
			if zc, cert, ok := ztunnelCert(c.PEM); ok {
				z.CertChain = append(z.CertChain, zc)
				last = cert
			}
		}
		for _, root := range roots {
			if last != nil && last.CheckSignatureFrom(root) == nil {
				z.RootCerts = append(z.RootCerts, certOf(root))
			}
		}
		out = append(out, z)
	}
	return out
}

func ztunnelCert(p string) (ZtunnelCert, *x509.Certificate, bool) {
	b, _ := pem.Decode([]byte(p))
	if b == nil {
		return ZtunnelCert{}, nil, false
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return ZtunnelCert{}, nil, false
	}
	return certOf(c), c, true
}

func certOf(c *x509.Certificate) ZtunnelCert {
	return ZtunnelCert{
		PEM:            string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})),
		SerialNumber:   new(big.Int).Set(c.SerialNumber).String(),
		ValidFrom:      c.NotBefore.UTC().Format(time.RFC3339),
		ExpirationTime: c.NotAfter.UTC().Format(time.RFC3339),
	}
}

// ZtunnelWorkloadStates describes the node's enrolled pods; serving says
// whether the tunnel serves one and, if it does, its open connections.
func ZtunnelWorkloadStates(pods []*workload.Workload, trustDomain string, serving func(*workload.Workload) (bool, *ZtunnelConnections)) map[string]ZtunnelWorkloadState {
	out := map[string]ZtunnelWorkloadState{}
	for _, w := range pods {
		if !w.Enrolled {
			continue
		}
		z := ZtunnelWorkloadState{State: "Pending", Info: ZtunnelWorkloadInfo{Name: w.Name, Namespace: w.Namespace, TrustDomain: trustDomain, ServiceAccount: w.ServiceAccount}}
		if up, conns := serving(w); up {
			z.State, z.Connections = "Up", conns
		}
		out[w.Key()] = z // a pod without a UID (a mirror pod) by namespace/name
	}
	return out
}

// ZtunnelCompiledPolicies converts istiod's compiled policies (the xDS
// source's), which already have ztunnel's structure.
//
// Two shapes istiod can send are read by the agent the way that can only
// deny more (see policy.Compiled): a match with no condition and a clause
// with no match. They are listed as enforced, in terms that read the same
// whichever way the reader takes them: in an ALLOW, a condition-less match
// is left out and a rule with a clause left without a match (it never
// matches) is left out; in a DENY, a clause with no match or with a
// condition-less one (it always matches) is left out. Listed as sent, an
// ALLOW rule with an empty clause reads, in ztunnel's terms, as admitting
// every connection, which the agent refuses.
func ZtunnelCompiledPolicies(set *policy.CompiledSet) []ZtunnelPolicy {
	out := []ZtunnelPolicy{}
	if set == nil {
		return out
	}
	for _, p := range set.Policies {
		z := ZtunnelPolicy{Name: p.Name, Namespace: p.Namespace, Action: "Allow", Rules: [][][]*ZtunnelPolicyMatch{}, DryRun: p.DryRun}
		if p.Action == policy.ActionDeny {
			z.Action = "Deny"
		}
		switch p.Scope {
		case policy.ScopeGlobal:
			z.Scope = "Global"
		case policy.ScopeNamespace:
			z.Scope = "Namespace"
		default:
			z.Scope = "WorkloadSelector"
		}
	groups:
		for _, g := range p.Groups {
			rule := [][]*ZtunnelPolicyMatch{}
			for _, c := range g.Clauses {
				clause := []*ZtunnelPolicyMatch{}
				always := len(c.Matches) == 0 // in a DENY
				for _, m := range c.Matches {
					if conditionless(m) {
						always = true
						continue
					}
					clause = append(clause, &ZtunnelPolicyMatch{
						Namespaces: compiledMatches(m.Namespaces), NotNamespaces: compiledMatches(m.NotNamespaces),
						Principals: compiledMatches(m.Principals), NotPrincipals: compiledMatches(m.NotPrincipals),
						SourceIps: prefixes(m.SourceIPs), NotSourceIps: prefixes(m.NotSourceIPs),
						DestinationIps: prefixes(m.DestinationIPs), NotDestinationIps: prefixes(m.NotDestinationIPs),
						DestinationPorts: m.DestinationPorts, NotDestinationPorts: m.NotDestinationPorts,
						ServiceAccounts: compiledSAs(m.ServiceAccounts), NotServiceAccounts: compiledSAs(m.NotServiceAccounts),
					})
				}
				switch {
				case p.Action == policy.ActionDeny && always:
					continue // matches every connection: no condition to list
				case p.Action != policy.ActionDeny && len(clause) == 0:
					continue groups // the rule never matches
				}
				rule = append(rule, clause)
			}
			z.Rules = append(z.Rules, rule)
		}
		out = append(out, z)
	}
	return out
}

// conditionless reports a match with no condition (policy.Compiled).
func conditionless(m policy.Match) bool {
	return len(m.Namespaces)+len(m.NotNamespaces)+len(m.ServiceAccounts)+len(m.NotServiceAccounts)+
		len(m.Principals)+len(m.NotPrincipals)+len(m.SourceIPs)+len(m.NotSourceIPs)+
		len(m.DestinationIPs)+len(m.NotDestinationIPs)+len(m.DestinationPorts)+len(m.NotDestinationPorts) == 0
}

func compiledMatches(ms []policy.StringMatch) []StringMatch {
	var out []StringMatch
	for _, m := range ms {
		switch m.Kind {
		case policy.MatchPrefix:
			out = append(out, StringMatch{Prefix: m.Value})
		case policy.MatchSuffix:
			out = append(out, StringMatch{Suffix: m.Value})
		case policy.MatchPresence:
			out = append(out, StringMatch{Presence: &struct{}{}})
		default:
			out = append(out, StringMatch{Exact: m.Value})
		}
	}
	return out
}

func prefixes(ps []netip.Prefix) []string {
	var out []string
	for _, p := range ps {
		out = append(out, p.String())
	}
	return out
}
