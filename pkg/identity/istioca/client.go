// Package istioca asks istiod for workload certificates the way ztunnel
// does: a CSR per identity to istio.v1.auth.IstioCertificateService over
// gRPC with TLS, authenticated by the node agent's projected service account
// token, naming the workload's identity in the request metadata
// (ImpersonatedIdentity). istiod signs only identities of pods on the
// caller's own node, so a compromised node cannot mint others. No signing
// key is on the node.
package istioca

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/redirector-mesh/redirector/internal/smallfile"
	"github.com/redirector-mesh/redirector/pkg/identity"
)

// Request metadata and headers istiod reads (as ztunnel sends them).
const (
	// ImpersonatedIdentityKey is the request metadata field naming the
	// identity a node agent asks for on behalf of a local pod.
	ImpersonatedIdentityKey = "ImpersonatedIdentity"
	// ClusterIDHeader names the cluster whose API server issued the token.
	ClusterIDHeader = "ClusterID"
)

// MaxTokenBytes bounds a token file read (a projected service account
// token is a few KiB): a fifo, a device or an outsized file at the path is
// an error, not a read that blocks every request or fills the memory.
const MaxTokenBytes = 64 << 10

// DefaultServerName is the name in istiod's serving certificate that the
// client checks when the address is not a DNS name of istiod.
const DefaultServerName = "istiod.istio-system.svc"

// Config configures a Client.
type Config struct {
	// Addr is istiod's CA address, host:port (port 15012).
	Addr string
	// ServerName is the DNS name istiod's serving certificate must carry;
	// empty: the host of Addr, or DefaultServerName when that is an IP.
	ServerName string
	// TokenFile holds the agent's service account token (a projected
	// token, audience istio-ca). It is re-read for every request, since
	// the kubelet rotates it.
	TokenFile string
	// ClusterID is istiod's name for this cluster (its CLUSTER_ID); empty
	// sends none.
	ClusterID string
	// Trust verifies istiod's serving certificate and the chains it
	// returns; a reloaded bundle takes effect at once (see Credentials).
	Trust identity.Trust
	// Logger logs connections closed by a change of the roots; nil:
	// slog.Default.
	Logger *slog.Logger
}

// Client implements identity.Signer with istiod.
type Client struct {
	cfg Config
	// creds are shared by every connection dial makes, so a change of the
	// roots reaches them all.
	creds  credentials.TransportCredentials
	mu     sync.Mutex
	conn   *caConn
	closed bool
}

// caConn is a connection to istiod and the requests in flight on it
// (guarded by Client.mu): one redial replaced is closed when the last of
// them ends, not under them.
type caConn struct {
	*grpc.ClientConn
	inflight int
	retired  bool
}

// New returns a client; it connects lazily, so istiod need not be up yet.
func New(cfg Config) (*Client, error) {
	if _, _, err := net.SplitHostPort(cfg.Addr); err != nil {
		return nil, fmt.Errorf("istiod address %q: want host:port: %w", cfg.Addr, err)
	}
	if cfg.Trust == nil {
		return nil, errors.New("istiod client: no trust bundle to verify istiod with")
	}
	if cfg.ServerName == "" {
		host, _, _ := net.SplitHostPort(cfg.Addr)
		cfg.ServerName = host
		if net.ParseIP(host) != nil {
			cfg.ServerName = DefaultServerName
		}
	}
	c := &Client{cfg: cfg, creds: Credentials(cfg.Trust, cfg.ServerName, cfg.Logger)}
	conn, err := c.dial()
	if err != nil {
		return nil, err
	}
	c.conn = &caConn{ClientConn: conn}
	return c, nil
}

func (c *Client) dial() (*grpc.ClientConn, error) {
	conn, err := grpc.NewClient(c.cfg.Addr,
		grpc.WithTransportCredentials(c.creds),
		grpc.WithMaxHeaderListSize(maxHeaderBytes),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxAnswerBytes)),
		// Reconnect quickly once istiod is back (gRPC's default backoff
		// grows to two minutes).
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 500 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 10 * time.Second},
			MinConnectTimeout: 5 * time.Second,
		}),
	)
	if err != nil {
		return nil, fmt.Errorf("istiod client for %s: %w", c.cfg.Addr, err)
	}
	return conn, nil
}

// maxHeaderBytes bounds the headers and trailers istiod's answers may
// carry (gRPC's default is 16 MiB): an error message there is kept as an
// identity's last error, logged at each retry and shown in the config
// dump. istiod's are a few hundred bytes.
const maxHeaderBytes = 64 << 10

// maxAnswerBytes bounds an answer (gRPC's default is 4 MiB): a real one
// is a chain of at most identity.MaxChainLen PEM certificates, a few KiB
// each, while 4 MiB of one-byte chain entries decode to some 50 MiB, for
// each of the requests in flight.
const maxAnswerBytes = 64 << 10

