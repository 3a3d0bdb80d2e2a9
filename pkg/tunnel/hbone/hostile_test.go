package hbone

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
)

// TestQueuedResetReturnsWindow: DATA buffered for a stream that waits in
// the handler queue, and is reset there, goes back to the connection's
// receive window at once: the server sends the connection-level
// WINDOW_UPDATE while the running handler still blocks. Before the fix
// only Close returned buffered bytes, and a queued stream that was reset
// was never closed: 16 MB of such streams stalled every tunnel of the
// connection for good.
func TestQueuedResetReturnsWindow(t *testing.T) {
	release, running := make(chan struct{}), make(chan struct{}, 1)
	t.Cleanup(func() { close(release) })
	_, rc := rawServer(t, ServerOptions{
		TLSConfig:            mustServerTLS(),
		MaxConcurrentStreams: 1,
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			running <- struct{}{}
			<-release // a handler that does not watch ctx
			return Response{Status: 403}
		},
	})
	// Stream 1's handler holds the one handler slot after its reset;
	// streams 3 and 5 queue behind it, 3 MB of DATA each, and are reset.
	if err := rc.connect(1, "10.0.0.1:80"); err != nil {
		t.Fatal(err)
	}
	<-running
	if err := rc.fr.WriteRSTStream(1, http2.ErrCodeCancel); err != nil {
		t.Fatal(err)
	}
	payload := make([]byte, maxReadFrameSize)
	for _, id := range []uint32{3, 5} {
		if err := rc.connect(id, "10.0.0.1:80"); err != nil {
			t.Fatal(err)
		}
		for range 3 {
			if err := rc.fr.WriteData(id, false, payload); err != nil {
				t.Fatal(err)
			}
		}
		if err := rc.fr.WriteRSTStream(id, http2.ErrCodeCancel); err != nil {
			t.Fatal(err)
		}
	}
	const initial = connWindow - defaultWindow // the preface's WINDOW_UPDATE
	f := rc.waitFor("connection-level WINDOW_UPDATE", func(f rawFrame) bool {
		return f.typ == http2.FrameWindowUpdate && f.stream == 0 && f.inc != initial
	})
	if f.inc != 6*maxReadFrameSize {
		t.Errorf("connection WINDOW_UPDATE of %d bytes, want the %d buffered", f.inc, 6*maxReadFrameSize)
	}
	select {
	case <-running:
		t.Error("a handler ran for a stream reset while queued")
	default:
	}
}

// TestUnsolicitedSettingsAck: a SETTINGS ack beyond the SETTINGS the server
// sent is a connection error PROTOCOL_ERROR, as in x/net. Before the fix
// the server ignored any number of them.
func TestUnsolicitedSettingsAck(t *testing.T) {
	_, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
	for range 2 { // the first acks the server's SETTINGS
		if err := rc.fr.WriteSettingsAck(); err != nil {
			t.Fatal(err)
		}
	}
	if code := rc.goAwayCode(); code != http2.ErrCodeProtocol {
		t.Fatalf("GOAWAY %v, want PROTOCOL_ERROR", code)
	}
}

// TestSelfDependentPriorityResets: a PRIORITY frame by which a stream
// depends on itself (RFC 9113 §5.3.1) resets the stream the normal way: an
// open stream is closed and its handler cancelled, and an idle one counts
// as used, so HEADERS cannot open it afterwards. Before the fix the server
// only sent RST_STREAM: the stream lived on, its handler ran, and the id
// stayed open for a new request.
func TestSelfDependentPriorityResets(t *testing.T) {
	var handled atomic.Int64
	started, cancelled := make(chan struct{}, 1), make(chan struct{}, 1)
	_, rc := rawServer(t, ServerOptions{
		TLSConfig: mustServerTLS(),
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			handled.Add(1)
			started <- struct{}{}
			select {
			case <-ctx.Done():
				cancelled <- struct{}{}
			case <-time.After(5 * time.Second):
			}
			return Response{Status: 503}
		},
	})
	if err := rc.connect(1, "10.0.0.1:80"); err != nil {
		t.Fatal(err)
	}
	<-started
	if err := rc.fr.WritePriority(1, http2.PriorityParam{StreamDep: 1, Weight: 1}); err != nil {
		t.Fatal(err)
	}
	f := rc.waitFor("RST_STREAM on stream 1", func(f rawFrame) bool { return f.typ == http2.FrameRSTStream && f.stream == 1 })
	if f.code != http2.ErrCodeProtocol {
		t.Errorf("stream 1 reset with %v, want PROTOCOL_ERROR", f.code)
	}
	select {
	case <-cancelled:
	case <-time.After(2 * time.Second):
		t.Fatal("the handler of stream 1 was not cancelled by its reset")
	}
	// Idle stream 7: reset, so it is closed; HEADERS on it is a
	// connection error (§5.1), not a new request.
	if err := rc.fr.WritePriority(7, http2.PriorityParam{StreamDep: 7, Weight: 1}); err != nil {
		t.Fatal(err)
	}
	if err := rc.connect(7, "10.0.0.1:80"); err != nil {
		t.Fatal(err)
	}
	if code := rc.goAwayCode(); code != http2.ErrCodeStreamClosed {
		t.Errorf("GOAWAY %v, want STREAM_CLOSED for HEADERS on a stream reset before", code)
	}
	if n := handled.Load(); n != 1 {
		t.Errorf("%d handlers ran, want 1 (stream 1 only)", n)
	}
}

