package hbone

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

var errWriteAfterCloseWrite = errors.New("hbone stream write after CloseWrite")

// maxInterimResponses bounds the informational (1xx) responses a client
// reads before the final one, as net/http's client does.
const maxInterimResponses = 5

// Stream is one CONNECT tunnel: a bidirectional byte stream multiplexed with
// others on a shared TLS connection. It implements net.Conn, CloseWrite for
// half-close, and io.WriterTo / io.ReaderFrom so that io.Copy and Relay move
// bytes between a stream and a socket without an intermediate buffer.
//
// Deadlines interrupt waiting for data or for flow-control window; a write
// already handed to the TLS connection completes on the connection's terms.
type Stream struct {
	c  *conn
	id uint32
	// Server: ctx is what the Handler works with; it ends when the stream
	// is reset, closed or its conn dies, so a reset cancels the handler's
	// dial. answered: the response went out (a later reset is not early).
	ctx      context.Context
	cancel   context.CancelFunc
	answered atomic.Bool

	// Receive side and state, guarded by mu.
	mu          sync.Mutex
	rcond       sync.Cond
	buf         recvBuf
	recvWindow  int64 // what the peer may still send on this stream
	recvUnacked int64
	remoteEnded bool // END_STREAM received
	peerReset   bool // RST_STREAM received
	localEnded  bool // END_STREAM sent (also written under wmu)
	// endCommitted: our END_STREAM is being written (set before the
	// write, under wmu): with remoteEnded, the stream no longer counts
	// toward the peer's concurrent streams (conn.uncount).
	endCommitted bool
	// uncounted: the stream no longer counts in conn.active. Guarded by
	// the conn's mu.
	uncounted bool
	err       error // reset or connection failure
	closed    bool  // Close called
	// onAbort runs once when the stream fails (closeOnAbort), told whether
	// received bytes wait for delivery.
	onAbort  func(pending bool)
	draining bool // WriteTo, or the reader delivering, holds the sink or a slice of buf outside mu
	// sink is the socket WriteTo writes to, when the connection's reader
	// may write into it directly; delivered counts what it wrote there
	// (deliver.go).
	sink *rawSock
	// sinkMoved, set with sink, is the relay's count (Counts) of the
	// bytes written to it, which the reader's deliveries add to as well.
	sinkMoved *atomic.Int64
	// deliveredAt is when the reader last delivered a whole small frame to
	// the app (0: answered since), answersFast whether the app answered the
	// delivery before it soon enough for reply polling (replypoll.go).
	deliveredAt  atomic.Int64
	answersFast  atomic.Bool
	delivered    int64
	readDeadline time.Time
	readTimer    *time.Timer
	earlySent    bool // client: Request.EarlyData went out with the request

	// deliveredRead is the connection's socket read (readCount) in which
	// the reader last delivered to this stream: a tiny frame only once per
	// read (deliver.go).
	deliveredRead uint64
	// Client: the response, signalled by closing respc.
	respc       chan struct{}
	respDone    bool
	gotResponse bool
	interim     int // informational (1xx) responses read
	status      int
	reason      string

	// wmu makes one writer at a time frame its bytes, so a Write's frames
	// stay in order and END_STREAM comes last.
	wmu sync.Mutex
	// Guarded by c.mu, next to the connection's own send window. The
	// writer waits on sendCond (L is &c.mu): for this stream's window, or,
	// queued in c.connWaiters (connQueued), for the connection's.
	sendCond      sync.Cond
	connQueued    bool
	sendWindow    int64
	sendErr       error
	writeDeadline time.Time
	writeTimer    *time.Timer
}

func newStream(c *conn, id uint32) *Stream {
	s := &Stream{c: c, id: id, recvWindow: c.streamTarget}
	s.rcond.L = &s.mu
	s.sendCond.L = &c.mu
	if c.cfg.client {
		s.respc = make(chan struct{})
	} else {
		s.ctx, s.cancel = context.WithCancel(c.ctx)
	}
	return s
}

// closeRespLocked wakes a client waiting for the response.
func (s *Stream) closeRespLocked() {
	if s.respc != nil && !s.respDone {
		s.respDone = true
		close(s.respc)
	}
}

