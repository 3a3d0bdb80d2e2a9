package policy

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// ErrInvalid is wrapped by every error Validate and ValidatePA return.
var ErrInvalid = errors.New("invalid policy")

var (
	errPort = errors.New("not a port number in 1..65535")
	errZone = errors.New("zoned addresses are not allowed")
)

// Validate checks an AuthorizationPolicy the way Istio's admission webhook
// does for what matters at L4, so that a manifest this rejects is one Istio
// would also reject. The error names the policy (namespace/name) and each
// offending field by path, for example
// "spec.rules[0].from[1].source.ipBlocks[0]".
//
// Authorize does not skip invalid policies (that would fail open); see its
// doc for what they do.
func Validate(ap AuthorizationPolicy) error { return validate(&ap) }

func validate(ap *AuthorizationPolicy) error {
	var v validator
	spec := &ap.Spec
	switch spec.Action {
	case "", ActionAllow, ActionDeny, ActionAudit, ActionCustom:
	default:
		v.add("spec.action", "unknown action %q (want ALLOW, DENY, AUDIT or CUSTOM)", spec.Action)
	}
	if ap.Unrecognized != "" {
		v.add("spec", "has what this agent does not know, so it cannot be enforced as written: %s", ap.Unrecognized)
	}
	if spec.Provider != nil && spec.Action != ActionCustom {
		v.add("spec.provider", "is only for action CUSTOM, not %q", spec.Action)
	}
	targeted := spec.TargetRef != nil || len(spec.TargetRefs) > 0
	if targeted && spec.Selector != nil {
		v.add("spec", "only one of selector, targetRef and targetRefs may be set")
	}
	if spec.TargetRef != nil && len(spec.TargetRefs) > 0 {
		v.add("spec", "only one of targetRef and targetRefs may be set")
	}
	for i := range spec.Rules {
		v.rule(fmt.Sprintf("spec.rules[%d]", i), &spec.Rules[i])
	}
	return v.err("authorizationpolicy", ap.Namespace, ap.Name)
}

func (v *validator) rule(path string, r *Rule) {
	if r.From != nil && len(r.From) == 0 {
		v.add(path+".from", "must not be empty when present")
	}
	for j, f := range r.From {
		p := fmt.Sprintf("%s.from[%d].source", path, j)
		s := f.Source
		if s == nil {
			v.add(p, "must be set")
			continue
		}
		if len(s.Principals)+len(s.NotPrincipals)+len(s.Namespaces)+len(s.NotNamespaces)+
			len(s.ServiceAccounts)+len(s.NotServiceAccounts)+len(s.IPBlocks)+len(s.NotIPBlocks)+
			len(s.RequestPrincipals)+len(s.NotRequestPrincipals)+len(s.RemoteIPBlocks)+len(s.NotRemoteIPBlocks)+
			len(s.TrustDomains)+len(s.NotTrustDomains) == 0 {
			v.add(p, "must not be empty")
		}
		if len(s.ServiceAccounts)+len(s.NotServiceAccounts) > 0 &&
			len(s.Principals)+len(s.NotPrincipals)+len(s.Namespaces)+len(s.NotNamespaces) > 0 {
			v.add(p, "serviceAccounts cannot be combined with principals or namespaces")
		}
		v.values(p+".principals", s.Principals)
		v.values(p+".notPrincipals", s.NotPrincipals)
		v.values(p+".namespaces", s.Namespaces)
		v.values(p+".notNamespaces", s.NotNamespaces)
		v.serviceAccounts(p+".serviceAccounts", s.ServiceAccounts)
		v.serviceAccounts(p+".notServiceAccounts", s.NotServiceAccounts)
		v.ipBlocks(p+".ipBlocks", s.IPBlocks)
		v.ipBlocks(p+".notIpBlocks", s.NotIPBlocks)
		v.values(p+".requestPrincipals", s.RequestPrincipals)
		v.values(p+".notRequestPrincipals", s.NotRequestPrincipals)
		v.ipBlocks(p+".remoteIpBlocks", s.RemoteIPBlocks)
		v.ipBlocks(p+".notRemoteIpBlocks", s.NotRemoteIPBlocks)
		v.trustDomains(p+".trustDomains", s.TrustDomains)
		v.trustDomains(p+".notTrustDomains", s.NotTrustDomains)
	}
	if r.To != nil && len(r.To) == 0 {
		v.add(path+".to", "must not be empty when present")
	}
	for j, t := range r.To {
		p := fmt.Sprintf("%s.to[%d].operation", path, j)
		o := t.Operation
		if o == nil {
			v.add(p, "must be set")
			continue
		}
		if len(o.Ports)+len(o.NotPorts)+len(o.Hosts)+len(o.NotHosts)+len(o.Methods)+len(o.NotMethods)+len(o.Paths)+len(o.NotPaths) == 0 {
			v.add(p, "must not be empty")
		}
		v.ports(p+".ports", o.Ports)
		v.ports(p+".notPorts", o.NotPorts)
		v.values(p+".hosts", o.Hosts)
		v.values(p+".notHosts", o.NotHosts)
		v.values(p+".methods", o.Methods)
		v.values(p+".notMethods", o.NotMethods)
		v.values(p+".paths", o.Paths)
		v.values(p+".notPaths", o.NotPaths)
	}
	for j := range r.When {
		w := &r.When[j]
		p := fmt.Sprintf("%s.when[%d]", path, j)
		if w.Key == "" {
			v.add(p+".key", "must be set")
			continue
		}
		if len(w.Values)+len(w.NotValues) == 0 {
			v.add(p, "at least one of values and notValues must be set for key %q", w.Key)
		}
		switch w.Key {
		case "source.ip", "destination.ip":
			v.ipBlocks(p+".values", w.Values)
			v.ipBlocks(p+".notValues", w.NotValues)
		case "destination.port":
			v.ports(p+".values", w.Values)
			v.ports(p+".notValues", w.NotValues)
		default:
			v.values(p+".values", w.Values)
			v.values(p+".notValues", w.NotValues)
		}
	}
}

