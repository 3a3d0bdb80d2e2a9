package hbone

import (
	"sync"
	"sync/atomic"
)

// Bulk transfers go in large units: a stream whose socket fills a frame buffer reads up to
// bulkFrameSize at once and sends it as one DATA frame, and the connection's writer hands the
// TLS records of a frame to the socket in one write (batchConn). Per byte that is fewer
// reads, writes, frame hand-offs and goroutine wake-ups on both agents (on/off in one run in
// BENCHMARKS.md). The size is a trade: a frame holds the connection's writer while it is
// written, so another stream's frame on the same connection may wait for one bulk frame
// (about 0.35 ms at 6 Gbps; 1 MiB frames measured a little cheaper, at four times the wait).
// The buffers are large, so a process-wide budget bounds how many exist: past it a stream
// falls back to frameBufSize frames and a connection writes its records one by one.
const (
	// bulkFrameSize is a bulk DATA frame with its header; peers that allow smaller frames
	// (SETTINGS_MAX_FRAME_SIZE) get it split.
	bulkFrameSize = 256 << 10
	// batchSize holds the TLS records of one bulk frame (16 records of 16 KiB, each with
	// 22 bytes of header and tag) plus what bw had coalesced before it.
	batchSize = bulkFrameSize + 32<<10
	// maxBulkBuffers bounds each kind of large buffer in use at once, process-wide:
	// 8 MiB of frames and 9 MiB of batches at most (sync.Pool may keep returned ones
	// until the next collections).
	maxBulkBuffers = 32
)

// bufBudget is a pool of equal buffers of which at most limit are out at once.
type bufBudget struct {
	pool   sync.Pool
	inUse  atomic.Int64
	taken  atomic.Uint64
	denied atomic.Uint64
	limit  int64
}

func newBufBudget(size int, limit int64) *bufBudget {
	b := &bufBudget{limit: limit}
	b.pool.New = func() any {
		buf := make([]byte, size)
		return &buf
	}
	return b
}

// get returns a buffer, or nil when limit are out.
func (b *bufBudget) get() *[]byte {
	for {
		n := b.inUse.Load()
		if n >= b.limit {
			b.denied.Add(1)
			return nil
		}
		if b.inUse.CompareAndSwap(n, n+1) {
			break
		}
	}
	b.taken.Add(1)
	return b.pool.Get().(*[]byte)
}

func (b *bufBudget) put(p *[]byte) {
	b.pool.Put(p)
	b.inUse.Add(-1)
}

var (
	bulkFrames  = newBufBudget(bulkFrameSize, maxBulkBuffers)
	batchBuffer = newBufBudget(batchSize, maxBulkBuffers)
)

// BufferStats is the state of the process-wide budgets of large buffers.
type BufferStats struct {
	Limit                       int    // of each kind
	FramesInUse, BatchesInUse   int    // out now
	FramesTaken, BatchesTaken   uint64 // handed out since start
	FramesDenied, BatchesDenied uint64 // wanted while all were out
}

// Buffers reports the large-buffer budgets, for metrics.
func Buffers() BufferStats {
	return BufferStats{
		Limit:         maxBulkBuffers,
		FramesInUse:   int(bulkFrames.inUse.Load()),
		BatchesInUse:  int(batchBuffer.inUse.Load()),
		FramesTaken:   bulkFrames.taken.Load(),
		BatchesTaken:  batchBuffer.taken.Load(),
		FramesDenied:  bulkFrames.denied.Load(),
		BatchesDenied: batchBuffer.denied.Load(),
	}
}