// onData stores a DATA frame's payload, given as small (copied into the
// buffer) and/or chunks (filled by readPayload, linked in without a copy);
// n is the frame's flow-controlled length. While WriteTo waits with nothing
// queued, the reader writes the payload into the sink itself (deliver.go).
func (s *Stream) onData(small []byte, chunks []chunk, n int64, end bool) error {
	s.mu.Lock()
	var serr http2.StreamError
	switch {
	case s.remoteEnded:
		// Frames after the peer's END_STREAM (RFC 9113 §5.1).
		s.mu.Unlock()
		recycleChunks(chunks)
		s.c.credit(0, 0, n)
		return http2.ConnectionError(http2.ErrCodeStreamClosed)
	case s.respc != nil && !s.gotResponse:
		serr = http2.StreamError{Code: http2.ErrCodeProtocol, Cause: errors.New("DATA before the response")}
	case n > s.recvWindow:
		serr = http2.StreamError{Code: http2.ErrCodeFlowControl, Cause: fmt.Errorf("DATA of %d bytes beyond the stream's receive window of %d", n, s.recvWindow)}
	}
	if serr.Code != http2.ErrCodeNo {
		s.mu.Unlock()
		recycleChunks(chunks)
		s.c.credit(0, 0, n)
		serr.StreamID = s.id
		return serr
	}
	s.recvWindow -= n
	stored := int64(len(small))
	for _, c := range chunks {
		stored += int64(c.w)
	}
	consumed := n - stored // padding is consumed on arrival
	read := s.c.readCount()
	if stored > 0 && stored <= bulkFrameSize && !s.closed && s.sink != nil && !s.draining && s.buf.n == 0 && s.readDeadline.IsZero() &&
		(stored >= tinyFrame || read == 0 || read != s.deliveredRead) {
		s.deliveredRead = read
		var wrote int
		sink := s.sink
		small, chunks, wrote = s.deliverLocked(small, chunks)
		consumed += int64(wrote)
		if len(small) == 0 && len(chunks) == 0 && stored <= replyPollMaxFrame {
			s.c.armReplyPoll(s, sink.fd)
		}
	}
	if s.closed { // before, or while the reader delivered
		consumed = n
		recycleChunks(chunks)
	} else {
		s.buf.write(small)
		for _, c := range chunks {
			s.buf.add(c)
		}
	}
	if end {
		s.remoteEnded = true
	}
	if s.buf.n > 0 || s.remoteEnded {
		s.rcond.Broadcast() // else everything was delivered: WriteTo sleeps on
	}
	inc := s.consumedLocked(consumed)
	done := s.remoteEnded && s.localEnded
	uncount := end && s.endCommitted && !done
	s.mu.Unlock()
	if consumed > 0 {
		s.c.credit(s.id, inc, consumed)
	}
	if done {
		s.c.forget(s)
	} else if uncount {
		s.c.uncount(s)
	}
	return nil
}

// onHeaders handles the response (client) or trailers on an open stream.
func (s *Stream) onHeaders(f *http2.MetaHeadersFrame) error {
	protoErr := func(format string, args ...any) error {
		return http2.StreamError{StreamID: s.id, Code: http2.ErrCodeProtocol, Cause: fmt.Errorf(format, args...)}
	}
	s.mu.Lock()
	if s.remoteEnded {
		s.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeStreamClosed) // frames after the peer's END_STREAM (§5.1)
	}
	if s.respc != nil && !s.gotResponse {
		if f.Truncated {
			// x/net's framer dropped the fields past our
			// SETTINGS_MAX_HEADER_LIST_SIZE: what is left is not the
			// server's answer (x/net's client refuses it too).
			s.mu.Unlock()
			return protoErr("response header list larger than SETTINGS_MAX_HEADER_LIST_SIZE (%d bytes)", maxHeaderListSize)
		}
		raw := f.PseudoValue("status")
		status, err := strconv.Atoi(raw)
		if err != nil || len(raw) != 3 || status < 100 {
			s.mu.Unlock()
			return protoErr("response :status %.16q is not a 3-digit code", raw)
		}
		if status < 200 { // interim response: wait for the final one
			s.interim++
			n := s.interim
			s.mu.Unlock()
			switch {
			case f.StreamEnded():
				return protoErr("informational (%d) response ends the stream", status)
			case n > maxInterimResponses:
				// A server that sends them without end would keep us
				// decoding headers, for nothing, until the connect timeout.
				return protoErr("more than %d informational (1xx) responses", maxInterimResponses)
			}
			return nil
		}
		s.gotResponse = true
		s.status = status
		for _, hf := range f.RegularFields() {
			if hf.Name == ReasonHeader {
				s.reason = hf.Value
			}
		}
		s.closeRespLocked()
	} else if !f.StreamEnded() {
		s.mu.Unlock()
		return protoErr("HEADERS after the response without END_STREAM (trailers must end the stream)")
	}
	if f.StreamEnded() {
		s.remoteEnded = true
		s.rcond.Broadcast()
	}
	done := s.remoteEnded && s.localEnded
	uncount := s.remoteEnded && s.endCommitted && !done
	s.mu.Unlock()
	if done {
		s.c.forget(s)
	} else if uncount {
		s.c.uncount(s)
	}
	return nil
}

