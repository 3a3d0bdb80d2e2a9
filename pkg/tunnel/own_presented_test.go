package tunnel

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"testing"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// A root removed from the trust bundle must also stop this node's own
// certificates issued under it from carrying new streams on pooled
// connections: a server that does not drain them itself (ztunnel, a
// waypoint; here a stand-in holding the old bundle) would go on taking
// streams as that identity. The trust change drains the pool's connections
// that presented such a certificate; the next stream needs a new
// handshake; the stream open meanwhile runs on. Loopback only, no
// namespace.
func TestTrustBundleChangeDrainsOwnPresented(t *testing.T) {
	rig := newTwoRoots(t)
	serverID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server-sa"}
	clientID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}
	serverCerts, clientCerts := rig.manager(rig.kept, serverID), rig.manager(rig.dropped, clientID)

	// The stand-in: verifies clients against both roots for good.
	oldBundle := x509.NewCertPool()
	oldBundle.AddCert(rig.dropped.Certificate())
	oldBundle.AddCert(rig.kept.Certificate())
	srvTLS := &tls.Config{MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"}, ClientAuth: tls.RequireAnyClientCert,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return serverCerts.Certificate(serverID) },
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			leaf, err := x509.ParseCertificate(raw[0])
			if err != nil {
				return err
			}
			_, err = leaf.Verify(x509.VerifyOptions{Roots: oldBundle, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
			return err
		}}
	app := echoListener(t)
	srv, err := hbone.NewServer(hbone.ServerOptions{TLSConfig: srvTLS, Handler: func(ctx context.Context, req *hbone.ServerRequest) hbone.Response {
		var d net.Dialer
		up, err := d.DialContext(ctx, "tcp", req.Target.String())
		if err != nil {
			return hbone.Response{Status: 503, Reason: err.Error()}
		}
		return hbone.Response{Upstream: up}
	}})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	t.Cleanup(func() {
		_ = srv.Close()
		if err := <-served; !errors.Is(err, hbone.ErrServerClosed) {
			t.Errorf("serve: %v", err)
		}
	})

	pool := hbone.NewPool(hbone.PoolOptions{})
	defer pool.Close()
	New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008, Certs: clientCerts, Pool: pool})
	connect := rig.pooledConnect(pool, clientCerts, clientID, serverID, l, app)
	open, err := connect()
	if err != nil {
		t.Fatalf("stream under both roots: %v", err)
	}
	defer open.Close()

	rig.dropRoot(t, "the client's")
	waitfor.Until(t, "the pooled connection that presented the client's certificate drained", func() bool {
		return pool.Stats().OwnCertificateDrains == 1
	})
	// The stand-in still takes the certificate (the client's CA cannot
	// issue under the kept root here): what matters is a new handshake.
	if s, err := connect(); err == nil {
		s.Close()
	}
	if st := pool.Stats(); st.DialsTotal < 2 {
		t.Errorf("dials = %d, want 2 or more: the stream after the change must need a new handshake", st.DialsTotal)
	}
	stillEchoes(t, open)
}

// echoListener is a loopback echo server, closed when the test ends.
func echoListener(t *testing.T) net.Listener {
	t.Helper()
	app, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { app.Close() })
	go func() {
		for {
			c, err := app.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return app
}
