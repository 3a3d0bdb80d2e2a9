package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
)

func TestEcho(t *testing.T) {
	var got atomic.Pointer[ServerRequest]
	var done sync.WaitGroup
	var fromClient, toClient atomic.Int64
	done.Add(1)
	handler := func(ctx context.Context, req *ServerRequest) Response {
		got.Store(req)
		resp := dialTarget(ctx, req)
		resp.Done = func(in, out int64, err error) {
			fromClient.Store(in)
			toClient.Store(out)
			done.Done()
		}
		return resp
	}
	e := newEnv(t, handler, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)

	ctx := context.Background()
	s, err := e.pool.Connect(ctx, e.key, tcpDial, mustClientTLS(), Request{
		Authority: app,
		Forwarded: `for="10.0.0.1";host=echo.default.svc.cluster.local`,
		Header:    http.Header{"Baggage": {"k8s.namespace.name=default"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	msg := []byte("hello through hbone")
	if _, err := s.Write(msg); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(s, buf); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf, msg) {
		t.Fatalf("echo = %q, want %q", buf, msg)
	}
	if err := s.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if rest, err := io.ReadAll(s); err != nil || len(rest) != 0 {
		t.Fatalf("after CloseWrite: read %q, %v; want EOF", rest, err)
	}
	s.Close()
	done.Wait()

	req := got.Load()
	if req.Target != app || req.Authority != app.String() {
		t.Errorf("target %v authority %q, want %v", req.Target, req.Authority, app)
	}
	if req.Forwarded != `for="10.0.0.1";host=echo.default.svc.cluster.local` {
		t.Errorf("forwarded = %q", req.Forwarded)
	}
	if req.Header.Get("Baggage") != "k8s.namespace.name=default" {
		t.Errorf("headers = %v", req.Header)
	}
	if req.TLS == nil || len(req.TLS.PeerCertificates) == 0 || req.TLS.PeerCertificates[0].URIs[0].String() != "spiffe://cluster.local/ns/default/sa/test" {
		t.Errorf("peer identity not passed to the handler")
	}
	if fromClient.Load() != int64(len(msg)) || toClient.Load() != int64(len(msg)) {
		t.Errorf("relay counted %d in, %d out; want %d each", fromClient.Load(), toClient.Load(), len(msg))
	}
	if s.LocalAddr() == nil || s.RemoteAddr().String() != e.addr.String() {
		t.Errorf("addresses: local %v remote %v", s.LocalAddr(), s.RemoteAddr())
	}
	if st := e.srv.Stats(); st.StreamsOK != 1 || st.ConnsAccepted != 1 {
		t.Errorf("server stats = %+v", st)
	}
}

func mustClientTLS() *tls.Config {
	good, _ := pkis()
	return good.clientTLS()
}

func TestIPv6Authority(t *testing.T) {
	var got atomic.Value
	e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
		got.Store(req.Authority)
		return Response{Status: 403, Reason: "no"}
	}, ServerOptions{}, PoolOptions{})
	target := netip.MustParseAddrPort("[fd00::1]:8080")
	_, err := e.connect(context.Background(), target)
	var se *StatusError
	if !errors.As(err, &se) || se.Status != 403 {
		t.Fatalf("err = %v, want 403", err)
	}
	if got.Load() != "[fd00::1]:8080" {
		t.Fatalf("authority = %v", got.Load())
	}
}

// TestConcurrentStreams opens 200 streams at once: the pool must spread them
// over ceil(200/MaxStreamsPerConn) connections (plus a little slack), and
// concurrent Connects for the new key must not each dial.
func TestConcurrentStreams(t *testing.T) {
	const streams, perConn = 200, 50
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{MaxStreamsPerConn: perConn})
	app := startUpstream(t, echo)

	var (
		wg    sync.WaitGroup
		open  sync.WaitGroup
		errs  = make(chan error, streams)
		ready = make(chan struct{})
	)
	wg.Add(streams)
	open.Add(streams)
	for i := range streams {
		go func() {
			defer wg.Done()
			s, err := e.connect(context.Background(), app)
			open.Done()
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			<-ready // hold every stream open until all are
			msg := fmt.Appendf(nil, "stream %d", i)
			if _, err := s.Write(msg); err != nil {
				errs <- err
				return
			}
			_ = s.CloseWrite()
			got, err := io.ReadAll(s)
			if err != nil || !bytes.Equal(got, msg) {
				errs <- fmt.Errorf("stream %d: got %q, %v", i, got, err)
			}
		}()
	}
	open.Wait()
	st := e.pool.Stats()
	close(ready)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	maxConns := (streams+perConn-1)/perConn + 1
	if st.ActiveStreams != streams || st.Conns > maxConns || st.DialsTotal > uint64(maxConns) {
		t.Errorf("with %d streams open: %+v, want %d active on at most %d conns", streams, st, streams, maxConns)
	}
	waitfor.Until(t, "streams to finish", func() bool { return e.pool.Stats().ActiveStreams == 0 })
}

