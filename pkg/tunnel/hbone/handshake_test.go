package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
)

// TestPrefaceWithoutSettingsTimesOut: a client that sends the 24-byte
// preface and then withholds the SETTINGS frame that must follow it (RFC
// 9113 §3.4) is closed after the handshake timeout. Before the fix the
// read deadline was cleared after the preface, and such a client held the
// connection until the idle timeout (5 minutes by default).
func TestPrefaceWithoutSettingsTimesOut(t *testing.T) {
	srv, err := NewServer(ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget, HandshakeTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	cli, srvSide := net.Pipe()
	t.Cleanup(func() { cli.Close() })
	go srv.serveHTTP2(srvSide, &tls.ConnectionState{}, nil, nil, trustGens{}, nil)
	start := time.Now()
	_ = cli.SetReadDeadline(start.Add(3 * time.Second))
	ended := make(chan error, 1)
	go func() { // the server's SETTINGS, then the end
		_, err := io.Copy(io.Discard, cli)
		ended <- err
	}()
	if _, err := cli.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	if err := <-ended; err != nil {
		t.Fatalf("connection without SETTINGS still open after %v: %v", time.Since(start), err)
	}
}

// TestHandshakeSlotHeldUntilSettings: a connection holds its handshake slot
// (ConnLimits.MaxHandshakes) through the TLS handshake and the HTTP/2
// preface, until the client's first SETTINGS frame. Before the fix the
// slot was given back after TLS, so a client with a certificate could hold
// connections in the preface outside the handshake limit.
func TestHandshakeSlotHeldUntilSettings(t *testing.T) {
	lim := NewConnLimiter(ConnLimits{})
	_, addr := serveLoopback(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget, Limiter: lim})
	conf := mustClientTLS()
	conf.NextProtos = []string{"h2"}
	tc, err := tls.Dial("tcp", addr, conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tc.Close() })
	go func() { _, _ = io.Copy(io.Discard, tc) }() // the server's SETTINGS
	time.Sleep(200 * time.Millisecond)             // the server's side of TLS is done long before
	if n := lim.Stats().Handshakes; n != 1 {
		t.Fatalf("%d handshakes counted after TLS, before the client's SETTINGS; want 1", n)
	}
	fr := http2.NewFramer(tc, nil)
	if _, err := tc.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	waitfor.Until(t, "the handshake slot back after SETTINGS", func() bool { return lim.Stats().Handshakes == 0 })
	if st := lim.Stats(); st.Conns != 1 {
		t.Errorf("limiter %+v, want the connection still counted", st)
	}
}

// dialFrom returns a Dialer whose connections come from the loopback
// address src.
func dialFrom(src string) Dialer {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		return d.DialContext(ctx, network, addr)
	}
}

// TestHandshakeEviction: silent connections that fill the node's handshake
// budget from a few source addresses, each within its per-source cap, do
// not lock out a real client: its connection evicts (closes) the oldest
// pending handshake, and the eviction is counted. Before the fix every new
// connection was refused at accept until the silent ones timed out, and
// attackers could renew them forever without a certificate.
func TestHandshakeEviction(t *testing.T) {
	lim := NewConnLimiter(ConnLimits{MaxHandshakes: 4, MaxHandshakesPerSource: 2})
	_, addr := serveLoopback(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget, Limiter: lim, HandshakeTimeout: time.Minute})
	var silent []net.Conn
	for i, src := range []string{"127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"} {
		c, err := dialFrom(src)(context.Background(), "tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		silent = append(silent, c)
		waitfor.Until(t, "the silent connection counted", func() bool { return lim.Stats().Handshakes == i+1 })
	}
	// The per-source cap stays: a third from 127.0.0.2 is refused, and
	// evicts nothing.
	extra, err := dialFrom("127.0.0.2")(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	waitfor.Until(t, "the third handshake from one source refused", func() bool { return lim.Stats().RefusedHandshakes == 1 })

	app := startUpstream(t, echo)
	pool := NewPool(PoolOptions{})
	defer pool.Close()
	good, _ := pkis()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	key := PoolKey{DstAddr: netip.MustParseAddrPort(addr)}
	s, err := pool.Connect(ctx, key, dialFrom("127.0.0.4"), good.clientTLS(), Request{Authority: app})
	if err != nil {
		t.Fatalf("a real client with the handshake budget full of silent connections: %v", err)
	}
	defer s.Close()
	if st := lim.Stats(); st.EvictedHandshakes != 1 {
		t.Errorf("limiter %+v, want 1 evicted handshake", st)
	}
	// The oldest silent connection is the one evicted.
	_ = silent[0].SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := silent[0].Read(make([]byte, 1)); isTimeout(err) {
		t.Error("the oldest silent connection is still open")
	}
	for _, c := range silent[1:] {
		_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); !isTimeout(err) {
			t.Errorf("a newer silent connection was closed: %v", err)
		}
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
