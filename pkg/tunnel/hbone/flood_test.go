package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// rawFrame is what a rawClient saw of one frame from the server.
type rawFrame struct {
	typ    http2.FrameType
	stream uint32
	code   http2.ErrCode // RST_STREAM, GOAWAY
	last   uint32        // GOAWAY: the last stream the server may have processed
	status int           // response HEADERS
	ack    bool          // PING ack
	ping   [8]byte       // PING data
	inc    uint32        // WINDOW_UPDATE increment
	length uint32        // the frame's payload length (DATA: flow-controlled bytes)
	end    bool          // END_STREAM (DATA, HEADERS)
}

// rawClient speaks raw HTTP/2 frames to a server connection over net.Pipe,
// as an attacker would; a goroutine reads everything the server sends into
// frames until the connection ends.
type rawClient struct {
	t      testing.TB
	nc     net.Conn
	fr     *http2.Framer
	enc    *hpack.Encoder
	buf    bytes.Buffer
	frames chan rawFrame
}

func newRawClient(t testing.TB, srv *Server) *rawClient {
	t.Helper()
	return newRawClientFrom(t, srv, netip.Addr{})
}

// newRawClientFrom is newRawClient for a client the server sees at src
// (over the pipe, which has no address of its own, when src is zero).
func newRawClientFrom(t testing.TB, srv *Server, src netip.Addr) *rawClient {
	t.Helper()
	cli, srvSide := net.Pipe()
	if src.IsValid() {
		srvSide = addrConn{srvSide, net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 40000))}
	}
	go srv.serveHTTP2(srvSide, &tls.ConnectionState{}, nil, nil, trustGens{}, nil)
	return newRawClientOver(t, cli)
}

// newRawClientOver is a raw client on cli, a connection to a server that
// already speaks HTTP/2 on it (a pipe, or a TLS connection that chose h2):
// it sends the preface and SETTINGS.
func newRawClientOver(t testing.TB, cli net.Conn) *rawClient {
	t.Helper()
	rc := &rawClient{t: t, nc: cli, fr: http2.NewFramer(cli, nil), frames: make(chan rawFrame, 1<<16)}
	rc.enc = hpack.NewEncoder(&rc.buf)
	t.Cleanup(func() { cli.Close() })
	go func() {
		defer close(rc.frames)
		fr := http2.NewFramer(nil, cli)
		fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			rf := rawFrame{typ: f.Header().Type, stream: f.Header().StreamID, length: f.Header().Length}
			if t := rf.typ; t == http2.FrameData || t == http2.FrameHeaders {
				rf.end = f.Header().Flags.Has(http2.FlagDataEndStream)
			}
			switch f := f.(type) {
			case *http2.MetaHeadersFrame:
				rf.status, _ = strconv.Atoi(f.PseudoValue("status"))
			case *http2.RSTStreamFrame:
				rf.code = f.ErrCode
			case *http2.GoAwayFrame:
				rf.code, rf.last = f.ErrCode, f.LastStreamID
			case *http2.PingFrame:
				rf.ack, rf.ping = f.IsAck(), f.Data
			case *http2.WindowUpdateFrame:
				rf.inc = f.Increment
			}
			select {
			case rc.frames <- rf:
			default: // nobody looks at floods of acks
			}
		}
	}()
	if _, err := cli.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	if err := rc.fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return rc
}

// addrConn is a connection that reports remote as its peer's address.
type addrConn struct {
	net.Conn
	remote net.Addr
}

func (c addrConn) RemoteAddr() net.Addr { return c.remote }

// connect sends HEADERS(CONNECT) for stream id.
func (rc *rawClient) connect(id uint32, authority string) error {
	return writeHeaderBlock(rc.fr, rc.enc, &rc.buf, id, []hpackField{
		{Name: ":method", Value: "CONNECT"}, {Name: ":authority", Value: authority}})
}

