package hbone

import (
	"sync"
	"sync/atomic"
)

// Bulk transfers go in large units: a stream whose socket fills a frame buffer reads up to
// bulkFrameSize at once and sends it as one DATA frame, and the connection's writer hands the
// TLS records of a frame to the socket in one write (batchConn). Per byte that is fewer
// reads, writes, frame hand-offs and goroutine wake-ups on both agents: measured on/off in one
// run, CPU per GB 0.79x and one flow 1.17x (BENCHMARKS.md). The buffers are large, so a
// process-wide budget bounds how many exist: past it a stream falls back to frameBufSize
// frames and a connection writes its records one by one, as a peer that stops reading could
// otherwise make every stalled stream hold a megabyte.
const (
	// bulkFrameSize is a bulk DATA frame with its header; peers that allow smaller frames
	// (SETTINGS_MAX_FRAME_SIZE) get it split.
	bulkFrameSize = 1 << 20
	// batchSize holds the TLS records of one bulk frame (64 records of 16 KiB, each with
	// 22 bytes of header and tag) plus what bw had coalesced before it.
	batchSize = bulkFrameSize + 32<<10
	// maxBulkBuffers bounds each kind of large buffer in use at once, process-wide:
	// 32 MiB of frames and 33 MiB of batches at most.
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
	if b.inUse.Add(1) > b.limit {
		b.inUse.Add(-1)
		b.denied.Add(1)
		return nil
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
