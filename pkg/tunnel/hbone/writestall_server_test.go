package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// downloadServer serves a loopback HBONE server whose handler relays
// CONNECTs to an application that sends without end, and refuses every
// other target (403), with the given write stall timeout.
func downloadServer(t *testing.T, stall time.Duration) (srv *Server, addr string, app string) {
	t.Helper()
	return downloadServerLimited(t, stall, nil)
}

// downloadServerLimited is downloadServer with the connection limiter lim
// (nil: the server's own).
func downloadServerLimited(t *testing.T, stall time.Duration, lim *ConnLimiter) (srv *Server, addr string, app string) {
	t.Helper()
	appAddr := startUpstream(t, func(c *net.TCPConn) {
		buf := make([]byte, 64<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	})
	good, _ := pkis()
	srv, addr = serveLoopback(t, ServerOptions{TLSConfig: good.serverTLS(), WriteStallTimeout: stall, Limiter: lim,
		Handler: func(ctx context.Context, req *ServerRequest) Response {
			if req.Target == appAddr {
				return dialTarget(ctx, req)
			}
			return Response{Status: 403, Reason: "denied by policy"}
		}})
	return srv, addr, appAddr.String()
}

// h2Client opens a TLS connection with the mesh's client certificate and
// the smallest receive buffer, sends the preface and SETTINGS granting
// large windows, and returns a framer on it.
func h2Client(t *testing.T, addr string) (*tls.Conn, *http2.Framer) {
	t.Helper()
	return h2ClientFrom(t, addr, "", true)
}

// h2ClientFrom is h2Client from the local address local (any when empty),
// with the smallest receive buffer only when small.
func h2ClientFrom(t *testing.T, addr, local string, small bool) (*tls.Conn, *http2.Framer) {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		if !small {
			return nil
		}
		var serr error
		err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 1) })
		if err != nil {
			return err
		}
		return serr
	}}
	if local != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(local)}
	}
	raw, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	good, _ := pkis()
	conf := good.clientTLS()
	conf.NextProtos = []string{"h2"}
	tc := tls.Client(raw, conf)
	_ = tc.SetDeadline(time.Now().Add(30 * time.Second))
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	if _, err := tc.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(tc, tc)
	if err := fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteWindowUpdate(0, 1<<30); err != nil {
		t.Fatal(err)
	}
	return tc, fr
}

// connecter returns a function that writes on fr a CONNECT to target as
// stream id, with an HPACK encoder of its own.
func connecter(fr *http2.Framer) func(id uint32, target string) error {
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	return func(id uint32, target string) error {
		return writeHeaderBlock(fr, enc, &buf, id, []hpackField{{Name: ":method", Value: "CONNECT"}, {Name: ":authority", Value: target}})
	}
}