// waitFor reads frames until match returns true, failing the test when the
// connection ends first or after 5 s.
func (rc *rawClient) waitFor(what string, match func(rawFrame) bool) rawFrame {
	rc.t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		select {
		case f, ok := <-rc.frames:
			if !ok {
				rc.t.Fatalf("connection ended waiting for %s", what)
			}
			if match(f) {
				return f
			}
		case <-timeout:
			rc.t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// goAwayCode returns the code of the GOAWAY the server sent before the
// connection ended, or fails the test after 5 s. A PING after the flood
// tells a server that kept the connection: its ack comes first.
func (rc *rawClient) goAwayCode() http2.ErrCode {
	rc.t.Helper()
	end := [8]byte{'e', 'n', 'd'}
	_ = rc.fr.WritePing(false, end)
	f := rc.waitFor("GOAWAY", func(f rawFrame) bool {
		return f.typ == http2.FrameGoAway || (f.typ == http2.FramePing && f.ack && f.ping == end)
	})
	if f.typ != http2.FrameGoAway {
		rc.t.Fatal("server answered a PING after the flood: the connection is still open, want GOAWAY")
	}
	return f.code
}

// countingUpstream is an application that counts the connections it
// accepted.
func countingUpstream(t *testing.T) (netip.AddrPort, *atomic.Int64) {
	var n atomic.Int64
	addr := startUpstream(t, func(c *net.TCPConn) {
		n.Add(1)
		_, _ = io.Copy(io.Discard, c)
	})
	return addr, &n
}

// rawServer builds a server with opts, closed when the test ends, and a
// raw client connected to it.
func rawServer(t testing.TB, opts ServerOptions) (*Server, *rawClient) {
	t.Helper()
	srv, err := NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	return srv, newRawClient(t, srv)
}

// serveLoopback builds a server with opts, serves it on a loopback port
// until the test ends, and returns the server and its address.
func serveLoopback(t testing.TB, opts ServerOptions) (*Server, string) {
	t.Helper()
	srv, err := NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	return srv, l.Addr().String()
}

// TestRapidReset: HEADERS(CONNECT) followed by a stream reset, thousands of
// times on one connection, closes it with GOAWAY ENHANCE_YOUR_CALM after
// the early-reset budget and dials the application a bounded number of
// times, whether the client sends the RST_STREAM (CVE-2023-44487) or sends
// a frame that makes the server reset the stream itself (the MadeYouReset
// class, CVE-2025-8671). Before the fixes the connection took all 5000
// pairs: first each handler dialled the app on the connection's context,
// which no reset cancelled; then only RST_STREAMs the client sent were
// charged, and each provoked reset cancelled a handler mid-dial for free.
func TestRapidReset(t *testing.T) {
	resetters := map[string]func(rc *rawClient, id uint32, app string) error{
		"client RST_STREAM": func(rc *rawClient, id uint32, _ string) error {
			return rc.fr.WriteRSTStream(id, http2.ErrCodeCancel)
		},
		"WINDOW_UPDATE increment 0": func(rc *rawClient, id uint32, _ string) error {
			return rc.fr.WriteWindowUpdate(id, 0)
		},
		"stream window overflow": func(rc *rawClient, id uint32, _ string) error {
			return rc.fr.WriteWindowUpdate(id, maxWindow)
		},
		"second HEADERS without END_STREAM": func(rc *rawClient, id uint32, app string) error {
			return rc.connect(id, app)
		},
	}
	for name, reset := range resetters {
		t.Run(name, func(t *testing.T) {
			app, accepted := countingUpstream(t)
			var handled atomic.Int64
			srv, rc := rawServer(t, ServerOptions{
				TLSConfig: mustServerTLS(),
				Handler: func(ctx context.Context, req *ServerRequest) Response {
					handled.Add(1)
					return dialTarget(ctx, req)
				},
			})
			rc.fr.AllowIllegalWrites = true // WINDOW_UPDATE 0
			const pairs = 5000
			sent := 0
			for id := uint32(1); sent < pairs; id += 2 {
				if rc.connect(id, app.String()) != nil || reset(rc, id, app.String()) != nil {
					break // the server closed the connection
				}
				sent++
			}
			if sent == pairs {
				if code := rc.goAwayCode(); code != http2.ErrCodeEnhanceYourCalm {
					t.Fatalf("GOAWAY %v, want ENHANCE_YOUR_CALM", code)
				}
			}
			st := srv.Stats()
			t.Logf("sent %d pairs; handlers run %d, app connections %d, stats %+v", sent, handled.Load(), accepted.Load(), st)
			if st.ConnsFlood != 1 {
				t.Errorf("ConnsFlood = %d, want 1", st.ConnsFlood)
			}
			if st.StreamsEarlyReset < 100 {
				t.Errorf("StreamsEarlyReset = %d, want at least the budget of 100", st.StreamsEarlyReset)
			}
			// The budget of early resets plus the handler queue bound the work.
			if n := handled.Load(); n > 100+5*200 {
				t.Errorf("%d handlers ran for %d reset streams", n, sent)
			}
			if n := accepted.Load(); n >= 200 {
				t.Errorf("the application accepted %d connections for reset streams, want < 200", n)
			}
		})
	}
}

// TestHandlerSlotHeldUntilExit: a reset frees the stream's HTTP/2 slot, but
// its handler keeps one of MaxConcurrentStreams handler slots until it
// returns; a new request waits for it. Before the fix the new request's
// handler started at once, so resets let a client run any number of
// handlers.
func TestHandlerSlotHeldUntilExit(t *testing.T) {
	release := make(chan struct{})
	var running, started atomic.Int64
	_, rc := rawServer(t, ServerOptions{
		TLSConfig:            mustServerTLS(),
		MaxConcurrentStreams: 2,
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			started.Add(1)
			running.Add(1)
			defer running.Add(-1)
			<-release // a handler that does not watch ctx (a dial in a syscall)
			return Response{Status: 403, Reason: "done"}
		},
	})
	for _, id := range []uint32{1, 3} {
		if err := rc.connect(id, "10.0.0.1:80"); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.Until(t, "two handlers running", func() bool { return running.Load() == 2 })
	for _, id := range []uint32{1, 3} {
		if err := rc.fr.WriteRSTStream(id, http2.ErrCodeCancel); err != nil {
			t.Fatal(err)
		}
	}
	if err := rc.connect(5, "10.0.0.1:80"); err != nil {
		t.Fatal(err)
	}
	// Stream 5 is accepted (no REFUSED_STREAM) but its handler waits.
	_ = rc.fr.WritePing(false, [8]byte{1})
	rc.waitFor("PING ack", func(f rawFrame) bool {
		if f.typ == http2.FrameRSTStream && f.stream == 5 {
			t.Fatalf("stream 5 reset with %v, want it queued", f.code)
		}
		return f.typ == http2.FramePing && f.ack
	})
	time.Sleep(50 * time.Millisecond)
	if n := started.Load(); n != 2 {
		t.Fatalf("%d handlers started while 2 reset streams' handlers still run, want 2", n)
	}
	close(release)
	f := rc.waitFor("response on stream 5", func(f rawFrame) bool { return f.typ == http2.FrameHeaders && f.stream == 5 })
	if f.status != 403 || started.Load() != 3 {
		t.Errorf("stream 5: status %d, %d handlers started; want 403 from the third", f.status, started.Load())
	}
}

// TestResetCancelsHandlerContext: the Handler's context is the stream's, so
// a RST_STREAM cancels a dial in progress. Before the fix it was the
// connection's, which lived on.
func TestResetCancelsHandlerContext(t *testing.T) {
	cancelled := make(chan error, 1)
	_, rc := rawServer(t, ServerOptions{
		TLSConfig: mustServerTLS(),
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			select {
			case <-ctx.Done():
				cancelled <- ctx.Err()
			case <-time.After(5 * time.Second):
				cancelled <- errors.New("handler context not cancelled within 5s of the reset")
			}
			return Response{Status: 503}
		},
	})
	if err := rc.connect(1, "10.0.0.1:80"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // let the handler start
	if err := rc.fr.WriteRSTStream(1, http2.ErrCodeCancel); err != nil {
		t.Fatal(err)
	}
	if err := <-cancelled; !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	// The connection lives on: one early reset is within the budget.
	_ = rc.fr.WritePing(false, [8]byte{2})
	rc.waitFor("PING ack", func(f rawFrame) bool { return f.typ == http2.FramePing && f.ack })
}

// TestHandlerQueueFull: requests beyond MaxConcurrentStreams running
// handlers queue, up to 4 times the limit; more is GOAWAY
// ENHANCE_YOUR_CALM, even with the early-reset budget out of the way.
func TestHandlerQueueFull(t *testing.T) {
	release, running := make(chan struct{}), make(chan struct{}, 10)
	t.Cleanup(func() { close(release) })
	_, rc := rawServer(t, ServerOptions{
		TLSConfig:            mustServerTLS(),
		MaxConcurrentStreams: 1,
		MaxEarlyResets:       1 << 20,
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			running <- struct{}{}
			<-release
			return Response{Status: 403}
		},
	})
	// Stream 1's handler holds the one handler slot after its reset;
	// 3..9 queue behind it and are reset too (they stay queued until the
	// slot frees); 11 is too many.
	if err := rc.connect(1, "10.0.0.1:80"); err != nil {
		t.Fatal(err)
	}
	<-running
	if err := rc.fr.WriteRSTStream(1, http2.ErrCodeCancel); err != nil {
		t.Fatal(err)
	}
	for id := uint32(3); id <= 11; id += 2 {
		if rc.connect(id, "10.0.0.1:80") != nil || rc.fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
			break
		}
	}
	if code := rc.goAwayCode(); code != http2.ErrCodeEnhanceYourCalm {
		t.Fatalf("GOAWAY %v, want ENHANCE_YOUR_CALM", code)
	}
}

