package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"io"
	"net"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// TestStalledPeerPinsNoMoreThanItsShareOfBulkBuffers: a client that grants the
// largest flow-control windows HTTP/2 allows and reads its socket slower than
// the applications behind its streams send (a trickle is enough; flow control
// never stops them) holds the bulk frame buffers its streams took: each is
// inside a write to its socket, or queued behind one, for as long as it keeps
// reading so. It gets no more than its address's share of the process-wide
// budget, and another peer's transfer still goes in bulk frames. Before the
// fix forty such streams from one address held all 32 bulk frame buffers
// within 200 ms, and every other tenant of the node sent 64 KiB frames, one
// TLS record per write, for as long as that peer liked.
func TestStalledPeerPinsNoMoreThanItsShareOfBulkBuffers(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	stop := make(chan struct{})
	app := writingUpstream(t, stop)
	defer close(stop)

	// The attacker, from another address than the honest pool's.
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	raw, err := d.Dial("tcp", e.addr.String())
	if err != nil {
		t.Fatalf("dial from a second loopback address: %v", err)
	}
	defer raw.Close()
	good, _ := pkis()
	conf := good.clientTLS()
	conf.NextProtos = []string{"h2"}
	tc := tls.Client(raw, conf)
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	out.WriteString(http2.ClientPreface)
	fr := http2.NewFramer(&out, nil)
	_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: maxWindow},
		http2.Setting{ID: http2.SettingMaxFrameSize, Val: 1<<24 - 1})
	_ = fr.WriteWindowUpdate(0, maxWindow-defaultWindow)
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for i := range 40 {
		hb.Reset()
		_ = enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
		_ = enc.WriteField(hpack.HeaderField{Name: ":authority", Value: app.String()})
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: hb.Bytes(), EndHeaders: true})
	}
	if _, err := tc.Write(out.Bytes()); err != nil {
		t.Fatal(err)
	}
	// It reads slowly, a little at a time: the server's writer is always
	// waiting for the socket, and every stream's frame waits behind it.
	go func() {
		buf := make([]byte, 64<<10)
		for {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			if _, err := raw.Read(buf); err != nil {
				return
			}
		}
	}()
	share := int(maxBulkBuffers / bulkShareDivisor)
	waitfor.Until(t, "the slow peer's streams to take bulk frame buffers", func() bool { return Buffers().FramesInUse >= share })
	time.Sleep(500 * time.Millisecond) // before the fix, they took all in 200 ms
	if n := Buffers().FramesInUse; n > share {
		t.Fatalf("a peer that reads slowly holds %d bulk frame buffers of %d, want at most its share, %d", n, maxBulkBuffers, share)
	}
	if Buffers().FramesDeniedShare == 0 {
		t.Error("no bulk frame buffer refused for the peer's share")
	}

	// Another peer's bulk transfer still gets bulk frames.
	const size = 8 << 20
	honest := startUpstream(t, func(c *net.TCPConn) {
		_, _ = io.Copy(c, io.LimitReader(newPRNGReader(3), size))
		_ = c.CloseWrite()
	})
	before := Buffers()
	s, err := e.connect(context.Background(), honest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_ = s.CloseWrite()
	if n, err := io.Copy(sha256.New(), s); err != nil || n != size {
		t.Fatalf("received %d bytes, %v; want %d", n, err, size)
	}
	if after := Buffers(); after.FramesTaken == before.FramesTaken {
		t.Errorf("the honest transfer got no bulk frame buffer: %+v -> %+v", before, after)
	}
}
