package hbone

import (
	"context"
	"errors"
	"net"
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
	testHookIdleChecked = func(c *conn) {
		select {
		case checked <- c:
			<-proceed
		default: // another firing: not held
		}
	}
	t.Cleanup(func() { testHookIdleChecked = nil })
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
