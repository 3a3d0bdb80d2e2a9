package hbone

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// heapInUse is the live heap after a collection.
func heapInUse() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// TestLargeControlFramesPinNoBuffer: a peer that sends one large frame the
// framer reads (an unknown extension type, or GOAWAY with a long debug
// text, up to our SETTINGS_MAX_FRAME_SIZE of 1 MiB) must not leave the
// connection holding a buffer that size for its remaining life. Before the
// fix x/net's Framer kept its read buffer at the largest frame it ever
// read: one junk frame per connection pinned 1 MiB each, outside the
// receive window budget, so one client address with its 1024 connections
// held 1 GiB of the node for as long as it kept them open (16 GiB for the
// node's 16384), while an honest idle connection holds some KiB.
func TestLargeControlFramesPinNoBuffer(t *testing.T) {
	srv, err := NewServer(ServerOptions{TLSConfig: mustServerTLS(), Handler: func(ctx context.Context, req *ServerRequest) Response {
		<-ctx.Done() // the stream that keeps the GOAWAY conn open
		return Response{Status: 503}
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	const conns = 16
	big := make([]byte, maxReadFrameSize)
	// The clients first (each holds its own buffers), and frames written
	// by hand from one shared payload, so that what grows is the server's.
	rcs := make([]*rawClient, conns+1)
	for i := range rcs {
		rcs[i] = newRawClient(t, srv)
		if i%2 == 1 {
			if err := rcs[i].connect(1, "10.0.0.1:80"); err != nil {
				t.Fatal(err)
			}
		}
		ping(t, rcs[i], [8]byte{'u', 'p'})
	}
	before := heapInUse()
	for i, rc := range rcs[1:] {
		typ, payload := http2.FrameType(0xfa), big // an unknown type: ignored
		if i%2 == 0 {
			// GOAWAY with a stream still open keeps the connection.
			typ, payload = http2.FrameGoAway, big[:len(big)-8]
			clear(payload[:8]) // last stream 0, NO_ERROR
		}
		hdr := []byte{byte(len(payload) >> 16), byte(len(payload) >> 8), byte(len(payload)), byte(typ), 0, 0, 0, 0, 0}
		if _, err := rc.nc.Write(append(hdr, payload...)); err != nil {
			t.Fatal(err)
		}
		ping(t, rc, [8]byte{'b', 'i', 'g'})
	}
	held := heapInUse() - before
	t.Logf("held %d KiB per connection", held/conns>>10)
	if perConn := held / conns; perConn > 256<<10 {
		t.Errorf("each connection holds %d KiB after one %d KiB frame, want at most 256 KiB", perConn>>10, maxReadFrameSize>>10)
	}
	if st := srv.Stats(); st.ConnsActive != conns+1 {
		t.Errorf("%d connections open, want %d", st.ConnsActive, conns+1)
	}
	runtime.KeepAlive(rcs)
}

// ping sends a PING and waits for its ack: the server read everything before.
func ping(t *testing.T, rc *rawClient, mark [8]byte) {
	t.Helper()
	if err := rc.fr.WritePing(false, mark); err != nil {
		t.Fatal(err)
	}
	rc.waitFor("PING ack", func(f rawFrame) bool { return f.typ == http2.FramePing && f.ack && f.ping == mark })
}

// TestClientLargeFramesPinNoBuffer is TestLargeControlFramesPinNoBuffer for
// the pool: a server that sends one 1 MiB frame of an unknown type on each
// pooled connection must not leave each holding a 1 MiB read buffer.
func TestClientLargeFramesPinNoBuffer(t *testing.T) {
	const conns = 8
	payload := make([]byte, maxReadFrameSize)
	frame := append([]byte{byte(len(payload) >> 16), byte(len(payload) >> 8), byte(len(payload)), 0xfa, 0, 0, 0, 0, 0}, payload...)
	servers := make(chan *hostileServer, conns)
	dial := dialHostile(t, func(hs *hostileServer) {
		if hs.awaitRequest(1) != nil {
			return
		}
		if hs.headers(1, false, hpackField{Name: ":status", Value: "200"}) == nil {
			servers <- hs
		}
	})
	pool := NewPool(PoolOptions{})
	t.Cleanup(func() { _ = pool.Close() })
	good, _ := pkis()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var hss []*hostileServer
	for i := range conns {
		key := hostileKey()
		key.Src = fmt.Sprintf("pod-%d", i)
		s, err := pool.Connect(ctx, key, dial, good.clientTLS(), Request{Authority: netip.MustParseAddrPort("10.0.0.3:80")})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		hss = append(hss, <-servers)
	}
	before := heapInUse()
	for _, hs := range hss {
		if _, err := hs.tc.Write(frame); err != nil {
			t.Fatal(err)
		}
		if f := hs.answerAfter(func(http2.Frame) bool { return false }); f != nil {
			t.Fatalf("the pool answered %v", f)
		}
	}
	held := heapInUse() - before
	t.Logf("held %d KiB per connection", held/conns>>10)
	if perConn := held / conns; perConn > 256<<10 {
		t.Errorf("each pooled connection holds %d KiB after one %d KiB frame, want at most 256 KiB", perConn>>10, maxReadFrameSize>>10)
	}
	if st := pool.Stats(); st.Conns != conns {
		t.Errorf("%d pooled connections, want %d", st.Conns, conns)
	}
}

// TestStalledGoAwayHoldsNoPayload: a GOAWAY longer than readBufKeep is read
// ahead of the framer (prefetch), so that a header declaring 1 MiB and
// nothing more costs nothing. But a peer that sends all of such a GOAWAY
// but its last byte, and stalls, must not make the connection hold what it
// sent: the debug text is only logged, cut short anyway, and 1 MiB per
// connection is what the receive window budget exists to refuse (1 GiB for
// one client address's 1024 connections). Before the fix each such
// connection held the 1 MiB it was sent, and more, until it ended.
func TestStalledGoAwayHoldsNoPayload(t *testing.T) {
	srv, err := NewServer(ServerOptions{TLSConfig: mustServerTLS(), Handler: func(ctx context.Context, req *ServerRequest) Response {
		<-ctx.Done()
		return Response{Status: 503}
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	const conns = 16
	payload := make([]byte, maxReadFrameSize) // last stream 0, NO_ERROR, zeros
	rcs := make([]*rawClient, conns)
	for i := range rcs {
		rcs[i] = newRawClient(t, srv)
		ping(t, rcs[i], [8]byte{'u', 'p'})
	}
	before := heapInUse()
	for _, rc := range rcs {
		hdr := []byte{byte(len(payload) >> 16), byte(len(payload) >> 8), byte(len(payload)), byte(http2.FrameGoAway), 0, 0, 0, 0, 0}
		// Over net.Pipe a write returns once the server read all of it.
		if _, err := rc.nc.Write(append(hdr, payload[:len(payload)-1]...)); err != nil {
			t.Fatal(err)
		}
	}
	held := heapInUse() - before
	t.Logf("held %d KiB per connection", held/conns>>10)
	if perConn := held / conns; perConn > 256<<10 {
		t.Errorf("each connection holds %d KiB of a stalled %d KiB GOAWAY, want at most 256 KiB", perConn>>10, maxReadFrameSize>>10)
	}
	runtime.KeepAlive(rcs)
}
