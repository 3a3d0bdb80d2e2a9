package hbone

import (
	"net/netip"
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

// bufBudget is a pool of equal buffers of which at most limit are out at once, and at most
// limit/bulkShareDivisor to one owner (the peer address of the connection that uses them).
// A buffer is held while its frame is written, or waits to be, so a peer that reads slower
// than its streams' applications send (granting large flow-control windows all the same)
// keeps every buffer its streams took for as long as it keeps reading so: without a share,
// forty such streams from one address held all the budget, and every other tenant of the
// node sent in 64 KiB frames for as long as that peer liked.
type bufBudget struct {
	pool   sync.Pool
	inUse  atomic.Int64 // changed under mu; read without it for metrics
	taken  atomic.Uint64
	denied atomic.Uint64
	// deniedShare counts buffers refused because their owner held its share.
	deniedShare atomic.Uint64
	limit       int64
	share       int64

	mu     sync.Mutex
	owners map[netip.Addr]int64 // buffers out per owner
}

// bulkShareDivisor sets an owner's share of a budget: a quarter, so an honest peer with a
// few bulk streams on one connection (whose frames are written one at a time anyway) keeps
// what it can use, and it takes four peers to spend the budget.
const bulkShareDivisor = 4

func newBufBudget(size int, limit int64) *bufBudget {
	b := &bufBudget{limit: limit, share: max(limit/bulkShareDivisor, 1), owners: make(map[netip.Addr]int64)}
	b.pool.New = func() any {
		buf := make([]byte, size)
		return &buf
	}
	return b
}

// get returns a buffer for owner, or nil when limit are out or owner holds its share.
func (b *bufBudget) get(owner netip.Addr) *[]byte {
	b.mu.Lock()
	switch {
	case b.inUse.Load() >= b.limit:
		b.mu.Unlock()
		b.denied.Add(1)
		return nil
	case b.owners[owner] >= b.share:
		b.mu.Unlock()
		b.deniedShare.Add(1)
		return nil
	}
	b.inUse.Add(1)
	b.owners[owner]++
	b.mu.Unlock()
	b.taken.Add(1)
	return b.pool.Get().(*[]byte)
}

// put gives back a buffer get returned for owner.
func (b *bufBudget) put(owner netip.Addr, p *[]byte) {
	b.pool.Put(p)
	b.mu.Lock()
	b.inUse.Add(-1)
	if b.owners[owner]--; b.owners[owner] <= 0 {
		delete(b.owners, owner)
	}
	b.mu.Unlock()
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
	// FramesDeniedShare and BatchesDeniedShare count buffers wanted by a peer that held
	// its share of the budget.
	FramesDeniedShare, BatchesDeniedShare uint64
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

		FramesDeniedShare:  bulkFrames.deniedShare.Load(),
		BatchesDeniedShare: batchBuffer.deniedShare.Load(),
	}
}
