package identity

import "errors"

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
	// expired, not exactly one SPIFFE URI SAN in the trust domain).
	ErrUntrustedPeer = errors.New("untrusted peer certificate")
	// ErrUnexpectedIdentity means the peer is trusted but is not the
	// workload identity the caller expected to reach.
	ErrUnexpectedIdentity = errors.New("unexpected peer identity")
)
