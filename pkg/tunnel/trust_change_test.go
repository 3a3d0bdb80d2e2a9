package tunnel

import (
	"context"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// A root removed from the trust bundle must stop authorizing the clients
// that chained to it, including on HBONE connections they opened before:
// the handshake was their only check. The pod's HBONE server drains those
// connections when the bundle changes, so the client's next stream needs a
// new handshake, which its certificate no longer passes; the stream open
// meanwhile runs on. Loopback only: the "pod" is 127.0.0.1 in this
// namespace.
func TestTrustBundleChangeDrainsUntrustedPeers(t *testing.T) {
	rig := newTwoRoots(t)
	dropped, kept, bundle, writeBundle, manager := rig.dropped, rig.kept, rig.bundle, rig.write, rig.manager
	ctx := rig.ctx
	var err error
	serverID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server-sa"}
	clientID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}
	serverCerts, clientCerts := manager(kept, serverID), manager(dropped, clientID)

	l, app := servedEchoPod(t, serverCerts)

	pool := hbone.NewPool(hbone.PoolOptions{})
	defer pool.Close()
	key := hbone.PoolKey{Src: "client", SrcIdentity: clientID.String(), DstIdentity: serverID.String(), DstAddr: l.Addr().(*net.TCPAddr).AddrPort()}
	target := app.Addr().(*net.TCPAddr).AddrPort()
	connect := func() (*hbone.Stream, error) {
		var d net.Dialer
		return pool.Connect(ctx, key, d.DialContext, identity.ClientConfig(clientCerts, clientID, serverID),
			hbone.Request{Authority: target, Forwarded: `for="127.0.0.1"`})
	}
	open, err := connect()
	if err != nil {
		t.Fatalf("stream under both roots: %v", err)
	}
	defer open.Close()

	writeBundle(kept)
	if changed, err := bundle.Reload(); !changed || err != nil {
		t.Fatalf("reload without the client's root: changed %v, err %v", changed, err)
	}
	time.Sleep(100 * time.Millisecond) // the server's GOAWAY reaches the pool

	if s, err := connect(); err == nil {
		s.Close()
		t.Fatal("a stream opened after the client's root left the trust bundle")
	} else {
		t.Logf("after the change: %v", err)
	}
	msg := []byte("still here")
	if _, err := open.Write(msg); err != nil {
		t.Fatalf("stream open at the change: write: %v", err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(open, buf); err != nil || string(buf) != string(msg) {
		t.Fatalf("stream open at the change: read %q, %v", buf, err)
	}
}

// twoRoots is a trust bundle of two roots, one of which a test drops, and
// certificate managers signed by either.
type twoRoots struct {
	ctx           context.Context
	dropped, kept *identity.CA
	bundle        *identity.Bundle
	// write replaces the bundle file with cas' roots (Reload reads it).
	write func(cas ...*identity.CA)
	// manager is a certificate manager for id, signed by ca, trusting the
	// bundle, with id's certificate ready.
	manager func(ca *identity.CA, id identity.ID) *identity.Manager
}

func newTwoRoots(t *testing.T) *twoRoots {
	t.Helper()
	newCA := func() *identity.CA {
		dir := t.TempDir()
		if err := identity.InitCA(dir, "cluster.local"); err != nil {
			t.Fatal(err)
		}
		ca, err := identity.LoadCA(dir)
		if err != nil {
			t.Fatal(err)
		}
		return ca
	}
	r := &twoRoots{dropped: newCA(), kept: newCA()}
	bundlePath := filepath.Join(t.TempDir(), "root-cert.pem")
	r.write = func(cas ...*identity.CA) {
		t.Helper()
		var pem []byte
		for _, ca := range cas {
			pem = append(pem, identitytest.CertPEM(ca.Certificate())...)
		}
		if err := os.WriteFile(bundlePath, pem, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	r.write(r.dropped, r.kept)
	var err error
	if r.bundle, err = identity.LoadBundle(bundlePath, "cluster.local"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	r.ctx = ctx
	r.manager = func(ca *identity.CA, id identity.ID) *identity.Manager {
		m := identity.New(identity.ManagerOptions{Signer: ca, Trust: r.bundle})
		t.Cleanup(m.Close)
		m.Add(id)
		if err := m.Wait(ctx, id); err != nil {
			t.Fatal(err)
		}
		return m
	}
	return r
}

// servedEchoPod serves the pod "server" (127.0.0.1, this namespace) with
// certs on an HBONE listener l, and an echo app on app; both closed when
// the test ends.
func servedEchoPod(t *testing.T, certs *identity.Manager) (l, app net.Listener) {
	t.Helper()
	tun := New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008, Certs: certs})
	tun.Update(&State{Dir: testDir(t, podObj("mesh", "server", "server-sa", "127.0.0.1", nil))})
	p := testPod(tun, "uid-server", netip.MustParseAddr("127.0.0.1"))
	inOwnNamespace(t, p)
	var err error
	if p.hbone, err = tun.newHBONEServer(p); err != nil {
		t.Fatal(err)
	}
	if l, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	go p.hbone.Serve(l)
	t.Cleanup(func() { p.hbone.Close() })
	return l, echoListener(t)
}
