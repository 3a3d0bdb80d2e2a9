package identity

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/asn1"
	"errors"
	"fmt"
	"slices"
	"time"
)

// ALPN is the only application protocol HBONE speaks.
const ALPN = "h2"

// ServerConfig is the TLS configuration of the HBONE listener for the local
// workload identity local. It requires TLS 1.3, offers ALPN h2, asks every
// client for a certificate, and accepts only certificates that chain to the
// mesh root, allow client authentication, and carry exactly one SPIFFE ID in
// the trust domain (see verifyPeer and idFromLeaf for the rest). A client
// that did not negotiate h2 is the HBONE server's to refuse, after the
// handshake: it answers in HTTP/1.1 that the port needs h2, where this
// config's only word would be the alert bad_certificate, which
// VerifyConnection's errors get and which blames a certificate that is fine. Which clients
// may then open which streams is policy's business, not this config's:
// read the identity with PeerID. The check holds at the handshake; a
// connection outliving the client's certificate or root is drained by the
// HBONE server (see Reverify).
//
// The certificate is fetched per handshake (GetCertificate), so rotation
// reaches new connections and never disturbs open ones.
func ServerConfig(m *Manager, local ID) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		NextProtos: []string{ALPN},
		ClientAuth: tls.RequireAnyClientCert,
		GetCertificate: func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			return m.presented(local, hello != nil && hello.Context() != nil)
		},
		// VerifyConnection rather than VerifyPeerCertificate: it also runs on
		// resumed sessions, so no path skips the identity check.
		VerifyConnection: func(cs tls.ConnectionState) error {
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
		GetClientCertificate: func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return m.presented(local, cri != nil && cri.Context() != nil)
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

// presented is Certificate for the TLS callbacks, counted only when a
// handshake asks: crypto/tls gives every handshake's hello and request info
// a context. The HBONE server and pool ask without one what a new
// handshake would present now, to stop connections whose certificate was
// renewed or lost (hbone's presented.go); such a check finding none is no
// handshake failing closed, and counted, an identity that lost its
// certificate read as about twice the failed handshakes it had.
func (m *Manager) presented(id ID, handshake bool) (*tls.Certificate, error) {
	if handshake {
		return m.Certificate(id)
	}
	cert, _, err := m.lookup(id)
	return cert, err
}

func checkALPN(cs tls.ConnectionState) error {
	if cs.NegotiatedProtocol != ALPN {
		return fmt.Errorf("alpn %q negotiated, want %q: peer does not speak hbone", cs.NegotiatedProtocol, ALPN)
	}
	return nil
}

// verifyPeer checks a peer's chain against the Manager's current roots at
// the Manager's time and returns the identity in its leaf. A chain longer
// than MaxChainLen is refused before any work on it: this node accepts no
// longer one from its own CA either, and each certificate costs a
// handshake time and memory.
func verifyPeer(m *Manager, chain []*x509.Certificate, usage x509.ExtKeyUsage) (ID, error) {
	id, _, err := verifyPeerChains(m, chain, usage)
	return id, err
}

// verifyPeerChains is verifyPeer, also returning the chains that verified.
func verifyPeerChains(m *Manager, chain []*x509.Certificate, usage x509.ExtKeyUsage) (ID, [][]*x509.Certificate, error) {
	if len(chain) == 0 {
		return ID{}, nil, ErrNoPeerCertificate
	}
	if len(chain) > MaxChainLen {
		return ID{}, nil, fmt.Errorf("%w: chain of %d certificates, at most %d accepted", ErrUntrustedPeer, len(chain), MaxChainLen)
	}
	roots, err := m.roots()
	if err != nil {
		return ID{}, nil, fmt.Errorf("%w: %w", ErrUntrustedPeer, err)
	}
	leaf := chain[0]
	opts := x509.VerifyOptions{
		Roots:       roots,
		CurrentTime: m.clock(),
		KeyUsages:   []x509.ExtKeyUsage{usage},
	}
	if len(chain) > 1 {
		opts.Intermediates = x509.NewCertPool()
		for _, c := range chain[1:] {
			opts.Intermediates.AddCert(c)
		}
	}
	chains, err := leaf.Verify(opts)
	if err != nil {
		return ID{}, nil, fmt.Errorf("%w: %w", ErrUntrustedPeer, err)
	}
	if err := strongChain(chains, usage); err != nil {
		return ID{}, nil, fmt.Errorf("%w: %w", ErrUntrustedPeer, err)
	}
	id, err := idFromLeaf(leaf)
	if err != nil {
		return ID{}, nil, err
	}
	if td := m.opts.Trust.TrustDomain(); id.TrustDomain != td {
		return ID{}, nil, fmt.Errorf("%w: %s is not in trust domain %q", ErrUntrustedPeer, id, td)
	}
	return id, chains, nil
}

// PeerChainEnd is when the chain the peer of a connection made with
// ServerConfig (usage x509.ExtKeyUsageClientAuth) or ClientConfig
// (x509.ExtKeyUsageServerAuth) presented stops verifying: the latest end
// among the chains that verify now against the current roots, each the
// first NotAfter along it, the root's included (chainsEnd). It is what the
// HBONE connection drains at. The chains are verified, not followed by
// issuer names: a peer may add certificates of its own making that carry
// its intermediate's name and a later end, and a drain time taken from
// them served it, as its identity, past the end of the chain that
// verified. A chain that does not verify now ends now.
func (m *Manager) PeerChainEnd(cs tls.ConnectionState, usage x509.ExtKeyUsage) time.Time {
	_, chains, err := verifyPeerChains(m, cs.PeerCertificates, usage)
	if err != nil {
		return m.clock()
	}
	return chainsEnd(chains, usage)
}

// Reverify checks again, against the current roots at the Manager's time,
// the chain presented by the peer of a connection made with ServerConfig
// (usage x509.ExtKeyUsageClientAuth: the peer is a client) or ClientConfig
// (x509.ExtKeyUsageServerAuth). A handshake checks the roots of its moment
// only; when they change (OnTrustChange), a connection whose peer no
// longer verifies, its root removed, must carry no new streams.
func (m *Manager) Reverify(cs tls.ConnectionState, usage x509.ExtKeyUsage) error {
	_, err := verifyPeer(m, cs.PeerCertificates, usage)
	return err
}

// OnTrustChange registers f to run after the roots of the Manager's Trust
// changed, if the Trust tells (a Bundle does; a file CA's roots are fixed
// for its life).
func (m *Manager) OnTrustChange(f func()) {
	if t, ok := m.opts.Trust.(interface{ OnChange(func()) }); ok {
		t.OnChange(f)
	}
}

// idFromLeaf reads the SPIFFE ID of an X.509-SVID: a leaf with exactly one
// URI SAN. A certificate naming two identities names none.
//
// The URI is read as the issuer encoded it (uriSANs), not from leaf.URIs:
// crypto/x509 hands those over parsed by net/url, which lowercases the
// scheme and drops an empty fragment, so "SPIFFE://td/ns/a/sa/b#" would
// read as an ID that ParseID refuses in that spelling and ztunnel does not
// accept.
//
// The leaf's key usage, when present, must allow digitalSignature (TLS 1.3
// signs the handshake with it, RFC 8446 4.4.2.2; crypto/tls does not check)
// and must not allow signing certificates or CRLs (the X.509-SVID
// specification; crypto/x509 does not check either). Istio's workload
// certificates carry digitalSignature and keyEncipherment. The key must be
// one rustls verifies (checkKey): crypto/tls takes RSA of 1024 bits.
func idFromLeaf(leaf *x509.Certificate) (ID, error) {
	if leaf.IsCA {
		return ID{}, fmt.Errorf("%w: leaf certificate is a CA", ErrUntrustedPeer)
	}
	if leaf.KeyUsage != 0 && leaf.KeyUsage&x509.KeyUsageDigitalSignature == 0 {
		return ID{}, fmt.Errorf("%w: leaf key usage lacks digitalSignature, which TLS 1.3 needs to sign the handshake", ErrUntrustedPeer)
	}
	if leaf.KeyUsage&(x509.KeyUsageCertSign|x509.KeyUsageCRLSign) != 0 {
		return ID{}, fmt.Errorf("%w: leaf key usage allows signing certificates or CRLs, which an X.509-SVID must not", ErrUntrustedPeer)
	}
	if err := checkKey(leaf.PublicKey); err != nil {
		return ID{}, fmt.Errorf("%w: leaf %w", ErrUntrustedPeer, err)
	}
	uris, err := uriSANs(leaf)
	if err != nil {
		return ID{}, fmt.Errorf("%w: %w", ErrUntrustedPeer, err)
	}
	if len(uris) != 1 {
		return ID{}, fmt.Errorf("%w: certificate has %d URI SANs, want exactly one SPIFFE ID", ErrUntrustedPeer, len(uris))
	}
	id, err := ParseID(uris[0])
	if err != nil {
		return ID{}, fmt.Errorf("%w: %w", ErrUntrustedPeer, err)
	}
	return id, nil
}

// strongChain accepts verified chains when one of them is one rustls
// (ztunnel) accepts too for usage (unusable): crypto/x509 verifies
// signatures of RSA keys of 1024 bits or of P-224 keys anywhere in a
// chain and ECDSA signatures with SHA-512 by P-256 keys, takes the
// anyExtendedKeyUsage purpose for every usage, builds paths of any depth
// and evaluates name constraints on URIs, where rustls refuses all of
// these, so such a chain would work only between agents like this one.
func strongChain(chains [][]*x509.Certificate, usage x509.ExtKeyUsage) error {
	var firstErr error
	for _, chain := range chains {
		c, err := unusable(chain, usage)
		if c == nil {
			return nil
		}
		if firstErr == nil {
			firstErr = fmt.Errorf("%w in the chain (%q)", err, c.Subject.String())
		}
	}
	if firstErr == nil {
		return errors.New("no verified chain")
	}
	return firstErr
}

// unusable returns the first certificate of a verified chain that rustls
// would refuse for usage, and why; nil if there is none. Every key in the
// chain, the root's included, signs something the verifier relies on, so
// each must be one checkKey accepts. Every certificate but the root (a
// trust anchor, whose extensions rustls does not read; crypto/x509 has
// checked its usages already) that has the extended key usage extension
// must name usage itself: rustls does not read anyExtendedKeyUsage
// (2.5.29.37.0) as allowing it, and refuses an empty extension. Each
// signature along the chain must be one rustls verifies
// (checkSignatureAlgorithm). No issuer, the root included, may constrain
// URI names: rustls does not evaluate such constraints and refuses every
// URI under them, permitted or not, where crypto/x509 evaluates them.
//
// Nor may more than maxIntermediates certificates stand between the leaf
// and the root: rustls builds no longer path, where crypto/x509 has no
// bound of its own (MaxChainLen bounds what is presented, the root left
// out, so a leaf and seven intermediates verified).
func unusable(chain []*x509.Certificate, usage x509.ExtKeyUsage) (*x509.Certificate, error) {
	if n := len(chain) - 2; n > maxIntermediates {
		return chain[maxIntermediates+1], fmt.Errorf("%d intermediates between the leaf and the root, at most %d accepted", n, maxIntermediates)
	}
	for i, c := range chain {
		if err := checkKey(c.PublicKey); err != nil {
			return c, err
		}
		if i > 0 && (len(c.PermittedURIDomains) > 0 || len(c.ExcludedURIDomains) > 0) {
			return c, errors.New("name constraints on URI names, which rustls does not evaluate: it refuses every SPIFFE ID under them")
		}
		if i == len(chain)-1 {
			break // the root: its own signature is not relied on
		}
		if hasExtension(c, oidExtKeyUsage) && !slices.Contains(c.ExtKeyUsage, usage) {
			return c, fmt.Errorf("extended key usage does not name %s", usageName(usage))
		}
		if err := checkSignatureAlgorithm(c, chain[i+1]); err != nil {
			return c, err
		}
	}
	return nil, nil
}

// checkSignatureAlgorithm refuses the signatures on c by issuer's key
// that crypto/x509 verifies and rustls (aws-lc-rs) does not: ECDSA with
// SHA-512 by a P-256 or P-384 key (rustls takes SHA-512 with P-521 only).
// The other algorithms crypto/x509 verifies, rustls does too, with the
// keys checkKey accepts.
func checkSignatureAlgorithm(c, issuer *x509.Certificate) error {
	if c.SignatureAlgorithm != x509.ECDSAWithSHA512 {
		return nil
	}
	if k, ok := issuer.PublicKey.(*ecdsa.PublicKey); ok && k.Curve != elliptic.P521() {
		return fmt.Errorf("signed with ECDSA and SHA-512 by a key on curve %s, which rustls does not verify", k.Curve.Params().Name)
	}
	return nil
}

// usageName names the usages verifyPeer checks, as the errors say them.
func usageName(u x509.ExtKeyUsage) string {
	switch u {
	case x509.ExtKeyUsageClientAuth:
		return "clientAuth"
	case x509.ExtKeyUsageServerAuth:
		return "serverAuth"
	}
	return fmt.Sprintf("usage %d", u)
}

// hasExtension reports whether c carries the extension id.
func hasExtension(c *x509.Certificate, id asn1.ObjectIdentifier) bool {
	for _, ext := range c.Extensions {
		if ext.Id.Equal(id) {
			return true
		}
	}
	return false
}

// maxIntermediates is the most intermediates rustls-webpki puts in a path
// (its MAX_SUB_CA_COUNT).
const maxIntermediates = 6

// oidExtKeyUsage is the X.509 extendedKeyUsage extension.
var oidExtKeyUsage = asn1.ObjectIdentifier{2, 5, 29, 37}

// checkKey accepts the public keys rustls verifies signatures of, as
// ztunnel builds it (aws-lc-rs; ring lacks P-521): RSA of minRSABits to
// maxRSABits, ECDSA on P-256, P-384 or P-521, and Ed25519. crypto/x509
// also verifies P-224 and any RSA size, and crypto/tls refuses RSA over
// 8192 bits only in what a peer sends: a CA answer with such a key would
// be taken here and refused by every peer.
func checkKey(pub any) error {
	switch k := pub.(type) {
	case *rsa.PublicKey:
		if n := k.N.BitLen(); n < minRSABits || n > maxRSABits {
			return fmt.Errorf("rsa key of %d bits, want %d to %d", n, minRSABits, maxRSABits)
		}
	case *ecdsa.PublicKey:
		switch k.Curve {
		case elliptic.P256(), elliptic.P384(), elliptic.P521():
		default:
			return fmt.Errorf("ecdsa key on curve %s, want P-256, P-384 or P-521", k.Curve.Params().Name)
		}
	case ed25519.PublicKey:
	default:
		return fmt.Errorf("key of type %T, want RSA, ECDSA or Ed25519", pub)
	}
	return nil
}

// minRSABits and maxRSABits bound the RSA keys accepted anywhere in a
// chain, as for a CA key (parseKey): rustls takes RSA signatures only from
// keys of 2048 to 8192 bits, and crypto/tls none over 8192 from a peer.
const (
	minRSABits = 2048
	maxRSABits = 8192
)

// oidSubjectAltName is the X.509 subjectAltName extension.
var oidSubjectAltName = asn1.ObjectIdentifier{2, 5, 29, 17}

// uriSANs returns the uniformResourceIdentifier names of c's
// subjectAltName extension, byte for byte as the issuer encoded them.
// crypto/x509 has parsed the extension already (and refuses a certificate
// holding it twice), so an error here means a certificate that was not
// parsed by it.
func uriSANs(c *x509.Certificate) ([]string, error) {
	var uris []string
	for _, ext := range c.Extensions {
		if !ext.Id.Equal(oidSubjectAltName) {
			continue
		}
		var seq asn1.RawValue
		rest, err := asn1.Unmarshal(ext.Value, &seq)
		if err != nil || len(rest) > 0 || seq.Class != asn1.ClassUniversal || seq.Tag != asn1.TagSequence || !seq.IsCompound {
			return nil, errors.New("subjectAltName extension is not a SEQUENCE")
		}
		for names := seq.Bytes; len(names) > 0; {
			var name asn1.RawValue
			if names, err = asn1.Unmarshal(names, &name); err != nil {
				return nil, fmt.Errorf("subjectAltName extension: %w", err)
			}
			const uriTag = 6 // GeneralName [6] uniformResourceIdentifier
			if name.Class == asn1.ClassContextSpecific && name.Tag == uriTag {
				uris = append(uris, string(name.Bytes))
			}
		}
	}
	return uris, nil
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
