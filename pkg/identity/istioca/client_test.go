package istioca

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/redirector-mesh/redirector/internal/stallproxy"
	"github.com/redirector-mesh/redirector/pkg/identity"
)

var idWeb = identity.ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "web"}

// testPKI is a self-signed root, as istiod makes it, that signs istiod's
// serving certificate and workload certificates.
type testPKI struct {
	root *x509.Certificate
	key  *ecdsa.PrivateKey
}

func newPKI(t *testing.T) testPKI {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{Organization: []string{"cluster.local"}},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	root, _ := x509.ParseCertificate(der)
	return testPKI{root: root, key: key}
}

func (p testPKI) sign(t *testing.T, tmpl *x509.Certificate, pub any) *x509.Certificate {
	t.Helper()
	tmpl.SerialNumber = big.NewInt(time.Now().UnixNano())
	tmpl.NotBefore = time.Now().Add(-time.Minute)
	if tmpl.NotAfter.IsZero() {
		tmpl.NotAfter = time.Now().Add(time.Hour)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.root, pub, p.key)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	return c
}

func pemOf(c *x509.Certificate) string {
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw}))
}

type staticTrust struct{ pool *x509.CertPool }

func (s staticTrust) TrustDomain() string   { return "cluster.local" }
func (s staticTrust) Roots() *x509.CertPool { return s.pool }
func trustOf(cs ...*x509.Certificate) staticTrust {
	p := x509.NewCertPool()
	for _, c := range cs {
		p.AddCert(c)
	}
	return staticTrust{p}
}

// fakeIstiod records requests and answers them with answer.
type fakeIstiod struct {
	pb.UnimplementedIstioCertificateServiceServer
	t   *testing.T
	pki testPKI

	mu     sync.Mutex
	md     metadata.MD
	req    *pb.IstioCertificateRequest
	answer func(csr *x509.CertificateRequest) (*pb.IstioCertificateResponse, error)
}

func (f *fakeIstiod) CreateCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	block, _ := pem.Decode([]byte(req.Csr))
	if block == nil {
		return nil, status.Error(codes.InvalidArgument, "bad csr")
	}
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	f.mu.Lock()
	f.md, f.req = md, req
	answer := f.answer
	f.mu.Unlock()
	return answer(csr)
}

// issue signs the CSR for uri, istiod's way: leaf then root.
func (f *fakeIstiod) issue(uri string) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
	return func(csr *x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
		u, _ := url.Parse(uri)
		leaf := f.pki.sign(f.t, &x509.Certificate{URIs: []*url.URL{u}, KeyUsage: x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}, csr.PublicKey)
		return &pb.IstioCertificateResponse{CertChain: []string{pemOf(leaf), pemOf(f.pki.root)}}, nil
	}
}

// startIstiod serves fake istiod over TLS with a serving certificate for
// names, signed by pki.
func startIstiod(t *testing.T, pki testPKI, names ...string) (*fakeIstiod, string) {
	t.Helper()
	return startIstiodUntil(t, pki, time.Time{}, names...)
}

// startIstiodUntil is startIstiod with a serving certificate valid until
// notAfter (zero: an hour).
func startIstiodUntil(t *testing.T, pki testPKI, notAfter time.Time, names ...string) (*fakeIstiod, string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	serving := pki.sign(t, &x509.Certificate{DNSNames: names, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		KeyUsage: x509.KeyUsageDigitalSignature, NotAfter: notAfter}, &key.PublicKey)
	creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{serving.Raw}, PrivateKey: key}}})
	srv := grpc.NewServer(grpc.Creds(creds))
	f := &fakeIstiod{t: t, pki: pki}
	f.answer = f.issue(idWeb.String())
	pb.RegisterIstioCertificateServiceServer(srv, f)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	return f, ln.Addr().String()
}

