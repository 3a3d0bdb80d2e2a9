package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"net"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
)

func TestBufBudget(t *testing.T) {
	b := newBufBudget(8, 2)
	x, y := b.get(), b.get()
	if x == nil || y == nil {
		t.Fatal("the budget refused a buffer below its limit")
	}
	if z := b.get(); z != nil {
		t.Fatal("the budget handed out a buffer past its limit")
	}
	if b.denied.Load() != 1 || b.inUse.Load() != 2 {
		t.Fatalf("denied %d, in use %d; want 1, 2", b.denied.Load(), b.inUse.Load())
	}
	b.put(x)
	if z := b.get(); z == nil || len(*z) != 8 {
		t.Fatal("a returned buffer was not handed out again")
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
	var held [][]*[]byte
	for _, b := range []*bufBudget{bulkFrames, batchBuffer} {
		var hs []*[]byte
		for p := b.get(); p != nil; p = b.get() {
			hs = append(hs, p)
		}
		held = append(held, hs)
	}
	before = Buffers()
	transfer()
	after = Buffers()
	for i, b := range []*bufBudget{bulkFrames, batchBuffer} {
		for _, p := range held[i] {
			b.put(p)
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

// TestStalledStreamsHoldNoBulkBuffer: streams whose peer stops reading (no WINDOW_UPDATE) wait
// for window with ordinary buffers: a peer cannot pin the bulk budget by not reading.
func TestStalledStreamsHoldNoBulkBuffer(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	stop := make(chan struct{})
	defer close(stop)
	// The app behind the server writes until the test ends; the client never reads.
	app := startUpstream(t, func(c *net.TCPConn) {
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