// abort fails both directions of the stream with err and forgets it. A
// server stream still waiting in the handler queue is closed too (releaseQueued):
// nobody else would give its buffered bytes back to the connection window.
// The handler's context is cancelled only once both directions carry err: a
// handler that wakes on it and answers must find the stream failed, or its
// response HEADERS would go out ahead of the RST_STREAM queued for it.
func (s *Stream) abort(err error) {
	s.mu.Lock()
	if s.err == nil {
		s.err = err
	}
	s.closeRespLocked()
	s.rcond.Broadcast()
	onAbort := s.onAbort
	s.onAbort = nil
	pending := s.buf.n > 0 || s.draining
	s.mu.Unlock()
	if onAbort != nil {
		onAbort(pending)
	}
	c := s.c
	c.mu.Lock()
	if s.sendErr == nil {
		s.sendErr = err
	}
	s.sendCond.Broadcast()
	c.mu.Unlock()
	if s.cancel != nil {
		s.cancel()
	}
	c.forget(s)
	if !c.cfg.client {
		c.releaseQueued(s)
	}
}

// closeOnAbort closes c when the stream fails (reset by either side, or
// its connection closed), at once if it failed already; stop undoes it.
// Relay uses it for the socket on the stream's other side: its copies
// block on that socket too (a write to an application that reads nothing,
// a read from one that sends nothing), where the stream's failure never
// reaches them, and the relay, with its socket, goroutines and the
// server's handler slot, outlived the stream for as long as the
// application lived (a forced Shutdown waited for it for ever). What the
// stream received before it failed is still delivered (WriteTo reads the
// buffer before the error): with some left, c is closed only after
// abortDeliverGrace, which a relay whose application reads it ends first.
func (s *Stream) closeOnAbort(c io.Closer) (stop func()) {
	var (
		mu    sync.Mutex
		timer *time.Timer
		done  bool
	)
	closeNow := func() { _ = c.Close() }
	s.mu.Lock()
	if s.err != nil {
		pending := s.buf.n > 0 || s.draining
		s.mu.Unlock()
		if !pending {
			closeNow()
			return func() {}
		}
		t := time.AfterFunc(abortDeliverGrace, closeNow)
		return func() { t.Stop() }
	}
	s.onAbort = func(pending bool) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case done:
		case pending:
			timer = time.AfterFunc(abortDeliverGrace, closeNow)
		default:
			closeNow()
		}
	}
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		s.onAbort = nil
		s.mu.Unlock()
		mu.Lock()
		done = true
		if timer != nil {
			timer.Stop()
		}
		mu.Unlock()
	}
}

// abortDeliverGrace is how long a relay whose stream failed may take to
// deliver what the stream received before, before closeOnAbort closes its
// socket.
const abortDeliverGrace = time.Second

// consumedLocked accounts n bytes taken by the application and returns the
// stream WINDOW_UPDATE increment to send, if the threshold was reached.
func (s *Stream) consumedLocked(n int64) uint32 {
	if n == 0 || s.remoteEnded || s.closed {
		return 0
	}
	s.recvUnacked += n
	if s.recvUnacked < s.c.streamTarget/4 {
		return 0
	}
	inc := s.recvUnacked
	s.recvWindow += inc
	s.recvUnacked = 0
	return uint32(inc)
}

