package hbone

import (
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
)

// batchConn sits between crypto/tls and the TCP socket. crypto/tls writes every TLS record
// with a write(2) of its own; while a large DATA frame is written, batchConn gathers its
// records and sends them in one write, so a bulk frame is one syscall instead of one per
// 16 KiB record, and the peer's reader wakes once for it. Outside a batch it writes through.
type batchConn struct {
	net.Conn
	raw *rawSock // Conn's reads and writes without the runtime's syscall bookkeeping, or nil
	mu  sync.Mutex
	buf *[]byte // gathered records while batching; nil otherwise

	// A batch's write(2) runs after crypto/tls's Write returned, where tls.Conn.Close cannot
	// see it: Close would wait (up to its 5 s close_notify deadline) instead of closing the
	// socket under a blocked write as it does for its own. abort does that for a batch.
	flushing, aborted atomic.Bool

	// written counts the plaintext bytes of the records crypto/tls wrote (a TLS 1.3 record
	// carries its length less tls13RecordOverhead), handed those the conn gave crypto/tls to
	// write (handedWriter). What was written beyond what was handed, once the handshake is
	// over, crypto/tls wrote of its own accord: mostly answers to the peer's KeyUpdate
	// requests, a key derivation and a record write each (conn.spendTLSAnswers).
	written, handed atomic.Int64

	// peer is the remote address, whose share of the batch buffer budget a batch takes.
	peer netip.Addr

	// readLeft, while readLimited, is how many more bytes Read returns before it fails with
	// readLimitErr: a TLS handshake (Server.serveConn, Pool.dial). Read and set only by the
	// goroutine that runs the handshake and then reads the connection.
	readLeft     int64
	readLimited  bool
	readLimitErr error
	// reads counts the socket reads that returned data, for direct delivery's
	// rule of one write per stream per read (Stream.onData). Same goroutine.
	reads uint64
}

// tls13RecordOverhead is what a TLS 1.3 record adds to its plaintext: the 5-byte header,
// the inner content type and the 16-byte AEAD tag of every TLS 1.3 cipher suite.
const tls13RecordOverhead = 5 + 1 + 16

// handedWriter is what a conn's bufio.Writer writes to: the TLS connection, counting the
// bytes handed to it in its batchConn.
type handedWriter struct {
	w io.Writer // the *tls.Conn
	b *batchConn
}

func (h handedWriter) Write(p []byte) (int, error) {
	h.b.handed.Add(int64(len(p)))
	return h.w.Write(p)
}

// newBatchConn returns the batchConn for an HBONE socket.
func newBatchConn(c net.Conn) *batchConn {
	return &batchConn{Conn: c, raw: newRawSock(c), peer: sourceAddr(c.RemoteAddr())}
}

// Read reads from the socket.
func (b *batchConn) Read(p []byte) (n int, err error) {
	switch {
	case b.readLimited:
		return b.limitedRead(p)
	case b.raw != nil:
		n, err = b.raw.Read(p)
	default:
		n, err = b.Conn.Read(p)
	}
	if n > 0 {
		b.reads++
	}
	return n, err
}

// limitRead makes Read fail with err after n more bytes, until unlimitRead.
func (b *batchConn) limitRead(n int64, err error) {
	b.readLeft, b.readLimited, b.readLimitErr = n, true, err
}

func (b *batchConn) unlimitRead() { b.readLimited = false }

func (b *batchConn) limitedRead(p []byte) (int, error) {
	if b.readLeft <= 0 {
		return 0, b.readLimitErr
	}
	if int64(len(p)) > b.readLeft {
		p = p[:b.readLeft]
	}
	b.readLimited = false
	n, err := b.Read(p)
	b.readLimited = true
	b.readLeft -= int64(n)
	return n, err
}

// write writes p to the socket.
func (b *batchConn) write(p []byte) (int, error) {
	if b.raw != nil {
		return b.raw.Write(p)
	}
	return b.Conn.Write(p)
}

// abort makes a connection's close immediate: a batch's write blocked on a peer that stopped
// reading is ended by closing the socket, and no batch writes after it. Both flags are
// sequentially consistent, so either abort sees the flush or the flush sees abort.
func (b *batchConn) abort() {
	b.aborted.Store(true)
	if b.flushing.Load() {
		_ = b.Conn.Close()
	}
}

// begin starts gathering, if the budget has a batch buffer left; otherwise the records go
// out one by one as without batching.
func (b *batchConn) begin() {
	b.mu.Lock()
	if b.buf == nil {
		if b.buf = batchBuffer.get(b.peer); b.buf != nil {
			*b.buf = (*b.buf)[:0]
		}
	}
	b.mu.Unlock()
}

// end sends what the batch gathered.
func (b *batchConn) end() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buf == nil {
		return nil
	}
	err := b.flushLocked()
	batchBuffer.put(b.peer, b.buf)
	b.buf = nil
	return err
}

func (b *batchConn) flushLocked() error {
	p := *b.buf
	*b.buf = p[:0]
	if len(p) == 0 {
		return nil
	}
	b.flushing.Store(true)
	defer b.flushing.Store(false)
	if b.aborted.Load() {
		return net.ErrClosed
	}
	_, err := b.write(p)
	return err
}

func (b *batchConn) Write(p []byte) (int, error) {
	b.written.Add(int64(len(p)) - tls13RecordOverhead) // one record per call after the handshake
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buf == nil {
		return b.write(p)
	}
	if len(*b.buf)+len(p) > cap(*b.buf) {
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
		if len(p) > cap(*b.buf) {
			return b.write(p)
		}
	}
	*b.buf = append(*b.buf, p...)
	return len(p), nil
}