// TestJunkFrameFloods: each kind of frame that costs the server work and
// carries nothing, sent in a flood, closes the connection with GOAWAY
// ENHANCE_YOUR_CALM. Before the fix a client that read the answers could
// send them forever.
func TestJunkFrameFloods(t *testing.T) {
	type flood struct {
		send func(rc *rawClient, i int) error // the i-th frame of the flood
		// closed: stream 1 is refused (closed) before the flood, rather
		// than kept open; maxStreams: the server's MaxConcurrentStreams.
		closed     bool
		maxStreams uint32
	}
	floods := map[string]flood{
		"PING": {send: func(rc *rawClient, _ int) error { return rc.fr.WritePing(false, [8]byte{}) }},
		"SETTINGS": {send: func(rc *rawClient, _ int) error {
			return rc.fr.WriteSettings(http2.Setting{ID: http2.SettingEnablePush, Val: 0})
		}},
		"empty DATA": {send: func(rc *rawClient, _ int) error { return rc.fr.WriteData(1, false, nil) }},
		"SETTINGS with many entries": {send: func(rc *rawClient, _ int) error {
			many := make([]http2.Setting, 10000)
			for i := range many {
				many[i] = http2.Setting{ID: http2.SettingInitialWindowSize, Val: uint32(i)}
			}
			return rc.fr.WriteSettings(many...)
		}},
		"PRIORITY": {send: func(rc *rawClient, _ int) error {
			return rc.fr.WritePriority(1, http2.PriorityParam{StreamDep: 0, Weight: 1})
		}},
		"unknown frame": {send: func(rc *rawClient, _ int) error { return rc.fr.WriteRawFrame(0x42, 0, 0, []byte("x")) }},
		"WINDOW_UPDATE on a closed stream": {closed: true, send: func(rc *rawClient, _ int) error {
			return rc.fr.WriteWindowUpdate(1, 1)
		}},
		// The first resets stream 1 (an early reset), the others are
		// stream errors on a stream already closed: each makes the server
		// send RST_STREAM (MadeYouReset).
		"WINDOW_UPDATE increment 0": {send: func(rc *rawClient, _ int) error {
			rc.fr.AllowIllegalWrites = true
			return rc.fr.WriteWindowUpdate(1, 0)
		}},
		// Stream 1 was ended by the server, not by the client, so it is
		// not in the ring of streams the client closed: DATA on it may be
		// in flight, and is dropped, but an empty one carries nothing.
		"empty DATA with END_STREAM on a closed stream": {closed: true, send: func(rc *rawClient, _ int) error {
			return rc.fr.WriteData(1, true, nil)
		}},
		"HEADERS beyond MAX_CONCURRENT_STREAMS": {maxStreams: 1, send: func(rc *rawClient, i int) error {
			return rc.connect(uint32(3+2*i), "10.0.0.1:80")
		}},
		"unsolicited PING ack": {send: func(rc *rawClient, _ int) error { return rc.fr.WritePing(true, [8]byte{}) }},
		// The first says the client goes away; every one after it makes
		// the server walk its streams again.
		"GOAWAY": {send: func(rc *rawClient, _ int) error { return rc.fr.WriteGoAway(0, http2.ErrCodeNo, nil) }},
	}
	for name, fl := range floods {
		t.Run(name, func(t *testing.T) {
			srv, rc := rawServer(t, ServerOptions{
				TLSConfig:            mustServerTLS(),
				MaxConcurrentStreams: fl.maxStreams,
				Handler: func(ctx context.Context, req *ServerRequest) Response {
					if fl.closed {
						return Response{Status: 403}
					}
					<-ctx.Done() // keep stream 1 open for empty DATA
					return Response{Status: 503}
				},
			})
			if err := rc.connect(1, "10.0.0.1:80"); err != nil {
				t.Fatal(err)
			}
			if fl.closed {
				rc.waitFor("stream 1 refused", func(f rawFrame) bool { return f.typ == http2.FrameRSTStream && f.stream == 1 })
			}
			for i := 0; i < 3*junkBurst; i++ {
				if fl.send(rc, i) != nil {
					break
				}
			}
			if code := rc.goAwayCode(); code != http2.ErrCodeEnhanceYourCalm {
				t.Fatalf("GOAWAY %v, want ENHANCE_YOUR_CALM", code)
			}
			if st := srv.Stats(); st.ConnsFlood != 1 {
				t.Errorf("ConnsFlood = %d, want 1", st.ConnsFlood)
			}
		})
	}
}

