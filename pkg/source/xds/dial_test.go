package xds

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"math/big"
	"net"
	"net/netip"
	"testing"
	"time"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/redirector-mesh/redirector/internal/stallproxy"
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
	proxy := stallproxy.New(t, ln.Addr().String())

	roots := x509.NewCertPool()
	roots.AddCert(pki.Root)
	conn, err := Dial(proxy.Addr, "", poolTrust{roots})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	h := &harness{t: t, ads: ads, updates: make(chan *Snapshot, 16)}
	c, err := New(Config{Conn: conn, Node: Node{IP: netip.MustParseAddr("10.0.0.9"), PodName: "redirector-abc", PodNamespace: "istio-system", NodeName: "node-a"},
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Run(ctx, func(s *Snapshot) { h.updates <- s })
	}()
	t.Cleanup(func() { cancel(); <-done })

	st, _ := h.accept()
	send(t, st, TypeAuthorization, "n1", nil)
	proxy.Stall()
	select {
	case <-ads.streams:
	case <-time.After(30 * time.Second):
		t.Fatal("no new stream 30 s after the connection to istiod went silent")
	}
}
