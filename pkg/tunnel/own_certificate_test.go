package tunnel

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// TestMissingOwnCertificateIsNotTheEndpoints: a client pod whose identity
// has no certificate (its first request to the CA not answered yet, the CA
// down or refusing it, the certificate expired) fails every HBONE
// handshake, on its side. That says nothing about the endpoint: it must
// not mark it failed for every pod of the node. Before, the handshake's
// error counted as the endpoint's: a node starting its pods with the CA
// slow had each new pod's first service connections mark up to three
// endpoints (or waypoint instances) each, steering the node's other pods
// away from them.
func TestMissingOwnCertificateIsNotTheEndpoints(t *testing.T) {
	rig := newTwoRoots(t)
	serverID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server-sa"}
	clientID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}
	serverCerts := rig.manager(rig.kept, serverID)
	// The client's identity is kept, its certificate not issued yet.
	clientCerts := identity.New(identity.ManagerOptions{Signer: neverSigner{}, Trust: rig.bundle})
	t.Cleanup(clientCerts.Close)
	clientCerts.Add(clientID)

	l, app := servedEchoPod(t, serverCerts)
	pool := hbone.NewPool(hbone.PoolOptions{})
	defer pool.Close()
	key := hbone.PoolKey{Src: "client", SrcIdentity: clientID.String(), DstIdentity: serverID.String(), DstAddr: l.Addr().(*net.TCPAddr).AddrPort()}
	var d net.Dialer
	_, err := pool.Connect(rig.ctx, key, d.DialContext, identity.ClientConfig(clientCerts, clientID, serverID),
		hbone.Request{Authority: app.Addr().(*net.TCPAddr).AddrPort(), Forwarded: `for="127.0.0.1"`})
	if err == nil {
		t.Fatal("a stream without a client certificate")
	}
	err = fmt.Errorf("HBONE to %s via %s: %w", key.DstAddr, key.DstAddr, err) // as dialHBONEVia wraps it
	if !errors.Is(err, identity.ErrNoCertificate) {
		t.Errorf("error %v does not say the client has no certificate", err)
	}
	if endpointFailed(err) {
		t.Errorf("the client's missing certificate marks the endpoint failed: %v", err)
	}
}

// neverSigner never answers: the identity stays pending.
type neverSigner struct{}

func (neverSigner) Name() string { return "never" }
func (neverSigner) Sign(ctx context.Context, _ identity.ID, _ time.Duration) (*tls.Certificate, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}
