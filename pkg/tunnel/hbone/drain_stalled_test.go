package hbone

import (
	"context"
	"crypto/tls"
	"net"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// smallSendBuffers is a listener whose connections have a small send
// buffer: the few KB a peer that reads nothing must make the server write
// before its writes block, where a node's default takes more of the same.
type smallSendBuffers struct{ net.Listener }

func (l smallSendBuffers) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetWriteBuffer(4096)
	}
	return c, err
}

// stalledIdle opens an HBONE connection to addr that opens no stream and,
// after the handshake, reads nothing, with the smallest receive buffer, and
// sends PINGs (within the junk budget) until the server's answers fill the
// socket buffers: the server's control writer then blocks in a write,
// holding the write lock, on a connection that is idle.
func stalledIdle(t *testing.T, addr string) {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 1) })
		if err != nil {
			return err
		}
		return serr
	}}
	raw, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	good, _ := pkis()
	conf := good.clientTLS()
	conf.NextProtos = []string{"h2"}
	tc := tls.Client(raw, conf)
	t.Cleanup(func() { raw.Close() })
	_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	if _, err := tc.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(tc, tc)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	for i := range 900 {
		if err := fr.WritePing(false, [8]byte{byte(i >> 8), byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDrainIdleStalledPeersBounded: draining connections (a pod's stop, a
// trust change, the certificate the server presented being renewed) closes
// at once those that carry no stream, in order: GOAWAY, then close_notify,
// each write bounded by a second. A peer that reads nothing holds each such
// close that long, and the drains went one connection after another: a
// meshed client holding idle connections to a pod, each with its answers
// to PINGs stuck in the socket, held the pod's stop (Shutdown, whatever its
// deadline) for about two seconds per connection, and with it the
// reconcile waiting on the stop. The close of Close and Evict was made
// concurrent before; the drains' close of idle connections was not.
func TestDrainIdleStalledPeersBounded(t *testing.T) {
	for _, how := range []string{"shutdown", "drain peers", "drain presented"} {
		t.Run(how, func(t *testing.T) {
			good, _ := pkis()
			srv, err := NewServer(ServerOptions{TLSConfig: good.serverTLS(), Handler: dialTarget})
			if err != nil {
				t.Fatal(err)
			}
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			go func() { _ = srv.Serve(smallSendBuffers{l}) }()
			t.Cleanup(func() { _ = srv.Close() })
			const n = 8
			for range n {
				stalledIdle(t, l.Addr().String())
			}
			time.Sleep(300 * time.Millisecond) // the answers fill the buffers
			start := time.Now()
			switch how {
			case "shutdown":
				ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
				_ = srv.Shutdown(ctx)
				cancel()
			case "drain peers":
				if got := srv.DrainPeers(func(tls.ConnectionState) bool { return false }); got != n {
					t.Errorf("DrainPeers drained %d, want %d", got, n)
				}
			case "drain presented":
				if got := srv.DrainPresented(func(*tls.Certificate) bool { return false }); got != n {
					t.Errorf("DrainPresented drained %d, want %d", got, n)
				}
			}
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("%s of %d idle connections whose peers read nothing took %s, want about one close's (2 s)", how, n, took.Round(time.Millisecond))
			}
		})
	}
}

// TestLastStreamCloseOfDrainedStalledConnBounded: the last stream of a
// draining connection closes it, in order, as the drain of an idle one
// does, and the peer that reads nothing held that close, on the goroutine
// closing the stream, for about two seconds: a relay's end, and a pod's
// stop closing the relays left at its deadline one after another.
func TestLastStreamCloseOfDrainedStalledConnBounded(t *testing.T) {
	app := startUpstream(t, func(c *net.TCPConn) {
		b := make([]byte, 64<<10)
		for {
			if _, err := c.Write(b); err != nil {
				return
			}
		}
	})
	good, _ := pkis()
	srv, addr := serveLoopback(t, ServerOptions{TLSConfig: good.serverTLS(), Handler: dialTarget})
	stalledDownload(t, addr, app)
	time.Sleep(500 * time.Millisecond) // the relay fills the socket buffers and blocks
	var s *Stream
	srv.mu.Lock()
	for c := range srv.conns {
		c.mu.Lock()
		s = c.streams[1]
		c.mu.Unlock()
	}
	srv.mu.Unlock()
	if s == nil {
		t.Fatal("no open stream 1 on the server")
	}
	if n := srv.DrainPeers(func(tls.ConnectionState) bool { return false }); n != 1 {
		t.Fatalf("DrainPeers drained %d, want 1", n)
	}
	start := time.Now()
	s.Close()
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Errorf("closing the last stream of a draining connection whose peer reads nothing took %s", took.Round(time.Millisecond))
	}
}
