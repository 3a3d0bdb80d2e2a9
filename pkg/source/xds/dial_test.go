package xds

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"math/big"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/redirector-mesh/redirector/internal/stallproxy"
	"github.com/redirector-mesh/redirector/internal/syncbuf"
	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
	"github.com/redirector-mesh/redirector/pkg/identity/istioca"
)

type poolTrust struct{ pool *x509.CertPool }

func (poolTrust) TrustDomain() string     { return "cluster.local" }
func (p poolTrust) Roots() *x509.CertPool { return p.pool }

// TestDialDetectsSilentIstiod: behind a proxy that keeps the TCP side open
// while nothing reaches istiod any more, the stream looked open for ever
// (istiod says nothing while nothing changes, TCP keepalive is answered by
// the proxy): the agent never reconnected and never saw a change again.
// HTTP/2 keepalive now closes such a connection and the client reconnects.
func TestDialDetectsSilentIstiod(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for a keepalive (gRPC pings at most every 10 s)")
	}
	orig := keepaliveParams
	keepaliveParams.Time, keepaliveParams.Timeout = 10*time.Second, time.Second
	t.Cleanup(func() { keepaliveParams = orig })

	ads, addr, trust := startTLSADS(t)
	proxy := stallproxy.New(t, addr)

	conn, err := Dial(proxy.Addr, "", trust)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	h := runClient(t, ads, conn, nil)

	st, _ := h.accept()
	send(t, st, TypeAuthorization, "n1", nil)
	proxy.Stall()
	select {
	case <-ads.streams:
	case <-time.After(30 * time.Second):
		t.Fatal("no new stream 30 s after the connection to istiod went silent")
	}
}

// startTLSADS serves a fakeADS over TLS as istiod, with a serving
// certificate for istioca.DefaultServerName under the returned trust.
func startTLSADS(t *testing.T) (*fakeADS, string, poolTrust) {
	t.Helper()
	ads, addr, pki := startTLSADSPKI(t)
	roots := x509.NewCertPool()
	roots.AddCert(pki.Root)
	return ads, addr, poolTrust{roots}
}

// startTLSADSPKI is startTLSADS returning the PKI its serving certificate
// is under.
func startTLSADSPKI(t *testing.T) (*fakeADS, string, identitytest.PKI) {
	t.Helper()
	pki := identitytest.NewPKI(t, "ecdsa")
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(1), DNSNames: []string{istioca.DefaultServerName},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, pki.Inter, &key.PublicKey, pki.InterKey)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der, pki.Inter.Raw}, PrivateKey: key}}})))
	ads := &fakeADS{streams: make(chan *fakeStream)}
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(srv, ads)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	return ads, ln.Addr().String(), pki
}

// TestDialBoundsErrorText: the error istiod ends a stream with (a gRPC
// trailer) was taken whole, up to gRPC's default of 16 MiB, and logged at
// every reconnect. The connection now accepts 64 KiB of headers at most.
func TestDialBoundsErrorText(t *testing.T) {
	ads, addr, trust := startTLSADS(t)
	conn, err := Dial(addr, "", trust)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	var logs syncbuf.Buffer
	h := runClient(t, ads, conn, func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&logs, nil)) })

	st, _ := h.accept()
	st.end <- status.Error(codes.Internal, strings.Repeat("x", 1<<20))
	h.accept()
	if n := len(logs.String()); n > maxHeaderBytes || !strings.Contains(logs.String(), "xds stream to istiod ended") {
		t.Fatalf("%d bytes logged: %.300s", n, logs.String())
	}
}

// TestTokenFileNotRegular: a token path holding a fifo or a device is an
// error naming it; before, a fifo blocked every stream's dial for ever and
// /dev/zero filled the memory.
func TestTokenFileNotRegular(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "token")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{fifo: "is not a regular file (a fifo)", "/dev/zero": "is not a regular file (a device)"} {
		done := make(chan error, 1)
		go func() { _, err := TokenFile(path)(); done <- err }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), path+" "+want) {
				t.Errorf("TokenFile(%s)() = %v, want %q", path, err, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("TokenFile(%s)() did not return in 5s", path)
		}
	}
}
