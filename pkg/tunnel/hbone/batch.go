package hbone

import (
	"net"
	"sync"
)

// batchConn sits between crypto/tls and the TCP socket. crypto/tls writes every TLS record
// with a write(2) of its own; while a large DATA frame is written, batchConn gathers its
// records and sends them in one write, so a bulk frame is one syscall instead of 64 and the
// peer's reader wakes once for it. Outside a batch it writes through.
type batchConn struct {
	net.Conn
	mu  sync.Mutex
	buf *[]byte // gathered records while batching; nil otherwise
}

// begin starts gathering, if the budget has a batch buffer left; otherwise the records go
// out one by one as without batching.
func (b *batchConn) begin() {
	b.mu.Lock()
	if b.buf == nil {
		if b.buf = batchBuffer.get(); b.buf != nil {
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
	batchBuffer.put(b.buf)
	b.buf = nil
	return err
}

func (b *batchConn) flushLocked() error {
	p := *b.buf
	*b.buf = p[:0]
	if len(p) == 0 {
		return nil
	}
	_, err := b.Conn.Write(p)
	return err
}

func (b *batchConn) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buf == nil {
		return b.Conn.Write(p)
	}
	if len(*b.buf)+len(p) > cap(*b.buf) {
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
		if len(p) > cap(*b.buf) {
			return b.Conn.Write(p)
		}
	}
	*b.buf = append(*b.buf, p...)
	return len(p), nil
}
