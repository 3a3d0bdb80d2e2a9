package hbone

import (
	"context"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// A peer that breaks HTTP/2 gets GOAWAY with the error's code, and the
// connection is counted as such on either side: before, only floods and
// zero stream limits had counters, and a peer breaking the protocol showed
// only in the failed connections' istio_tcp_* series.
func TestProtocolErrorClosesCounted(t *testing.T) {
	t.Run("server", func(t *testing.T) {
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
	})
	t.Run("pool", func(t *testing.T) {
		dial := dialHostile(t, func(hs *hostileServer) {
			if hs.awaitRequest(1) == nil {
				_ = hs.headers(3, true, hpackField{Name: ":status", Value: "200"}) // an answer on a stream never opened
			}
		})
		pool := NewPool(PoolOptions{})
		t.Cleanup(func() { _ = pool.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if s, err := connectHostile(ctx, pool, dial); err == nil {
			s.Close()
			t.Fatal("Connect succeeded over a connection the server broke")
		}
		if st := pool.Stats(); st.ProtocolErrorCloses != 1 || st.FloodCloses != 0 {
			t.Errorf("ProtocolErrorCloses = %d, FloodCloses = %d, want 1 and 0", st.ProtocolErrorCloses, st.FloodCloses)
		}
	})
}