// waitLocked waits for buffered data; it returns io.EOF once the peer ended
// the stream and everything was read.
func (s *Stream) waitLocked() error {
	for s.buf.n == 0 {
		switch {
		case s.closed:
			return net.ErrClosed
		case s.remoteEnded:
			return io.EOF
		case s.err != nil:
			return s.err
		case !s.readDeadline.IsZero() && !time.Now().Before(s.readDeadline):
			return os.ErrDeadlineExceeded
		}
		s.rcond.Wait()
	}
	return nil
}

// Read reads tunnelled bytes; io.EOF means the peer half-closed.
func (s *Stream) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	s.mu.Lock()
	if err := s.waitLocked(); err != nil {
		s.mu.Unlock()
		return 0, err
	}
	n := s.buf.read(p)
	inc := s.consumedLocked(int64(n))
	s.mu.Unlock()
	s.c.credit(s.id, inc, int64(n))
	return n, nil
}

// WriteTo writes the stream's bytes to w straight from the receive buffer
// until the peer half-closes (returning nil) or an error.
//
// While it waits with nothing buffered, the connection's reader may write
// arriving bytes into w itself (deliver.go); they count in the total.
func (s *Stream) WriteTo(w io.Writer) (total int64, err error) { return s.writeTo(w, nil) }

// writeTo is WriteTo adding what it and the reader write to moved, if not
// nil, as they write it.
func (s *Stream) writeTo(w io.Writer, moved *atomic.Int64) (total int64, err error) {
	s.mu.Lock()
	s.sink, s.sinkMoved, s.delivered = rawSink(w), moved, 0
	write := w.Write
	if s.sink != nil { // the same write(2)s, without the runtime's bookkeeping (rawio.go)
		write = s.sink.Write
	}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.sink, s.sinkMoved = nil, nil
		for s.draining { // the reader is delivering: count what it wrote
			s.rcond.Wait()
		}
		total += s.delivered
		s.delivered = 0
		s.mu.Unlock()
	}()
	for {
		s.mu.Lock()
		if err := s.waitLocked(); err != nil {
			s.mu.Unlock()
			if err == io.EOF {
				return total, nil
			}
			return total, err
		}
		p := s.buf.peek()
		s.draining = true
		s.mu.Unlock()

		n, werr := write(p)
		addMoved(moved, n)

		s.mu.Lock()
		s.draining = false
		if s.closed { // Close dropped the buffer while we wrote from it
			s.mu.Unlock()
			if werr == nil {
				werr = net.ErrClosed
			}
			return total + int64(n), werr
		}
		s.buf.advance(n, true)
		inc := s.consumedLocked(int64(n))
		s.mu.Unlock()
		s.c.credit(s.id, inc, int64(n))
		total += int64(n)
		if werr != nil {
			return total, werr
		}
	}
}

// Write sends p as DATA frames, waiting for flow-control window as needed.
func (s *Stream) Write(p []byte) (int, error) {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	bp := frameBufPool.Get().(*[]byte)
	defer frameBufPool.Put(bp)
	buf := *bp
	written := 0
	for len(p) > 0 {
		k := copy(buf[frameHeaderLen:], p)
		n, err := s.sendLocked(buf, k)
		written += n
		if err != nil {
			return written, err
		}
		p = p[k:]
	}
	return written, nil
}

// ReadFrom sends everything r yields until io.EOF (returning nil), reading
// straight into frame buffers. It does not half-close the stream.
//
// A socket is read only once it is readable, into a pooled buffer taken for
// that read, so an idle tunnel holds no buffer at all. Other readers get a
// small buffer to wait with and a full frame buffer during bursts.
func (s *Stream) ReadFrom(r io.Reader) (int64, error) { return s.readFrom(r, nil) }