// TestConnsPerKeySpreads: with ConnsPerKey 2 a key's streams go to a second
// connection once the first carries one, then to the least loaded, and never
// to a third; with the default they share one.
func TestConnsPerKeySpreads(t *testing.T) {
	for _, tc := range []struct {
		connsPerKey int
		wantLoads   []int
	}{{0, []int{8}}, {2, []int{4, 4}}} {
		t.Run(fmt.Sprintf("ConnsPerKey=%d", tc.connsPerKey), func(t *testing.T) {
			e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{ConnsPerKey: tc.connsPerKey})
			app := startUpstream(t, echo)
			var streams []*Stream
			open := func() {
				s, err := e.connect(context.Background(), app)
				if err != nil {
					t.Fatal(err)
				}
				streams = append(streams, s)
			}
			open()
			open()
			// The second stream found the first conn busy; the spare is
			// dialled in the background.
			waitfor.Until(t, "conns dialled", func() bool { return e.pool.Stats().Conns == len(tc.wantLoads) })
			for range 6 {
				open()
			}
			var loads []int
			e.pool.mu.Lock()
			for _, c := range e.pool.entries[e.key].conns {
				c.mu.Lock()
				loads = append(loads, c.active)
				c.mu.Unlock()
			}
			e.pool.mu.Unlock()
			slices.Sort(loads)
			if !slices.Equal(loads, tc.wantLoads) || e.pool.Stats().DialsTotal != uint64(len(tc.wantLoads)) {
				t.Errorf("8 streams on conns carrying %v (%d dials), want %v", loads, e.pool.Stats().DialsTotal, tc.wantLoads)
			}
			for i, s := range streams {
				msg := fmt.Appendf(nil, "stream %d", i)
				if _, err := s.Write(msg); err != nil {
					t.Fatal(err)
				}
				_ = s.CloseWrite()
				if got, err := io.ReadAll(s); err != nil || !bytes.Equal(got, msg) {
					t.Errorf("stream %d: got %q, %v", i, got, err)
				}
				s.Close()
			}
		})
	}
}

// TestOverflowConnsEmptyAfterBurst: conns dialled because a burst filled
// the key's own conns carry no streams once the burst is over, while the own
// ones have room, and so close at IdleTimeout. Least loaded over every conn
// spread a later load one stream per conn, and kept them all.
func TestOverflowConnsEmptyAfterBurst(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{ConnsPerKey: 1, MaxStreamsPerConn: 2, IdleTimeout: 300 * time.Millisecond})
	app := startUpstream(t, echo)
	openN := func(n int) []*Stream {
		var streams []*Stream
		for range n {
			s, err := e.connect(context.Background(), app)
			if err != nil {
				t.Fatal(err)
			}
			streams = append(streams, s)
		}
		return streams
	}
	closeAll := func(streams []*Stream) {
		for _, s := range streams {
			s.Close()
		}
	}
	burst := openN(6)
	if n := e.pool.Stats().Conns; n != 3 {
		t.Fatalf("a burst of 6 streams, 2 per conn: %d conns, want 3", n)
	}
	closeAll(burst)
	waitfor.Until(t, "the burst's streams to end", func() bool { return e.pool.Stats().ActiveStreams == 0 })

	// An ordinary load after it, two streams at a time: always on the
	// key's own conn, and the two others close, under that load. Each pair
	// is waited out before the next: a closed stream's slot comes back
	// when the control writer has sent its reset, and a 10 ms pause stood
	// for that, so a late writer (a loaded VM, -race) left the own conn one
	// slot and the next pair was split on a correct pool. The load runs
	// until the overflow conns are gone (about IdleTimeout), a second at
	// least; spread over every conn, it would keep them for ever.
	start := time.Now()
	for n := e.pool.Stats().Conns; n != 1 || time.Since(start) < time.Second; n = e.pool.Stats().Conns {
		if time.Since(start) > waitfor.Timeout {
			t.Fatalf("%d conns %s after the burst under a load of two streams, want 1 (the overflow ones closed idle)", n, waitfor.Timeout)
		}
		pair := openN(2)
		if pair[0].c != pair[1].c {
			t.Fatalf("two streams on two conns while the first had room for both")
		}
		closeAll(pair)
		waitfor.Until(t, "the pair's streams to end", func() bool { return e.pool.Stats().ActiveStreams == 0 })
	}
}

