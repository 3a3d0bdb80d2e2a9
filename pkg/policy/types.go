// Package policy holds the security.istio.io/v1 PeerAuthentication and L4
// AuthorizationPolicy shapes and decides, for one connection, what they say.
//
// The types mirror the YAML users write for Istio, so a manifest that works
// with Istio ambient decodes here unchanged. The fields that only a waypoint
// (L7 proxy) can enforce are decoded too, not to enforce them but so that
// Authorize can treat rules that use them the way ztunnel does instead of
// silently reading them as broader rules.
package policy

import "time"

// TypeMeta is the apiVersion and kind a policy document names.
type TypeMeta struct {
	APIVersion string `json:"apiVersion,omitempty"`
	Kind       string `json:"kind,omitempty"`
}

// Meta is the part of a policy's metadata the evaluation reads. It is the
// project's own: each source fills it from what it reads (a manifest, the
// API server), so no Kubernetes type reaches this package.
type Meta struct {
	Name      string `json:"name,omitempty"`
	Namespace string `json:"namespace,omitempty"`
	UID       string `json:"uid,omitempty"`
	// ResourceVersion and Labels are kept for the config dump and logs.
	ResourceVersion string            `json:"resourceVersion,omitempty"`
	Labels          map[string]string `json:"labels,omitempty"`
	Annotations     map[string]string `json:"annotations,omitempty"`
	// CreationTimestamp orders competing PeerAuthentications: the oldest
	// wins, as in Istio.
	CreationTimestamp time.Time `json:"creationTimestamp,omitzero"`
}

// GetName and GetNamespace name the policy in errors and sorting.
func (m *Meta) GetName() string      { return m.Name }
func (m *Meta) GetNamespace() string { return m.Namespace }

// MTLSMode is a PeerAuthentication mode.
type MTLSMode string

// PeerAuthentication modes, as Istio spells them.
const (
	ModeUnset      MTLSMode = "UNSET"
	ModeStrict     MTLSMode = "STRICT"
	ModePermissive MTLSMode = "PERMISSIVE"
	ModeDisable    MTLSMode = "DISABLE"
)

// WorkloadSelector picks pods by label in the policy's namespace.
type WorkloadSelector struct {
	MatchLabels map[string]string `json:"matchLabels,omitempty"`
}

// MTLS is the mtls block of a PeerAuthentication.
type MTLS struct {
	Mode MTLSMode `json:"mode,omitempty"`
}

// PeerAuthenticationSpec is spec of security.istio.io/v1 PeerAuthentication.
type PeerAuthenticationSpec struct {
	Selector      *WorkloadSelector `json:"selector,omitempty"`
	MTLS          *MTLS             `json:"mtls,omitempty"`
	PortLevelMTLS map[uint32]MTLS   `json:"portLevelMtls,omitempty"`
}

// PeerAuthentication is security.istio.io/v1 PeerAuthentication.
type PeerAuthentication struct {
	TypeMeta `json:",inline"`
	Meta     `json:"metadata,omitempty"`
	Spec     PeerAuthenticationSpec `json:"spec"`
	// Unrecognized names what a source found in the object that these
	// types do not know (a newer Istio field, a typo); Spec then lacks it.
	// Without the field the policy may select more or relax more than
	// written, so its level is read as STRICT (see EffectiveMode).
	Unrecognized string `json:"-"`
}

// Action is an AuthorizationPolicy action.
type Action string

// Authorization actions. Only ALLOW and DENY are enforced at L4; AUDIT and
// CUSTOM are Istio actions that ztunnel ignores, and so does Authorize. An
// empty action means ALLOW, as in Istio.
const (
	ActionAllow  Action = "ALLOW"
	ActionDeny   Action = "DENY"
	ActionAudit  Action = "AUDIT"
	ActionCustom Action = "CUSTOM"
)