// readFrom is ReadFrom adding what it sends to moved, if not nil, as it
// sends it.
func (s *Stream) readFrom(r io.Reader, moved *atomic.Int64) (int64, error) {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if sc, ok := r.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			obs, _ := r.(readObserver)
			return s.readFromSocket(rc, obs, moved)
		}
	}
	small := smallBufPool.Get().(*[]byte)
	defer smallBufPool.Put(small)
	var big *[]byte
	defer func() {
		if big != nil {
			frameBufPool.Put(big)
		}
	}()
	buf := *small
	var total int64
	for {
		n, rerr := r.Read(buf[frameHeaderLen:])
		if n > 0 {
			sent, err := s.sendLocked(buf, n)
			total += int64(sent)
			addMoved(moved, sent)
			if err != nil {
				return total, err
			}
		}
		if rerr == io.EOF {
			return total, nil
		}
		if rerr != nil {
			return total, rerr
		}
		switch {
		case big == nil && n == len(buf)-frameHeaderLen: // a burst: more is waiting
			big = frameBufPool.Get().(*[]byte)
			buf = *big
		case big != nil && n < smallBufSize-frameHeaderLen: // the burst is over
			frameBufPool.Put(big)
			big = nil
			buf = *small
		}
	}
}

// readObserver is a socket that wants to know what ReadFrom read from it
// through its file descriptor (accel.Conn, for the sockops budget).
type readObserver interface{ ObserveRead(n int) }

// readFromSocket is ReadFrom for a socket: each read takes a frame buffer
// from the pool and gives it back if the socket has nothing (EAGAIN) before
// waiting, so buffers are held only while bytes are in flight. A read that
// fills its buffer means a burst: the next reads take a bulk frame buffer if
// the budget has one and the send window has room for more than an ordinary
// frame, and read no more than that room, so a stream waits for window with
// an ordinary buffer, never a bulk one (bulkbuf.go). obs, if not nil, is
// told of every read, and moved, if not nil, of every send.
func (s *Stream) readFromSocket(rc syscall.RawConn, obs readObserver, moved *atomic.Int64) (int64, error) {
	var (
		total  int64
		bp     *[]byte
		bulk   bool // bp is from bulkFrames
		burst  bool // the last read filled its buffer
		denied bool // this burst asked the budget in vain: do not ask again before the next
		n      int
		rerr   error
	)
	release := func() {
		if bulk {
			bulkFrames.put(s.c.peer, bp)
		} else {
			frameBufPool.Put(bp)
		}
		bp, bulk = nil, false
	}
	read := func(fd uintptr) bool {
		room := 0
		if burst {
			room = s.sendRoom()
			if bulk && room < frameBufSize {
				release() // the window is nearly spent: wait for it with an ordinary buffer
			}
			if bp == nil && !denied && room >= frameBufSize {
				bp = bulkFrames.get(s.c.peer)
				bulk, denied = bp != nil, bp == nil
			}
		}
		if bp == nil {
			bp = frameBufPool.Get().(*[]byte)
		}
		buf := (*bp)[frameHeaderLen:]
		if bulk {
			buf = buf[:min(len(buf), room)]
		}
		for {
			n, rerr = sockRead(fd, buf)
			if rerr != syscall.EINTR {
				break
			}
		}
		if rerr == syscall.EAGAIN {
			release()
			burst, denied = false, false
			return false // wait for the socket to become readable
		}
		return true
	}
	defer func() {
		if bp != nil {
			release()
		}
	}()
	for {
		if err := rc.Read(read); err != nil {
			return total, err
		}
		switch {
		case rerr != nil:
			return total, os.NewSyscallError("read", rerr)
		case n == 0:
			return total, nil // EOF
		}
		if obs != nil {
			obs.ObserveRead(n)
		}
		s.noteAnswer()
		sent, err := s.sendLocked(*bp, n)
		total += int64(sent)
		addMoved(moved, sent)
		if err != nil {
			return total, err
		}
		if !bulk && n == len(*bp)-frameHeaderLen {
			burst = true
			release() // the next read may take a bulk buffer
		}
	}
}

// sendRoom is the send window open to s now: its own and its connection's,
// whichever is smaller.
func (s *Stream) sendRoom() int {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	return int(max(min(s.sendWindow, c.sendWindow), 0))
}

// sendLocked sends buf[9:9+n] as one or more DATA frames, writing each
// frame header in place just before its payload. The caller holds wmu.
func (s *Stream) sendLocked(buf []byte, n int) (int, error) {
	if s.localEnded {
		return 0, errWriteAfterCloseWrite
	}
	off := 0
	for off < n {
		k, err := s.awaitSendWindow(n - off)
		if err != nil {
			return off, err
		}
		if err := s.c.writeData(buf[off:off+frameHeaderLen+k], s.id, false); err != nil {
			return off, err
		}
		off += k
	}
	return n, nil
}