// TestContinuationFlood: a header block that never ends, in empty
// CONTINUATION frames (which x/net's framer reads without limit), closes the
// connection with GOAWAY ENHANCE_YOUR_CALM. Before the fix the server read
// them for as long as they came.
func TestContinuationFlood(t *testing.T) {
	_, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
	rc.buf.Reset()
	_ = rc.enc.WriteField(hpackField{Name: ":method", Value: "CONNECT"})
	if err := rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: rc.buf.Bytes()}); err != nil {
		t.Fatal(err)
	}
	for range 100000 {
		if rc.fr.WriteContinuation(1, false, nil) != nil {
			break
		}
	}
	f := rc.waitFor("GOAWAY", func(f rawFrame) bool { return f.typ == http2.FrameGoAway })
	if f.code != http2.ErrCodeEnhanceYourCalm {
		t.Fatalf("GOAWAY %v, want ENHANCE_YOUR_CALM", f.code)
	}
}

// TestOccasionalJunkIsFine: keepalive PINGs and a few SETTINGS over a long
// connection stay within the budget.
func TestOccasionalJunkIsFine(t *testing.T) {
	b := newBudget(junkBurst, floodPeriod)
	now := time.Now().UnixNano()
	for i := range 100000 { // one a 20 ms for half an hour, and bursts
		if !b.spend(now + int64(i)*int64(20*time.Millisecond)) {
			t.Fatalf("spend %d refused at 50/s, want the budget to hold 100/s", i)
		}
	}
	for i := range junkBurst - 10 {
		if !b.spend(now + 100000*int64(20*time.Millisecond)) {
			t.Fatalf("burst spend %d refused", i)
		}
	}
}