// TestEvictDuringSpreadDial: a connection still being dialled when its
// source is evicted is closed when made, not pooled: nothing may leave from a
// pod that went away.
func TestEvictDuringSpreadDial(t *testing.T) {
	// The idle timeout is far beyond waitfor's: a spare kept in the pool
	// would stay open past the wait.
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{ConnsPerKey: 2, IdleTimeout: time.Minute})
	app := startUpstream(t, echo)
	good, _ := pkis()
	dialing, release := make(chan struct{}, 1), make(chan struct{})
	var dials atomic.Int32
	spare := &closeSpy{}
	held := func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := tcpDial(ctx, network, addr)
		if dials.Add(1) == 2 && err == nil {
			dialing <- struct{}{}
			<-release
			spare.Conn = c
			return spare, nil
		}
		return c, err
	}
	req := Request{Authority: app, Forwarded: `for="10.0.0.1"`}
	for range 2 {
		s, err := e.pool.Connect(context.Background(), e.key, held, good.clientTLS(), req)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
	}
	<-dialing
	if n := e.pool.Evict(func(PoolKey) bool { return true }); n != 1 {
		t.Errorf("Evict closed %d connections, want 1", n)
	}
	close(release)
	waitfor.Until(t, "the spare, dialled for an evicted source, to be closed", spare.closed.Load)
	waitfor.Until(t, "the server to see no connection", func() bool { return e.srv.Stats().ConnsActive == 0 })
}

// closeSpy is a net.Conn that records its Close.
type closeSpy struct {
	net.Conn
	closed atomic.Bool
}

func (c *closeSpy) Close() error {
	c.closed.Store(true)
	return c.Conn.Close()
}

// TestServerStreamLimit: the pool allows more streams than the server does;
// it must follow the server's SETTINGS and retry refused streams.
func TestServerStreamLimit(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{MaxConcurrentStreams: 4}, PoolOptions{})
	app := startUpstream(t, echo)
	var wg, opened sync.WaitGroup
	errs := make(chan error, 20)
	release := make(chan struct{})
	for range 20 {
		wg.Add(1)
		opened.Add(1)
		go func() {
			defer wg.Done()
			s, err := e.connect(context.Background(), app)
			opened.Done()
			if err != nil {
				errs <- err
				return
			}
			<-release
			s.Close()
		}()
	}
	opened.Wait()
	if st := e.pool.Stats(); st.Conns < 5 || st.ActiveStreams != 20 {
		t.Errorf("20 streams with a server limit of 4: %+v, want 20 streams on at least 5 conns", st)
	}
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestNoDialStampede: concurrent Connects for a new key share one dial.
func TestNoDialStampede(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)
	var wg sync.WaitGroup
	streams := make(chan *Stream, 50)
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := e.connect(context.Background(), app)
			if err != nil {
				t.Error(err)
				return
			}
			streams <- s
		}()
	}
	wg.Wait()
	close(streams)
	for s := range streams {
		s.Close()
	}
	if st := e.pool.Stats(); st.DialsTotal != 1 || st.Conns != 1 {
		t.Errorf("50 concurrent connects: %+v, want one dial", st)
	}
}

// TestHalfClose: the client half-closes; the application sees EOF, still
// answers, then closes; the client reads the answer and then EOF.
func TestHalfClose(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, func(c *net.TCPConn) {
		n, _ := io.Copy(io.Discard, c) // until the client's CloseWrite
		fmt.Fprintf(c, "got %d bytes", n)
	})
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Write(make([]byte, 100000)); err != nil {
		t.Fatal(err)
	}
	if err := s.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Write([]byte("x")); err == nil {
		t.Error("write after CloseWrite succeeded")
	}
	got, err := io.ReadAll(s)
	if err != nil || string(got) != "got 100000 bytes" {
		t.Fatalf("read %q, %v", got, err)
	}
}

// TestLargeTransfer sends 256 MiB through a stream; the application hashes
// what it got and sends the hash back.
func TestLargeTransfer(t *testing.T) {
	size := int64(256 << 20)
	if testing.Short() {
		size = 32 << 20
	}
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, func(c *net.TCPConn) {
		h := sha256.New()
		_, _ = io.Copy(h, c)
		_, _ = c.Write(h.Sum(nil))
	})
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	want := sha256.New()
	src := io.TeeReader(io.LimitReader(newPRNGReader(1), size), want)
	n, err := io.Copy(s, src)
	if err != nil || n != size {
		t.Fatalf("copied %d, %v", n, err)
	}
	if err := s.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(s)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want.Sum(nil)) {
		t.Fatalf("sha256 mismatch after %d bytes", size)
	}
}

// prngReader yields a cheap deterministic byte stream.
type prngReader struct{ r *rand.ChaCha8 }

func newPRNGReader(seed byte) io.Reader { return prngReader{rand.NewChaCha8([32]byte{seed})} }

func (p prngReader) Read(b []byte) (int, error) { return p.r.Read(b) }