// acquire is the connection a request uses now, counted in flight until
// release.
func (c *Client) acquire() *caConn {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.conn.inflight++
	return c.conn
}

// release ends a request on cc; the last one on a replaced connection
// closes it.
func (c *Client) release(cc *caConn) {
	c.mu.Lock()
	cc.inflight--
	last := cc.retired && cc.inflight == 0
	c.mu.Unlock()
	if last {
		cc.Close()
	}
}

// redial replaces stale, on which a request timed out, with a new
// connection. A connection whose far end is gone while something between
// keeps the TCP side open (a proxy or load balancer in front of istiod)
// would otherwise time out every request for ever: HTTP/2 keepalive cannot
// find it out here, since istiod refuses PINGs while no request is open
// and more often than every 15 s, longer than a request may take. A slow
// istiod costs one new connection per timeout, which may reach another
// replica.
//
// The requests still in flight on stale run on, each to its own deadline,
// and the last closes it (release): closed at once, it failed up to 7
// requests that istiod may have been about to answer, which the manager
// then asked again for, so that one slow answer (a slow signer behind
// istiod's API, such as cert-manager's istio-csr) multiplied the requests.
func (c *Client) redial(stale *caConn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn != stale || c.closed {
		return // another request did already, or Close
	}
	fresh, err := c.dial()
	if err != nil {
		return
	}
	c.conn = &caConn{ClientConn: fresh}
	stale.retired = true
}

// verifyServer checks istiod's serving certificate against the mesh roots
// and its DNS name. It returns when the verified chain stops being valid:
// the earliest end of validity of its certificates.
func verifyServer(chain []*x509.Certificate, roots *x509.CertPool, name string) (time.Time, error) {
	if len(chain) == 0 {
		return time.Time{}, errors.New("istiod presented no certificate")
	}
	opts := x509.VerifyOptions{Roots: roots, DNSName: name, Intermediates: x509.NewCertPool()}
	for _, c := range chain[1:] {
		opts.Intermediates.AddCert(c)
	}
	chains, err := chain[0].Verify(opts)
	if err != nil {
		return time.Time{}, fmt.Errorf("istiod's serving certificate: %w", err)
	}
	// Of the chains that verify, the one valid longest decides.
	var until time.Time
	for _, c := range chains {
		end := c[0].NotAfter
		for _, cert := range c[1:] {
			if cert.NotAfter.Before(end) {
				end = cert.NotAfter
			}
		}
		if end.After(until) {
			until = end
		}
	}
	return until, nil
}

// Close closes the connection to istiod.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	return c.conn.Close()
}

// Name implements identity.Signer.
func (c *Client) Name() string { return "istiod:" + c.cfg.Addr }

// Sign implements identity.Signer: it makes a P-256 key and CSR for id,
// asks istiod for a certificate valid for ttl, and returns it only if the
// leaf is for exactly id and our key and the chain verifies to the trust
// bundle.
func (c *Client) Sign(ctx context.Context, id identity.ID, ttl time.Duration) (*tls.Certificate, error) {
	token, err := c.token()
	if err != nil {
		return nil, &identity.CAError{Reason: identity.ReasonToken, Err: err}
	}
	key, csrPEM, err := makeCSR(id)
	if err != nil {
		return nil, &identity.CAError{Reason: identity.ReasonLocal, Err: err}
	}
	md := metadata.Pairs("authorization", "Bearer "+token)
	if c.cfg.ClusterID != "" {
		md.Set(ClusterIDHeader, c.cfg.ClusterID)
	}
	req := &pb.IstioCertificateRequest{
		Csr:              string(csrPEM),
		ValidityDuration: int64(ttl / time.Second),
		Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
			ImpersonatedIdentityKey: structpb.NewStringValue(id.String()),
		}},
	}
	conn := c.acquire()
	resp, err := pb.NewIstioCertificateServiceClient(conn).CreateCertificate(metadata.NewOutgoingContext(ctx, md), req)
	if status.Code(err) == codes.DeadlineExceeded {
		c.redial(conn)
	}
	c.release(conn)
	if err != nil {
		return nil, &identity.CAError{Reason: reasonOf(err), Err: fmt.Errorf("istiod CreateCertificate: %w", err)}
	}
	cert, err := c.parse(id, key, resp.GetCertChain())
	if err != nil {
		return nil, err
	}
	return cert, nil
}

