package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
)

// TestIdleCloseRacingNewStream: a CONNECT that arrives as the server's idle
// timer finds the connection idle is refused (REFUSED_STREAM), and the
// GOAWAY that closes the connection does not claim it, so the client may
// retry it on another connection (RFC 9113 §6.8). The hook holds the timer
// between its idle check and the close until the reader took the HEADERS.
// Before the fix the stream was accepted and its handler run, then the close
// failed it under a GOAWAY naming it processed: the client's CONNECT was
// lost, not retried.
func TestIdleCloseRacingNewStream(t *testing.T) {
	checked := make(chan *conn, 1)
	proceed := make(chan struct{})
	testHookIdleChecked.set(t, func(c *conn) {
		select {
		case checked <- c:
			<-proceed
		default: // another firing: not held
		}
	})
	t.Cleanup(func() { close(proceed) })
	var handlers atomic.Int32
	_, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), IdleTimeout: 20 * time.Millisecond,
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			handlers.Add(1)
			<-ctx.Done()
			return Response{Status: 503, Reason: "gone"}
		}})
	c := <-checked
	if err := rc.connect(1, "10.0.0.1:80"); err != nil {
		t.Fatal(err)
	}
	waitfor.Until(t, "the reader took the HEADERS", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.lastPeerID == 1
	})
	proceed <- struct{}{}
	refused := false
	f := rc.waitFor("GOAWAY", func(f rawFrame) bool {
		if f.typ == http2.FrameRSTStream && f.stream == 1 && f.code == http2.ErrCodeRefusedStream {
			refused = true
		}
		return f.typ == http2.FrameGoAway
	})
	if f.last >= 1 && !refused {
		t.Errorf("GOAWAY(last stream %d) closed the idle connection with stream 1 neither refused nor beyond it: the client cannot retry its CONNECT", f.last)
	}
	if n := handlers.Load(); n != 0 {
		t.Errorf("%d handlers ran for a stream taken as the connection closed for idleness, want 0", n)
	}
}

// failingApp is an application connection whose reads fail at once, as a
// socket the application reset does.
type failingApp struct{ net.Conn }

func (failingApp) Read([]byte) (int, error) { return 0, errors.New("connection reset by the app") }

// TestDrainedConnSendsLastStreamsReset: on a draining server connection, the
// RST_STREAM of its last stream (here the relay's, when the application
// failed) reaches the client before the connection ends. Before the fix the
// stream was forgotten first, which closed the drained connection, and the
// reset queued after that was dropped: the client saw the connection end,
// not its stream reset.
func TestDrainedConnSendsLastStreamsReset(t *testing.T) {
	answer := make(chan struct{})
	srv, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: func(ctx context.Context, req *ServerRequest) Response {
		<-answer
		app, other := net.Pipe()
		t.Cleanup(func() { other.Close() })
		return Response{Upstream: failingApp{app}}
	}})
	if err := rc.connect(1, "10.0.0.1:80"); err != nil {
		t.Fatal(err)
	}
	var c *conn
	waitfor.Until(t, "the stream taken", func() bool {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		for sc := range srv.conns {
			sc.mu.Lock()
			if sc.streams[1] != nil {
				c = sc
			}
			sc.mu.Unlock()
		}
		return c != nil
	})
	c.drain()
	rc.waitFor("GOAWAY", func(f rawFrame) bool { return f.typ == http2.FrameGoAway })
	close(answer)
	rc.waitFor("RST_STREAM on stream 1", func(f rawFrame) bool {
		return f.typ == http2.FrameRSTStream && f.stream == 1
	})
}