func TestDeniedCarriesReason(t *testing.T) {
	e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
		return Response{Status: http.StatusForbidden, Reason: "denied by policy ns1/deny-all"}
	}, ServerOptions{}, PoolOptions{})
	_, err := e.connect(context.Background(), netip.MustParseAddrPort("10.0.0.2:80"))
	var se *StatusError
	if !errors.As(err, &se) || se.Status != 403 || se.Reason != "denied by policy ns1/deny-all" {
		t.Fatalf("err = %v, want 403 with the reason", err)
	}
	waitfor.Until(t, "stream released", func() bool { return e.pool.Stats().ActiveStreams == 0 })
	if st := e.srv.Stats(); st.StreamsDenied != 1 {
		t.Errorf("server stats = %+v", st)
	}
}

func TestDialFailureIs503(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	closed := l.Addr().(*net.TCPAddr).AddrPort()
	l.Close()
	_, err := e.connect(context.Background(), closed)
	var se *StatusError
	if !errors.As(err, &se) || se.Status != 503 || !contains(se.Reason, "connection refused") {
		t.Fatalf("err = %v, want 503 naming the dial error", err)
	}
}

// TestMalformedRequests uses a generic HTTP/2 client (x/net) to send what
// the pool never sends.
func TestMalformedRequests(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	tr := &http2.Transport{TLSClientConfig: mustClientTLS()}
	defer tr.CloseIdleConnections()
	base := "https://" + e.addr.String()

	tests := []struct {
		name, method, host string
		status             int
		reason             string
	}{
		{"GET", "GET", "10.0.0.1:80", 405, `method "GET" not allowed`},
		{"authority not ip:port", "CONNECT", "foo.example:80", 400, "malformed :authority"},
		{"authority without port", "CONNECT", "10.0.0.1", 400, "malformed :authority"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(tc.method, base, nil)
			req.Host = tc.host
			resp, err := tr.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tc.status {
				t.Errorf("status = %d, want %d", resp.StatusCode, tc.status)
			}
			if h := resp.Header.Get(ReasonHeader); !contains(h, tc.reason) || !contains(string(body), tc.reason) {
				t.Errorf("reason header %q body %q, want %q", h, body, tc.reason)
			}
		})
	}
	if st := e.srv.Stats(); st.StreamsBadRequest != uint64(len(tests)) {
		t.Errorf("server stats = %+v", st)
	}
}

func TestParseRequest(t *testing.T) {
	f := func(kv ...string) []hpackField {
		var out []hpackField
		for i := 0; i < len(kv); i += 2 {
			out = append(out, hpackField{Name: kv[i], Value: kv[i+1]})
		}
		return out
	}
	tests := []struct {
		name   string
		fields []hpackField
		status int
		target string
	}{
		{"ok", f(":method", "CONNECT", ":authority", "10.1.2.3:8080"), 0, "10.1.2.3:8080"},
		{"ok ipv6", f(":method", "CONNECT", ":authority", "[fd00::2]:80"), 0, "[fd00::2]:80"},
		{"v4-mapped is unmapped", f(":method", "CONNECT", ":authority", "[::ffff:10.0.0.1]:80"), 0, "10.0.0.1:80"},
		{"no method", f(":authority", "10.1.2.3:8080"), 400, ""},
		{"post without path", f(":method", "POST", ":authority", "10.1.2.3:8080"), 400, ""},
		{"post", f(":method", "POST", ":scheme", "https", ":path", "/", ":authority", "10.1.2.3:8080"), 405, ""},
		{"no authority", f(":method", "CONNECT"), 400, ""},
		{"hostname", f(":method", "CONNECT", ":authority", "svc:80"), 400, ""},
		{"zone", f(":method", "CONNECT", ":authority", "[fe80::1%eth0]:80"), 400, ""},
		{"port 0", f(":method", "CONNECT", ":authority", "10.0.0.1:0"), 400, ""},
		{"path", f(":method", "CONNECT", ":authority", "10.0.0.1:80", ":path", "/"), 400, ""},
		{"extended connect", f(":method", "CONNECT", ":protocol", "websocket", ":authority", "10.0.0.1:80"), 400, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req, status, reason, _ := parseRequest(tc.fields, false)
			if status != tc.status {
				t.Fatalf("status = %d (%s), want %d", status, reason, tc.status)
			}
			if status == 0 && req.Target.String() != tc.target {
				t.Errorf("target = %v, want %v", req.Target, tc.target)
			}
			if status != 0 && reason == "" {
				t.Error("refusal without a reason")
			}
		})
	}
	if _, status, _, _ := parseRequest(f(":method", "CONNECT", ":authority", "10.0.0.1:80"), true); status != 431 {
		t.Errorf("truncated headers: status %d, want 431", status)
	}
}

func TestWrongCAFailsHandshake(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	_, other := pkis()
	_, err := e.pool.Connect(context.Background(), e.key, tcpDial, other.clientTLS(), Request{Authority: netip.MustParseAddrPort("10.0.0.1:80")})
	if err == nil || !contains(err.Error(), "tls handshake") {
		t.Fatalf("err = %v, want a handshake failure", err)
	}
	waitfor.Until(t, "handshake failure counted", func() bool { return e.srv.Stats().HandshakeFailures == 1 })
	if st := e.pool.Stats(); st.Conns != 0 {
		t.Errorf("failed dial left %d conns in the pool", st.Conns)
	}
}

