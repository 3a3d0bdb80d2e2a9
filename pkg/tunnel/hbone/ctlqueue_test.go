package hbone

import (
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// TestWindowUpdatesQueuedBounded: a client that uploads without ever
// reading what the server sends cannot make the server queue WINDOW_UPDATE
// frames without end. The server returns window when the application took
// the bytes, queueing a WINDOW_UPDATE for its control writer, which is stuck
// writing to a client that reads nothing; the window counts as returned at
// once, so the client may go on sending. Before the fix those frames were
// queued outside the maxQueuedControl bound of every other control frame:
// with the small windows a client gets once its address spent its share of
// the window budget (a WINDOW_UPDATE per 16 KiB), 48 MiB of upload queued
// over 6000 of them, and the queue grew with every byte for as long as the
// client kept uploading (x/net counts them among its queued control frames
// and closes the connection past its limit).
func TestWindowUpdatesQueuedBounded(t *testing.T) {
	srv, err := NewServer(ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	upstream := startUpstream(t, func(c *net.TCPConn) { _, _ = io.Copy(io.Discard, c) })
	src := netip.MustParseAddr("10.9.7.1")
	// Connections that spend the address's share of the window budget,
	// so the next gets HTTP/2's initial 64 KiB: WINDOW_UPDATEs every 16 KiB.
	for range maxPeerWindow/(connWindow-defaultWindow) + 1 {
		ping(t, newRawClientFrom(t, srv, src), [8]byte{'e', 'a', 't'})
	}

	cli, srvSide := net.Pipe()
	t.Cleanup(func() { cli.Close() })
	go srv.serveHTTP2(addrConn{srvSide, net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 40001))}, &tls.ConnectionState{}, nil, nil, trustGens{}, nil)
	answered := make(chan struct{})
	go func() {
		// Read up to the answer to stream 1, then never again.
		fr := http2.NewFramer(nil, cli)
		fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			if f.Header().Type == http2.FrameHeaders && f.Header().StreamID == 1 {
				close(answered)
				return
			}
		}
	}()
	fr := http2.NewFramer(cli, nil)
	var hbuf bytes.Buffer
	if _, err := cli.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	if err := writeHeaderBlock(fr, hpack.NewEncoder(&hbuf), &hbuf, 1, []hpackField{
		{Name: ":method", Value: "CONNECT"}, {Name: ":authority", Value: upstream.String()}}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-answered:
	case <-time.After(5 * time.Second):
		t.Fatal("no answer to the CONNECT")
	}
	var sc *conn
	srv.mu.Lock()
	for c := range srv.conns {
		if c.peer == src && c.streams[1] != nil {
			sc = c
		}
	}
	srv.mu.Unlock()
	if sc == nil {
		t.Fatal("server connection not found")
	}
	sc.mu.Lock()
	target := sc.recvTarget
	sc.mu.Unlock()
	if target != defaultWindow {
		t.Fatalf("connection window %d, want the initial %d (budget spent)", target, defaultWindow)
	}
	// Upload 48 MiB in 16 KiB frames, each once the application took
	// the last: the server's accounting leaves the window full each time.
	payload := make([]byte, 16<<10)
	maxQueued := 0
	for i := range 3 << 10 {
		if err := fr.WriteData(1, false, payload); err != nil {
			break // the server closed the connection: fine
		}
		deadline := time.Now().Add(5 * time.Second)
		for {
			sc.mu.Lock()
			queued, idle, dead := len(sc.ctl), sc.recvWindow+sc.recvUnacked == sc.recvTarget, sc.err != nil
			sc.mu.Unlock()
			maxQueued = max(maxQueued, queued)
			if idle || dead {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("frame %d: the application did not take the upload", i)
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
	// One credit queues up to two frames (the stream's and the
	// connection's) before it finds the queue over its bound.
	if maxQueued > maxQueuedControl+2 {
		t.Errorf("the server queued %d control frames for a client that reads nothing, want at most %d", maxQueued, maxQueuedControl+2)
	}
	sc.mu.Lock()
	dead := sc.err != nil
	sc.mu.Unlock()
	if !dead {
		t.Error("the connection of a client that reads nothing of 48 MiB worth of WINDOW_UPDATEs is still open")
	}
}
