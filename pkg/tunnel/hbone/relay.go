package hbone

import (
	"io"
	"sync"
)

// relayBufSize is the copy buffer for pairs with no zero-copy path: neither
// side a *Stream (which frames in place) nor a TCP socket (splice). It
// matches the Stream's frame and receive chunk size.
const relayBufSize = 64 << 10

var relayBufPool = sync.Pool{New: func() any {
	b := make([]byte, relayBufSize)
	return &b
}}

// closeWriter is implemented by *net.TCPConn, *tls.Conn, *net.UnixConn and
// *Stream.
type closeWriter interface {
	CloseWrite() error
}

// Relay copies a to b and b to a at the same time until both directions
// are done, then closes a and b. A direction that reaches EOF half-closes
// its destination (CloseWrite, when it has one) and the other direction
// goes on: the peer that sent EOF may still be reading. An error in either
// direction closes both sides, which ends the other direction too.
//
// It returns the bytes copied each way and the first error (nil when both
// directions ended with EOF). Copies go through io.Copy, so a *Stream
// reads or writes frames in place and TCP-to-TCP pairs splice.
//
// A side that is a *Stream closes the other side when it fails (reset, or
// its connection closed): a copy blocked on the other side would not see
// it otherwise.
func Relay(a, b io.ReadWriteCloser) (aToB, bToA int64, err error) {
	if s, ok := a.(*Stream); ok {
		defer s.closeOnAbort(b)()
	}
	if s, ok := b.(*Stream); ok {
		defer s.closeOnAbort(a)()
	}
	var (
		once     sync.Once
		firstErr error
	)
	fail := func(e error) {
		once.Do(func() {
			firstErr = e
			_ = a.Close()
			_ = b.Close()
		})
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var e error
		if bToA, e = copyHalf(a, b); e != nil {
			fail(e)
		}
	}()
	var e error
	if aToB, e = copyHalf(b, a); e != nil {
		fail(e)
	}
	wg.Wait()
	fail(nil) // close both if no error did
	return aToB, bToA, firstErr
}

// copyHalf copies src to dst until EOF, then half-closes dst.
func copyHalf(dst io.Writer, src io.Reader) (int64, error) {
	var n int64
	var err error
	// A Stream on either side is called directly rather than through
	// io.Copy and the socket's own WriteTo: a shallower stack for the
	// goroutine that waits in it, which is most of an idle tunnel's memory.
	rf, dstStream := dst.(*Stream)
	wt, srcStream := src.(*Stream)
	_, srcFast := src.(io.WriterTo)
	_, dstFast := dst.(io.ReaderFrom)
	switch {
	case dstStream:
		n, err = rf.ReadFrom(src)
	case srcStream:
		n, err = wt.WriteTo(dst)
	case srcFast || dstFast:
		n, err = io.Copy(dst, src)
	default:
		bp := relayBufPool.Get().(*[]byte)
		n, err = io.CopyBuffer(dst, src, *bp)
		relayBufPool.Put(bp)
	}
	if err != nil {
		return n, err
	}
	if cw, ok := dst.(closeWriter); ok {
		return n, cw.CloseWrite()
	}
	return n, nil
}