func TestIdleConnClosed(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{IdleTimeout: 100 * time.Millisecond})
	app := startUpstream(t, echo)
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // an open stream keeps the conn
	if st := e.pool.Stats(); st.Conns != 1 {
		t.Fatalf("conn with an open stream closed: %+v", st)
	}
	s.Close()
	waitfor.Until(t, "idle conn closed", func() bool { return e.pool.Stats().Conns == 0 })
	waitfor.Until(t, "server saw the close", func() bool { return e.srv.Stats().ConnsActive == 0 })

	// The next Connect dials again.
	s, err = e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if st := e.pool.Stats(); st.DialsTotal != 2 {
		t.Errorf("dials = %d, want 2", st.DialsTotal)
	}
}

func TestServerIdleTimeout(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{IdleTimeout: 100 * time.Millisecond}, PoolOptions{})
	s, err := e.connect(context.Background(), startUpstream(t, echo))
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	waitfor.Until(t, "server closes idle conn", func() bool { return e.srv.Stats().ConnsActive == 0 })
	waitfor.Until(t, "pool drops the conn", func() bool { return e.pool.Stats().Conns == 0 })
}

// TestShutdownDrains: Shutdown lets an open stream finish, refuses new
// ones, and returns once it ended.
func TestShutdownDrains(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	shut := make(chan error, 1)
	go func() { shut <- e.srv.Shutdown(context.Background()) }()
	waitfor.Until(t, "pool sees GOAWAY", func() bool {
		s2, err := e.connect(context.Background(), app)
		if err != nil {
			return true
		}
		s2.Close()
		return false
	})
	if _, err := s.Write([]byte("still works")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 11)
	if _, err := io.ReadFull(s, buf); err != nil || string(buf) != "still works" {
		t.Fatalf("read %q, %v", buf, err)
	}
	select {
	case err := <-shut:
		t.Fatalf("shutdown returned %v with a stream open", err)
	case <-time.After(50 * time.Millisecond):
	}
	s.Close()
	select {
	case err := <-shut:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("shutdown did not return after the last stream closed")
	}
}

// TestShutdownDuringHandshakeRetried: a conn accepted before Shutdown
// closed the listener and handshaken after it began (an upgrade's drain)
// must not fail the request its client sent right after the handshake:
// the server answers with GOAWAY, and the pool retries on a new conn,
// here to a second server standing in for the successor agent. It once
// closed such a conn without a word, and the request failed.
func TestShutdownDuringHandshakeRetried(t *testing.T) {
	inHandshake, release := make(chan struct{}), make(chan struct{})
	var verified atomic.Int32
	good, _ := pkis()
	blocking := good.serverTLS()
	blocking.VerifyConnection = func(tls.ConnectionState) error {
		if verified.Add(1) == 1 {
			close(inHandshake)
			<-release
		}
		return nil
	}
	old := newEnv(t, dialTarget, ServerOptions{TLSConfig: blocking}, PoolOptions{})
	successor := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)

	var dials atomic.Int32
	dial := func(ctx context.Context, network, _ string) (net.Conn, error) {
		if dials.Add(1) == 1 {
			return tcpDial(ctx, network, old.addr.String())
		}
		return tcpDial(ctx, network, successor.addr.String())
	}
	type result struct {
		s   *Stream
		err error
	}
	connected := make(chan result, 1)
	go func() {
		s, err := old.pool.Connect(context.Background(), old.key, dial, good.clientTLS(), Request{Authority: app, Forwarded: `for="10.0.0.1"`})
		connected <- result{s, err}
	}()
	<-inHandshake
	shut := make(chan error, 1)
	go func() { shut <- old.srv.Shutdown(context.Background()) }()
	waitfor.Until(t, "shutdown began", old.srv.isClosed)
	close(release)

	r := <-connected
	if r.err != nil {
		t.Fatalf("connect across the shutdown: %v (dials %d)", r.err, dials.Load())
	}
	defer r.s.Close()
	if n := dials.Load(); n != 2 {
		t.Errorf("%d dials, want 2 (the shut down server, then the successor)", n)
	}
	if _, err := r.s.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(r.s, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo through the successor: %q, %v", buf, err)
	}
	select {
	case err := <-shut:
		if err != nil {
			t.Fatalf("shutdown: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("shutdown did not return")
	}
}

func TestShutdownTimeoutClosesStreams(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	s, err := e.connect(context.Background(), startUpstream(t, echo))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := e.srv.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("shutdown = %v, want deadline exceeded", err)
	}
	if _, err := io.ReadAll(s); err == nil {
		t.Fatal("stream survived a forced shutdown")
	}
	waitfor.Until(t, "broken conn removed from the pool", func() bool { return e.pool.Stats().Conns == 0 })
}

