package hbone

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"
)

// countsPair is the two ends of a loopback TCP connection.
func countsPair(t *testing.T) (client, proxied *net.TCPConn) {
	t.Helper()
	l, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	client, err = net.DialTCP("tcp", nil, l.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	proxied, err = l.AcceptTCP()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close(); proxied.Close() })
	return client, proxied
}

// echoThrough writes n bytes into c and reads their echo back.
func echoThrough(t *testing.T, c net.Conn, n int) {
	t.Helper()
	msg := bytes.Repeat([]byte("y"), n)
	errc := make(chan error, 1)
	go func() { _, err := c.Write(msg); errc <- err }()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, n)); err != nil {
		t.Fatalf("echo of %d bytes: %v", n, err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// countsReach waits until counts show want each way.
func countsReach(t *testing.T, what string, counts *Counts, want int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for counts.AToB.Load() != want || counts.BToA.Load() != want {
		if time.Now().After(deadline) {
			t.Fatalf("%s: running counts %d and %d, want %d each way", what, counts.AToB.Load(), counts.BToA.Load(), want)
		}
		time.Sleep(time.Millisecond)
	}
}

// wrapped hides a socket's type, as the acceleration's accel.Conn does: the
// relay copies it through a buffer.
type wrapped struct{ net.Conn }

// A relay's running counts move as its copies do, on every copy path
// (splice between TCP sockets, a Stream's frames in place and the reader's
// direct deliveries, a buffer), so a connection's bytes can be read while
// it is open; at the end they equal what the relay returns. Before, the
// counts existed only as the relay's return values.
func TestRelayCountsWhileRunning(t *testing.T) {
	const n = 500 << 10
	type relayed struct {
		aToB, bToA int64
		err        error
	}
	for _, tc := range []struct {
		name string
		// upstream returns the relay's other side: a connection to an
		// echo server.
		upstream func(t *testing.T, app netip.AddrPort) io.ReadWriteCloser
		wrap     bool
	}{
		{"TCP to TCP (splice)", func(t *testing.T, app netip.AddrPort) io.ReadWriteCloser {
			c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(app))
			if err != nil {
				t.Fatal(err)
			}
			return c
		}, false},
		{"wrapped socket to TCP (buffer)", func(t *testing.T, app netip.AddrPort) io.ReadWriteCloser {
			c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(app))
			if err != nil {
				t.Fatal(err)
			}
			return c
		}, true},
		{"TCP to Stream", func(t *testing.T, app netip.AddrPort) io.ReadWriteCloser {
			e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
			s, err := e.connect(context.Background(), app)
			if err != nil {
				t.Fatal(err)
			}
			return s
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			app := startUpstream(t, echo)
			client, proxied := countsPair(t)
			var a io.ReadWriteCloser = proxied
			if tc.wrap {
				a = wrapped{proxied}
			}
			up := tc.upstream(t, app)
			var counts Counts
			done := make(chan relayed, 1)
			go func() {
				var r relayed
				r.aToB, r.bToA, r.err = RelayCounting(a, up, &counts)
				done <- r
			}()
			echoThrough(t, client, n)
			countsReach(t, "open", &counts, n)
			echoThrough(t, client, n)
			countsReach(t, "open", &counts, 2*n)
			select {
			case r := <-done:
				t.Fatalf("relay ended early: %+v", r)
			default:
			}
			if err := client.CloseWrite(); err != nil {
				t.Fatal(err)
			}
			r := <-done
			if r.err != nil || r.aToB != 2*n || r.bToA != 2*n {
				t.Fatalf("relay returned %d, %d, %v; want %d each way", r.aToB, r.bToA, r.err, 2*n)
			}
			if counts.AToB.Load() != r.aToB || counts.BToA.Load() != r.bToA {
				t.Errorf("running counts %d, %d at the end, relay returned %d, %d", counts.AToB.Load(), counts.BToA.Load(), r.aToB, r.bToA)
			}
		})
	}
}

// The server's relay adds to Response.Counts as it copies (the stream's
// frames and the reader's direct deliveries into the app's socket), and
// they equal Done's counts at the end.
func TestServerResponseCounts(t *testing.T) {
	const n = 500 << 10
	var counts Counts
	type result struct{ from, to int64 }
	done := make(chan result, 1)
	e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
		r := dialTarget(ctx, req)
		if r.Upstream != nil {
			r.Counts = &counts
			r.Done = func(from, to int64, err error) { done <- result{from, to} }
		}
		return r
	}, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	echoThrough(t, s, n)
	countsReach(t, "server relay", &counts, n)
	if err := s.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(io.Discard, s); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.from != n || r.to != n || counts.AToB.Load() != n || counts.BToA.Load() != n {
		t.Errorf("Done got %d, %d; running counts %d, %d; want %d each", r.from, r.to, counts.AToB.Load(), counts.BToA.Load(), n)
	}
}

// BenchmarkTCPRelayRoundTrip is a 1-byte echo through a TCP-to-TCP relay
// (splice): the latency the splice loop adds per request and response.
func BenchmarkTCPRelayRoundTrip(b *testing.B) {
	roundTrips(b, viaTCPRelay(b, startUpstream(b, echo)))
}