// fakeListener returns its errors from Accept before the real listener's
// connections.
type fakeListener struct {
	net.Listener
	mu   sync.Mutex
	errs []error
}

func (l *fakeListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	if len(l.errs) > 0 {
		err := l.errs[0]
		l.errs = l.errs[1:]
		l.mu.Unlock()
		return nil, err
	}
	l.mu.Unlock()
	return l.Listener.Accept()
}

// TestAcceptBackoff: EMFILE and ENFILE from Accept do not end Serve; while
// it backs off, Accepting reports false, and it serves again afterwards.
func TestAcceptBackoff(t *testing.T) {
	good, _ := pkis()
	srv, err := NewServer(ServerOptions{TLSConfig: good.serverTLS(), Handler: dialTarget})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var errs []error
	for range 7 { // 5+10+...+320 ms of backoff
		errs = append(errs, &net.OpError{Op: "accept", Net: "tcp", Err: syscall.EMFILE})
	}
	errs = append(errs, &net.OpError{Op: "accept", Net: "tcp", Err: syscall.ENFILE})
	fl := &fakeListener{Listener: l, errs: errs}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(fl) }()
	waitfor.Until(t, "Accepting false during the backoff", func() bool { return !srv.Accepting() })
	pool := NewPool(PoolOptions{})
	defer pool.Close()
	app := startUpstream(t, echo)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := pool.Connect(ctx, PoolKey{DstAddr: l.Addr().(*net.TCPAddr).AddrPort()}, tcpDial, good.clientTLS(), Request{Authority: app})
	if err != nil {
		t.Fatalf("connect after the accept errors: %v", err)
	}
	s.Close()
	if !srv.Accepting() {
		t.Error("Accepting false after accepting again")
	}
	if st := srv.Stats(); st.AcceptErrors != uint64(len(errs)) {
		t.Errorf("AcceptErrors = %d, want %d", st.AcceptErrors, len(errs))
	}
	_ = srv.Close()
	if err := <-served; !errors.Is(err, ErrServerClosed) {
		t.Errorf("Serve returned %v, want ErrServerClosed", err)
	}
	if srv.Accepting() {
		t.Error("Accepting true after Close")
	}
}

