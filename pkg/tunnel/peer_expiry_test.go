package tunnel

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"math/big"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// TestPeerChainEndNotExtendedByForgedIssuer: a client whose leaf (an hour
// left) chains through an intermediate expiring in two seconds must get
// no stream on its connection once that intermediate has expired: the
// leaf verifies no more. The client adds to its chain a certificate of its
// own making that carries the intermediate's name and ends in an hour.
// The handshake verified the real chain, but the server took the drain
// time by following issuer names, the latest-ending match first: it took
// the forged certificate, and served new streams as that identity until
// the leaf's own end. The drain time is that of the chains that verified.
func TestPeerChainEndNotExtendedByForgedIssuer(t *testing.T) {
	pki := identitytest.NewPKI(t, "ecdsa")
	ca, err := identity.LoadCAFor(identitytest.WriteCacerts(t, pki), "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	serverID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server-sa"}
	serverCerts := identity.NewManager(ca, time.Hour, nil)
	t.Cleanup(serverCerts.Close)
	serverCerts.Add(serverID)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := serverCerts.Wait(ctx, serverID); err != nil {
		t.Fatal(err)
	}
	l, app := servedEchoPod(t, serverCerts)

	cert, short := forgedIssuerChain(t, pki, "/ns/mesh/sa/client")
	client := &tls.Config{
		MinVersion: tls.VersionTLS13, NextProtos: []string{identity.ALPN},
		Certificates:       []tls.Certificate{cert},
		InsecureSkipVerify: true, // the server is not what is tested
	}

	pool := hbone.NewPool(hbone.PoolOptions{})
	defer pool.Close()
	key := hbone.PoolKey{Src: "client", SrcIdentity: "spiffe://cluster.local/ns/mesh/sa/client", DstIdentity: serverID.String(), DstAddr: l.Addr().(*net.TCPAddr).AddrPort()}
	target := app.Addr().(*net.TCPAddr).AddrPort()
	connect := func() (*hbone.Stream, error) {
		var d net.Dialer
		return pool.Connect(ctx, key, d.DialContext, client, hbone.Request{Authority: target, Forwarded: `for="127.0.0.1"`})
	}
	open, err := connect()
	if err != nil {
		t.Fatalf("stream while the intermediate is valid: %v", err)
	}
	defer open.Close()

	time.Sleep(time.Until(short.NotAfter) + 500*time.Millisecond)
	if s, err := connect(); err == nil {
		s.Close()
		t.Fatalf("a stream opened %s after the client's intermediate expired", time.Since(short.NotAfter).Round(time.Millisecond))
	} else {
		t.Logf("after the intermediate's end: %v", err)
	}
}

// forgedIssuerChain is a leaf for path (an hour left) under an
// intermediate of pki's root that expires in two seconds, presented with a
// self-signed certificate of the intermediate's name that ends in an hour.
func forgedIssuerChain(t *testing.T, pki identitytest.PKI, path string) (tls.Certificate, *x509.Certificate) {
	t.Helper()
	now := time.Now()
	shortKey := identitytest.NewKey(t, "ecdsa")
	short := identitytest.Sign(t, &x509.Certificate{
		SerialNumber: big.NewInt(30), Subject: pkix.Name{CommonName: "short intermediate"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(2 * time.Second),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
	}, shortKey, pki.Root, pki.RootKey)
	forgedKey := identitytest.NewKey(t, "ecdsa")
	forgedTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(31), Subject: short.Subject,
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
	}
	forged := identitytest.Sign(t, forgedTmpl, forgedKey, forgedTmpl, forgedKey)
	leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leaf := identitytest.Sign(t, &x509.Certificate{
		SerialNumber: big.NewInt(32), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
		URIs: []*url.URL{{Scheme: "spiffe", Host: "cluster.local", Path: path}},
	}, leafKey, short, shortKey)
	return tls.Certificate{Certificate: [][]byte{leaf.Raw, short.Raw, forged.Raw}, PrivateKey: leafKey, Leaf: leaf}, short
}

// TestPoolChainEndNotExtendedByForgedIssuer is the same from the client's
// side: the pool of a tunnel drains its connection to a server whose
// intermediate expired, though the server presented a forged certificate
// of that intermediate's name ending later.
func TestPoolChainEndNotExtendedByForgedIssuer(t *testing.T) {
	pki := identitytest.NewPKI(t, "ecdsa")
	ca, err := identity.LoadCAFor(identitytest.WriteCacerts(t, pki), "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	clientID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}
	serverID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server-sa"}
	clientCerts := identity.NewManager(ca, time.Hour, nil)
	t.Cleanup(clientCerts.Close)
	clientCerts.Add(clientID)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := clientCerts.Wait(ctx, clientID); err != nil {
		t.Fatal(err)
	}
	pool := hbone.NewPool(hbone.PoolOptions{})
	defer pool.Close()
	New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008, Certs: clientCerts, Pool: pool})

	cert, short := forgedIssuerChain(t, pki, "/ns/mesh/sa/server-sa")
	app, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()
	go func() {
		for {
			c, err := app.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
		}
	}()
	srv, err := hbone.NewServer(hbone.ServerOptions{
		TLSConfig: &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequireAnyClientCert},
		Handler: func(ctx context.Context, req *hbone.ServerRequest) hbone.Response {
			var d net.Dialer
			up, err := d.DialContext(ctx, "tcp", req.Target.String())
			if err != nil {
				return hbone.Response{Status: 503}
			}
			return hbone.Response{Upstream: up}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	defer srv.Close()

	key := hbone.PoolKey{Src: "client", SrcIdentity: clientID.String(), DstIdentity: serverID.String(), DstAddr: l.Addr().(*net.TCPAddr).AddrPort()}
	connect := func() (*hbone.Stream, error) {
		var d net.Dialer
		return pool.Connect(ctx, key, d.DialContext, identity.ClientConfig(clientCerts, clientID, serverID),
			hbone.Request{Authority: app.Addr().(*net.TCPAddr).AddrPort(), Forwarded: `for="127.0.0.1"`})
	}
	open, err := connect()
	if err != nil {
		t.Fatalf("stream while the server's intermediate is valid: %v", err)
	}
	defer open.Close()

	time.Sleep(time.Until(short.NotAfter) + 500*time.Millisecond)
	if s, err := connect(); err == nil {
		s.Close()
		t.Fatalf("a stream opened %s after the server's intermediate expired", time.Since(short.NotAfter).Round(time.Millisecond))
	} else {
		t.Logf("after the intermediate's end: %v", err)
	}
}