// TestServerClosesConnWhoseClientReadsNothing: a client opens a download,
// stops reading the connection (its socket's buffers fill and the server's
// writer blocks in a write, holding the write lock), and sends CONNECTs
// that are refused: each refusal's handler blocks behind that write with
// its handler slot and goroutine. The server closes such a connection once
// a write made no progress for WriteStallTimeout, which frees them all and
// is counted. Before, nothing ended it while the client kept the
// connection: 200 handler goroutines per connection, 1024 connections per
// client address, for as long as it liked.
func TestServerClosesConnWhoseClientReadsNothing(t *testing.T) {
	checkGoroutines(t)
	const stall = time.Second
	srv, addr, app := downloadServer(t, stall)
	_, fr := h2Client(t, addr)
	connect := connecter(fr)
	if err := connect(1, app); err != nil {
		t.Fatal(err)
	}
	// The download fills the socket buffers; then every refusal waits.
	waitfor.Until(t, "the download established", func() bool { return srv.Stats().StreamsOK == 1 })
	time.Sleep(200 * time.Millisecond)
	for i := range 199 {
		if err := connect(uint32(3+2*i), "10.0.0.1:80"); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.Until(t, "200 handlers held", func() bool { return srv.Stats().HandlersHeld == 200 })
	start := time.Now()
	waitfor.Until(t, "the stalled connection closed and its handlers gone", func() bool {
		st := srv.Stats()
		return st.ConnsActive == 0 && st.HandlersHeld == 0
	})
	took := time.Since(start)
	st := srv.Stats()
	t.Logf("closed %v after the handlers blocked; %+v", took, st)
	if st.ConnsWriteStalled != 1 {
		t.Errorf("ConnsWriteStalled = %d, want 1", st.ConnsWriteStalled)
	}
}

// TestServerKeepsSlowReader: a client that reads a download slowly, so
// that one write of the server may take longer than WriteStallTimeout, is
// not taken for one that reads nothing: its connection lives.
func TestServerKeepsSlowReader(t *testing.T) {
	checkGoroutines(t)
	const stall = time.Second
	srv, addr, app := downloadServer(t, stall)
	tc, fr := h2Client(t, addr)
	if err := connecter(fr)(1, app); err != nil {
		t.Fatal(err)
	}
	// About 40 KB/s, a few KiB at a time: a 256 KiB frame takes six
	// seconds to go out.
	var read int64
	end := time.Now().Add(5 * stall)
	for time.Now().Before(end) {
		n, err := io.CopyN(io.Discard, tc, 4<<10)
		read += n
		if err != nil {
			t.Fatalf("after %d bytes: %v", read, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	st := srv.Stats()
	t.Logf("read %d bytes in %v; %+v", read, 5*stall, st)
	if st.ConnsWriteStalled != 0 || st.ConnsActive != 1 {
		t.Errorf("a slow reader's connection was closed as stalled (%d stalled, %d open)", st.ConnsWriteStalled, st.ConnsActive)
	}
}

// TestHandlersBoundedPerSource: the streams one client address holds
// handlers for are bounded over all its connections. A client that stops
// reading two connections, each with a download filling its socket, and
// sends 199 CONNECTs on each that are refused behind it, holds at most MaxHandlersPerSource
// handlers (each a goroutine and a stream, until the write stall check);
// its other streams are refused with REFUSED_STREAM and counted, and a
// client at another address still opens a tunnel at once. Before, each
// connection held 200, and the 1024 connections one address may open
// some 1.5 GiB of goroutines and streams (about 1.5 MiB per connection,
// measured), beyond the agent's memory limit.
func TestHandlersBoundedPerSource(t *testing.T) {
	checkGoroutines(t)
	const limit = 50
	lim := NewConnLimiter(ConnLimits{MaxHandlersPerSource: limit})
	srv, addr, app := downloadServerLimited(t, time.Minute, lim)
	var connects []func(id uint32, target string) error
	for conn := range 2 {
		_, fr := h2ClientFrom(t, addr, "127.0.0.1", true)
		connect := connecter(fr)
		if err := connect(1, app); err != nil {
			t.Fatal(err)
		}
		waitfor.Until(t, "the download established", func() bool { return srv.Stats().StreamsOK == uint64(conn+1) })
		connects = append(connects, connect)
	}
	time.Sleep(200 * time.Millisecond)
	for _, connect := range connects {
		for i := range 199 {
			if err := connect(uint32(3+2*i), "10.0.0.1:80"); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitfor.Until(t, "streams over the limit refused", func() bool {
		return lim.Stats().RefusedHandlers >= 2*200-limit
	})
	time.Sleep(200 * time.Millisecond)
	if held := srv.Stats().HandlersHeld; held > limit {
		t.Errorf("one address holds %d handlers, want at most %d", held, limit)
	}

	// Another address is not held back.
	tc, fr := h2ClientFrom(t, addr, "127.0.0.2", false)
	start := time.Now()
	if err := connecter(fr)(1, app); err != nil {
		t.Fatal(err)
	}
	_ = tc.SetReadDeadline(time.Now().Add(5 * time.Second))
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("the other address's CONNECT: %v", err)
		}
		if h, ok := f.(*http2.MetaHeadersFrame); ok {
			if st := h.PseudoValue("status"); st != "200" {
				t.Fatalf("the other address's CONNECT got %s, want 200", st)
			}
			break
		}
	}
	st := lim.Stats()
	t.Logf("another address's tunnel in %v; refused over the limit %d; %+v", time.Since(start), st.RefusedHandlers, srv.Stats())
}