// TestCloseInOrderWaitsForControlWrite: a connection closed in order (here
// a drained server connection whose last stream the client reset) sends
// the control frames its writer already took before it ends the
// connection: a stream's RST_STREAM reaches the client. The hook holds the
// control writer, with a batch holding stream 3's reset, until the close
// began. Before the fix the close sent TLS close_notify meanwhile, and the
// writer's reset, written after it, was lost: the client saw the
// connection end, not its stream reset.
func TestCloseInOrderWaitsForControlWrite(t *testing.T) {
	running := make(chan struct{}, 2)
	srv, addr := serveLoopback(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: func(ctx context.Context, req *ServerRequest) Response {
		running <- struct{}{}
		<-ctx.Done()
		return Response{Status: 503}
	}})
	conf := mustClientTLS()
	conf.NextProtos = []string{"h2"}
	tc, err := tls.Dial("tcp", addr, conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tc.Close() })
	rc := newRawClientOver(t, tc)
	for _, id := range []uint32{1, 3} {
		if err := rc.connect(id, "10.0.0.1:80"); err != nil {
			t.Fatal(err)
		}
		<-running
	}
	var c *conn
	srv.mu.Lock()
	for sc := range srv.conns {
		c = sc
	}
	srv.mu.Unlock()

	grabbed := make(chan struct{})
	testHookCtlBatch.set(t, func(hc *conn, batch []ctlFrame) {
		if hc != c || !slices.ContainsFunc(batch, func(f ctlFrame) bool { return f.typ == http2.FrameRSTStream && f.id == 3 }) {
			return
		}
		close(grabbed)
		select {
		case <-c.done:
		case <-time.After(5 * time.Second):
		}
	})

	c.drain()
	rc.waitFor("GOAWAY", func(f rawFrame) bool { return f.typ == http2.FrameGoAway })
	// A window beyond 2^31-1: the server resets stream 3 (FLOW_CONTROL_ERROR).
	if err := rc.fr.WriteWindowUpdate(3, maxWindow); err != nil {
		t.Fatal(err)
	}
	<-grabbed
	// The last stream ends: the drained connection closes in order.
	if err := rc.fr.WriteRSTStream(1, http2.ErrCodeCancel); err != nil {
		t.Fatal(err)
	}
	rc.waitFor("RST_STREAM on stream 3", func(f rawFrame) bool {
		return f.typ == http2.FrameRSTStream && f.stream == 3
	})
}

// TestConnectEvictedWhileReservedNotRedialled: a Connect whose connection
// Evict closed between the stream slot's reservation and the stream's
// opening fails as evicted. Before the fix it was retried as a stream the
// peer never saw, and the retry, finding the key gone, dialled a new
// connection from the evicted source, which nothing would evict again.
func TestConnectEvictedWhileReservedNotRedialled(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	var evicted atomic.Bool
	testHookReserved.set(t, func(p *Pool, c *conn) {
		if !evicted.Swap(true) {
			p.Evict(func(PoolKey) bool { return true })
		}
	})
	_, err = e.connect(context.Background(), app)
	if !errors.Is(err, errEvicted) {
		t.Errorf("Connect on a connection evicted meanwhile: %v, want %v", err, errEvicted)
	}
	if st := e.pool.Stats(); st.DialsTotal != 1 || st.Conns != 0 {
		t.Errorf("pool stats %+v: want 1 dial and no connection after the eviction", st)
	}
}

// TestConnectWaitingForEvictedDialNotRedialled: a Connect waiting for
// another's dial of its key fails as evicted when Evict closed that dial's
// connection before the server's SETTINGS came. Before the fix the dial
// ended without an error then, and the waiter, finding the key gone,
// dialled a new connection from the evicted source.
func TestConnectWaitingForEvictedDialNotRedialled(t *testing.T) {
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	inner := listenTCP(t, "127.0.0.1:0", func(c net.Conn) {
		defer c.Close()
		good, _ := pkis()
		tc := tls.Server(c, good.serverTLS())
		if tc.Handshake() != nil {
			return
		}
		<-release // no SETTINGS until the test ends
	})
	var dials atomic.Int32
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return inner(ctx, network, addr)
	}
	pool := hostilePool(t)
	waiting := make(chan struct{})
	testHookDialWait.set(t, func() { close(waiting) })

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	first := make(chan error, 1)
	go func() { first <- connectAndClose(ctx, pool, dial) }()
	waitfor.Until(t, "the first dial's connection pooled", func() bool { return pool.Stats().Conns == 1 })
	second := make(chan error, 1)
	go func() { second <- connectAndClose(ctx, pool, dial) }()
	<-waiting
	pool.Evict(func(PoolKey) bool { return true })
	for _, ch := range []chan error{first, second} {
		if err := <-ch; !errors.Is(err, errEvicted) {
			t.Errorf("Connect during the eviction: %v, want %v", err, errEvicted)
		}
	}
	if n := dials.Load(); n != 1 {
		t.Errorf("%d dials, want 1: none from the evicted source after its eviction", n)
	}
}