func (c *Client) token() (string, error) {
	if c.cfg.TokenFile == "" {
		return "", errors.New("no token file configured (--ca-token-file)")
	}
	b, err := smallfile.Read(c.cfg.TokenFile, MaxTokenBytes)
	if err != nil {
		return "", fmt.Errorf("read token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("token file %s is empty", c.cfg.TokenFile)
	}
	return tok, nil
}

func makeCSR(id identity.ID) (*ecdsa.PrivateKey, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate key: %w", err)
	}
	u, err := url.Parse(id.String())
	if err != nil {
		return nil, nil, fmt.Errorf("csr san: %w", err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{u}}, key)
	if err != nil {
		return nil, nil, fmt.Errorf("create csr: %w", err)
	}
	return key, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}), nil
}

// maxAnswerCerts bounds the certificates of an answer as a whole: the
// chain, at most identity.MaxChainLen of them presented, and the roots
// istiod appends, its whole root-cert.pem, every trust anchor of a
// multi-root mesh (ISTIO_MULTIROOT_MESH), which a few dozen cover. A
// 64 KiB answer (maxAnswerBytes) holds some 300 certificates as small as
// can be.
const maxAnswerCerts = 64

// parse turns istiod's answer (PEM strings: the leaf, then the chain its
// cert-chain.pem flattens, root included, then its root-cert.pem as one
// entry) into a certificate for id, checked. The roots are left out of
// what is presented, so they do not count against identity.MaxChainLen.
func (c *Client) parse(id identity.ID, key crypto.Signer, chainPEM []string) (*tls.Certificate, error) {
	bad := func(format string, a ...any) error {
		return &identity.CAError{Reason: identity.ReasonBadResponse, Err: fmt.Errorf("istiod answer: "+format, a...)}
	}
	var certs []*x509.Certificate
	for i, p := range chainPEM {
		// Before the rest is parsed or any signature checked: a real
		// answer holds a few, a hostile one thousands.
		if len(certs) > maxAnswerCerts {
			return nil, bad("more than %d certificates, at most %d accepted", len(certs), maxAnswerCerts)
		}
		cs, err := identity.ParseCertificates([]byte(p))
		if err != nil {
			return nil, bad("chain entry %d: %w", i, err)
		}
		certs = append(certs, cs...)
	}
	if len(certs) == 0 {
		return nil, bad("empty certificate chain")
	}
	if len(certs) > maxAnswerCerts {
		return nil, bad("%d certificates, at most %d accepted", len(certs), maxAnswerCerts)
	}
	leaf := certs[0]
	if pub, ok := key.Public().(*ecdsa.PublicKey); !ok || !pub.Equal(leaf.PublicKey) {
		return nil, bad("leaf is not for the key of our request")
	}
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != id.String() {
		var got []string
		for _, u := range leaf.URIs {
			got = append(got, u.String())
		}
		return nil, &identity.CAError{Reason: identity.ReasonWrongIdentity,
			Err: fmt.Errorf("%w: asked istiod for %s, leaf carries %v", identity.ErrUnexpectedIdentity, id, got)}
	}
	roots, err := identity.TrustRoots(c.cfg.Trust)
	if err != nil {
		return nil, &identity.CAError{Reason: identity.ReasonUntrustedChain, Err: err}
	}
	opts := x509.VerifyOptions{
		Roots:         roots,
		Intermediates: x509.NewCertPool(),
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
	}
	// Present the leaf and the intermediates; roots (self-signed) stay
	// out: peers verify against their own bundle, never one we send.
	out := &tls.Certificate{Certificate: [][]byte{leaf.Raw}, PrivateKey: key, Leaf: leaf}
	for _, ch := range certs[1:] {
		if isSelfSigned(ch) {
			continue
		}
		if len(out.Certificate) == identity.MaxChainLen {
			return nil, bad("chain of more than %d certificates below the roots, at most %d accepted", identity.MaxChainLen, identity.MaxChainLen)
		}
		opts.Intermediates.AddCert(ch)
		out.Certificate = append(out.Certificate, ch.Raw)
	}
	if _, err := leaf.Verify(opts); err != nil {
		return nil, &identity.CAError{Reason: identity.ReasonUntrustedChain,
			Err: fmt.Errorf("%w: chain from istiod does not verify to the trust bundle: %w", identity.ErrUntrustedPeer, err)}
	}
	return out, nil
}

func isSelfSigned(c *x509.Certificate) bool {
	return c.IsCA && c.CheckSignatureFrom(c) == nil
}

// reasonOf maps a gRPC error to a failure reason.
func reasonOf(err error) string {
	switch status.Code(err) {
	case codes.Unauthenticated:
		return identity.ReasonUnauthenticated
	case codes.PermissionDenied:
		return identity.ReasonPermissionDenied
	case codes.Unavailable:
		return identity.ReasonUnavailable
	case codes.DeadlineExceeded, codes.Canceled:
		return identity.ReasonTimeout
	default:
		return identity.ReasonRefused
	}
}
