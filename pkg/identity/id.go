// Package identity gives workloads their mesh identities: SPIFFE IDs, a
// file-backed CA that mints short-lived X.509 SVIDs for them, a per-service
// account certificate cache that rotates before expiry, and the TLS 1.3
// configurations the HBONE tunnel uses to prove and check those identities.
package identity

import (
	"fmt"
	"strings"
)

const spiffeScheme = "spiffe://"

// MaxIDLen is the longest SPIFFE ID accepted, in bytes: the SPIFFE
// specification's limit for the URI. An ID is a policy key, a metric label
// and a log field, so a CA or peer cannot make one arbitrarily large.
const MaxIDLen = 2048

// ID is a Kubernetes workload identity: the service account a pod runs as,
// within a trust domain. Its URI form is
// spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>, the form Istio
// puts in certificates, so the two meshes can verify each other.
type ID struct {
	TrustDomain    string
	Namespace      string
	ServiceAccount string
}

// String returns the SPIFFE URI of id.
func (id ID) String() string {
	return spiffeScheme + id.Principal()
}

// Principal returns id without the spiffe:// scheme
// ("cluster.local/ns/default/sa/web"): the form AuthorizationPolicy
// principals are written in.
func (id ID) Principal() string {
	return id.TrustDomain + "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount
}

// IsZero reports whether id is the zero ID (no identity).
func (id ID) IsZero() bool {
	return id == ID{}
}

// Validate reports whether id can be written as a SPIFFE ID that ParseID
// would read back unchanged.
func (id ID) Validate() error {
	if n := len(spiffeScheme) + len(id.TrustDomain) + len("/ns/") + len(id.Namespace) + len("/sa/") + len(id.ServiceAccount); n > MaxIDLen {
		return fmt.Errorf("%w: %d bytes, longer than %d", ErrInvalidID, n, MaxIDLen)
	}
	if err := ValidateTrustDomain(id.TrustDomain); err != nil {
		return fmt.Errorf("%w %q: %w", ErrInvalidID, id.String(), err)
	}
	if err := validateSegment("namespace", id.Namespace); err != nil {
		return fmt.Errorf("%w %q: %w", ErrInvalidID, id.String(), err)
	}
	if err := validateSegment("service account", id.ServiceAccount); err != nil {
		return fmt.Errorf("%w %q: %w", ErrInvalidID, id.String(), err)
	}
	return nil
}

// MarshalText writes id as its SPIFFE URI, so IDs read naturally in JSON
// (the inspect CLI, config dumps) and work as JSON map keys.
func (id ID) MarshalText() ([]byte, error) {
	if id.IsZero() {
		return nil, nil
	}
	return []byte(id.String()), nil
}

// UnmarshalText parses a SPIFFE URI with ParseID.
func (id *ID) UnmarshalText(b []byte) error {
	if len(b) == 0 {
		*id = ID{}
		return nil
	}
	parsed, err := ParseID(string(b))
	if err != nil {
		return err
	}
	*id = parsed
	return nil
}

// ParseID parses spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>.
// It is strict: the scheme and trust domain must be lowercase, there may be
// no port, user info, query, fragment, percent-encoding, empty or dot
// segments, or trailing slash, and it is at most MaxIDLen bytes. Being
// strict here matters because the result is compared for equality in
// authorization decisions: two spellings of one identity must not exist.
func ParseID(s string) (ID, error) {
	if len(s) > MaxIDLen {
		// Not quoted in full: the point is that it is too long to repeat.
		return ID{}, fmt.Errorf("%w %.64q...: %d bytes, longer than %d", ErrInvalidID, s, len(s), MaxIDLen)
	}
	rest, ok := strings.CutPrefix(s, spiffeScheme)
	if !ok {
		return ID{}, fmt.Errorf("%w %q: must start with %q", ErrInvalidID, s, spiffeScheme)
	}
	td, path, ok := strings.Cut(rest, "/")
	if !ok {
		return ID{}, fmt.Errorf("%w %q: no path; want %s<trust-domain>/ns/<namespace>/sa/<service-account>", ErrInvalidID, s, spiffeScheme)
	}
	if err := ValidateTrustDomain(td); err != nil {
		return ID{}, fmt.Errorf("%w %q: %w", ErrInvalidID, s, err)
	}
	parts := strings.Split(path, "/")
	if len(parts) != 4 || parts[0] != "ns" || parts[2] != "sa" {
		return ID{}, fmt.Errorf("%w %q: path must be /ns/<namespace>/sa/<service-account>", ErrInvalidID, s)
	}
	id := ID{TrustDomain: td, Namespace: parts[1], ServiceAccount: parts[3]}
	if err := validateSegment("namespace", id.Namespace); err != nil {
		return ID{}, fmt.Errorf("%w %q: %w", ErrInvalidID, s, err)
	}
	if err := validateSegment("service account", id.ServiceAccount); err != nil {
		return ID{}, fmt.Errorf("%w %q: %w", ErrInvalidID, s, err)
	}
	return id, nil
}

// ValidateTrustDomain checks a trust domain name: 1 to 255 characters of
// lowercase letters, digits, '-', '_' and '.', made of non-empty
// dot-separated labels (DNS-like, as the SPIFFE specification asks). The
// error names the offending value.
func ValidateTrustDomain(td string) error {
	switch {
	case td == "":
		return fmt.Errorf("trust domain is empty")
	case len(td) > 255:
		return fmt.Errorf("trust domain %q is longer than 255 characters", td)
	}
	for i := 0; i < len(td); i++ {
		c := td[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return fmt.Errorf("trust domain %q: character %q at offset %d is not a lowercase letter, digit, '-', '_' or '.'", td, c, i)
		}
	}
	for label := range strings.SplitSeq(td, ".") {
		if label == "" {
			return fmt.Errorf("trust domain %q has an empty label", td)
		}
	}
	return nil
}

// validateSegment checks one SPIFFE path segment: letters, digits, '-',
// '_' and '.', not empty, not "." or "..". Kubernetes names are a subset.
func validateSegment(what, seg string) error {
	switch seg {
	case "":
		return fmt.Errorf("%s is empty", what)
	case ".", "..":
		return fmt.Errorf("%s %q is a dot segment", what, seg)
	}
	for i := 0; i < len(seg); i++ {
		c := seg[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return fmt.Errorf("%s %q: character %q at offset %d is not a letter, digit, '-', '_' or '.'", what, seg, c, i)
		}
	}
	return nil
}
