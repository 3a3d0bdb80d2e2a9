package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
)

func TestBufBudget(t *testing.T) {
	a, c := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	b := newBufBudget(8, 2)
	x, y := b.get(a), b.get(c)
	if x == nil || y == nil {
		t.Fatal("the budget refused a buffer below its limit")
	}
	if z := b.get(c); z != nil {
		t.Fatal("the budget handed out a buffer past its limit")
	}
	if b.denied.Load() != 1 || b.inUse.Load() != 2 {
		t.Fatalf("denied %d, in use %d; want 1, 2", b.denied.Load(), b.inUse.Load())
	}
	b.put(a, x)
	if z := b.get(a); z == nil || len(*z) != 8 {
		t.Fatal("a returned buffer was not handed out again")
	}
}

// TestBufBudgetShare: an owner gets no more than its share of a budget, counted apart from
// a spent budget, and gets more once it gave some back.
func TestBufBudgetShare(t *testing.T) {
	a, c := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	b := newBufBudget(8, 8)
	var held []*[]byte
	for range 8 / bulkShareDivisor {
		p := b.get(a)
		if p == nil {
			t.Fatal("the budget refused an owner a buffer within its share")
		}
		held = append(held, p)
	}
	if p := b.get(a); p != nil {
		t.Fatal("the budget handed an owner a buffer past its share")
	}
	if b.deniedShare.Load() != 1 || b.denied.Load() != 0 {
		t.Fatalf("denied for the share %d, for the limit %d; want 1, 0", b.deniedShare.Load(), b.denied.Load())
	}
	if p := b.get(c); p == nil {
		t.Fatal("another owner was refused a buffer: the first one's share is the limit")
	}
	b.put(a, held[0])
	if p := b.get(a); p == nil {
		t.Fatal("an owner that gave a buffer back got none")
	}
}

// TestBulkTransfer: an app's socket that keeps the tunnel busy is read in bulk frames, whose
// records leave in batches; the bytes arrive intact, and the buffers go back to the budget.
// With the budget spent, the same transfer takes ordinary frames and is as intact.
func TestBulkTransfer(t *testing.T) {
	const size = 48 << 20
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	// The app behind the server side sends size bytes: the server's relay reads them from
	// the socket (Stream.ReadFrom's socket path) into the stream.
	app := startUpstream(t, func(c *net.TCPConn) {
		_, _ = io.Copy(c, io.LimitReader(newPRNGReader(7), size))
		_ = c.CloseWrite()
	})
	want := sha256.New()
	_, _ = io.Copy(want, io.LimitReader(newPRNGReader(7), size))
	transfer := func() {
		t.Helper()
		s, err := e.connect(context.Background(), app)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		_ = s.CloseWrite()
		h := sha256.New()
		if n, err := io.Copy(h, s); err != nil || n != size {
			t.Fatalf("received %d bytes, %v; want %d", n, err, size)
		}
		if !bytes.Equal(h.Sum(nil), want.Sum(nil)) {
			t.Fatal("the bytes arrived changed")
		}
	}

	before := Buffers()
	transfer()
	after := Buffers()
	if after.FramesTaken == before.FramesTaken || after.BatchesTaken == before.BatchesTaken {
		t.Errorf("no bulk frames or batches used: %+v -> %+v", before, after)
	}
	waitBuffersBack(t)

	// Spend the budgets: the transfer falls back to ordinary frames, one record per write.
	type heldBuf struct {
		owner netip.Addr
		p     *[]byte
	}
	var held [][]heldBuf
	for _, b := range []*bufBudget{bulkFrames, batchBuffer} {
		var hs []heldBuf
		for i := byte(1); b.inUse.Load() < b.limit; i++ { // each owner its share
			owner := netip.AddrFrom4([4]byte{10, 9, 0, i})
			for p := b.get(owner); p != nil; p = b.get(owner) {
				hs = append(hs, heldBuf{owner, p})
			}
		}
		held = append(held, hs)
	}
	before = Buffers()
	transfer()
	after = Buffers()
	for i, b := range []*bufBudget{bulkFrames, batchBuffer} {
		for _, h := range held[i] {
			b.put(h.owner, h.p)
		}
	}
	if after.FramesTaken != before.FramesTaken || after.BatchesTaken != before.BatchesTaken {
		t.Errorf("buffers handed out past the budget: %+v -> %+v", before, after)
	}
	if after.FramesDenied == before.FramesDenied || after.BatchesDenied == before.BatchesDenied {
		t.Errorf("a spent budget was not counted as denied: %+v -> %+v", before, after)
	}
	waitBuffersBack(t)
}

func waitBuffersBack(t *testing.T) {
	t.Helper()
	waitfor.Until(t, "bulk buffers back in the budget", func() bool {
		b := Buffers()
		return b.FramesInUse == 0 && b.BatchesInUse == 0
	})
}

// writingUpstream is an app that writes to every connection until stop is
// closed, whether its peer reads or not (each write gives up after 100 ms).
func writingUpstream(t *testing.T, stop <-chan struct{}) netip.AddrPort {
	return startUpstream(t, func(c *net.TCPConn) {
		buf := make([]byte, 1<<20)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_ = c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
			_, _ = c.Write(buf)
		}
	})
}

// TestStalledStreamsHoldNoBulkBuffer: streams whose peer stops reading (no WINDOW_UPDATE) wait
// for window with ordinary buffers: a peer cannot pin the bulk budget by not reading.
func TestStalledStreamsHoldNoBulkBuffer(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	stop := make(chan struct{})
	defer close(stop)
	// The app behind the server writes until the test ends; the client never reads.
	app := writingUpstream(t, stop)
	before := Buffers()
	for range 4 {
		s, err := e.connect(context.Background(), app)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
	}
	waitfor.Until(t, "the stalled streams to have used bulk frames", func() bool {
		return Buffers().FramesTaken > before.FramesTaken
	})
	// Each stream's window (4 MiB) fills and is never given back: they all wait now.
	time.Sleep(500 * time.Millisecond)
	waitfor.Until(t, "stalled streams to hold no bulk frame buffer", func() bool {
		return Buffers().FramesInUse == 0
	})
}