func writeToken(t *testing.T, tok string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(tok+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func newClient(t *testing.T, cfg Config) *Client {
	t.Helper()
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func sign(c *Client) (*tls.Certificate, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.Sign(ctx, idWeb, 2*time.Hour)
}

func TestSignSendsWhatIstiodChecks(t *testing.T) {
	pki := newPKI(t)
	f, addr := startIstiod(t, pki, DefaultServerName)
	c := newClient(t, Config{Addr: addr, TokenFile: writeToken(t, "tok-123"), ClusterID: "Kubernetes", Trust: trustOf(pki.root)})
	cert, err := sign(c)
	if err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	md, req := f.md, f.req
	f.mu.Unlock()
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer tok-123" {
		t.Errorf("authorization = %v", got)
	}
	if got := md.Get("clusterid"); len(got) != 1 || got[0] != "Kubernetes" {
		t.Errorf("ClusterID header = %v", got)
	}
	if got := req.GetMetadata().GetFields()[ImpersonatedIdentityKey].GetStringValue(); got != idWeb.String() {
		t.Errorf("ImpersonatedIdentity = %q", got)
	}
	if req.ValidityDuration != 7200 {
		t.Errorf("validity = %d, want 7200", req.ValidityDuration)
	}
	if len(cert.Certificate) != 1 || cert.Leaf.URIs[0].String() != idWeb.String() {
		t.Errorf("presented chain of %d (root must stay out), leaf %v", len(cert.Certificate), cert.Leaf.URIs)
	}
	if c.Name() != "istiod:"+addr {
		t.Errorf("name %q", c.Name())
	}
}

func TestSignRefuses(t *testing.T) {
	pki := newPKI(t)
	stranger := newPKI(t)
	for name, tc := range map[string]struct {
		answer func(f *fakeIstiod) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error)
		token  string
		reason string
		want   string
	}{
		"other identity": {answer: func(f *fakeIstiod) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
			return f.issue("spiffe://cluster.local/ns/other/sa/trusted")
		}, reason: identity.ReasonWrongIdentity, want: "ns/other/sa/trusted"},
		"untrusted chain": {answer: func(f *fakeIstiod) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
			other := &fakeIstiod{t: t, pki: stranger}
			return other.issue(idWeb.String())
		}, reason: identity.ReasonUntrustedChain, want: "does not verify"},
		"empty": {answer: func(f *fakeIstiod) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
			return func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
				return &pb.IstioCertificateResponse{}, nil
			}
		}, reason: identity.ReasonBadResponse, want: "empty"},
		"not our key": {answer: func(f *fakeIstiod) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
			return func(csr *x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
				k, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
				csr.PublicKey = &k.PublicKey
				return f.issue(idWeb.String())(csr)
			}
		}, reason: identity.ReasonBadResponse, want: "key"},
		"outsized chain": {answer: func(f *fakeIstiod) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
			return func(csr *x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
				resp, err := f.issue(idWeb.String())(csr)
				for range identity.MaxChainLen {
					resp.CertChain = append(resp.CertChain, resp.CertChain[0]) // not a root: presented
				}
				return resp, err
			}
		}, reason: identity.ReasonBadResponse, want: "at most"},
		"outsized answer of roots": {answer: func(f *fakeIstiod) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
			return func(csr *x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
				resp, err := f.issue(idWeb.String())(csr)
				resp.CertChain = append(resp.CertChain, strings.Repeat(pemOf(f.pki.root), maxAnswerCerts))
				return resp, err
			}
		}, reason: identity.ReasonBadResponse, want: "at most"},
		// Refused once the bound is passed, before the rest is parsed
		// (the garbage entry after it is never read).
		"outsized chain, refused before the rest is parsed": {answer: func(f *fakeIstiod) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
			return func(csr *x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
				resp, err := f.issue(idWeb.String())(csr)
				for range maxAnswerCerts {
					resp.CertChain = append(resp.CertChain, pemOf(f.pki.root))
				}
				resp.CertChain = append(resp.CertChain, "garbage")
				return resp, err
			}
		}, reason: identity.ReasonBadResponse, want: "at most"},
		"oversized answer, refused before it is decoded": {answer: func(f *fakeIstiod) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
			return func(csr *x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
				resp, err := f.issue(idWeb.String())(csr)
				for range maxAnswerBytes {
					resp.CertChain = append(resp.CertChain, "x")
				}
				return resp, err
			}
		}, reason: identity.ReasonRefused, want: "larger than max"},
		"node authorizer": {answer: func(f *fakeIstiod) func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
			return func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
				return nil, status.Error(codes.Unauthenticated, "request impersonation authentication failure")
			}
		}, reason: identity.ReasonUnauthenticated, want: "impersonation"},
		"no token": {token: " ", reason: identity.ReasonToken, want: "empty"},
	} {
		t.Run(name, func(t *testing.T) {
			f, addr := startIstiod(t, pki, DefaultServerName)
			if tc.answer != nil {
				f.answer = tc.answer(f)
			}
			tok := tc.token
			if tok == "" {
				tok = "tok"
			}
			c := newClient(t, Config{Addr: addr, TokenFile: writeToken(t, tok), Trust: trustOf(pki.root)})
			_, err := sign(c)
			if err == nil || identity.ReasonOf(err) != tc.reason || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v (reason %s), want reason %s containing %q", err, identity.ReasonOf(err), tc.reason, tc.want)
			}
		})
	}
}

// istiod's serving certificate must chain to the mesh roots and carry the
// expected name; anything else is not istiod.
func TestSignVerifiesIstiod(t *testing.T) {
	pki := newPKI(t)
	_, addr := startIstiod(t, pki, "istiod.other-ns.svc")
	c := newClient(t, Config{Addr: addr, TokenFile: writeToken(t, "tok"), Trust: trustOf(pki.root)})
	if _, err := sign(c); err == nil || identity.ReasonOf(err) != identity.ReasonUnavailable {
		t.Errorf("wrong server name: err = %v", err)
	}
	_, addr = startIstiod(t, newPKI(t), DefaultServerName)
	c = newClient(t, Config{Addr: addr, TokenFile: writeToken(t, "tok"), Trust: trustOf(pki.root)})
	_, err := sign(c)
	if err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("untrusted istiod: err = %v", err)
	}
}