// awaitSendWindow reserves up to want bytes of stream and connection send
// window, at most one frame's worth. A writer whose stream has window but
// whose connection has none queues for the connection's; whatever it
// leaves with, it hands what is left of that window to the next in line.
func (s *Stream) awaitSendWindow(want int) (int, error) {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	defer c.passConnWindowLocked()
	defer c.leaveConnQueueLocked(s)
	for {
		switch {
		case s.sendErr != nil:
			return 0, s.sendErr
		case c.err != nil:
			return 0, c.err
		case !s.writeDeadline.IsZero() && !time.Now().Before(s.writeDeadline):
			return 0, os.ErrDeadlineExceeded
		case s.sendWindow <= 0:
			// Woken by this stream's WINDOW_UPDATE; no place in the
			// connection's queue meanwhile.
			c.leaveConnQueueLocked(s)
			c.passConnWindowLocked()
		case c.sendWindow <= 0 || c.acksPending > 0:
			if !s.connQueued {
				s.connQueued = true
				c.connWaiters = append(c.connWaiters, s)
			}
		default:
			k := min(int64(want), s.sendWindow, c.sendWindow, int64(c.peerMaxFrame.Load()))
			s.sendWindow -= k
			c.sendWindow -= k
			return int(k), nil
		}
		c.sendWaiting++
		s.sendCond.Wait()
		c.sendWaiting--
		c.sendWakes++
	}
}

// passConnWindowLocked wakes the writer that has waited longest for the
// connection's send window, if there is window and DATA may go out. The
// woken writer passes on what it leaves, so a grant wakes the writers it
// can feed, one after another, not every stream's (a peer granting a byte
// at a time would otherwise buy a wake-up per open stream for each).
func (c *conn) passConnWindowLocked() {
	if c.sendWindow <= 0 || c.acksPending > 0 || len(c.connWaiters) == 0 {
		return
	}
	s := c.connWaiters[0]
	c.connWaiters[0] = nil
	c.connWaiters = c.connWaiters[1:]
	s.connQueued = false
	s.sendCond.Broadcast()
}

// leaveConnQueueLocked takes s out of the connection's queue for window.
func (c *conn) leaveConnQueueLocked(s *Stream) {
	if s.connQueued {
		s.connQueued = false
		c.connWaiters = slices.DeleteFunc(c.connWaiters, func(w *Stream) bool { return w == s })
	}
}

// sendErrNow reports why the stream can no longer send, if it cannot.
func (s *Stream) sendErrNow() error {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	if s.sendErr != nil {
		return s.sendErr
	}
	return s.c.err
}

// CloseWrite half-closes the stream: the peer reads EOF (END_STREAM) while
// this side can still read. It waits for a concurrent Write or ReadFrom.
func (s *Stream) CloseWrite() error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if s.localEnded {
		return nil
	}
	if err := s.sendErrNow(); err != nil {
		return err
	}
	var hdr [frameHeaderLen]byte
	s.commitEnd()
	if err := s.c.writeData(hdr[:], s.id, true); err != nil {
		return err
	}
	s.endLocal()
	return nil
}

// commitEnd records, before our END_STREAM is written, that it will be: a
// stream the peer ended already stops counting toward its concurrent
// streams now (conn.uncount), not once the write returned. The peer may
// open a new stream as soon as it reads that END_STREAM, and its HEADERS,
// read on the reader goroutine while this one still returned from the write,
// were refused (REFUSED_STREAM) for a limit the peer kept. The caller holds
// wmu.
func (s *Stream) commitEnd() {
	s.mu.Lock()
	s.endCommitted = true
	uncount := s.remoteEnded
	s.mu.Unlock()
	if uncount {
		s.c.uncount(s)
	}
}

// endLocal records that END_STREAM was sent. The caller holds wmu.
func (s *Stream) endLocal() {
	s.mu.Lock()
	s.localEnded = true
	done := s.remoteEnded
	s.mu.Unlock()
	if done {
		s.c.forget(s)
	}
}