// TestRefusalWithoutWindowFreesStream: a client that grants no send window
// (SETTINGS_INITIAL_WINDOW_SIZE 0, never a WINDOW_UPDATE) and sends
// requests that are refused cannot keep their streams: the refusal's body
// waits for window only for refuseWriteTimeout, then the stream is reset,
// its stream and handler slots freed for the next requests, and the cut
// counted. Before the fix each refusal's body write waited for window for
// as long as the connection lived, so MaxConcurrentStreams refused requests
// (denied by policy, or malformed: no app socket, outside every tunnel
// limit) held every stream and handler slot of the connection, and a
// goroutine each, for good: later requests got REFUSED_STREAM.
func TestRefusalWithoutWindowFreesStream(t *testing.T) {
	defer func(d time.Duration) { refuseWriteTimeout = d }(refuseWriteTimeout)
	refuseWriteTimeout = 50 * time.Millisecond
	var handled atomic.Int64
	srv, rc := rawServer(t, ServerOptions{
		TLSConfig:            mustServerTLS(),
		MaxConcurrentStreams: 2,
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			handled.Add(1)
			return Response{Status: 403, Reason: "denied by authorization policy"}
		},
	})
	if err := rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0}); err != nil {
		t.Fatal(err)
	}
	// Two rounds of two refused requests, each round filling the stream
	// limit; the second is served only once the first's streams are gone.
	for round, ids := range [][]uint32{{1, 3}, {5, 7}} {
		for _, id := range ids {
			if err := rc.connect(id, "10.0.0.1:80"); err != nil {
				t.Fatal(err)
			}
		}
		seen := map[uint32]http2.ErrCode{}
		for len(seen) < len(ids) {
			f := rc.waitFor(fmt.Sprintf("round %d: both streams reset (have %d)", round, len(seen)), func(f rawFrame) bool {
				return f.typ == http2.FrameRSTStream
			})
			seen[f.stream] = f.code
		}
		for _, id := range ids {
			if code, ok := seen[id]; !ok || code != http2.ErrCodeNo {
				t.Fatalf("round %d: stream %d reset with %v (seen %v), want NO_ERROR after its 403", round, id, code, ok)
			}
		}
	}
	if n := handled.Load(); n != 4 {
		t.Errorf("%d handlers ran, want 4", n)
	}
	// A cut is counted just after its stream's reset is written.
	waitfor.Until(t, "four refusals counted as cut", func() bool { return srv.Stats().RefusalsCut >= 4 })
	if st := srv.Stats(); st.RefusalsCut != 4 || st.StreamsRefused != 0 {
		t.Errorf("RefusalsCut = %d, StreamsRefused = %d, want 4 and 0", st.RefusalsCut, st.StreamsRefused)
	}
}

// TestRefusalsWaitingForWindowBounded: refusals whose client grants no
// window wait for it only while a slot of the process-wide refusalWaits is
// free; past that their body is left out at once and the stream is done.
// Before, every refused stream held its goroutine for refuseWriteTimeout,
// bounded only by streams per connection times connections per address
// (some 200,000 goroutines for one address with a mesh certificate).
func TestRefusalsWaitingForWindowBounded(t *testing.T) {
	defer func(d time.Duration, w chan struct{}) { refuseWriteTimeout, refusalWaits = d, w }(refuseWriteTimeout, refusalWaits)
	refuseWriteTimeout = time.Minute
	refusalWaits = make(chan struct{}, 2)
	srv, rc := rawServer(t, ServerOptions{
		TLSConfig:            mustServerTLS(),
		MaxConcurrentStreams: 8,
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			return Response{Status: 403, Reason: "denied by authorization policy"}
		},
	})
	if err := rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0}); err != nil {
		t.Fatal(err)
	}
	for id := uint32(1); id <= 11; id += 2 {
		if err := rc.connect(id, "10.0.0.1:80"); err != nil {
			t.Fatal(err)
		}
	}
	// Two of the six refusals wait (a minute) for window; the other four
	// are cut and their streams reset at once.
	reset := map[uint32]bool{}
	for len(reset) < 4 {
		f := rc.waitFor(fmt.Sprintf("four refused streams reset (have %d)", len(reset)), func(f rawFrame) bool {
			return f.typ == http2.FrameRSTStream
		})
		reset[f.stream] = true
	}
	waitfor.Until(t, "four refusals counted as cut", func() bool { return srv.Stats().RefusalsCut == 4 })
	if st := srv.Stats(); st.HandlersHeld != 2 {
		t.Errorf("%d handlers held, want the 2 refusals waiting for window", st.HandlersHeld)
	}
}