// freezeProxy forwards TCP between a client and target until frozen, then
// drops everything silently: a peer that vanished without a word.
type freezeProxy struct {
	l      net.Listener
	frozen atomic.Bool
}

func newFreezeProxy(t *testing.T, target netip.AddrPort) *freezeProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &freezeProxy{l: l}
	var wg sync.WaitGroup
	t.Cleanup(func() { l.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target.String())
			if err != nil {
				c.Close()
				continue
			}
			pipe := func(dst, src net.Conn) {
				defer wg.Done()
				defer dst.Close()
				defer src.Close()
				buf := make([]byte, 32<<10)
				for {
					n, err := src.Read(buf)
					if err != nil {
						return
					}
					if p.frozen.Load() {
						continue
					}
					if _, err := dst.Write(buf[:n]); err != nil {
						return
					}
				}
			}
			wg.Add(2)
			go pipe(up, c)
			go pipe(c, up)
		}
	}()
	return p
}

// TestPingTimeoutClosesDeadConn: a pooled connection whose peer stops
// answering is closed by the keepalive, failing its streams, instead of
// lingering until TCP gives up.
//
// The timeout is a second, not 200 ms: client, server and proxy share this
// process, and on a loaded VM (under -race) one of them running a quarter
// of a second late makes a correct keepalive close a live connection. The
// alive phase outlasts interval and timeout, so an unanswered PING would
// still close the connection within it.
func TestPingTimeoutClosesDeadConn(t *testing.T) {
	const interval, timeout = 100 * time.Millisecond, time.Second
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{PingInterval: interval, PingTimeout: timeout})
	app := startUpstream(t, echo)
	proxy := newFreezeProxy(t, e.addr)
	good, _ := pkis()
	key := PoolKey{DstAddr: proxy.l.Addr().(*net.TCPAddr).AddrPort()}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := e.pool.Connect(ctx, key, tcpDial, good.clientTLS(), Request{Authority: app})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// Alive and idle: pings are answered, the connection stays.
	time.Sleep(interval + timeout + 400*time.Millisecond)
	if st := e.pool.Stats(); st.Conns != 1 {
		t.Fatalf("pool has %d conns while the peer answers pings, want 1", st.Conns)
	}
	proxy.frozen.Store(true)
	_ = s.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = s.Read(make([]byte, 1))
	if !errors.Is(err, ErrConnClosed) || !strings.Contains(err.Error(), "keepalive") {
		t.Fatalf("read on a dead connection: %v, want the keepalive to close it", err)
	}
	waitfor.Until(t, "the pool to drop the dead connection", func() bool { return e.pool.Stats().Conns == 0 })
}