// Source is rule.from[].source.
type Source struct {
	Principals         []string `json:"principals,omitempty"`
	NotPrincipals      []string `json:"notPrincipals,omitempty"`
	Namespaces         []string `json:"namespaces,omitempty"`
	NotNamespaces      []string `json:"notNamespaces,omitempty"`
	ServiceAccounts    []string `json:"serviceAccounts,omitempty"`
	NotServiceAccounts []string `json:"notServiceAccounts,omitempty"`
	IPBlocks           []string `json:"ipBlocks,omitempty"`
	NotIPBlocks        []string `json:"notIpBlocks,omitempty"`

	// L7 only: recognised, never enforced here (see Authorize).
	RequestPrincipals    []string `json:"requestPrincipals,omitempty"`
	NotRequestPrincipals []string `json:"notRequestPrincipals,omitempty"`
	RemoteIPBlocks       []string `json:"remoteIpBlocks,omitempty"`
	NotRemoteIPBlocks    []string `json:"notRemoteIpBlocks,omitempty"`

	// TrustDomains and NotTrustDomains are not enforced at L4 either:
	// istiod does not send them to ztunnel. They are treated as the L7
	// fields are (see Authorize), so a rule using them can only deny more.
	TrustDomains    []string `json:"trustDomains,omitempty"`
	NotTrustDomains []string `json:"notTrustDomains,omitempty"`
}

// From is one entry of rule.from.
type From struct {
	Source *Source `json:"source,omitempty"`
}

// Operation is rule.to[].operation.
type Operation struct {
	Ports    []string `json:"ports,omitempty"`
	NotPorts []string `json:"notPorts,omitempty"`

	// L7 only: recognised, never enforced here (see Authorize).
	Hosts      []string `json:"hosts,omitempty"`
	NotHosts   []string `json:"notHosts,omitempty"`
	Methods    []string `json:"methods,omitempty"`
	NotMethods []string `json:"notMethods,omitempty"`
	Paths      []string `json:"paths,omitempty"`
	NotPaths   []string `json:"notPaths,omitempty"`
}

// To is one entry of rule.to.
type To struct {
	Operation *Operation `json:"operation,omitempty"`
}

// Condition is one entry of rule.when. Only the keys source.ip,
// source.namespace, source.principal, destination.ip and destination.port
// can be decided at L4; any other key is L7 (see Authorize).
type Condition struct {
	Key       string   `json:"key"`
	Values    []string `json:"values,omitempty"`
	NotValues []string `json:"notValues,omitempty"`
}

// Rule is one AuthorizationPolicy rule.
type Rule struct {
	From []From      `json:"from,omitempty"`
	To   []To        `json:"to,omitempty"`
	When []Condition `json:"when,omitempty"`
}

// PolicyTargetReference is spec.targetRef(s): it binds a policy to a
// waypoint, gateway or service instead of to pods.
type PolicyTargetReference struct {
	Group     string `json:"group,omitempty"`
	Kind      string `json:"kind"`
	Name      string `json:"name"`
	Namespace string `json:"namespace,omitempty"`
}

// AuthorizationPolicySpec is spec of security.istio.io/v1 AuthorizationPolicy.
type AuthorizationPolicySpec struct {
	Selector *WorkloadSelector `json:"selector,omitempty"`
	// TargetRef and TargetRefs attach the policy to a waypoint or gateway;
	// such a policy is never enforced by the node's L4 tunnel (as in
	// ztunnel), so Authorize skips it.
	TargetRef  *PolicyTargetReference  `json:"targetRef,omitempty"`
	TargetRefs []PolicyTargetReference `json:"targetRefs,omitempty"`
	Action     Action                  `json:"action,omitempty"`
	// Provider names the external authorizer of a CUSTOM policy; it is
	// decoded so that such a manifest loads, and never enforced at L4.
	Provider *ExtensionProvider `json:"provider,omitempty"`
	Rules    []Rule             `json:"rules,omitempty"`
}

// ExtensionProvider is spec.provider of a CUSTOM AuthorizationPolicy.
type ExtensionProvider struct {
	Name string `json:"name,omitempty"`
}

// AuthorizationPolicy is security.istio.io/v1 AuthorizationPolicy.
type AuthorizationPolicy struct {
	TypeMeta `json:",inline"`
	Meta     `json:"metadata,omitempty"`
	Spec     AuthorizationPolicySpec `json:"spec"`
	// Unrecognized names what a source found in the object that these
	// types do not know (a newer Istio field, a typo); Spec then lacks it.
	// Dropping a field can widen an ALLOW rule, so such a policy is
	// invalid (see Validate) and fails closed.
	Unrecognized string `json:"-"`
}