// TestHandlerGauges: the streams holding a handler slot and those queued
// for one are counted while a client keeps them (here: handlers that do
// not watch their context, and streams reset behind them), and both
// gauges return to zero once the handlers end. Before, ServerStats had
// neither: what a client held in handlers and the queue was bounded but
// not visible.
func TestHandlerGauges(t *testing.T) {
	release, running := make(chan struct{}), make(chan struct{}, 10)
	srv, rc := rawServer(t, ServerOptions{
		TLSConfig:            mustServerTLS(),
		MaxConcurrentStreams: 1,
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			running <- struct{}{}
			<-release
			return Response{Status: 403}
		},
	})
	for id := uint32(1); id <= 5; id += 2 {
		if err := rc.connect(id, "10.0.0.1:80"); err != nil {
			t.Fatal(err)
		}
		if id == 1 {
			<-running
		}
		if err := rc.fr.WriteRSTStream(id, http2.ErrCodeCancel); err != nil {
			t.Fatal(err)
		}
	}
	// A PING's ack says the server read everything before it.
	_ = rc.fr.WritePing(false, [8]byte{1})
	rc.waitFor("PING ack", func(f rawFrame) bool { return f.typ == http2.FramePing && f.ack })
	if st := srv.Stats(); st.HandlersHeld != 1 || st.HandlersQueued != 2 {
		t.Errorf("HandlersHeld %d, HandlersQueued %d; want 1 and 2", st.HandlersHeld, st.HandlersQueued)
	}
	close(release)
	waitfor.Until(t, "no handler held or queued", func() bool {
		st := srv.Stats()
		return st.HandlersHeld == 0 && st.HandlersQueued == 0
	})
}

