package admin

import "time"

// Config dump sections. `redirector inspect` reads the dump by these
// names. workloads, services and policies (with certificates and
// workloadState, see ztunnel.go) are in ztunnel's shape; pods, certs and
// meshPolicies are the agent's own views.
const (
	SectionPods      = "pods"      // this node's pods with their selection decision ([]PodRow)
	SectionWorkloads = "workloads" // every workload ([]ZtunnelWorkload)
	SectionServices  = "services"  // services and their endpoints ([]ZtunnelService)
	SectionPolicies  = "policies"  // AuthorizationPolicies as ztunnel holds them ([]ZtunnelPolicy)
	SectionCerts     = "certs"     // []CertRow
)

// PodRow is one pod of the pods section: what selection decided and why,
// and whether the tunnel serves it, which is what someone asking "why is my
// pod not captured?" needs.
type PodRow struct {
	Namespace      string   `json:"namespace"`
	Name           string   `json:"name"`
	UID            string   `json:"uid"`
	Addresses      []string `json:"addresses"`
	Enrolled       bool     `json:"enrolled"`
	Reason         string   `json:"reason"` // the selection rule that decided
	CaptureInbound bool     `json:"captureInbound"`
	CaptureDNS     bool     `json:"captureDNS"` // the node's DNS_CAPTURE, or the pod's annotation over it
	Listening      bool     `json:"listening"`  // the tunnel's listeners are open
}

// Policies is the meshPolicies section.
type Policies struct {
	PeerAuthentications   any `json:"peerAuthentications"`
	AuthorizationPolicies any `json:"authorizationPolicies"`
}

// CertRow is one cached workload certificate, in the certs section and the
// expiry metric. The JSON names are what `redirector inspect certs` decodes:
// keep them.
type CertRow struct {
	Identity  string      `json:"identity"` // SPIFFE URI
	Serial    string      `json:"serial"`   // lowercase hex
	NotBefore time.Time   `json:"notBefore"`
	NotAfter  time.Time   `json:"notAfter"`
	Issuer    string      `json:"issuer"`
	State     string      `json:"state"` // pending, valid, refreshing, failing or expired
	CA        string      `json:"ca"`    // where it came from: file:DIR or istiod:ADDR
	RefreshAt time.Time   `json:"refreshAt"`
	LastError string      `json:"lastError,omitempty"` // of the last CA request, if it failed
	Failures  int         `json:"failures,omitempty"`  // CA requests failed in a row
	Chain     []ChainCert `json:"chain,omitempty"`     // leaf first, as presented to peers
}

// ChainCert is one certificate of a presented chain.
type ChainCert struct {
	Subject  string    `json:"subject"`
	Issuer   string    `json:"issuer"`
	Serial   string    `json:"serial"`
	NotAfter time.Time `json:"notAfter"`
	PEM      string    `json:"pem"`
}