// The trust bundle is read at each connection: a root added to the file
// is used without a restart.
func TestTrustBundleReload(t *testing.T) {
	oldRoot, newRoot := newPKI(t), newPKI(t)
	path := filepath.Join(t.TempDir(), "root-cert.pem")
	if err := os.WriteFile(path, []byte(pemOf(oldRoot.root)), 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := identity.LoadBundle(path, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	_, addr := startIstiod(t, newRoot, DefaultServerName)
	c := newClient(t, Config{Addr: addr, TokenFile: writeToken(t, "tok"), Trust: b})
	if _, err := sign(c); err == nil {
		t.Fatal("istiod under a root not in the bundle was trusted")
	}
	if err := os.WriteFile(path, []byte(pemOf(oldRoot.root)+pemOf(newRoot.root)), 0o644); err != nil {
		t.Fatal(err)
	}
	if changed, err := b.Reload(); err != nil || !changed {
		t.Fatalf("reload: changed %v, %v", changed, err)
	}
	if len(b.Certificates()) != 2 {
		t.Errorf("%d roots after reload, want 2", len(b.Certificates()))
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, err := sign(c)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still failing after the bundle gained the root: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// A broken file keeps the last good roots.
	if err := os.WriteFile(path, []byte("not pem"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Reload(); err == nil {
		t.Error("reload of a broken bundle succeeded")
	}
	if len(b.Certificates()) != 2 {
		t.Error("broken file replaced the roots")
	}
}

func TestNewRefusesBadConfig(t *testing.T) {
	if _, err := New(Config{Addr: "istiod", Trust: trustOf()}); err == nil || !strings.Contains(err.Error(), "host:port") {
		t.Errorf("address without port: %v", err)
	}
	if _, err := New(Config{Addr: "istiod:15012"}); err == nil {
		t.Error("no trust bundle accepted")
	}
	var ce *identity.CAError
	c := newClient(t, Config{Addr: "127.0.0.1:1", Trust: trustOf()})
	if _, err := sign(c); !errors.As(err, &ce) || ce.Reason != identity.ReasonToken {
		t.Errorf("no token file: %v", err)
	}
}

// TestSignRedialsAfterTimeout: behind a proxy that keeps the TCP side open
// while nothing reaches istiod any more, every request timed out on the
// same dead connection for ever (TCP keepalive is answered by the proxy,
// and istiod refuses the HTTP/2 PINGs that could tell). A request that
// times out now replaces the connection, so the next one reaches istiod.
func TestSignRedialsAfterTimeout(t *testing.T) {
	pki := newPKI(t)
	_, addr := startIstiod(t, pki, DefaultServerName)
	proxy := stallproxy.New(t, addr)
	c := newClient(t, Config{Addr: proxy.Addr, TokenFile: writeToken(t, "tok"), Trust: trustOf(pki.root)})
	if _, err := sign(c); err != nil {
		t.Fatal(err)
	}
	proxy.Stall()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if _, err := c.Sign(ctx, idWeb, 2*time.Hour); identity.ReasonOf(err) != identity.ReasonTimeout {
		t.Fatalf("signed through a silent connection, or failed otherwise: %v", err)
	}
	if _, err := sign(c); err != nil {
		t.Fatalf("after a timeout, the next request: %v", err)
	}
}

// TestSignBoundsErrorText: istiod's error message (a gRPC trailer) was
// taken whole, up to gRPC's default of 16 MiB, and kept as the
// identity's last error, logged at every retry and shown in the config
// dump. The connection now accepts 64 KiB of headers at most.
func TestSignBoundsErrorText(t *testing.T) {
	pki := newPKI(t)
	f, addr := startIstiod(t, pki, DefaultServerName)
	f.answer = func(*x509.CertificateRequest) (*pb.IstioCertificateResponse, error) {
		return nil, status.Error(codes.Internal, strings.Repeat("x", 1<<20))
	}
	c := newClient(t, Config{Addr: addr, TokenFile: writeToken(t, "tok"), Trust: trustOf(pki.root)})
	_, err := sign(c)
	if err == nil || len(err.Error()) > maxHeaderBytes {
		t.Fatalf("error of %d bytes: %.200v", len(fmt.Sprint(err)), err)
	}
	t.Logf("error: %.300v", err)
}

// TestTokenNotRegular: a token path holding a fifo or a device is an error
// naming it. Before, a fifo blocked each certificate request in its read,
// past the request timeout, holding one of the 8 request slots for ever.
func TestTokenNotRegular(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "token")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{fifo: "is not a regular file (a fifo)", "/dev/zero": "is not a regular file (a device)"} {
		c := &Client{cfg: Config{TokenFile: path}}
		done := make(chan error, 1)
		go func() { _, err := c.token(); done <- err }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), path+" "+want) {
				t.Errorf("token() from %s = %v, want %q", path, err, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("token() from %s did not return in 5s", path)
		}
	}
}