// TestConnLimiterFairShare: connections from a few addresses that fill the
// node's MaxConns, each within MaxConnsPerSource, do not lock out another
// client: its connection evicts (closes) the oldest of the source holding
// the most, until the sources hold equal shares, and each eviction is
// counted. Before the fix every new connection was refused while they
// stayed open, and a peer with a valid certificate keeps a connection
// open as long as it likes (one stream each, or new ones after the idle
// timeout): MaxConns/MaxConnsPerSource addresses locked the node's inbound
// HBONE for everyone else.
func TestConnLimiterFairShare(t *testing.T) {
	lim := NewConnLimiter(ConnLimits{MaxConns: 4, MaxConnsPerSource: 4})
	a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	// admit admits a connection from src, handshaken, and returns the
	// client's side of it (nil when refused).
	admit := func(src netip.Addr) net.Conn {
		cli, srvSide := net.Pipe()
		t.Cleanup(func() { cli.Close() })
		h, _ := lim.admit(src, srvSide)
		if h == nil {
			return nil
		}
		lim.handshakeDone(h)
		return cli
	}
	closed := func(c net.Conn) bool {
		_ = c.SetReadDeadline(time.Now().Add(time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		return errors.Is(err, io.EOF) || errors.Is(err, io.ErrClosedPipe)
	}
	var fromA []net.Conn
	for range 4 {
		c := admit(a)
		if c == nil {
			t.Fatal("a connection from a within the limits was refused")
		}
		fromA = append(fromA, c)
	}
	// b takes a's oldest, then its next; a third would leave b the larger.
	for i := range 2 {
		if admit(b) == nil {
			t.Fatalf("connection %d from b refused while a holds more", i+1)
		}
		if !closed(fromA[i]) {
			t.Errorf("a's connection %d was not evicted", i)
		}
	}
	if admit(b) != nil {
		t.Error("a third connection from b admitted: the shares are equal")
	}
	if st := lim.Stats(); st.Conns != 4 || st.EvictedConns != 2 || st.RefusedConns != 1 {
		t.Errorf("limiter %+v, want 4 connections, 2 evicted, 1 refused", st)
	}
	if closed(fromA[2]) || closed(fromA[3]) {
		t.Error("a's newer connections were closed")
	}
}

// TestHandshakeRatePerSource: a client address that opens connections and
// drops them as soon as the server's handshake flight is out (each costing
// the server a key exchange and a signature, the client nothing it must
// prove) gets HandshakeRatePerSource of them a second, ten seconds' worth
// at once, and the rest are closed at accept and counted; other addresses
// are not affected, and the budget refills with time. Before the fix only
// the handshakes in progress were bounded, so an unauthenticated client
// that never kept one could make the node do handshakes as fast as it
// could open connections.
func TestHandshakeRatePerSource(t *testing.T) {
	lim := NewConnLimiter(ConnLimits{HandshakeRatePerSource: 1})
	now := time.Unix(1000, 0).UnixNano()
	lim.now = func() int64 { return now }
	a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	// openAndDrop admits a connection from src and drops it at once, as
	// the flood does; it reports whether it was admitted.
	openAndDrop := func(src netip.Addr) bool {
		_, srvSide := net.Pipe()
		h, _ := lim.admit(src, srvSide)
		if h == nil {
			return false
		}
		lim.handshakeDone(h)
		lim.release(h)
		return true
	}
	for i := range 10 {
		if !openAndDrop(a) {
			t.Fatalf("handshake %d of the burst refused", i+1)
		}
	}
	for range 100 {
		if openAndDrop(a) {
			t.Fatal("a handshake beyond the burst admitted")
		}
	}
	if !openAndDrop(b) {
		t.Error("another address was refused")
	}
	now += int64(time.Second)
	if !openAndDrop(a) || openAndDrop(a) {
		t.Error("a second later, want one more handshake admitted, and only one")
	}
	if st := lim.Stats(); st.RefusedHandshakeRate != 101 || st.Conns != 0 || st.Handshakes != 0 {
		t.Errorf("limiter %+v, want 101 refused for the rate and nothing held", st)
	}
}

// TestSmallWindowUpdatesWakeOneWriter: a client downloads on many streams
// of one connection, lets a window run dry (the connection's, or one
// stream's with the others' empty too), then grants it one byte at a time,
// each after the byte before arrived. A grant lets one writer send one
// byte, so it wakes that writer, not every stream's. Before the fix every
// grant woke all of them: a 13-byte frame bought the peer a goroutine
// wake-up and a turn on the connection lock per stream writing (up to 200
// by default).
func TestSmallWindowUpdatesWakeOneWriter(t *testing.T) {
	const streams, grants = 50, 200
	target := endlessUpstream(t)
	for _, tc := range []struct {
		name  string
		setup func(*rawClient) error // before the streams open
		grant uint32                 // the stream the grants are for
	}{
		{"connection window", nil, 0},
		{"stream window", func(rc *rawClient) error {
			if err := rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0}); err != nil {
				return err
			}
			return rc.fr.WriteWindowUpdate(0, 1<<20)
		}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
			if tc.setup != nil {
				if err := tc.setup(rc); err != nil {
					t.Fatal(err)
				}
			}
			for i := range streams {
				if err := rc.connect(uint32(2*i+1), target.String()); err != nil {
					t.Fatal(err)
				}
			}
			c := serverConnOf(t, srv)
			// settled: every stream's writer waits for window.
			settled := func() bool {
				c.mu.Lock()
				defer c.mu.Unlock()
				return c.sendWaiting == streams
			}
			wakes := func() uint64 {
				c.mu.Lock()
				defer c.mu.Unlock()
				return c.sendWakes
			}
			waitfor.Until(t, "every stream's writer waiting for window", settled)
			mark := [8]byte{'s', 'e', 't', 't', 'l', 'e', 'd'}
			if err := rc.fr.WritePing(false, mark); err != nil {
				t.Fatal(err)
			}
			rc.waitFor("PING ack", func(f rawFrame) bool { return f.typ == http2.FramePing && f.ack && f.ping == mark })
			before := wakes()
			for range grants {
				if err := rc.fr.WriteWindowUpdate(tc.grant, 1); err != nil {
					t.Fatal(err)
				}
				rc.waitFor("the granted byte", func(f rawFrame) bool { return f.typ == http2.FrameData })
			}
			waitfor.Until(t, "the writers waiting again", settled)
			woke := wakes() - before
			t.Logf("%d one-byte grants with %d writers waiting woke writers %d times", grants, streams, woke)
			if woke > 3*grants {
				t.Errorf("%d wake-ups for %d one-byte grants: want at most %d (a grant wakes the writer it lets send)", woke, grants, 3*grants)
			}
		})
	}
}