func TestReadDeadline(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	s, err := e.connect(context.Background(), startUpstream(t, echo))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_ = s.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := s.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read = %v, want deadline exceeded", err)
	}
	_ = s.SetReadDeadline(time.Time{})
	if _, err := s.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(s, make([]byte, 1)); err != nil {
		t.Fatalf("read after clearing the deadline: %v", err)
	}
}

// TestWriteDeadline: an application that stops reading exhausts the
// stream's flow-control window; a blocked Write then honours its deadline.
func TestWriteDeadline(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	stop := make(chan struct{})
	app := startUpstream(t, func(c *net.TCPConn) { <-stop })
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	defer close(stop)
	defer s.Close()
	_ = s.SetWriteDeadline(time.Now().Add(300 * time.Millisecond))
	buf := make([]byte, 1<<20)
	var total int
	for total < 256<<20 {
		n, err := s.Write(buf)
		total += n
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	t.Fatalf("wrote %d bytes to an application that reads nothing", total)
}

// TestPeerCloseResetsStream: the application closing abruptly reaches the
// client as the end of the stream, and the conn stays usable.
func TestUpstreamCloseEndsStream(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, func(c *net.TCPConn) { _, _ = c.Write([]byte("bye")) })
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(s)
	if string(got) != "bye" || err != nil {
		t.Fatalf("read %q, %v", got, err)
	}
	s.Close()
	s, err = e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if st := e.pool.Stats(); st.DialsTotal != 1 {
		t.Errorf("dials = %d, want 1 (conn reused)", st.DialsTotal)
	}
}

func TestConnectContextCancelled(t *testing.T) {
	block := make(chan struct{})
	e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
		select {
		case <-block:
		case <-ctx.Done():
		}
		return Response{Status: 503}
	}, ServerOptions{}, PoolOptions{})
	defer close(block)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := e.connect(ctx, netip.MustParseAddrPort("10.0.0.1:80")); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want deadline exceeded", err)
	}
	waitfor.Until(t, "cancelled stream released", func() bool { return e.pool.Stats().ActiveStreams == 0 })
}

func TestRelayHalfCloseTCP(t *testing.T) {
	checkGoroutines(t)
	// client <-> [a  Relay  b] <-> app, all TCP.
	app := startUpstream(t, func(c *net.TCPConn) {
		b, _ := io.ReadAll(c)
		_, _ = c.Write(bytes.ToUpper(b))
	})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	type result struct {
		ab, ba int64
		err    error
	}
	res := make(chan result, 1)
	go func() {
		a, err := l.Accept()
		if err != nil {
			res <- result{err: err}
			return
		}
		b, err := net.Dial("tcp", app.String())
		if err != nil {
			a.Close()
			res <- result{err: err}
			return
		}
		ab, ba, err := Relay(a, b)
		res <- result{ab, ba, err}
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = c.Write([]byte("hello"))
	_ = c.(*net.TCPConn).CloseWrite()
	got, _ := io.ReadAll(c)
	if string(got) != "HELLO" {
		t.Fatalf("got %q", got)
	}
	r := <-res
	if r.err != nil || r.ab != 5 || r.ba != 5 {
		t.Fatalf("relay = %+v", r)
	}
}

func TestRequestValidation(t *testing.T) {
	p := NewPool(PoolOptions{})
	defer p.Close()
	bad := []Request{
		{},
		{Authority: netip.MustParseAddrPort("10.0.0.1:0")},
		{Authority: netip.MustParseAddrPort("10.0.0.1:80"), Forwarded: "for=\"x\"\r\nevil: 1"},
		{Authority: netip.MustParseAddrPort("10.0.0.1:80"), Header: http.Header{"Connection": {"close"}}},
		{Authority: netip.MustParseAddrPort("10.0.0.1:80"), Header: http.Header{"Bad Name": {"x"}}},
		{Authority: netip.MustParseAddrPort("10.0.0.1:80"), EarlyData: make([]byte, MaxEarlyData+1)},
	}
	for _, r := range bad {
		if _, err := p.Connect(context.Background(), PoolKey{}, tcpDial, mustClientTLS(), r); err == nil {
			t.Errorf("Connect(%+v) succeeded", r)
		}
	}
	if st := p.Stats(); st.DialsTotal != 0 {
		t.Errorf("invalid requests dialled: %+v", st)
	}
}

// Early data reaches the destination before anything written after
// Connect, in order, on a fresh connection and on a pooled one.
func TestEarlyData(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)
	good, _ := pkis()
	for i, size := range []int{1, MaxEarlyData} {
		early := bytes.Repeat([]byte{byte('a' + i)}, size)
		s, err := e.pool.Connect(context.Background(), e.key, tcpDial, good.clientTLS(), Request{Authority: app, EarlyData: early})
		if err != nil {
			t.Fatal(err)
		}
		if !s.EarlyDataSent() {
			t.Fatalf("stream %d: early data not sent with fresh windows", i)
		}
		rest := bytes.Repeat([]byte("z"), 100000)
		if _, err := s.Write(rest); err != nil {
			t.Fatal(err)
		}
		if err := s.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(s)
		s.Close()
		if err != nil || !bytes.Equal(got, append(early, rest...)) {
			t.Fatalf("stream %d: echoed %d bytes (err %v), want the %d early bytes then the rest", i, len(got), err, size)
		}
	}
	if st := e.pool.Stats(); st.DialsTotal != 1 {
		t.Errorf("pool stats = %+v, want the second stream on the pooled connection", st)
	}
}

