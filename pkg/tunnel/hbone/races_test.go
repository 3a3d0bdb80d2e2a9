package hbone

import (
	"context"
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
