package identity

import (
	"context"
	"errors"
)

// Errors a caller may want to tell apart (errors.Is); every error returned by
// this package that means one of these wraps it.
var (
	// ErrInvalidID means a string or ID is not a well-formed Kubernetes
	// SPIFFE ID (spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>).
	ErrInvalidID = errors.New("invalid spiffe id")
	// ErrCAExists means InitCA found a CA already in place and left it alone.
	ErrCAExists = errors.New("ca already exists")
	// ErrNoPeerCertificate means the peer completed no certificate exchange.
	ErrNoPeerCertificate = errors.New("peer presented no certificate")
	// ErrUntrustedPeer means the peer's certificate does not chain to the
	// mesh CA root or is not a usable SPIFFE certificate (wrong key usage,
	// expired, a CA, a weak key, a chain over MaxChainLen, not exactly one
	// SPIFFE URI SAN in the trust domain), or no roots are loaded.
	ErrUntrustedPeer = errors.New("untrusted peer certificate")
	// ErrUnexpectedIdentity means the peer is trusted but is not the
	// workload identity the caller expected to reach.
	ErrUnexpectedIdentity = errors.New("unexpected peer identity")
)

// ErrNoCertificate means the Manager has no unexpired certificate for an
// identity: a handshake that needs one fails closed.
var ErrNoCertificate = errors.New("no valid certificate")

// Reasons a CA request failed, the label of
// redirector_ca_request_failures_total. Signers report theirs with CAError.
const (
	ReasonUnavailable      = "unavailable"       // CA unreachable or not serving
	ReasonTimeout          = "timeout"           // no answer within the request timeout
	ReasonUnauthenticated  = "unauthenticated"   // the CA refused our credentials or the identity
	ReasonPermissionDenied = "permission_denied" // the CA refused to sign this identity
	ReasonToken            = "token"             // our own credential could not be read
	ReasonBadResponse      = "bad_response"      // the answer was malformed
	ReasonWrongIdentity    = "wrong_identity"    // the leaf did not carry exactly the identity asked for
	ReasonUntrustedChain   = "untrusted_chain"   // the chain did not verify to the trust bundle
	ReasonShortLifetime    = "short_lifetime"    // the chain would expire before it could be renewed
	ReasonNotYetValid      = "not_yet_valid"     // the leaf's NotBefore is ahead of this node's clock
	ReasonRefused          = "refused"           // any other refusal by the CA
	ReasonLocal            = "local"             // signing failed locally (file CA)
)

// CAError is a CA request failure with a short, stable reason for metrics.
type CAError struct {
	Reason string
	Err    error
}

func (e *CAError) Error() string { return e.Err.Error() }
func (e *CAError) Unwrap() error { return e.Err }

// ReasonOf classifies err for metrics: the reason of the first CAError in
// its chain, else timeout for deadlines, else local.
func ReasonOf(err error) string {
	var ce *CAError
	switch {
	case errors.As(err, &ce):
		return ce.Reason
	case errors.Is(err, context.DeadlineExceeded):
		return ReasonTimeout
	default:
		return ReasonLocal
	}
}
