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

// A root removed from the trust bundle must stop new streams on HBONE
// connections opened before, whichever side's certificate chained to it:
//   - the client's: the handshake was the pod's only check of the client.
//     The pod's HBONE server drains those connections when the bundle
//     changes, so the client's next stream needs a new handshake, which
//     its certificate no longer passes.
//   - the server's (the pod's own): a client that does not drain for it
//     (ztunnel, a waypoint; here a pool no tunnel drains, verifying the
//     server only at its handshake) would go on opening streams to the pod
//     as its peer. The trust change drains the server's connections that
//     presented such a certificate; the next handshake, which the client
//     holding the new bundle refuses, is needed.
//
// The stream open at the change runs on. Loopback only: the "pod" is
// 127.0.0.1 in this namespace.
func TestTrustBundleChangeDrainsInbound(t *testing.T) {
	for _, whose := range []string{"the client's", "the server's"} {
		t.Run(whose, func(t *testing.T) {
			rig := newTwoRoots(t)
			serverID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server-sa"}
			clientID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}
			serverCA, clientCA := rig.kept, rig.dropped
			if whose == "the server's" {
				serverCA, clientCA = rig.dropped, rig.kept
			}
			serverCerts, clientCerts := rig.manager(serverCA, serverID), rig.manager(clientCA, clientID)
			l, app := servedEchoPod(t, serverCerts)

			pool := hbone.NewPool(hbone.PoolOptions{})
			defer pool.Close()
			connect := rig.pooledConnect(pool, clientCerts, clientID, serverID, l, app)
			open, err := connect()
			if err != nil {
				t.Fatalf("stream under both roots: %v", err)
			}
			defer open.Close()

			rig.dropRoot(t, whose)
			time.Sleep(100 * time.Millisecond) // the server's GOAWAY reaches the pool
			if s, err := connect(); err == nil {
				s.Close()
				t.Fatalf("a stream opened after %s root left the trust bundle", whose)
			} else {
				t.Logf("after the change: %v", err)
			}
			if st := pool.Stats(); st.DialsTotal < 2 {
				t.Errorf("dials = %d, want 2 or more: the stream after the change must need a new handshake", st.DialsTotal)
			}
			stillEchoes(t, open)
		})
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

// pooledConnect returns a function that opens a stream through pool from
// clientID (certificates clientCerts) to serverID's HBONE listener l,
// towards the app listening on app.
func (r *twoRoots) pooledConnect(pool *hbone.Pool, clientCerts *identity.Manager, clientID, serverID identity.ID, l, app net.Listener) func() (*hbone.Stream, error) {
	key := hbone.PoolKey{Src: "client", SrcIdentity: clientID.String(), DstIdentity: serverID.String(), DstAddr: l.Addr().(*net.TCPAddr).AddrPort()}
	target := app.Addr().(*net.TCPAddr).AddrPort()
	return func() (*hbone.Stream, error) {
		var d net.Dialer
		return pool.Connect(r.ctx, key, d.DialContext, identity.ClientConfig(clientCerts, clientID, serverID),
			hbone.Request{Authority: target, Forwarded: `for="127.0.0.1"`})
	}
}

// dropRoot rewrites the bundle with the kept root alone and reloads it;
// whose names the side that loses its root, for the failure message.
func (r *twoRoots) dropRoot(t *testing.T, whose string) {
	t.Helper()
	r.write(r.kept)
	if changed, err := r.bundle.Reload(); !changed || err != nil {
		t.Fatalf("reload without %s root: changed %v, err %v", whose, changed, err)
	}
}

// stillEchoes checks that a stream opened before a trust change still
// carries bytes both ways.
func stillEchoes(t *testing.T, open *hbone.Stream) {
	t.Helper()
	msg := []byte("still here")
	if _, err := open.Write(msg); err != nil {
		t.Fatalf("stream open at the change: write: %v", err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(open, buf); err != nil || string(buf) != string(msg) {
		t.Fatalf("stream open at the change: read %q, %v", buf, err)
	}
}