// A refused tunnel drops its early data: the application never sees it.
func TestEarlyDataRefused(t *testing.T) {
	e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
		return Response{Status: http.StatusForbidden, Reason: "denied"}
	}, ServerOptions{}, PoolOptions{})
	good, _ := pkis()
	_, err := e.pool.Connect(context.Background(), e.key, tcpDial, good.clientTLS(),
		Request{Authority: netip.MustParseAddrPort("10.0.0.2:80"), EarlyData: []byte("secret")})
	var se *StatusError
	if !errors.As(err, &se) || se.Status != http.StatusForbidden {
		t.Fatalf("err = %v, want 403", err)
	}
	waitfor.Until(t, "stream released", func() bool { return e.pool.Stats().ActiveStreams == 0 })
}

// Pods never share a pooled connection, and evicting one pod's connections
// fails its streams only.
func TestPoolKeyedBySourceAndEvict(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)
	good, _ := pkis()
	open := func(src string) *Stream {
		key := e.key
		key.Src = src
		s, err := e.pool.Connect(context.Background(), key, tcpDial, good.clientTLS(), Request{Authority: app})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	a, b := open("pod-a"), open("pod-b")
	if st := e.pool.Stats(); st.Conns != 2 || st.DialsTotal != 2 {
		t.Fatalf("two source pods: %+v, want a connection each", st)
	}
	evicted := e.pool.Evict(func(k PoolKey) bool { return k.Src == "pod-a" })
	if evicted != 1 {
		t.Errorf("Evict closed %d connections, want 1", evicted)
	}
	if _, err := a.Write([]byte("x")); err == nil {
		if _, err := a.Read(make([]byte, 1)); err == nil {
			t.Error("a stream of the evicted pod still works")
		}
	}
	if _, err := b.Write([]byte("y")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1)
	if _, err := io.ReadFull(b, got); err != nil || got[0] != 'y' {
		t.Errorf("the other pod's stream: %q, %v", got, err)
	}
}

// A connection whose peer stops answering is not given new streams: after
// one Connect times out, the next dials afresh.
func TestUnansweredConnectRetiresConn(t *testing.T) {
	var calls atomic.Int32
	e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
		if calls.Add(1) == 1 {
			<-ctx.Done() // never answer the first request
			return Response{Status: http.StatusServiceUnavailable}
		}
		return dialTarget(ctx, req)
	}, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := e.connect(ctx, app); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("unanswered connect: %v, want a timeout", err)
	}
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := e.pool.Stats(); st.DialsTotal != 2 {
		t.Errorf("after a timed-out connect: %+v, want a second connection dialled", st)
	}
}

// Early data that does not fit the send windows is not sent (and Connect
// does not wait for window): the caller keeps it.
func TestEarlyDataWithoutWindow(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)
	first, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	c := first.c
	c.mu.Lock()
	c.sendWindow = 0 // as if other streams had used the connection's window
	c.mu.Unlock()
	good, _ := pkis()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := e.pool.Connect(ctx, e.key, tcpDial, good.clientTLS(), Request{Authority: app, EarlyData: []byte("early")})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.EarlyDataSent() {
		t.Error("early data reported sent without window")
	}
}

