package identity

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
)

// ALPN is the only application protocol HBONE speaks.
const ALPN = "h2"

// ServerConfig is the TLS configuration of the HBONE listener for the local
// workload identity local. It requires TLS 1.3 and ALPN h2, asks every client
// for a certificate, and accepts only certificates that chain to the mesh
// root, allow client authentication, and carry exactly one SPIFFE ID in the
// trust domain. Which clients may then open which streams is policy's
// business, not this config's: read the identity with PeerID.
//
// The certificate is fetched per handshake (GetCertificate), so rotation
// reaches new connections and never disturbs open ones.
func ServerConfig(m *Manager, local ID) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		NextProtos: []string{ALPN},
		ClientAuth: tls.RequireAnyClientCert,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return m.Certificate(local)
		},
		// VerifyConnection rather than VerifyPeerCertificate: it also runs on
		// resumed sessions, so no path skips the identity check.
		VerifyConnection: func(cs tls.ConnectionState) error {
			if err := checkALPN(cs); err != nil {
				return err
			}
			_, err := verifyPeer(m, cs.PeerCertificates, x509.ExtKeyUsageClientAuth)
			return err
		},
		// Tickets would let a client skip presenting a certificate on
		// resumption; every connection proves a current certificate instead.
		SessionTicketsDisabled: true,
		Time:                   m.clock,
	}
}

// ClientConfig is the TLS configuration for dialing the HBONE port of a
// workload that must be expectedServer, presenting local's certificate.
// Go's hostname verification does not apply to SPIFFE IDs, so it is turned
// off (InsecureSkipVerify) and replaced by VerifyConnection, which checks the
// chain against the mesh root (server authentication usage) and requires the
// server's SPIFFE ID to equal expectedServer exactly.
func ClientConfig(m *Manager, local ID, expectedServer ID) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		NextProtos: []string{ALPN},
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return m.Certificate(local)
		},
		InsecureSkipVerify: true, // replaced by VerifyConnection below
		VerifyConnection: func(cs tls.ConnectionState) error {
			if err := checkALPN(cs); err != nil {
				return err
			}
			got, err := verifyPeer(m, cs.PeerCertificates, x509.ExtKeyUsageServerAuth)
			if err != nil {
				return err
			}
			if got != expectedServer {
				return fmt.Errorf("%w: expected server %s, got %s", ErrUnexpectedIdentity, expectedServer, got)
			}
			return nil
		},
		Time: m.clock,
	}
}

func checkALPN(cs tls.ConnectionState) error {
	if cs.NegotiatedProtocol != ALPN {
		return fmt.Errorf("alpn %q negotiated, want %q: peer does not speak hbone", cs.NegotiatedProtocol, ALPN)
	}
	return nil
}

// verifyPeer checks a peer's chain against the Manager's current roots at
// the Manager's time and returns the identity in its leaf.
func verifyPeer(m *Manager, chain []*x509.Certificate, usage x509.ExtKeyUsage) (ID, error) {
	if len(chain) == 0 {
		return ID{}, ErrNoPeerCertificate
	}
	leaf := chain[0]
	opts := x509.VerifyOptions{
		Roots:       m.opts.Trust.Roots(),
		CurrentTime: m.clock(),
		KeyUsages:   []x509.ExtKeyUsage{usage},
	}
	if len(chain) > 1 {
		opts.Intermediates = x509.NewCertPool()
		for _, c := range chain[1:] {
			opts.Intermediates.AddCert(c)
		}
	}
	if _, err := leaf.Verify(opts); err != nil {
		return ID{}, fmt.Errorf("%w: %w", ErrUntrustedPeer, err)
	}
	id, err := idFromLeaf(leaf)
	if err != nil {
		return ID{}, err
	}
	if td := m.opts.Trust.TrustDomain(); id.TrustDomain != td {
		return ID{}, fmt.Errorf("%w: %s is not in trust domain %q", ErrUntrustedPeer, id, td)
	}
	return id, nil
}

// idFromLeaf reads the SPIFFE ID of an X.509-SVID: a leaf with exactly one
// URI SAN. A certificate naming two identities names none.
func idFromLeaf(leaf *x509.Certificate) (ID, error) {
	if leaf.IsCA {
		return ID{}, fmt.Errorf("%w: leaf certificate is a CA", ErrUntrustedPeer)
	}
	if len(leaf.URIs) != 1 {
		return ID{}, fmt.Errorf("%w: certificate has %d URI SANs, want exactly one SPIFFE ID", ErrUntrustedPeer, len(leaf.URIs))
	}
	id, err := ParseID(leaf.URIs[0].String())
	if err != nil {
		return ID{}, fmt.Errorf("%w: %w", ErrUntrustedPeer, err)
	}
	return id, nil
}

// PeerID returns the identity of the peer of a connection whose handshake
// completed with ServerConfig or ClientConfig (which verified the chain).
// On any other connection state the result proves nothing.
func PeerID(cs tls.ConnectionState) (ID, error) {
	if !cs.HandshakeComplete {
		return ID{}, errors.New("peer id: tls handshake not complete")
	}
	if len(cs.PeerCertificates) == 0 {
		return ID{}, fmt.Errorf("peer id: %w", ErrNoPeerCertificate)
	}
	id, err := idFromLeaf(cs.PeerCertificates[0])
	if err != nil {
		return ID{}, fmt.Errorf("peer id: %w", err)
	}
	return id, nil
}
