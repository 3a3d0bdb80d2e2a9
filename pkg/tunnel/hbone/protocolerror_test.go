package hbone

import (
	"context"
	"testing"

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
