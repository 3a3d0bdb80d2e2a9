package hbone

import (
	"context"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// TestRapidResetAcrossConnections: a client that spreads its rapid resets
// over many connections, each under its connection's budget of 100 per
// 10 s, is still a flood: the budget is the source address's, over every
// connection it holds to the node's servers. Before the fix each of the
// 1024 connections one address may hold had a budget of its own, so an
// address reset 100 times as many streams (each a handler run and maybe a
// dial of the app) as one connection may, with nothing closed; a client
// at another address kept working meanwhile, and still must.
func TestRapidResetAcrossConnections(t *testing.T) {
	app, _ := countingUpstream(t)
	attacker := netip.MustParseAddr("10.9.0.1")
	var handled atomic.Int64
	// The clock stands still, so the budget refills nothing however slowly
	// a loaded machine sends the flood.
	lim := NewConnLimiter(ConnLimits{})
	start := time.Now().UnixNano()
	lim.now = func() int64 { return start }
	srv, err := NewServer(ServerOptions{
		Limiter:   lim,
		TLSConfig: mustServerTLS(),
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			if sourceAddr(req.RemoteAddr) == attacker {
				// Slow to answer (an app slow to accept), so
				// every reset of the flood comes before the answer.
				handled.Add(1)
				<-ctx.Done()
				return Response{Status: 503}
			}
			return dialTarget(ctx, req)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	const conns, perConn = 30, 90 // each connection under its budget of 100
	sent, closed := 0, 0
	for range conns {
		rc := newRawClientFrom(t, srv, attacker)
		ok := true
		for id := uint32(1); id < 2*perConn; id += 2 {
			if rc.connect(id, app.String()) != nil || rc.fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
				ok = false
				break
			}
			sent++
		}
		if ok {
			// Did the server keep this connection? A PING tells.
			_ = rc.fr.WritePing(false, [8]byte{'e', 'n', 'd'})
		}
		f := rc.waitFor("PING ack or GOAWAY", func(f rawFrame) bool {
			return f.typ == http2.FrameGoAway || (f.typ == http2.FramePing && f.ack)
		})
		if f.typ == http2.FrameGoAway {
			if f.code != http2.ErrCodeEnhanceYourCalm {
				t.Fatalf("GOAWAY %v, want ENHANCE_YOUR_CALM", f.code)
			}
			closed++
		}
	}
	st := srv.Stats()
	t.Logf("sent %d pairs over %d connections; %d closed; handlers %d; stats %+v",
		sent, conns, closed, handled.Load(), st)
	if closed == 0 || st.ConnsFlood == 0 {
		t.Fatalf("%d early resets from one address over %d connections closed none of them: want the address's budget (%d per 10 s) to hold",
			st.StreamsEarlyReset, conns, defaultEarlyResetsPerSource)
	}
	// The budget, plus the reset each later connection is closed at.
	if st.StreamsEarlyReset > defaultEarlyResetsPerSource+conns {
		t.Errorf("%d early resets taken from one address, want about its budget of %d", st.StreamsEarlyReset, defaultEarlyResetsPerSource)
	}
	if n := srv.limiter.Stats().SourceResetFloods; n == 0 {
		t.Error("ConnLimiterStats.SourceResetFloods = 0, want the floods counted")
	}

	// Another address is not the attacker's: its stream is served.
	other := newRawClientFrom(t, srv, netip.MustParseAddr("10.9.0.2"))
	if err := other.connect(1, app.String()); err != nil {
		t.Fatal(err)
	}
	if f := other.waitFor("response", func(f rawFrame) bool { return f.typ == http2.FrameHeaders || f.typ == http2.FrameGoAway }); f.status != 200 {
		t.Fatalf("a client at another address got %+v, want 200", f)
	}
}