// ValidatePA checks a PeerAuthentication as Istio's admission webhook does.
// The error names the policy (namespace/name) and each offending field.
// EffectiveMode reads an unknown mode, or a policy with an unknown field,
// as STRICT and ignores portLevelMtls on a policy without a selector.
func ValidatePA(pa PeerAuthentication) error {
	var v validator
	if pa.Unrecognized != "" {
		v.add("spec", "has what this agent does not know, so it is enforced as STRICT: %s", pa.Unrecognized)
	}
	if pa.Spec.MTLS != nil {
		v.mode("spec.mtls.mode", pa.Spec.MTLS.Mode)
	}
	if pa.Spec.PortLevelMTLS != nil {
		if !hasSelector(pa.Spec.Selector) {
			v.add("spec.portLevelMtls", "needs a selector with matchLabels; mesh and namespace policies cannot set port-level mTLS")
		}
		if len(pa.Spec.PortLevelMTLS) == 0 {
			v.add("spec.portLevelMtls", "must have at least one port when present")
		}
		for _, port := range slices.Sorted(maps.Keys(pa.Spec.PortLevelMTLS)) {
			p := fmt.Sprintf("spec.portLevelMtls[%d]", port)
			if port == 0 || port > 65535 {
				v.add(p, "%s", errPort)
			}
			v.mode(p+".mode", pa.Spec.PortLevelMTLS[port].Mode)
		}
	}
	return v.err("peerauthentication", pa.Namespace, pa.Name)
}

// validator collects field errors so one report shows every problem.
type validator struct{ errs []string }

func (v *validator) add(path, format string, args ...any) {
	v.errs = append(v.errs, path+": "+fmt.Sprintf(format, args...))
}

func (v *validator) err(kind, ns, name string) error {
	if len(v.errs) == 0 {
		return nil
	}
	return fmt.Errorf("%w %s %s/%s: %s", ErrInvalid, kind, ns, name, strings.Join(v.errs, "; "))
}

func (v *validator) mode(path string, m MTLSMode) {
	switch m {
	case "", ModeUnset, ModeStrict, ModePermissive, ModeDisable:
	default:
		v.add(path, "unknown mode %q (want UNSET, STRICT, PERMISSIVE or DISABLE)", m)
	}
}

func (v *validator) values(path string, vals []string) {
	for i, s := range vals {
		if s == "" {
			v.add(fmt.Sprintf("%s[%d]", path, i), "empty value")
		}
	}
}

// trustDomains checks as Istio's webhook does: not empty, at most one
// "*" and only at an end, no "/".
func (v *validator) trustDomains(path string, tds []string) {
	for i, s := range tds {
		n := strings.Count(s, "*")
		switch {
		case s == "":
			v.add(fmt.Sprintf("%s[%d]", path, i), "empty value")
		case n > 1 || (n == 1 && s != "*" && !strings.HasPrefix(s, "*") && !strings.HasSuffix(s, "*")):
			v.add(fmt.Sprintf("%s[%d]", path, i), "%q: one wildcard at most, at the start or end", s)
		case strings.Contains(s, "/"):
			v.add(fmt.Sprintf("%s[%d]", path, i), "%q: a trust domain has no '/'", s)
		}
	}
}

func (v *validator) ipBlocks(path string, blocks []string) {
	for i, b := range blocks {
		if _, err := parseIPBlock(b, true); err != nil {
			v.add(fmt.Sprintf("%s[%d]", path, i), "malformed ip block %q: %v", b, err)
		}
	}
}

func (v *validator) ports(path string, ports []string) {
	for i, s := range ports {
		if _, err := parsePort(s); err != nil {
			v.add(fmt.Sprintf("%s[%d]", path, i), "%q is %v", s, err)
		}
	}
}

func (v *validator) serviceAccounts(path string, sas []string) {
	for i, s := range sas {
		ns, name, qualified := strings.Cut(s, "/")
		if !qualified {
			name = s
		}
		if name == "" || (qualified && ns == "") || strings.Contains(name, "/") || strings.Contains(s, "*") {
			v.add(fmt.Sprintf("%s[%d]", path, i), "%q is not <service-account> or <namespace>/<service-account>", s)
		}
	}
}
