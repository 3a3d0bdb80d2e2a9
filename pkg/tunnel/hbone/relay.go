package hbone

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// relayBufSize is the copy buffer for pairs with no zero-copy path: neither
// side a *Stream (which frames in place) nor both TCP sockets (splice). It
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

// Counts are a relay's running byte counts, one per direction: each copy
// adds what a write (or a delivery of the connection's reader, deliver.go)
// moved as soon as it moved it, so that what an open connection has carried
// can be read while it lasts (the tunnel's byte metrics of long-lived
// connections). Once the relay has returned they equal its totals. Adding
// is one atomic add per write to a counter of this relay alone: nothing is
// shared with other connections on the data path.
type Counts struct {
	AToB, BToA atomic.Int64
}

// Relay copies a to b and b to a at the same time until both directions
// are done, then closes a and b. A direction that reaches EOF half-closes
// its destination (CloseWrite, when it has one) and the other direction
// goes on: the peer that sent EOF may still be reading. An error in either
// direction closes both sides, which ends the other direction too.
//
// It returns the bytes copied each way and the first error (nil when both
// directions ended with EOF). A *Stream reads or writes frames in place,
// and TCP-to-TCP pairs splice.
//
// A side that is a *Stream closes the other side when it fails (reset, or
// its connection closed): a copy blocked on the other side would not see
// it otherwise.
func Relay(a, b io.ReadWriteCloser) (aToB, bToA int64, err error) {
	return RelayCounting(a, b, nil)
}

// RelayCounting is Relay adding to counts, when not nil, as bytes move.
func RelayCounting(a, b io.ReadWriteCloser, counts *Counts) (aToB, bToA int64, err error) {
	if counts == nil {
		counts = new(Counts)
	}
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
			mirrorReset(e, a, b)
			_ = a.Close()
			_ = b.Close()
		})
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var e error
		if bToA, e = copyHalf(a, b, &counts.BToA); e != nil {
			fail(e)
		}
	}()
	var e error
	if aToB, e = copyHalf(b, a, &counts.AToB); e != nil {
		fail(e)
	}
	wg.Wait()
	fail(nil) // close both if no error did
	return aToB, bToA, firstErr
}

// copyHalf copies src to dst until EOF, then half-closes dst; moved gets
// what each write moved, as it moves it.
func copyHalf(dst io.Writer, src io.Reader, moved *atomic.Int64) (int64, error) {
	var n int64
	var err error
	// A Stream on either side is called directly rather than through
	// io.Copy and the socket's own WriteTo: a shallower stack for the
	// goroutine that waits in it, which is most of an idle tunnel's memory.
	rf, dstStream := dst.(*Stream)
	wt, srcStream := src.(*Stream)
	dstTCP, dstIsTCP := dst.(*net.TCPConn)
	srcTCP, srcIsTCP := src.(*net.TCPConn)
	switch {
	case dstStream:
		n, err = rf.readFrom(src, moved)
	case srcStream:
		n, err = wt.writeTo(dst, moved)
	default:
		handled := false
		if dstIsTCP && srcIsTCP {
			n, handled, err = spliceCopy(dstTCP, srcTCP, moved)
		}
		if !handled {
			bp := relayBufPool.Get().(*[]byte)
			n, err = copyBuffer(dst, src, *bp, moved)
			relayBufPool.Put(bp)
		}
	}
	if err != nil {
		return n, err
	}
	if cw, ok := dst.(closeWriter); ok {
		return n, cw.CloseWrite()
	}
	return n, nil
}

// copyBuffer is io.CopyBuffer without the WriterTo and ReaderFrom paths
// (the pairs that have a faster one take it in copyHalf; the others, such
// as a socket the acceleration wraps, would only copy through a buffer of
// their own), adding each write to moved.
func copyBuffer(dst io.Writer, src io.Reader, buf []byte, moved *atomic.Int64) (int64, error) {
	var total int64
	for {
		nr, rerr := src.Read(buf)
		if nr > 0 {
			nw, werr := dst.Write(buf[:nr])
			if nw < 0 || nw > nr {
				nw, werr = 0, errInvalidWrite
			}
			total += int64(nw)
			moved.Add(int64(nw))
			if werr != nil {
				return total, werr
			}
			if nw != nr {
				return total, io.ErrShortWrite
			}
		}
		if rerr == io.EOF {
			return total, nil
		}
		if rerr != nil {
			return total, rerr
		}
	}
}

// addMoved adds n to moved, a copy's running count (Counts), if it has one.
func addMoved(moved *atomic.Int64, n int) {
	if moved != nil && n > 0 {
		moved.Add(int64(n))
	}
}

// lingerSocket is a TCP socket a relay can close with a reset: a
// *net.TCPConn, or a wrapper of one that keeps its methods.
type lingerSocket interface {
	SetLinger(sec int) error
	SyscallConn() (syscall.RawConn, error)
}

// mirrorReset passes a reset on: when err is one side's reset (ECONNRESET,
// or EPIPE writing to a side already reset), each TCP side with nothing of
// ours left unacknowledged in its send queue is closed with a reset
// (SO_LINGER 0) instead of a FIN, as the reset would have reached that peer
// without the relay. Closed with a FIN, the relay's socket was the side
// that closed first, so it stayed in TIME_WAIT for 60 s on its local port:
// a plain TCP upstream's is a port of the pod's own ephemeral range on the
// pod's address, towards the destination the app just used, and a client
// that closes with a reset (SO_LINGER 0, as load generators and connection
// pools do to keep their ports free) had each connection leave one there.
// Its next connections to that destination then found the range full: the
// tunnel's dial failed (the app's connection reset) and so did the app's own
// connect, at a rate the same client sustains without the mesh for ever
// (TestResetClientLeavesNoTimeWait). The inbound dial to the app (plaintext
// clients) left its TIME_WAIT on the client's address the same way. A side
// that still has bytes of ours to deliver gets a FIN as before: a reset
// would discard them.
func mirrorReset(err error, sides ...io.ReadWriteCloser) {
	if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.EPIPE) {
		return
	}
	for _, s := range sides {
		ls, ok := s.(lingerSocket)
		if !ok || unacked(ls) != 0 {
			continue
		}
		_ = ls.SetLinger(0)
	}
}

// unacked is how many bytes s has sent or queued that its peer has not
// acknowledged (SIOCOUTQ; a FIN not yet acknowledged counts one); -1 when
// it cannot be read.
func unacked(s lingerSocket) int {
	rc, err := s.SyscallConn()
	if err != nil {
		return -1
	}
	n := -1
	if cerr := rc.Control(func(fd uintptr) {
		v, err := unix.IoctlGetInt(int(fd), unix.SIOCOUTQ)
		if err == nil {
			n = v
		}
	}); cerr != nil {
		return -1
	}
	return n
}
