// Package policy holds the security.istio.io/v1 PeerAuthentication and L4
// AuthorizationPolicy shapes and decides, for one connection, what they say.
//
// The types mirror the YAML users write for Istio (only the L4 fields), so a
// manifest that works with Istio ambient decodes here unchanged.
package policy

import metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              PeerAuthenticationSpec `json:"spec"`
}

// Action is an AuthorizationPolicy action.
type Action string

// Authorization actions handled at L4.
const (
	ActionAllow Action = "ALLOW"
	ActionDeny  Action = "DENY"
)

// Source is rule.from[].source.
type Source struct {
	Principals    []string `json:"principals,omitempty"`
	NotPrincipals []string `json:"notPrincipals,omitempty"`
	Namespaces    []string `json:"namespaces,omitempty"`
	NotNamespaces []string `json:"notNamespaces,omitempty"`
	IPBlocks      []string `json:"ipBlocks,omitempty"`
	NotIPBlocks   []string `json:"notIpBlocks,omitempty"`
}

// From is one entry of rule.from.
type From struct {
	Source *Source `json:"source,omitempty"`
}

// Operation is rule.to[].operation (L4 fields only).
type Operation struct {
	Ports    []string `json:"ports,omitempty"`
	NotPorts []string `json:"notPorts,omitempty"`
}

// To is one entry of rule.to.
type To struct {
	Operation *Operation `json:"operation,omitempty"`
}

// Rule is one AuthorizationPolicy rule.
type Rule struct {
	From []From `json:"from,omitempty"`
	To   []To   `json:"to,omitempty"`
}

// AuthorizationPolicySpec is spec of security.istio.io/v1 AuthorizationPolicy.
type AuthorizationPolicySpec struct {
	Selector *WorkloadSelector `json:"selector,omitempty"`
	Action   Action            `json:"action,omitempty"`
	Rules    []Rule            `json:"rules,omitempty"`
}

// AuthorizationPolicy is security.istio.io/v1 AuthorizationPolicy.
type AuthorizationPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              AuthorizationPolicySpec `json:"spec"`
}