// A connect that times out on a connection whose peer still sends frames
// (its app is only slow) keeps the connection for new streams.
func TestSlowAnswerKeepsLiveConn(t *testing.T) {
	slow := make(chan struct{})
	e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
		if req.Target.Port() == 9 { // the slow app
			select {
			case <-slow:
			case <-ctx.Done():
			}
			return Response{Status: http.StatusServiceUnavailable}
		}
		return dialTarget(ctx, req)
	}, ServerOptions{}, PoolOptions{})
	defer close(slow)
	app := startUpstream(t, echo)
	live, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { // keep frames coming back on the connection
		defer close(done)
		b := []byte{'x'}
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := live.Write(b); err != nil {
				return
			}
			if _, err := io.ReadFull(live, b); err != nil {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := e.connect(ctx, netip.AddrPortFrom(app.Addr(), 9)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("connect to the slow app: %v, want a timeout", err)
	}
	close(stop)
	<-done
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if st := e.pool.Stats(); st.DialsTotal != 1 {
		t.Errorf("after a slow answer on a live connection: %+v, want it kept (one dial)", st)
	}
}

// writeCounter counts the writes to a connection's socket.
type writeCounter struct {
	net.Conn
	writes *atomic.Int64
}

func (w *writeCounter) Write(p []byte) (int, error) {
	w.writes.Add(1)
	return w.Conn.Write(p)
}

// TestBurstSharesWrites: small frames that the streams of one connection write at the same
// moment (a client's burst of requests, whose relays the network poller wakes together) leave
// in a few TLS records and write(2)s, not one each. One CPU makes "the same moment"
// deterministic: every writer is runnable before the first one runs.
func TestBurstSharesWrites(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, func(c *net.TCPConn) { _, _ = io.Copy(io.Discard, c) })
	var writes atomic.Int64
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := tcpDial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &writeCounter{Conn: c, writes: &writes}, nil
	}
	good, _ := pkis()
	const n = 16
	streams := make([]*Stream, n)
	for i := range streams {
		s, err := e.pool.Connect(context.Background(), e.key, dial, good.clientTLS(), Request{Authority: app})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if i > 0 && s.c != streams[0].c {
			t.Fatal("the streams are not on one connection: the test would prove nothing")
		}
		streams[i] = s
	}
	// Past crypto/tls's small first records (dynamic record sizing, the first 128 KiB).
	for range 10 {
		if _, err := streams[0].Write(make([]byte, 16<<10)); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(50 * time.Millisecond) // window updates and their flushes are done

	// A lone frame, after a quiet spell, is flushed without a yield: nothing is coming with it.
	time.Sleep(10 * time.Duration(burstGap.Load()))
	yieldsOf := func() uint64 {
		c := streams[0].c
		c.wmu.Lock()
		defer c.wmu.Unlock()
		return c.yields
	}
	yields := yieldsOf()
	if _, err := streams[0].Write(make([]byte, 1024)); err != nil {
		t.Fatal(err)
	}
	if yieldsOf() != yields {
		t.Fatal("a lone frame yielded before its flush")
	}
	time.Sleep(50 * time.Millisecond)

	// A burst. The frames of one come tens of microseconds apart in the agents; here one P
	// runs both ends of the connection and spaces them out more.
	defer burstGap.Store(burstGap.Load())
	burstGap.Store(int64(time.Second))
	before := writes.Load()
	start := make(chan struct{})
	errs := make(chan error, n)
	for _, s := range streams {
		go func() {
			<-start
			_, err := s.Write(make([]byte, 1024))
			errs <- err
		}()
	}
	close(start)
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	// 16 frames of 1033 bytes: one full record and the rest, two writes; one per frame
	// without sharing.
	if got := writes.Load() - before; got > 4 {
		t.Fatalf("a burst of %d small frames took %d socket writes, want at most 4", n, got)
	}
}

// TestClientCountsStreamUntilEndOrResetWritten: a client stream counts
// toward the server's stream limit until our END_STREAM or RST_STREAM is
// written. Before, a stream the server had ended stopped counting when our
// END_STREAM was committed, or when Close queued its reset; another Connect
// took its slot on the same connection, and that stream's HEADERS could be
// written first: one stream too many at the server, refused (REFUSED_STREAM)
// and retried by the pool (most of the reset streams here).
func TestClientCountsStreamUntilEndOrResetWritten(t *testing.T) {
	for _, ended := range []bool{true, false} {
		name := map[bool]string{true: "ended", false: "reset"}[ended]
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, dialTarget, ServerOptions{MaxConcurrentStreams: 1}, PoolOptions{ConnsPerKey: 4})
			app := startUpstream(t, func(c *net.TCPConn) { c.Close() })
			var wg sync.WaitGroup
			for range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for range 300 {
						s, err := e.connect(context.Background(), app)
						if err != nil {
							t.Error(err)
							return
						}
						_, _ = io.Copy(io.Discard, s) // the server's END_STREAM
						if ended {
							if err := s.CloseWrite(); err != nil {
								t.Error(err)
							}
						}
						s.Close() // a reset unless ended
					}
				}()
			}
			wg.Wait()
			if st := e.srv.Stats(); st.StreamsRefused != 0 {
				t.Errorf("%d of 1200 streams refused by a server with a limit of 1, want none", st.StreamsRefused)
			}
			// The last resets may still be on their way out.
			active := e.pool.Stats().ActiveStreams
			for deadline := time.Now().Add(2 * time.Second); active != 0 && time.Now().Before(deadline); active = e.pool.Stats().ActiveStreams {
				time.Sleep(5 * time.Millisecond)
			}
			if active != 0 {
				t.Errorf("pool counts %d active streams after all ended, want 0", active)
			}
		})
	}
}
