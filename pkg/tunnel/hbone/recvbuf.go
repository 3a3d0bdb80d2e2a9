package hbone

import "sync"

// chunkSize is the unit of a stream's receive buffer. It matches the size
// Relay hands to a socket in one write.
const chunkSize = 64 << 10

var chunkPool = sync.Pool{New: func() any {
	b := make([]byte, chunkSize)
	return &b
}}

// chunk is a pooled buffer holding unread bytes in b[r:w].
type chunk struct {
	b    *[]byte
	r, w int
}

func recycleChunks(cs []chunk) {
	for _, c := range cs {
		chunkPool.Put(c.b)
	}
}

// recvBuf is a stream's FIFO of received bytes in pooled chunks, so a
// stream holds memory only for bytes the application has not read yet.
// Only the connection's reader adds to it.
type recvBuf struct {
	chunks []chunk
	n      int // bytes buffered
}

// write copies p in, filling the last chunk first.
func (b *recvBuf) write(p []byte) {
	for len(p) > 0 {
		if len(b.chunks) == 0 || b.chunks[len(b.chunks)-1].w == chunkSize {
			b.chunks = append(b.chunks, chunk{b: chunkPool.Get().(*[]byte)})
		}
		t := &b.chunks[len(b.chunks)-1]
		k := copy((*t.b)[t.w:], p)
		t.w += k
		b.n += k
		p = p[k:]
	}
}

// add links in a chunk filled elsewhere.
func (b *recvBuf) add(c chunk) {
	if c.w == c.r {
		chunkPool.Put(c.b)
		return
	}
	b.chunks = append(b.chunks, c)
	b.n += c.w - c.r
}

// peek returns the first contiguous run of buffered bytes.
func (b *recvBuf) peek() []byte {
	if b.n == 0 {
		return nil
	}
	c := &b.chunks[0]
	return (*c.b)[c.r:c.w]
}

// advance drops k bytes from the front. recycle is false while a slice
// from peek may still be in use outside the stream's lock.
func (b *recvBuf) advance(k int, recycle bool) {
	c := &b.chunks[0]
	c.r += k
	b.n -= k
	if c.r < c.w {
		return
	}
	if recycle {
		chunkPool.Put(c.b)
	}
	b.chunks[0] = chunk{}
	b.chunks = b.chunks[1:]
	if len(b.chunks) == 0 {
		b.chunks = nil
	}
}

func (b *recvBuf) read(p []byte) int {
	n := 0
	for n < len(p) && b.n > 0 {
		k := copy(p[n:], b.peek())
		b.advance(k, true)
		n += k
	}
	return n
}

// release drops everything, recycling the chunks unless a slice from peek
// is still in use.
func (b *recvBuf) release(recycle bool) {
	if recycle {
		recycleChunks(b.chunks)
	}
	*b = recvBuf{}
}