// TestConnLimiter: connections over a handshake or connection limit are
// closed at accept and counted; one limiter serves several servers, and
// slots come back when connections end.
func TestConnLimiter(t *testing.T) {
	lim := NewConnLimiter(ConnLimits{MaxConns: 3, MaxHandshakesPerSource: 2})
	var servers []*Server
	var addrs []string
	for range 2 {
		srv, addr := serveLoopback(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget, Limiter: lim, HandshakeTimeout: time.Second})
		servers = append(servers, srv)
		addrs = append(addrs, addr)
	}
	dial := func(addr string) net.Conn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// closedSoon reports whether the server closed c without a word.
	closedSoon := func(c net.Conn) bool {
		_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
	}
	idle := []net.Conn{dial(addrs[0]), dial(addrs[1])} // two handshakes from 127.0.0.1, over two servers
	waitfor.Until(t, "two handshakes counted", func() bool { return lim.Stats().Handshakes == 2 })
	if c := dial(addrs[0]); !closedSoon(c) {
		t.Error("a third handshake from one source was not closed at once")
	}
	for _, c := range idle {
		if closedSoon(c) {
			t.Error("an admitted idle connection was closed before its handshake timeout")
		}
	}
	if st := lim.Stats(); st.RefusedHandshakes != 1 || st.Conns != 2 {
		t.Errorf("limiter %+v, want 1 refused handshake and 2 connections", st)
	}
	if n := servers[0].Stats().ConnsRefused; n != 1 {
		t.Errorf("server ConnsRefused = %d, want 1", n)
	}
	// The handshake timeout frees the slots.
	waitfor.Until(t, "handshake timeouts to free the slots", func() bool {
		st := lim.Stats()
		return st.Conns == 0 && st.Handshakes == 0
	})
	// Established connections count against MaxConns.
	good, _ := pkis()
	pool := NewPool(PoolOptions{})
	defer pool.Close()
	app := startUpstream(t, echo)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i := range 3 {
		key := PoolKey{Src: strconv.Itoa(i), DstAddr: netip.MustParseAddrPort(addrs[0])}
		s, err := pool.Connect(ctx, key, tcpDial, good.clientTLS(), Request{Authority: app})
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		defer s.Close()
	}
	if c := dial(addrs[1]); !closedSoon(c) {
		t.Error("a fourth connection with MaxConns 3 was not closed at once")
	}
	if st := lim.Stats(); st.RefusedConns != 1 || st.Conns != 3 || st.Handshakes != 0 {
		t.Errorf("limiter %+v, want 3 connections, none handshaking, 1 refused", st)
	}
}

// TestReasonHasNoPaths: whatever error text a Handler puts in a refusal,
// the peer gets no file system paths or source positions.
func TestReasonHasNoPaths(t *testing.T) {
	reason := `connect to 10.0.0.5:8080: dial 10.0.0.5:8080 from /proc/4242/ns/net: open "/var/run/netns/cni-1": no such file (dial.go:42) pin=/sys/fs/bpf/redirector/pods/x`
	e := newEnv(t, func(context.Context, *ServerRequest) Response {
		return Response{Status: 503, Reason: reason}
	}, ServerOptions{}, PoolOptions{})
	_, err := e.connect(context.Background(), netip.MustParseAddrPort("10.0.0.5:8080"))
	var se *StatusError
	if !errors.As(err, &se) {
		t.Fatalf("connect: %v, want a StatusError", err)
	}
	for _, leak := range []string{"/proc", "/var/run", "cni-1", "dial.go", "/sys/fs"} {
		if strings.Contains(se.Reason, leak) {
			t.Errorf("reason sent to the peer contains %q: %s", leak, se.Reason)
		}
	}
	for _, keep := range []string{"connect to 10.0.0.5:8080", "no such file", "[path]"} {
		if !strings.Contains(se.Reason, keep) {
			t.Errorf("reason lost %q: %s", keep, se.Reason)
		}
	}
}

