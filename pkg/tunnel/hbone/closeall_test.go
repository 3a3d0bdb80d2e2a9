package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// stalledDownload opens an HBONE connection to addr as a client that grants
// huge windows, CONNECTs to app (which sends without end) and, once the
// answer came, reads nothing more: the server's relay fills the socket
// buffers and blocks in a write holding the connection's write lock.
func stalledDownload(t *testing.T, addr string, app netip.AddrPort) {
	t.Helper()
	good, _ := pkis()
	conf := good.clientTLS()
	conf.NextProtos = []string{"h2"}
	tc, err := tls.Dial("tcp", addr, conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tc.Close() })
	if _, err := tc.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(tc, tc)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30})
	_ = fr.WriteWindowUpdate(0, 1<<30)
	var buf bytes.Buffer
	if err := writeHeaderBlock(fr, hpack.NewEncoder(&buf), &buf, 1, []hpackField{
		{Name: ":method", Value: "CONNECT"}, {Name: ":authority", Value: app.String()}}); err != nil {
		t.Fatal(err)
	}
	_ = tc.SetReadDeadline(time.Now().Add(5 * time.Second))
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("waiting for the CONNECT's answer: %v", err)
		}
		if h, ok := f.(*http2.MetaHeadersFrame); ok && h.StreamID == 1 {
			if st := h.PseudoValue("status"); st != "200" {
				t.Fatalf("CONNECT answered %s, want 200", st)
			}
			return
		}
	}
}

// TestCloseWithStalledPeersBounded: closing a server whose clients stopped
// reading, each with a relay blocked in a write, takes about one close's
// write deadline, not one per connection. A close in order waits for the
// write lock (a control frame taken before it must go out first) until its
// write deadline unblocks the writer; one connection after another, a pod's
// stop (Shutdown, then Close) waited a second per such connection, and a
// client holding hundreds of them held the pod's stop, and the reconcile
// waiting on it, for minutes.
func TestCloseWithStalledPeersBounded(t *testing.T) {
	app := startUpstream(t, func(c *net.TCPConn) {
		b := make([]byte, 64<<10)
		for {
			if _, err := c.Write(b); err != nil {
				return
			}
		}
	})
	good, _ := pkis()
	srv, addr := serveLoopback(t, ServerOptions{TLSConfig: good.serverTLS(), Handler: dialTarget})
	const n = 8
	for range n {
		stalledDownload(t, addr, app)
	}
	time.Sleep(500 * time.Millisecond) // the relays fill the socket buffers and block
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	start := time.Now()
	_ = srv.Shutdown(ctx)
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Shutdown of %d connections whose clients read nothing took %v, want about one close's time (a write deadline of %v or two), not one per connection", n, took.Round(time.Millisecond), closeWriteDeadline)
	}
}

// TestEvictWithStalledPeersBounded: Evict of a pod's connections to servers
// that read nothing, each with a write blocked, takes about one close's
// write deadline, not one per connection (see
// TestCloseWithStalledPeersBounded).
func TestEvictWithStalledPeersBounded(t *testing.T) {
	h := newStallServer(t)
	pool := NewPool(PoolOptions{PingInterval: time.Minute, PingTimeout: time.Minute})
	t.Cleanup(func() { _ = pool.Close() })
	good, _ := pkis()
	req := Request{Authority: netip.MustParseAddrPort("10.0.0.3:80")}
	const n = 8
	var streams []*Stream
	for i := range n {
		key := PoolKey{Src: "pod", SrcIdentity: "a", DstIdentity: string(rune('b' + i)), DstAddr: h.l.Addr().(*net.TCPAddr).AddrPort()}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		s, err := pool.Connect(ctx, key, tcpDial, good.clientTLS(), req)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		streams = append(streams, s)
	}
	// The stall server stops reading every connection once the first
	// stream sent DATA, so each writer blocks.
	for _, s := range streams {
		go func() { _, _ = s.Write(make([]byte, 64<<20)) }()
	}
	time.Sleep(500 * time.Millisecond) // the writers fill the socket buffers and block
	start := time.Now()
	if got := pool.Evict(func(k PoolKey) bool { return k.Src == "pod" }); got != n {
		t.Errorf("Evict closed %d connections, want %d", got, n)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Evict of %d connections to servers that read nothing took %v, want about one close's time (a write deadline of %v or two), not one per connection", n, took.Round(time.Millisecond), closeWriteDeadline)
	}
}

// TestCloseNotifyBounded: the close_notify of a close in order, to a peer
// that reads nothing, gives up at the close's write deadline. crypto/tls
// sets a deadline of its own on it, 5 s, over the one we set, so such a
// close took 5 s more than closeWriteDeadline (a pod's stop waited for it,
// Evict once per connection).
func TestCloseNotifyBounded(t *testing.T) {
	h := newStallServer(t)
	pool := NewPool(PoolOptions{PingInterval: time.Minute, PingTimeout: time.Minute})
	t.Cleanup(func() { _ = pool.Close() })
	good, _ := pkis()
	key := PoolKey{Src: "pod", SrcIdentity: "a", DstIdentity: "b", DstAddr: h.l.Addr().(*net.TCPAddr).AddrPort()}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	s, err := pool.Connect(ctx, key, tcpDial, good.clientTLS(), Request{Authority: netip.MustParseAddrPort("10.0.0.3:80")})
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	<-h.stopped
	// Fill the socket's buffers under TLS: the peer reads nothing more,
	// so close_notify finds no room, while crypto/tls saw no failed write.
	raw := s.c.cfg.batch.Conn
	junk := make([]byte, 1<<20)
	for stuck := 0; stuck < 3; {
		_ = raw.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
		if n, _ := raw.Write(junk); n == 0 {
			stuck++
		} else {
			stuck = 0
		}
	}
	start := time.Now()
	pool.Evict(func(PoolKey) bool { return true })
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("a close in order to a peer that reads nothing took %v, want about two write deadlines of %v", took.Round(time.Millisecond), closeWriteDeadline)
	}
}