// writeResponse sends the server's response HEADERS.
func (s *Stream) writeResponse(status int, reason string, end bool) error {
	fields := []hpack.HeaderField{{Name: ":status", Value: strconv.Itoa(status)}}
	if reason != "" {
		fields = append(fields,
			hpack.HeaderField{Name: ReasonHeader, Value: reason},
			hpack.HeaderField{Name: "content-type", Value: "text/plain; charset=utf-8"})
	}
	if status == 405 {
		fields = append(fields, hpack.HeaderField{Name: "allow", Value: "CONNECT"})
	}
	s.answered.Store(true)
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if err := s.sendErrNow(); err != nil {
		return err
	}
	c := s.c
	if end {
		s.commitEnd()
	}
	c.lockWrite()
	err := c.writeHeadersLocked(s.id, fields, end)
	if err == nil {
		err = c.bw.Flush()
	}
	c.unlockWrite()
	if err != nil {
		c.close(http2.ErrCodeNo, fmt.Errorf("write response: %w", err), false)
		return fmt.Errorf("%w: %w", ErrConnClosed, err)
	}
	if end {
		s.endLocal()
	}
	return nil
}

// Close ends the stream in both directions. Unless both sides had already
// ended it cleanly, the peer gets RST_STREAM(CANCEL). Unread data is
// discarded.
func (s *Stream) Close() error {
	s.closeWithCode(http2.ErrCodeCancel)
	return nil
}

func (s *Stream) closeWithCode(code http2.ErrCode) {
	if s.cancel != nil {
		s.cancel()
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	reset := s.err == nil && !(s.localEnded && s.remoteEnded)
	unread := int64(s.buf.n)
	s.buf.release(!s.draining)
	s.closeRespLocked()
	s.rcond.Broadcast()
	if s.readTimer != nil {
		s.readTimer.Stop()
	}
	s.mu.Unlock()

	c := s.c
	c.mu.Lock()
	if s.sendErr == nil {
		s.sendErr = net.ErrClosed
	}
	if s.writeTimer != nil {
		s.writeTimer.Stop()
	}
	s.sendCond.Broadcast()
	c.mu.Unlock()
	// Forgotten before the reset is sent: a peer that answers the reset
	// at once must find the stream closed by us (frames then are junk it
	// pays for), not still half-closed by its own END_STREAM. (sendReset
	// forgets a client's stream.)
	switch {
	case !reset:
		c.forget(s)
	case c.cfg.client:
		c.sendReset(s, s.id, code)
	default:
		c.forgetAndReset(s, code)
	}
	if unread > 0 {
		c.credit(0, 0, unread)
	}
}

// LocalAddr is the local address of the underlying TLS connection.
func (s *Stream) LocalAddr() net.Addr { return s.c.nc.LocalAddr() }

// RemoteAddr is the remote address of the underlying TLS connection.
func (s *Stream) RemoteAddr() net.Addr { return s.c.nc.RemoteAddr() }

// SetDeadline sets both the read and the write deadline.
func (s *Stream) SetDeadline(t time.Time) error {
	_ = s.SetReadDeadline(t)
	return s.SetWriteDeadline(t)
}

// SetReadDeadline bounds waiting in Read and WriteTo.
func (s *Stream) SetReadDeadline(t time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.readDeadline = t
	s.readTimer = armTimer(s.readTimer, t, func() {
		s.mu.Lock()
		s.rcond.Broadcast()
		s.mu.Unlock()
	})
	s.rcond.Broadcast()
	return nil
}

// SetWriteDeadline bounds waiting for flow-control window in Write and
// ReadFrom.
func (s *Stream) SetWriteDeadline(t time.Time) error {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	s.writeDeadline = t
	s.writeTimer = armTimer(s.writeTimer, t, func() {
		c.mu.Lock()
		s.sendCond.Broadcast()
		c.mu.Unlock()
	})
	s.sendCond.Broadcast()
	return nil
}

// armTimer (re)arms t to run f at at, or stops it for a zero time.
func armTimer(t *time.Timer, at time.Time, f func()) *time.Timer {
	if at.IsZero() {
		if t != nil {
			t.Stop()
		}
		return t
	}
	if t == nil {
		return time.AfterFunc(time.Until(at), f)
	}
	t.Reset(time.Until(at))
	return t
}

var _ net.Conn = (*Stream)(nil)
