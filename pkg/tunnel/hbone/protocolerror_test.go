package hbone

import (
	"context"
	"testing"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
)

// A client that breaks HTTP/2 gets GOAWAY with the error's code, and the
// connection is counted as such: before, only floods had a counter, and a
// peer breaking the protocol showed only in the failed connections'
// istio_tcp_* series. (The pool's side: TestClientConnectionErrorsExplained.)
func TestServerCountsProtocolErrorCloses(t *testing.T) {
	srv, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: func(ctx context.Context, req *ServerRequest) Response {
		return Response{Status: 200}
	}})
	// DATA on a stream never opened: PROTOCOL_ERROR (RFC 9113 §5.1).
	if err := rc.fr.WriteData(5, false, []byte("x")); err != nil {
		t.Fatal(err)
	}
	if code := rc.goAwayCode(); code != http2.ErrCodeProtocol {
		t.Fatalf("GOAWAY %v, want PROTOCOL_ERROR", code)
	}
	if st := srv.Stats(); st.ConnsProtocolError != 1 || st.ConnsFlood != 0 {
		t.Errorf("ConnsProtocolError = %d, ConnsFlood = %d, want 1 and 0", st.ConnsProtocolError, st.ConnsFlood)
	}
}

// TestFramesAfterPeerResetWhileAnswered: DATA a client sends after its own
// RST_STREAM is STREAM_CLOSED (RFC 9113 §5.1), also when the handler
// answered and closed the stream just as the reader took the reset (the
// hook holds the reader there until the stream is gone). Before the fix the
// stream's removal did not know of the reset and the DATA was dropped
// unanswered; h2spec's "closed: Sends a DATA frame after sending
// RST_STREAM frame" failed now and then under the race detector.
func TestFramesAfterPeerResetWhileAnswered(t *testing.T) {
	answer := make(chan struct{})
	_, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: func(ctx context.Context, req *ServerRequest) Response {
		<-answer
		return Response{Status: 403, Reason: "denied"}
	}})
	testHookResetFound.set(t, func(c *conn, id uint32) {
		close(answer)
		waitfor.Until(t, "the handler closed the stream", func() bool {
			c.mu.Lock()
			defer c.mu.Unlock()
			return c.streams[id] == nil
		})
	})
	if err := rc.connect(1, "10.0.0.1:80"); err != nil {
		t.Fatal(err)
	}
	if err := rc.fr.WriteRSTStream(1, http2.ErrCodeCancel); err != nil {
		t.Fatal(err)
	}
	if err := rc.fr.WriteData(1, true, []byte("test")); err != nil {
		t.Fatal(err)
	}
	rc.waitFor("RST_STREAM(STREAM_CLOSED) on stream 1", func(f rawFrame) bool {
		return f.typ == http2.FrameRSTStream && f.stream == 1 && f.code == http2.ErrCodeStreamClosed
	})
}
