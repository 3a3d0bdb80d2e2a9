package hbone

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// TestMadeYouReset: HEADERS(CONNECT) followed by a frame that makes the
// server reset the stream itself (the MadeYouReset class, CVE-2025-8671)
// costs the client the early-reset budget just as its own RST_STREAM would:
// a flood of such pairs closes the connection with GOAWAY
// ENHANCE_YOUR_CALM and the resets are counted. Before the fix only
// RST_STREAMs the client sent were charged, and each of these pairs
// cancelled a handler mid-dial for free.
func TestMadeYouReset(t *testing.T) {
	provokers := map[string]func(rc *rawClient, id uint32, app string) error{
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
	for name, provoke := range provokers {
		t.Run(name, func(t *testing.T) {
			app, accepted := countingUpstream(t)
			var handled atomic.Int64
			srv, err := NewServer(ServerOptions{
				TLSConfig: mustServerTLS(),
				Handler: func(ctx context.Context, req *ServerRequest) Response {
					handled.Add(1)
					return dialTarget(ctx, req)
				},
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = srv.Close() })
			rc := newRawClient(t, srv)
			rc.fr.AllowIllegalWrites = true // WINDOW_UPDATE 0
			const pairs = 5000
			sent := 0
			for id := uint32(1); sent < pairs; id += 2 {
				if rc.connect(id, app.String()) != nil || provoke(rc, id, app.String()) != nil {
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
			if n := handled.Load(); n > 100+5*200 {
				t.Errorf("%d handlers ran for %d reset streams", n, sent)
			}
		})
	}
}

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
	srv, err := NewServer(ServerOptions{
		TLSConfig:            mustServerTLS(),
		MaxConcurrentStreams: 1,
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			running <- struct{}{}
			<-release // a handler that does not watch ctx
			return Response{Status: 403}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	rc := newRawClient(t, srv)
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
	srv, err := NewServer(ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	rc := newRawClient(t, srv)
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
	srv, err := NewServer(ServerOptions{
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
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	rc := newRawClient(t, srv)
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
