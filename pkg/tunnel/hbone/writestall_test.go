package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// stallServer is an HBONE server on loopback TCP that grants huge windows,
// answers CONNECTs with 200, and stops reading for good once stream 1's
// first DATA arrived, while it goes on sending PINGs: alive by every sign
// but reading nothing of the client's.
type stallServer struct {
	l       net.Listener
	stopped chan struct{}
	once    sync.Once
}

func newStallServer(t *testing.T) *stallServer {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &stallServer{l: l, stopped: make(chan struct{})}
	done := make(chan struct{})
	t.Cleanup(func() { close(done); l.Close() })
	good, _ := pkis()
	go func() {
		for {
			raw, err := l.Accept()
			if err != nil {
				return
			}
			go h.serve(raw, good, done)
		}
	}()
	return h
}

func (h *stallServer) serve(raw net.Conn, good *testPKI, done chan struct{}) {
	defer raw.Close()
	tc := tls.Server(raw, good.serverTLS())
	if tc.Handshake() != nil {
		return
	}
	var preface [len(http2.ClientPreface)]byte
	if _, err := io.ReadFull(tc, preface[:]); err != nil {
		return
	}
	var wmu sync.Mutex
	var hbuf bytes.Buffer
	fr := http2.NewFramer(tc, tc)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	enc := hpack.NewEncoder(&hbuf)
	wmu.Lock()
	_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30})
	_ = fr.WriteWindowUpdate(0, 1<<30)
	wmu.Unlock()
	go func() { // the signs of life
		for {
			select {
			case <-done:
				return
			case <-time.After(50 * time.Millisecond):
			}
			wmu.Lock()
			err := fr.WritePing(false, [8]byte{1})
			wmu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	for {
		select {
		case <-h.stopped:
			<-done // read nothing more, hold the socket
			return
		default:
		}
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			wmu.Lock()
			hbuf.Reset()
			_ = enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
			_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: hbuf.Bytes(), EndHeaders: true})
			wmu.Unlock()
		case *http2.DataFrame:
			if f.StreamID == 1 {
				h.once.Do(func() { close(h.stopped) })
			}
		}
	}
}

// TestPeerThatReadsNothingHoldsNoConnect: a peer that stops reading while
// an app uploads leaves that stream's writer blocked in write(2) with the
// connection's write lock. Before, every later CONNECT to the same peer
// reserved a stream on that connection and then waited for the lock past
// its own deadline, for as long as the kernel kept the peer (minutes: the
// peer's PINGs kept keepalive content), and so did the pod's stop. Now a
// CONNECT gives up at its deadline and drains the connection, and a write
// that makes no progress for the keepalive timeout closes it.
func TestPeerThatReadsNothingHoldsNoConnect(t *testing.T) {
	h := newStallServer(t)
	pool := NewPool(PoolOptions{PingInterval: 100 * time.Millisecond, PingTimeout: time.Second})
	t.Cleanup(func() { _ = pool.Close() })
	good, _ := pkis()
	key := PoolKey{Src: "pod", SrcIdentity: "a", DstIdentity: "b", DstAddr: h.l.Addr().(*net.TCPAddr).AddrPort()}
	req := Request{Authority: netip.MustParseAddrPort("10.0.0.3:80")}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	s, err := pool.Connect(ctx, key, tcpDial, good.clientTLS(), req)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	writeDone := make(chan error, 1)
	go func() {
		_, err := s.Write(make([]byte, 64<<20)) // blocks once the socket buffers are full
		writeDone <- err
	}()
	<-h.stopped
	time.Sleep(300 * time.Millisecond) // the writer fills the buffers and blocks

	const n = 10
	took := make(chan time.Duration, n)
	for range n {
		go func() {
			start := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			if s2, err := pool.Connect(ctx, key, tcpDial, good.clientTLS(), req); err == nil {
				s2.Close()
			}
			took <- time.Since(start)
		}()
	}
	for range n {
		select {
		case d := <-took:
			if d > 900*time.Millisecond {
				t.Errorf("a CONNECT with a 300 ms deadline took %v", d)
			}
		case <-time.After(3 * time.Second):
			t.Fatal("a CONNECT with a 300 ms deadline still waits after 3 s: blocked behind the stalled write")
		}
	}
	select {
	case err := <-writeDone:
		if err == nil {
			t.Error("the write to a peer that reads nothing succeeded")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the write to a peer that reads nothing still blocks 5 s on, with a 1 s keepalive timeout")
	}
}
