package tunnel

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// stallConn holds back the last TLS record of the client's second flight
// (Certificate, CertificateVerify, Finished) until release is closed: the
// server has verified the client certificate but not finished the handshake.
type stallConn struct {
	net.Conn
	mu       sync.Mutex
	writes   int
	verified chan struct{}
	release  chan struct{}
}

func (c *stallConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	c.writes++
	n := c.writes
	c.mu.Unlock()
	if n != 2 {
		return c.Conn.Write(b)
	}
	// split off the last record
	off, last := 0, 0
	for off+5 <= len(b) {
		l := int(binary.BigEndian.Uint16(b[off+3:]))
		last = off
		off += 5 + l
	}
	if _, err := c.Conn.Write(b[:last]); err != nil {
		return 0, err
	}
	close(c.verified)
	<-c.release
	if _, err := c.Conn.Write(b[last:]); err != nil {
		return 0, err
	}
	return len(b), nil
}

// TestTrustChangeDuringHandshake: a client whose certificate the server
// verified, and whose last handshake flight it holds back while the trust
// bundle drops the client's root, gets no stream. Before, the connection
// was registered after the recheck of the trust change had run over the
// registered ones, and served the removed root's identity until the
// client's leaf expired; a fresh connection was refused all along.
func TestTrustChangeDuringHandshake(t *testing.T) {
	rig := newTwoRoots(t)
	dropped, kept, bundle, writeBundle, manager, ctx := rig.dropped, rig.kept, rig.bundle, rig.write, rig.manager, rig.ctx
	serverID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server-sa"}
	clientID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}
	serverCerts, clientCerts := manager(kept, serverID), manager(dropped, clientID)

	l, app := servedEchoPod(t, serverCerts)

	pool := hbone.NewPool(hbone.PoolOptions{})
	defer pool.Close()
	key := hbone.PoolKey{Src: "client", SrcIdentity: clientID.String(), DstIdentity: serverID.String(), DstAddr: l.Addr().(*net.TCPAddr).AddrPort()}
	target := app.Addr().(*net.TCPAddr).AddrPort()
	sc := &stallConn{verified: make(chan struct{}), release: make(chan struct{})}
	var once sync.Once
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		var out net.Conn = c
		once.Do(func() { sc.Conn = c; out = sc })
		return out, nil
	}
	go func() {
		<-sc.verified
		time.Sleep(300 * time.Millisecond) // server has run VerifyConnection on the client's certificate
		writeBundle(kept)
		changed, err := bundle.Reload()
		t.Logf("bundle reloaded without the client's root while its handshake is in flight: changed=%v err=%v", changed, err)
		close(sc.release)
	}()
	connect := func() (*hbone.Stream, error) {
		return pool.Connect(ctx, key, dial, identity.ClientConfig(clientCerts, clientID, serverID),
			hbone.Request{Authority: target, Forwarded: `for="127.0.0.1"`})
	}
	for i := 0; i < 3; i++ {
		s, err := connect()
		if err != nil {
			t.Logf("stream %d after the root was removed: refused: %v", i, err)
			continue
		}
		msg := []byte("hello")
		s.Write(msg)
		buf := make([]byte, len(msg))
		_, rerr := io.ReadFull(s, buf)
		s.Close()
		t.Errorf("stream %d opened and served (%q, %v) with a client whose root left the bundle", i, buf, rerr)
	}
	// Control: a fresh connection with the same certificate is refused.
	pool2 := hbone.NewPool(hbone.PoolOptions{})
	defer pool2.Close()
	var d net.Dialer
	if s, err := pool2.Connect(ctx, key, d.DialContext, identity.ClientConfig(clientCerts, clientID, serverID),
		hbone.Request{Authority: target, Forwarded: `for="127.0.0.1"`}); err == nil {
		s.Close()
		t.Fatal("control: fresh connection accepted")
	} else {
		t.Logf("control: fresh connection refused: %v", err)
	}
}

type stallListener struct {
	net.Listener
	sc *stallConn
}

func (l *stallListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.sc.mu.Lock()
	first := l.sc.Conn == nil
	if first {
		l.sc.Conn = c
	}
	l.sc.mu.Unlock()
	if first {
		return l.sc, nil
	}
	return c, nil
}

// TestTrustChangeDuringHandshakeOutbound: the same for the client side. A
// server whose certificate the pool verified, and whose last handshake
// flight is held back while the trust bundle drops its root, gets no
// stream of this node's traffic.
func TestTrustChangeDuringHandshakeOutbound(t *testing.T) {
	rig := newTwoRoots(t)
	dropped, kept, bundle, writeBundle, manager, ctx := rig.dropped, rig.kept, rig.bundle, rig.write, rig.manager, rig.ctx
	var err error
	serverID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server-sa"}
	clientID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}
	serverCerts, clientCerts := manager(dropped, serverID), manager(kept, clientID)

	srv, err := hbone.NewServer(hbone.ServerOptions{
		TLSConfig: identity.ServerConfig(serverCerts, serverID),
		Handler: func(ctx context.Context, req *hbone.ServerRequest) hbone.Response {
			a, b := net.Pipe()
			go func() { defer b.Close(); _, _ = io.Copy(b, b) }()
			return hbone.Response{Upstream: a}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	sc := &stallConn{verified: make(chan struct{}), release: make(chan struct{}), writes: 1}
	go srv.Serve(&stallListener{Listener: raw, sc: sc})
	t.Cleanup(func() { srv.Close() })

	pool := hbone.NewPool(hbone.PoolOptions{})
	defer pool.Close()
	// The client side's tunnel: its recheckPeers drains pool conns on a trust change.
	_ = New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008, Certs: clientCerts, Pool: pool})

	key := hbone.PoolKey{Src: "client", SrcIdentity: clientID.String(), DstIdentity: serverID.String(), DstAddr: raw.Addr().(*net.TCPAddr).AddrPort()}
	go func() {
		<-sc.verified
		time.Sleep(300 * time.Millisecond)
		writeBundle(kept)
		changed, err := bundle.Reload()
		t.Logf("bundle reloaded without the server's root while the handshake is in flight: changed=%v err=%v", changed, err)
		close(sc.release)
	}()
	var d net.Dialer
	for i := 0; i < 3; i++ {
		s, err := pool.Connect(ctx, key, d.DialContext, identity.ClientConfig(clientCerts, clientID, serverID),
			hbone.Request{Authority: netip.MustParseAddrPort("127.0.0.1:9"), Forwarded: `for="127.0.0.1"`})
		if err != nil {
			t.Logf("stream %d: refused: %v", i, err)
			continue
		}
		s.Write([]byte("x"))
		s.Close()
		t.Errorf("stream %d sent to a server whose root left the bundle", i)
		time.Sleep(200 * time.Millisecond)
	}
}