func TestSanitizeReason(t *testing.T) {
	for in, want := range map[string]string{
		"denied by authorization policy: ns/allow-web": "denied by authorization policy: ns/allow-web",
		"source 10.0.0.0/8 and fd00::/64 not allowed":  "source 10.0.0.0/8 and fd00::/64 not allowed",
		"open /run/x.sock: permission denied":          "open [path]: permission denied",
		"enter netns (/proc/1/ns/net), file=./a/b":     "enter netns ([path]), file=[path]",
		"panic at tunnel/inbound.go:120":               "panic at [file]",
		"line one\nline two":                           "line one line two",
		"stat '~/x': no such file":                     "stat '[path]': no such file",
	} {
		if got := sanitizeReason(in); got != want {
			t.Errorf("sanitizeReason(%q) = %q, want %q", in, got, want)
		}
	}
}

func mustServerTLS() *tls.Config {
	good, _ := pkis()
	return good.serverTLS()
}

// TestHonestResetsWithinBudget: a pooled client whose 100 pending CONNECTs
// (its per-connection maximum) all time out at once resets them all before
// an answer; that stays within the early-reset budget, so the server does
// not take an honest client for an attacker.
func TestHonestResetsWithinBudget(t *testing.T) {
	var started atomic.Int64
	e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
		started.Add(1)
		<-ctx.Done() // an app that never accepts
		return Response{Status: 503}
	}, ServerOptions{}, PoolOptions{MaxStreamsPerConn: 100})
	var wg sync.WaitGroup
	for range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			if s, err := e.connect(ctx, netip.MustParseAddrPort("10.0.0.1:80")); err == nil {
				s.Close()
				t.Error("connect to an app that never accepts succeeded")
			}
		}()
	}
	wg.Wait()
	// Every handler ends (the resets, or the client's connection closing
	// once it gave up on it, cancelled them) and none was taken for a flood.
	// (A Connect whose 300 ms ran out before its stream opened, on a loaded
	// machine, started no handler.)
	waitfor.Until(t, "every handler to end", func() bool {
		n := started.Load()
		return n > 0 && e.srv.Stats().StreamsDenied == uint64(n)
	})
	if st := e.srv.Stats(); st.ConnsFlood != 0 || st.StreamsEarlyReset == 0 {
		t.Errorf("server stats %+v: want early resets and no connection closed as a flood", st)
	}
}

// TestCloseInOrderSendsQueuedResets: a connection closed in order (a drain's close) sends the
// resets still queued for its control writer before GOAWAY, and its socket stays open until the
// peer closed its side, so the server reads the reset rather than losing it to a TCP reset. The
// reset is queued without waking the writer, as when the close comes before the writer ran.
func TestCloseInOrderSendsQueuedResets(t *testing.T) {
	running := make(chan struct{}, 1)
	e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
		running <- struct{}{}
		<-ctx.Done() // an app that never accepts
		return Response{Status: 503}
	}, ServerOptions{}, PoolOptions{})
	connected := make(chan error, 1)
	go func() {
		s, err := e.connect(context.Background(), netip.MustParseAddrPort("10.0.0.1:80"))
		if err == nil {
			s.Close()
		}
		connected <- err
	}()
	<-running
	e.pool.mu.Lock()
	c := e.pool.entries[e.key].conns[0]
	e.pool.mu.Unlock()
	c.mu.Lock()
	var id uint32
	for sid := range c.streams {
		id = sid
	}
	c.ctl = append(c.ctl, ctlFrame{typ: http2.FrameRSTStream, id: id, val: uint32(http2.ErrCodeCancel)})
	c.mu.Unlock()

	c.close(http2.ErrCodeNo, fmt.Errorf("%w: drained", ErrConnClosed), true)
	if err := <-connected; err == nil {
		t.Fatal("connect succeeded on a closed connection")
	}
	// The server's reader counts a reset after it cancels the handler, and reads the end of
	// the connection only after that: wait for the connection to end.
	waitfor.Until(t, "the handler and the connection to end", func() bool {
		st := e.srv.Stats()
		return st.StreamsDenied == 1 && st.ConnsActive == 0
	})
	if st := e.srv.Stats(); st.StreamsEarlyReset != 1 {
		t.Errorf("server stats %+v: want the queued reset read as an early reset", st)
	}
}
