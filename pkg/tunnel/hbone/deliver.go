package hbone

import (
	"io"
	"net"
	"sync/atomic"
	"syscall"
)

// Direct delivery. A stream's bytes normally go from the connection's
// reader to the stream's buffer and from there, on the goroutine running
// WriteTo, to the destination socket: a hand-off per DATA frame (a futex
// wake and a thread switch, often to the other CPU, where the decrypted
// bytes are no longer in cache). While WriteTo waits with nothing queued,
// the reader instead writes the frame's bytes into the socket itself with
// one non-blocking writev(2), and queues for WriteTo only what the socket
// did not take. WriteTo still does every blocking write, so the reader never
// waits on one stream's socket and the other streams of the connection never
// wait behind it.
//
// Every frame is delivered so, small ones too. The 16 streams of a fortio
// burst share one connection, and each hand-off left a goroutine waiting for
// a CPU: an execution trace of the agents at 1000 qps put 30 % of their
// scheduler latency on the reader's wake-ups of WriteTo. For a while a lone
// frame (a round trip's) was still handed off, as it measured faster so; once
// the tunnel's socket calls stopped waking the runtime's monitor thread
// (rawio.go), delivering it too made round trips 0.84-0.87x, HTTP p50 at 1000
// qps 0.93-0.94x and the agents' CPU 0.72x at one request at a time and
// 0.89-0.91x at 16 (both placements, 2 December).
//
// The cost is head-of-line: a frame of another stream on the connection
// waits for the reader's write as well as for the frame's decryption, of the
// same order. Frames over our own bulk size (a peer may send up to 1 MiB) are
// handed off, so that wait is bounded by one 256 KiB write.

// A tiny frame (under tinyFrame bytes) is delivered so only when it is the
// first its stream delivered in this read of the connection's socket
// (readCount); later ones of the same read are queued for WriteTo, which
// writes what gathered in one write. A peer packing a stream's bytes into
// DATA frames of a byte each (ten on the wire, some 1600 per TLS record)
// otherwise made the reader write them one write(2), and one TCP segment
// to the app, each (TestTinyDataFramesCoalesced). A frame of tinyFrame bytes
// or more costs the peer about what a TCP segment of its own would.

// tinyFrame is the DATA payload below which a frame is tiny.
const tinyFrame = 64

// readCount is how many reads of the connection's socket returned data,
// 0 when it has no batchConn (tests' pipes). Reader goroutine only.
func (c *conn) readCount() uint64 {
	if c.cfg.batch == nil {
		return 0
	}
	return c.cfg.batch.reads
}

// directBytes counts the bytes readers wrote to sockets themselves.
var directBytes atomic.Int64

// RawWriter is a socket wrapper whose Write is a plain write(2) on the
// file descriptor RawWriteConn returns, so the reader may write to it
// directly (accel.Conn). *net.TCPConn and *net.UnixConn qualify as they are;
// a wrapper that transforms or counts writes must not implement it.
type RawWriter interface {
	RawWriteConn() (syscall.RawConn, error)
}

// rawSink returns the socket w's bytes may be written to directly, through
// its file descriptor, or nil.
func rawSink(w io.Writer) *rawSock {
	var (
		rc  syscall.RawConn
		err error
	)
	switch c := w.(type) {
	case *net.TCPConn:
		rc, err = c.SyscallConn()
	case *net.UnixConn:
		rc, err = c.SyscallConn()
	case RawWriter:
		rc, err = c.RawWriteConn()
	default:
		return nil
	}
	if err != nil {
		return nil
	}
	var laddr, raddr net.Addr
	if nc, ok := w.(net.Conn); ok {
		laddr, raddr = nc.LocalAddr(), nc.RemoteAddr()
	}
	return rawSockOf(rc, laddr, raddr)
}

// deliverLocked writes a frame's bytes (small, then chunks) to the stream's
// sink and returns what the socket did not take, with the count it took.
// Chunks written in full go back to the pool. It is called by the
// connection's reader with s.mu held, when WriteTo is waiting with nothing
// buffered (so nothing may be written before these bytes); it holds the
// socket with draining, as WriteTo does, while mu is released for the
// write.
func (s *Stream) deliverLocked(small []byte, chunks []chunk) ([]byte, []chunk, int) {
	s.draining = true
	sink, moved := s.sink, s.sinkMoved
	s.mu.Unlock()

	bufs := s.c.iov[:0]
	if len(small) > 0 {
		bufs = append(bufs, small)
	}
	for _, c := range chunks {
		bufs = append(bufs, (*c.b)[c.r:c.w])
	}
	wrote := sink.writeNow(bufs)
	directBytes.Add(int64(wrote))
	addMoved(moved, wrote)
	clear(bufs) // no pointers to the chunks stay behind in the scratch slice
	s.c.iov = bufs[:0]

	left := wrote
	k := min(left, len(small))
	small, left = small[k:], left-k
	for left > 0 && len(chunks) > 0 {
		c := &chunks[0]
		k := min(left, c.w-c.r)
		c.r += k
		left -= k
		if c.r < c.w {
			break
		}
		chunkPool.Put(c.b)
		chunks = chunks[1:]
	}

	s.mu.Lock()
	s.draining = false
	s.delivered += int64(wrote)
	if s.sink == nil {
		s.rcond.Broadcast() // WriteTo is returning and waits for this count
	}
	return small, chunks, wrote
}
