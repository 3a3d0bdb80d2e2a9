package hbone

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"golang.org/x/sys/unix"
)

// HTTP/2 settings this package advertises, and related limits.
const (
	// streamWindow is the receive window granted to each stream. It is large
	// so that one stream can fill a fast link without stalling on
	// WINDOW_UPDATE round trips; memory is only spent on bytes the
	// application has not read yet.
	streamWindow = 4 << 20
	// connWindow bounds what all streams of a connection may have buffered
	// but unread together, when the process-wide budget holds it
	// (windowbudget.go).
	connWindow = 16 << 20
	// maxReadFrameSize lets peers send large DATA frames: fewer frame
	// headers and reads per byte.
	maxReadFrameSize = 1 << 20
	// maxHeaderListSize bounds a decoded header block. A CONNECT request
	// needs a few hundred bytes.
	maxHeaderListSize = 16 << 10
	// frameBufSize is the size of the buffers DATA frames are built in. A
	// full frame (9-byte header and payload) fills exactly four 16 KiB TLS
	// records, so the TLS layer never emits a runt record after each frame.
	frameBufSize = 64 << 10

	// directReadMin is the DATA payload size from which the reader reads
	// straight into fresh receive-buffer chunks (one copy less per byte);
	// half a chunk, so such chunks are at least half full.
	directReadMin = chunkSize / 2

	// coalesceSize is the write buffer that frames of concurrent writers
	// share: one TLS record's worth of plaintext.
	coalesceSize = 16 << 10

	frameHeaderLen     = 9
	maxTLSRecord       = 16384 // plaintext bytes in one TLS record
	defaultWindow      = 65535 // RFC 9113 initial window
	defaultMaxFrame    = 16384 // RFC 9113 initial SETTINGS_MAX_FRAME_SIZE
	maxWindow          = 1<<31 - 1
	maxStreamID        = 1<<31 - 1
	maxQueuedControl   = 4096 // more pending control frames than this is a flood
	maxKeptControl     = 64   // room for control frames the control writer keeps between batches
	closeWriteDeadline = time.Second

	// floodPeriod is the period of the flood budgets: a peer gets the
	// burst of a budget at once and the same again per period.
	floodPeriod = 10 * time.Second
	// junkBurst is the budget of frames that cost us work and carry no
	// stream data (CVE-2019-9512/9515/9518 class: PING and SETTINGS that
	// must be answered, empty DATA, PRIORITY, unknown frame types, frames
	// for closed streams): about 100 a second sustained.
	junkBurst = 1000
	// pendingPerStream bounds queued handlers, as x/net's scheduleHandler:
	// up to this many times the stream limit may wait for a running
	// handler to finish; more means streams are reset faster than their
	// handlers end (CVE-2023-44487).
	pendingPerStream = 4
	// maxSettingsPerFrame bounds the settings in one SETTINGS frame; there
	// are 7 kinds, and honest peers send each once.
	maxSettingsPerFrame = 32
)

// maxHeaderBlockBytes bounds the bytes one header block may take on the
// wire, frame headers included: x/net's framer bounds the decoded size, but
// not a stream of empty CONTINUATION frames (CVE-2024-28182 class). An
// honest block is at most maxHeaderListSize plus a few frame headers.
const maxHeaderBlockBytes = 8 * maxHeaderListSize

// maxHeaderFrame bounds a CONTINUATION frame: a header block within
// maxHeaderListSize (HPACK encodes no field longer than it counts decoded),
// and its padding. The framer reads those frames of a block on its own,
// into a buffer of the declared size (checkFrameLength).
const maxHeaderFrame = maxHeaderListSize + 512

var errHeaderBlockTooLong = errors.New("header block too long")

// readBufKeep is the most a connection's read framer may keep as its read
// buffer between frames. x/net's Framer keeps a buffer the size of the
// largest frame it ever read; DATA bypasses it, and every other frame an
// honest peer sends fits in HTTP/2's default 16 KiB, but a peer may send any
// frame up to our SETTINGS_MAX_FRAME_SIZE (1 MiB): an unknown type, GOAWAY
// with a long debug text, a padded HEADERS.
const readBufKeep = defaultMaxFrame

// blockReader is the reader under the framer. While left is not negative
// (during a header block), it lets at most left more bytes through. read
// counts every byte it let through.
type blockReader struct {
	r    io.Reader
	left int64
	read int64
	// pre, when not empty, is read before r: a frame's payload read ahead
	// (conn.prefetch).
	pre []byte
}

func (b *blockReader) Read(p []byte) (n int, err error) {
	if b.left == 0 {
		return 0, errHeaderBlockTooLong
	}
	if b.left > 0 && int64(len(p)) > b.left {
		p = p[:b.left]
	}
	if len(b.pre) > 0 {
		n = copy(p, b.pre)
		b.pre = b.pre[n:]
	} else {
		n, err = b.r.Read(p)
	}
	if b.left > 0 {
		b.left -= int64(n)
	}
	b.read += int64(n)
	return n, err
}

// peerError explains a connection error (an http2.ConnectionError) the peer
// caused, for our GOAWAY's debug data.
type peerError struct {
	reason string
	err    error
}

func (e *peerError) Error() string { return e.reason + ": " + e.err.Error() }
func (e *peerError) Unwrap() error { return e.err }

// headerBlockReason says why x/net's framer refused a header block with ce
// and no detail of its own.
func headerBlockReason(ce http2.ConnectionError) string {
	if http2.ErrCode(ce) == http2.ErrCodeCompression {
		return fmt.Sprintf("header block not decoded: a field over SETTINGS_MAX_HEADER_LIST_SIZE (%d bytes), or invalid HPACK", maxHeaderListSize)
	}
	return fmt.Sprintf("header block refused: far over SETTINGS_MAX_HEADER_LIST_SIZE (%d bytes), or a CONTINUATION after an invalid field", maxHeaderListSize)
}

// peerErrorReason is the debug data of the GOAWAY closing a connection for
// err, a connection error the peer caused; "" for other errors. The texts
// are this package's or x/net's framer's own (fr.ErrorDetail), which name
// no local detail.
func peerErrorReason(err error, fr *http2.Framer) string {
	var fe *floodError
	var pe *peerError
	var ce http2.ConnectionError
	reason := ""
	switch {
	case errors.As(err, &fe):
		reason = fe.reason
	case errors.As(err, &pe):
		reason = pe.reason
	case errors.As(err, &ce):
		if d := fr.ErrorDetail(); d != nil {
			reason = d.Error()
		}
	case errors.Is(err, http2.ErrFrameTooLarge):
		reason = fmt.Sprintf("frame larger than SETTINGS_MAX_FRAME_SIZE (%d bytes)", maxReadFrameSize)
	}
	return sanitizeReason(reason)
}

// floodError is a connection error for a peer that abuses the protocol
// without breaking it: the conn goes with GOAWAY ENHANCE_YOUR_CALM.
type floodError struct{ reason string }

func (e *floodError) Error() string { return "peer floods: " + e.reason }

// smallBufSize is the frame buffer a Stream.ReadFrom waits with.
const smallBufSize = 4 << 10

// Buffers for building DATA frames in place.
var (
	frameBufPool = sync.Pool{New: func() any {
		b := make([]byte, frameBufSize)
		return &b
	}}
	smallBufPool = sync.Pool{New: func() any {
		b := make([]byte, smallBufSize)
		return &b
	}}
)

// connConfig is what the owner (Pool or Server) tells a conn.
type connConfig struct {
	client      bool
	batch       *batchConn    // under TLS: gathers a DATA frame's records into one write; nil: none
	maxStreams  uint32        // server: SETTINGS_MAX_CONCURRENT_STREAMS we enforce
	idleTimeout time.Duration // 0: never idle-close
	log         *slog.Logger
	// onIdle runs on a timer goroutine when the conn had no streams for
	// idleTimeout. It must re-check idleness (idleForLocked).
	onIdle func(*conn)
	// onClose runs once, after the conn died and its streams were failed.
	onClose func(*conn)
	// onReady (client) runs once, when the peer's first SETTINGS arrived or
	// the conn died before that.
	onReady func(*conn)
	// onRequest (server) is called on the reader goroutine for each new
	// stream; it must not block. An error is a connection error.
	onRequest func(*Stream, *http2.MetaHeadersFrame) error
	// onRefused (server) counts streams refused for lack of capacity.
	onRefused func()
	// checkPresented (server) runs on the reader, without c.mu, for each
	// new stream before it is accepted, while c takes new streams: it
	// drains c if the certificate c presented is no longer current
	// (presented.go).
	checkPresented func()
	// prefaceTimeout (server) bounds the wait for the client preface and
	// the SETTINGS frame that must follow it; onPreface (server) runs on
	// the reader once that SETTINGS frame was read.
	prefaceTimeout time.Duration
	onPreface      func()
	// maxEarlyResets (server) is the budget of streams the peer may reset
	// before they were answered, per floodPeriod.
	maxEarlyResets int
	// onEarlyReset (server) counts such resets and takes each from the
	// budget of the peer's address, over all its connections: false when
	// that is spent, a flood. onFlood counts conns closed with
	// ENHANCE_YOUR_CALM.
	onEarlyReset func() bool
	onFlood      func()
	// onProtocolError counts conns closed because the peer broke HTTP/2
	// (our GOAWAY carries PROTOCOL_ERROR, FLOW_CONTROL_ERROR,
	// FRAME_SIZE_ERROR, ...).
	onProtocolError func()
	// onZeroStreamLimit (client) counts conns drained because the server
	// set SETTINGS_MAX_CONCURRENT_STREAMS to 0.
	onZeroStreamLimit func()
	// pingInterval and pingTimeout (client) enable keepalive: a PING when
	// nothing arrived for pingInterval, and the conn closes when nothing,
	// not even the PING's ack, arrived pingTimeout after it.
	pingInterval, pingTimeout time.Duration
	// writeStallTimeout (server; 0: none) closes the conn when one write
	// to the peer made no progress for that long, at most half as long
	// again (checkWriteStall); onWriteStall counts such closes.
	writeStallTimeout time.Duration
	onWriteStall      func()
}

// ctlFrame is a control frame queued for the control writer goroutine.
type ctlFrame struct {
	typ  http2.FrameType
	id   uint32
	val  uint32 // WINDOW_UPDATE increment, error code, or 1 for a PING to send (not an ack)
	ping [8]byte
	// release: the client stream this RST_STREAM resets still counts
	// toward the server's limit until the frame is written (forgetUntilSent).
	release *Stream
}

// pendingStream is a request whose handler waits for a free handler slot.
type pendingStream struct {
	s         *Stream
	fields    []hpack.HeaderField
	truncated bool
}

// conn is one HTTP/2 connection carrying CONNECT streams, client or server.
//
// Goroutines: one reader (readLoop) decodes frames and never blocks on the
// network write side, so two peers writing to each other cannot deadlock;
// one control writer sends the frames the reader and readers of stream data
// produce (SETTINGS/PING acks, WINDOW_UPDATE, RST_STREAM); DATA and HEADERS
// are written by the goroutine that calls Stream.Write.
//
// Lock order: Pool.mu, Stream.wmu, Stream.mu, conn.wmu, conn.mu; conn.mu
// is never held while taking another lock, and the owner's callbacks run
// without conn locks.
type conn struct {
	cfg      connConfig
	nc       net.Conn
	tlsState *tls.ConnectionState
	// fr writes frames (under wmu); rfr, the reader's own, reads them and
	// is replaced after a frame too large to keep its buffer for
	// (renewReadFramer). hdec is rfr's HPACK decoder, whose dynamic table
	// outlives each rfr.
	fr      *http2.Framer
	rfr     *http2.Framer
	hdec    *hpack.Decoder
	ctx     context.Context // cancelled when the conn dies
	cancel  context.CancelFunc
	poolKey PoolKey // client: the pool entry this conn belongs to
	// peer is the remote address, whose share of the bulk frame budget
	// the conn's streams take (bulkbuf.go).
	peer netip.Addr
	// closeByReader: a close in order left the socket to the reader, which
	// closes it once the peer closed its side (closeConn).
	closeByReader atomic.Bool

	lastFrame     atomic.Int64 // when the last stream frame arrived, UnixNano: a sign of life
	lastRead      atomic.Int64 // when the last frame of any kind arrived, UnixNano
	peerMaxFrame  atomic.Uint32
	peerTableSize atomic.Uint32
	readyOnce     sync.Once

	// wmu serializes writes to bw. It is held only while writing, never
	// while waiting for flow control. Take it with lockWrite.
	wmu sync.Mutex
	// writing is when the holder of wmu took it (monotonic), 0 while
	// nobody holds it: a write that blocks for long means a peer that reads
	// nothing of ours (keepalive closes the conn).
	writing atomic.Int64
	// writeSeq (with writeStallTimeout) counts takes and releases of wmu
	// for writes: odd while a write is in progress. The stall check
	// compares it between ticks, where writing would need a clock read per
	// write.
	writeSeq atomic.Uint64
	// dataWaiters counts writeData calls waiting for wmu. While one waits,
	// the holder leaves its frame in bw for the waiter to flush: frames of
	// streams writing at the same moment share TLS records and syscalls.
	dataWaiters atomic.Int32
	// lastData is when (rawio.go's clock) writeData last finished: a frame
	// that follows another within burstGap yields before flushing.
	lastData  atomic.Int64
	yields    uint64 // writeData's yields (under wmu; tests)
	bw        *bufio.Writer
	henc      *hpack.Encoder
	hbuf      bytes.Buffer
	hencLimit uint32

	mu         sync.Mutex
	streams    map[uint32]*Stream
	active     int // streams open or reserved (client) on this conn
	ending     int // streams uncount took out of active, not yet forgotten: their END_STREAM is still being written (emptyLocked)
	nextID     uint32
	lastPeerID uint32
	// lastAccepted (server) is the last stream the peer opened that we
	// took (not refused): what a GOAWAY names as the last we may have
	// processed, so a stream refused as the conn goes away stays beyond
	// it, retried by the client even if its RST_STREAM is lost in the close.
	lastAccepted   uint32
	peerMaxStreams uint32
	peerInitWindow int64
	acksPending    int   // SETTINGS acks queued, not yet written: DATA waits
	sendWindow     int64 // connection-level window the peer granted us
	// connWaiters are the streams whose writers wait for the connection's
	// send window (their own has room), longest waiting first; see
	// passConnWindowLocked.
	connWaiters  []*Stream
	sendWaiting  int           // writers waiting for send window now
	sendWakes    uint64        // times a waiting writer was woken (tests read it)
	recvWindow   int64         // what the peer may still send before our next WINDOW_UPDATE
	recvTarget   int64         // our connection window: defaultWindow plus recvReserved
	streamTarget int64         // our stream window (SETTINGS_INITIAL_WINDOW_SIZE), set by start
	recvReserved int64         // taken from the process-wide window budget (start) until close
	windows      *windowBudget // the budget recvReserved is from (the process's, or a test's)
	windowOwner  netip.Addr    // whose share of the window budget recvReserved is
	windowRemote netip.Addr    // client: the server, whose part of that share it is (windowPair)
	recvUnacked  int64         // bytes consumed locally and not yet returned to the peer
	sawSettings  bool
	goAway       bool // no new streams: GOAWAY sent or received, or closing
	goAwaySent   bool
	// goAwayDebug is the debug data of the GOAWAY of a connection error the
	// peer caused: why, in a fixed text (readLoop).
	goAwayDebug   string
	err           error // set once, when the conn dies
	idleSince     time.Time
	idleTimer     *time.Timer
	expiryTimer   *time.Timer // drainAtPeerExpiry
	peerNotAfter  time.Time   // the end of the peer's chain; zero: none
	ctl, ctlSpare []ctlFrame
	// Server: handlers running for this conn and requests waiting for one
	// (x/net's scheduleHandler). A handler holds its slot until it and the
	// relay it started ended, whatever happened to the stream meanwhile.
	handlers int
	pending  []pendingStream
	// Client keepalive: when the outstanding PING went out (0: none), and
	// the PINGs sent whose ack has not come (an ack beyond them is junk).
	pingTimer    *time.Timer
	pingSent     int64
	pingsUnacked int
	// stallTimer runs checkWriteStall every half writeStallTimeout;
	// stallSeq is the writeSeq it saw last, stallTicks how many ticks in a
	// row saw that same write in progress with no byte acknowledged,
	// stallAcked the bytes the peer had acknowledged then. Under mu.
	stallTimer *time.Timer
	stallSeq   uint64
	stallTicks int
	stallAcked uint64

	ctlWake chan struct{}
	done    chan struct{}

	// peerClosed holds the last streams the peer ended (END_STREAM or
	// RST_STREAM) that are gone from streams, so DATA on them is known to
	// break the protocol (STREAM_CLOSED) rather than be in flight when we
	// closed them. Guarded by mu.
	peerClosed     [16]uint32
	peerClosedNext int

	// Reader-owned.
	blockReader blockReader // what the framer reads from
	rchunks     []chunk     // reused by readChunks
	iov         [][]byte    // reused by deliverLocked (reader only)
	// replyFd is the app socket whose answer a reply poll waits for (-1:
	// none), after a delivery at replyAt (replypoll.go).
	replyFd     int32
	replyAt     int64
	earlyResets budget // server: resets of streams not yet answered
	junk        budget // frames that cost work and carry nothing
	// settingsUnacked counts our SETTINGS frames the peer has not acked
	// (start sends one); an ack beyond them is a protocol error.
	settingsUnacked int
	goAwayRead      bool // a GOAWAY arrived: another one is junk
	// rd is what the reader reads the TLS connection through
	// (tlsReader); tlsAnswered counts the plaintext bytes crypto/tls
	// wrote of its own accord that were charged (spendTLSAnswers), from
	// tlsBase on: what it had written, less what it was handed, before.
	rd          io.Reader
	tlsAnswered int64
	tlsBase     int64
	tlsCounted  bool // a TLS 1.3 conn over a batchConn: spendTLSAnswers counts

	// presented is the certificate we presented, set before the conn is
	// pooled or registered with its server (presented.go); nil: none.
	presented *presentedCert
}

// keyUpdateLen is the plaintext of the KeyUpdate message crypto/tls writes to
// answer a peer's request for one: a 4-byte handshake header and 1 byte.
const keyUpdateLen = 5

// tlsReader is the reader's view of the TLS connection: after each read it
// charges the peer for what crypto/tls wrote meanwhile of its own accord.
type tlsReader struct{ c *conn }

func (r tlsReader) Read(p []byte) (int, error) {
	n, err := r.c.nc.Read(p)
	if ferr := r.c.spendTLSAnswers(); ferr != nil {
		// Not n: io.ReadFull drops the error of a read that filled its
		// buffer. The connection ends, and what was read with it.
		return 0, ferr
	}
	return n, err
}

// spendTLSAnswers charges the junk budget for each record crypto/tls wrote
// of its own accord, which is the answer to a TLS 1.3 KeyUpdate that asks
// for one in return: the peer's record costs it a few bytes, and us a key
// derivation each way and a write(2), and carries nothing. crypto/tls
// answers any number of them, only checking that no more than 16 come
// without application data between, so a flood of them was a flood of
// PINGs without the budget. Only the reader calls it (tlsReader), after a
// read: crypto/tls answers KeyUpdates within the reader's read, and no
// more than 16 in one. The written count is loaded before the handed
// one, which grows first, so the difference never counts our own writes.
func (c *conn) spendTLSAnswers() error {
	if !c.tlsCounted {
		return nil
	}
	b := c.cfg.batch
	written := b.written.Load()
	own := written - b.handed.Load() - c.tlsBase
	for ; own-c.tlsAnswered >= keyUpdateLen; c.tlsAnswered += keyUpdateLen {
		if err := c.spendJunk("TLS KeyUpdate"); err != nil {
			return err
		}
	}
	return nil
}

func newConn(parent context.Context, nc net.Conn, cfg connConfig) *conn {
	c := &conn{
		cfg:            cfg,
		nc:             nc,
		streams:        make(map[uint32]*Stream),
		nextID:         1,
		peerMaxStreams: math.MaxUint32,
		peerInitWindow: defaultWindow,
		sendWindow:     defaultWindow,
		recvWindow:     defaultWindow,
		recvTarget:     defaultWindow,
		windowOwner:    windowOwnerOf(nc, cfg.client),
		peer:           sourceAddr(nc.RemoteAddr()),
		ctlWake:        make(chan struct{}, 1),
		done:           make(chan struct{}),
		hencLimit:      4096,
		blockReader:    blockReader{left: -1},
		earlyResets:    newBudget(cfg.maxEarlyResets, floodPeriod),
		junk:           newBudget(junkBurst, floodPeriod),
		// start sends our SETTINGS before the reader reads anything.
		settingsUnacked: 1,
	}
	c.lastRead.Store(time.Now().UnixNano())
	c.ctx, c.cancel = context.WithCancel(parent)
	c.peerMaxFrame.Store(defaultMaxFrame)
	c.peerTableSize.Store(4096)
	// bw coalesces small frames into one TLS record (at most one full
	// record's worth); larger DATA frames go to TLS without a copy when bw
	// is empty.
	c.rd = tlsReader{c}
	c.blockReader.r = c.rd
	var w io.Writer = nc
	if tc, ok := nc.(*tls.Conn); ok && cfg.batch != nil && tc.ConnectionState().Version == tls.VersionTLS13 {
		// The handshake is over and nothing of ours written yet: what
		// crypto/tls wrote so far (the handshake, session tickets) is the
		// base of spendTLSAnswers's count. Only TLS 1.3 has KeyUpdates,
		// and the record overhead the count assumes.
		c.tlsBase = cfg.batch.written.Load() - cfg.batch.handed.Load()
		c.tlsCounted = true
		w = handedWriter{w: nc, b: cfg.batch}
	}
	c.bw = bufio.NewWriterSize(w, coalesceSize)
	c.replyFd = -1
	if cfg.batch != nil && cfg.batch.raw != nil {
		cfg.batch.raw.idle = c.replyPoll // reader only: reply polling
	}
	c.fr = http2.NewFramer(c.bw, nil)
	c.hdec = hpack.NewDecoder(4096, nil)
	c.renewReadFramer()
	c.henc = hpack.NewEncoder(&c.hbuf)
	if cfg.idleTimeout > 0 {
		c.idleSince = time.Now()
		c.idleTimer = time.AfterFunc(cfg.idleTimeout, func() { cfg.onIdle(c) })
	}
	return c
}

// renewReadFramer gives the reader a fresh framer, which holds no read
// buffer yet. Only between frames: the state the framer carries from frame
// to frame is a header block's, which it reads whole, and the HPACK
// decoder's table, which the new one shares.
func (c *conn) renewReadFramer() {
	fr := http2.NewFramer(io.Discard, &c.blockReader)
	fr.ReadMetaHeaders = c.hdec
	fr.MaxHeaderListSize = maxHeaderListSize
	fr.SetMaxReadFrameSize(maxReadFrameSize)
	fr.SetReuseFrames()
	c.rfr = fr
}

// start writes our connection preface and launches the control writer. The
// caller then runs readLoop (server) or starts it on a goroutine (client).
func (c *conn) start() error {
	// Under mu: the idle timer runs from newConn, and its close reads
	// these (releaseWindowLocked).
	c.mu.Lock()
	c.windows = windows
	if c.cfg.client {
		c.windowRemote = c.peer // the server decides how many connections we open to it
	}
	c.mu.Unlock()
	extra := windows.reserveFor(c.windowOwner, c.windowRemote, connWindow-defaultWindow, c)
	c.mu.Lock()
	c.recvReserved = extra
	if c.err != nil {
		// Closed already (the idle timer runs from newConn): closeConn gave
		// back nothing, and nothing later would give this back.
		c.releaseWindowLocked()
		extra = 0
	}
	c.recvTarget += extra
	c.recvWindow += extra
	// A stream gets a quarter of the connection's window, as with a full
	// one: it takes four streams whose applications do not read to stop
	// the others, also on a connection the budget gave less. Never below
	// HTTP/2's initial 64 KiB, which a peer may use before our SETTINGS
	// reach it (our own client sends early data so).
	c.streamTarget = min(streamWindow, max(c.recvTarget/4, defaultWindow))
	c.mu.Unlock()
	settings := []http2.Setting{
		{ID: http2.SettingInitialWindowSize, Val: uint32(c.streamTarget)},
		{ID: http2.SettingMaxFrameSize, Val: maxReadFrameSize},
		{ID: http2.SettingMaxHeaderListSize, Val: maxHeaderListSize},
	}
	if c.cfg.client {
		settings = append(settings, http2.Setting{ID: http2.SettingEnablePush, Val: 0})
	} else {
		settings = append(settings, http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: c.cfg.maxStreams})
	}
	c.lockWrite()
	if c.cfg.client {
		_, _ = c.bw.WriteString(http2.ClientPreface)
	}
	_ = c.fr.WriteSettings(settings...)
	if extra > 0 {
		_ = c.fr.WriteWindowUpdate(0, uint32(extra))
	}
	err := c.bw.Flush()
	c.unlockWrite()
	if err != nil {
		c.mu.Lock()
		c.releaseWindowLocked()
		c.mu.Unlock()
		return fmt.Errorf("write http2 preface: %w", err)
	}
	go c.ctlLoop()
	if c.cfg.pingInterval > 0 {
		c.mu.Lock()
		if c.err == nil {
			c.pingTimer = time.AfterFunc(c.cfg.pingInterval, c.keepalive)
		}
		c.mu.Unlock()
	}
	if c.cfg.writeStallTimeout > 0 {
		c.mu.Lock()
		if c.err == nil {
			c.stallTimer = time.AfterFunc(c.cfg.writeStallTimeout/2, c.checkWriteStall)
		}
		c.mu.Unlock()
	}
	return nil
}

// checkWriteStall runs on a timer (server) every half writeStallTimeout:
// it closes the conn when the same write was in progress at three ticks in
// a row, so for at least writeStallTimeout, and the peer acknowledged no
// byte of ours meanwhile (on a TCP socket; a peer that reads slowly, with a
// long write in progress, is not stalled). Such a peer reads nothing of
// ours, while the writer holds the write lock: every stream's writes, every
// response and refusal wait behind it, each holding its handler slot and
// goroutine, and nothing else ends them while the peer keeps the
// connection (a stream open keeps it from the idle timeout, and TCP keeps
// probing a zero window for ever). Before, a client that opened a download,
// stopped reading and sent CONNECTs that were refused held 200 handler
// goroutines per connection for as long as it liked, with 1024 connections
// per address. The pool's keepalive does the same for client conns.
func (c *conn) checkWriteStall() {
	seq := c.writeSeq.Load()
	writing := seq%2 == 1
	var acked uint64
	known := false
	if writing {
		acked, known = c.bytesAcked()
	}
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	switch {
	case !writing || seq != c.stallSeq:
		c.stallSeq, c.stallTicks = seq, 0
	case known && acked != c.stallAcked:
		c.stallTicks = 0 // the same write, but the peer takes our bytes
	default:
		c.stallTicks++
	}
	c.stallAcked = acked
	stalled := c.stallTicks >= 2
	if !stalled {
		c.stallTimer.Reset(c.cfg.writeStallTimeout / 2)
	}
	c.mu.Unlock()
	if !stalled {
		return
	}
	if c.cfg.onWriteStall != nil {
		c.cfg.onWriteStall()
	}
	c.cfg.log.Warn("hbone peer reads nothing of ours, closing its connection", "remote", c.nc.RemoteAddr(), "stalled", c.cfg.writeStallTimeout)
	c.close(http2.ErrCodeNo, fmt.Errorf("%w: a write to the peer made no progress for %v", ErrConnClosed, c.cfg.writeStallTimeout), false)
}

// bytesAcked is how many bytes of ours the peer acknowledged on the conn's
// TCP socket (TCP_INFO), and whether that is known.
func (c *conn) bytesAcked() (uint64, bool) {
	nc := c.nc
	if c.cfg.batch != nil {
		nc = c.cfg.batch.Conn
	}
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return 0, false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return 0, false
	}
	var info *unix.TCPInfo
	var ierr error
	if err := rc.Control(func(fd uintptr) { info, ierr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil || ierr != nil {
		return 0, false
	}
	return info.Bytes_acked, true
}

// keepalive runs on a timer (client): it sends a PING when nothing arrived
// for pingInterval and closes the conn when nothing arrived for pingTimeout
// after one, so a pooled conn to a peer that vanished without a word
// (power loss, a dropped route) fails fast instead of holding streams
// until TCP gives up, minutes later.
func (c *conn) keepalive() {
	now := time.Now().UnixNano()
	interval, timeout := int64(c.cfg.pingInterval), int64(c.cfg.pingTimeout)
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	last := c.lastRead.Load()
	dead := false
	stalled := c.writeStalled(c.cfg.pingTimeout)
	switch {
	case stalled:
		// The peer answers (PINGs, frames) but reads nothing of ours: a
		// writer blocked this long holds every stream's writes and every
		// new CONNECT of the conn.
		dead = true
	case c.pingSent != 0 && last >= c.pingSent:
		c.pingSent = 0 // the ack or other frames came: alive
	case c.pingSent != 0 && now-c.pingSent >= timeout:
		dead = true
	}
	wake := false
	if !dead && c.pingSent == 0 && now-last >= interval {
		c.pingSent = now
		c.pingsUnacked++
		c.ctl = append(c.ctl, ctlFrame{typ: http2.FramePing, val: 1})
		wake = true
	}
	next := interval - (now - last)
	if c.pingSent != 0 {
		next = min(interval, c.pingSent+timeout-now)
	}
	c.pingTimer.Reset(time.Duration(max(next, int64(time.Millisecond))))
	c.mu.Unlock()
	if dead && stalled {
		c.close(http2.ErrCodeNo, fmt.Errorf("%w: a write to the peer made no progress for %v", ErrConnClosed, c.cfg.pingTimeout), false)
		return
	}
	if dead {
		c.close(http2.ErrCodeNo, fmt.Errorf("%w: keepalive PING unanswered for %v", ErrConnClosed, c.cfg.pingTimeout), false)
		return
	}
	if wake {
		select {
		case c.ctlWake <- struct{}{}:
		default:
		}
	}
}

// readLoop reads frames until the connection fails, then closes it.
func (c *conn) readLoop() {
	err := c.readFrames()
	var ce http2.ConnectionError
	var fe *floodError
	var ge *GoAwayError
	if debug := peerErrorReason(err, c.rfr); debug != "" {
		c.mu.Lock()
		c.goAwayDebug = debug
		c.mu.Unlock()
	}
	switch {
	case errors.As(err, &fe):
		if c.cfg.onFlood != nil {
			c.cfg.onFlood()
		}
		c.cfg.log.Warn("hbone peer floods, closing its connection", "remote", c.nc.RemoteAddr(), "reason", fe.reason)
		c.closeConn(http2.ErrCodeEnhanceYourCalm, err, true, true)
	case errors.As(err, &ce):
		c.countProtocolError()
		c.closeConn(http2.ErrCode(ce), fmt.Errorf("peer broke http2 protocol: %w", err), true, true)
	case errors.Is(err, http2.ErrFrameTooLarge):
		c.countProtocolError()
		c.closeConn(http2.ErrCodeFrameSize, err, true, true)
	case errors.As(err, &ge):
		c.closeConn(http2.ErrCodeNo, err, false, true)
	default:
		c.close(http2.ErrCodeNo, err, false)
	}
	if c.closeByReader.Load() {
		_ = c.nc.Close()
	}
}

func (c *conn) readFrames() error {
	// inPreface (server): the client's preface is not complete until its
	// first SETTINGS frame (RFC 9113 §3.4), so the preface deadline stays
	// until that frame was read: a client must not hold a connection
	// silent, between the 24 bytes and SETTINGS, until the idle timeout.
	inPreface := !c.cfg.client
	if inPreface {
		var preface [len(http2.ClientPreface)]byte
		if c.cfg.prefaceTimeout > 0 {
			_ = c.nc.SetReadDeadline(time.Now().Add(c.cfg.prefaceTimeout))
		}
		if _, err := io.ReadFull(c.rd, preface[:]); err != nil {
			return fmt.Errorf("read client preface: %w", err)
		}
		if string(preface[:]) != http2.ClientPreface {
			return &peerError{reason: "no HTTP/2 client preface", err: http2.ConnectionError(http2.ErrCodeProtocol)}
		}
	}
	for {
		// DATA payloads are read here rather than by the framer, straight
		// into the stream's buffer; the framer reads everything else.
		fh, err := c.rfr.ReadFrameHeader()
		if err == nil {
			now := time.Now().UnixNano()
			c.lastRead.Store(now)
			if fh.StreamID != 0 {
				c.lastFrame.Store(now)
			}
			if fh.Type == http2.FrameData && c.sawSettings {
				err = c.readData(fh)
			} else if skip, ferr := c.checkFrameLength(&fh); ferr != nil || skip {
				err = ferr
			} else {
				var f http2.Frame
				if fh.Type == http2.FrameHeaders {
					c.blockReader.left = maxHeaderBlockBytes
					c.rfr.SetMaxReadFrameSize(maxHeaderFrame) // its CONTINUATION frames
				}
				from := c.blockReader.read
				f, err = c.rfr.ReadFrameForHeader(fh)
				c.blockReader.left = -1
				c.blockReader.pre = nil
				if fh.Type == http2.FrameHeaders {
					c.rfr.SetMaxReadFrameSize(maxReadFrameSize)
					var ce http2.ConnectionError
					switch {
					case errors.Is(err, http2.ErrFrameTooLarge):
						err = &floodError{reason: fmt.Sprintf("CONTINUATION frame larger than %d bytes, more than a header block within SETTINGS_MAX_HEADER_LIST_SIZE needs", maxHeaderFrame)}
					case errors.As(err, &ce) && c.rfr.ErrorDetail() == nil:
						err = &peerError{reason: headerBlockReason(ce), err: err}
					}
				}
				if errors.Is(err, errHeaderBlockTooLong) {
					err = &floodError{reason: "header block (HEADERS and CONTINUATION frames) too long"}
				}
				if err == nil {
					err = c.onFrame(f)
				}
				if c.blockReader.read-from > readBufKeep {
					// The framer now keeps a buffer that large for
					// the life of the connection: one such frame per
					// connection pinned 1 MiB each. The frame is
					// handled; drop the framer and its buffer.
					c.renewReadFramer()
				}
			}
		}
		if inPreface && c.sawSettings {
			inPreface = false
			_ = c.nc.SetReadDeadline(time.Time{})
			if c.cfg.onPreface != nil {
				c.cfg.onPreface()
			}
		}
		if err == nil {
			continue
		}
		var se http2.StreamError
		if !errors.As(err, &se) {
			if inPreface {
				return fmt.Errorf("read client preface SETTINGS: %w", err)
			}
			return err
		}
		if err := c.resetStreamFor(se.StreamID, se.Code, se.Cause); err != nil {
			return err
		}
	}
}

// checkFrameLength runs before the framer reads a frame that is not DATA,
// whose payload x/net's framer allocates at the length the header declares,
// before a byte of it arrived: a peer that sent a 9-byte header declaring 1
// MiB (our SETTINGS_MAX_FRAME_SIZE, which is for DATA) and then nothing held
// 1 MiB of ours for the life of the connection, 1 GiB with the 1024
// connections one address may open. So what the framer reads is at most
// readBufKeep, what it keeps anyway, except: a frame no honest peer sends
// that large (every type of a fixed or small size, SETTINGS of more than
// maxSettingsPerFrame, a frame before the first SETTINGS, HEADERS that
// x/net would refuse) is a flood; a HEADERS, or a GOAWAY whose debug text
// may be long, is read first into a buffer that grows as its bytes arrive
// (prefetch); a frame of an unknown type, which is ignored, is read and
// dropped (skip true), charged to the junk budget. The CONTINUATION frames
// of a header block, which the framer reads on its own, are bounded by
// maxHeaderFrame. Of a GOAWAY only its first maxGoAwayRead bytes are kept,
// the rest of its debug text read and dropped, and fh shortened to match:
// a peer that sent all of a 1 MiB GOAWAY but its last byte, and stalled,
// made the connection hold all it sent.
func (c *conn) checkFrameLength(fh *http2.FrameHeader) (skip bool, err error) {
	if fh.Length <= readBufKeep {
		return false, nil
	}
	tooLong := func() error {
		return &floodError{reason: fmt.Sprintf("%v frame declaring %d bytes, more than any honest one needs", fh.Type, fh.Length)}
	}
	switch {
	case !c.sawSettings:
		return false, tooLong() // the first frame must be SETTINGS
	case fh.Type == http2.FrameHeaders:
		// x/net refuses a fragment over twice the header list size it has
		// left (for headers and trailers: 4 times ours), after reading it.
		// Below, the list may be just over the limit: the stream is
		// refused with 431, and the connection lives.
		if fh.Length > 4*maxHeaderListSize+512 {
			return false, tooLong()
		}
		return false, c.prefetch(fh.Length)
	case fh.Type == http2.FrameGoAway:
		if err := c.prefetch(maxGoAwayRead); err != nil {
			return false, err
		}
		if _, err := io.CopyN(io.Discard, c.rd, int64(fh.Length-maxGoAwayRead)); err != nil {
			return false, err
		}
		fh.Length = maxGoAwayRead
		return false, nil
	case fh.Type > http2.FrameContinuation: // unknown: ignored (RFC 9113 §5.5)
		if err := c.spendJunk(fh.Type.String()); err != nil {
			return false, err
		}
		_, err := io.CopyN(io.Discard, c.rd, int64(fh.Length))
		return true, err
	default:
		return false, tooLong()
	}
}

// maxGoAwayRead is the most of a GOAWAY frame kept (checkFrameLength): its
// last stream and code, and a debug text longer than any log line shows.
const maxGoAwayRead = readBufKeep

// prefetch reads the next n bytes, a frame's payload, into a buffer that
// grows as they arrive, for the framer to read (blockReader.pre).
func (c *conn) prefetch(n uint32) error {
	var buf bytes.Buffer
	if _, err := io.CopyN(&buf, c.rd, int64(n)); err != nil {
		return err
	}
	c.blockReader.pre = buf.Bytes()
	return nil
}

func (c *conn) onFrame(f http2.Frame) error {
	if !c.sawSettings {
		// RFC 9113 §3.4: the preface ends with a SETTINGS frame.
		if sf, ok := f.(*http2.SettingsFrame); !ok || sf.IsAck() {
			return http2.ConnectionError(http2.ErrCodeProtocol)
		}
	}
	switch f := f.(type) { // DATA is handled by readData
	case *http2.MetaHeadersFrame:
		return c.onHeaders(f)
	case *http2.SettingsFrame:
		return c.onSettings(f)
	case *http2.WindowUpdateFrame:
		return c.onWindowUpdate(f)
	case *http2.PingFrame:
		if f.IsAck() {
			return c.onPingAck()
		}
		if err := c.spendJunk("PING"); err != nil {
			return err
		}
		c.queue(ctlFrame{typ: http2.FramePing, ping: f.Data})
	case *http2.RSTStreamFrame:
		return c.onReset(f)
	case *http2.GoAwayFrame:
		return c.onGoAway(f)
	case *http2.PushPromiseFrame:
		// We never enable push, and a client cannot push.
		if c.cfg.client {
			return &peerError{reason: "PUSH_PROMISE with SETTINGS_ENABLE_PUSH 0", err: http2.ConnectionError(http2.ErrCodeProtocol)}
		}
		return http2.ConnectionError(http2.ErrCodeProtocol)
	case *http2.PriorityFrame:
		if f.StreamDep == f.StreamID {
			// Depends on itself (§5.3.1): a stream error like any other,
			// which closes the stream (and the id, if idle) and is
			// charged to the peer there.
			return c.resetStream(f.StreamID, http2.ErrCodeProtocol)
		}
		return c.spendJunk("PRIORITY")
	default:
		// Unknown frames are ignored (RFC 9113 §5.5), within the junk
		// budget.
		return c.spendJunk(f.Header().Type.String())
	}
	return nil
}

// onPingAck handles a PING ack: the answer to our keepalive PING, or, when
// none is outstanding (a server never sends PINGs), a frame that carries
// nothing and costs a read, like any other junk.
func (c *conn) onPingAck() error {
	c.mu.Lock()
	solicited := c.pingsUnacked > 0
	if solicited {
		c.pingsUnacked--
	}
	c.mu.Unlock()
	if solicited {
		return nil
	}
	return c.spendJunk("unsolicited PING ack")
}

// notePeerClosedLocked remembers that the peer ended stream id, once.
func (c *conn) notePeerClosedLocked(id uint32) {
	if slices.Contains(c.peerClosed[:], id) {
		return
	}
	c.peerClosed[c.peerClosedNext] = id
	c.peerClosedNext = (c.peerClosedNext + 1) % len(c.peerClosed)
}

// endedByPeer is called by the reader after the peer ended s (end: an
// END_STREAM or RST_STREAM was handled) and passes err on. If our side took
// s out of the conn between the reader's lookup and the end being recorded
// on s (a handler that answered and closed just then), remove could not know
// the peer had ended it: it is remembered here, so the peer's later frames
// on it are still STREAM_CLOSED rather than dropped unanswered.
func (c *conn) endedByPeer(s *Stream, end bool, err error) error {
	if end {
		c.mu.Lock()
		if c.streams[s.id] != s {
			c.notePeerClosedLocked(s.id)
		}
		c.mu.Unlock()
	}
	return err
}

// testHookResetFound, if set, runs in onReset between finding the stream
// and recording the reset on it: tests widen that window.
var testHookResetFound testHook[func(c *conn, id uint32)]

// peerClosedRecently reports whether id is one of the last streams the
// peer ended that are gone.
func (c *conn) peerClosedRecently(id uint32) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, pid := range c.peerClosed {
		if pid == id {
			return true
		}
	}
	return false
}

// spendJunk takes a frame that costs work and carries nothing from the
// peer's budget; a peer that sends them in a flood is a connection error.
// Only the reader calls it; it takes no lock.
func (c *conn) spendJunk(what string) error {
	if c.junk.spend(time.Now().UnixNano()) {
		return nil
	}
	return &floodError{reason: "too many " + what + " frames"}
}

// idleStreamLocked reports whether id names a stream that was never opened;
// frames other than HEADERS on such a stream are a connection error.
func (c *conn) idleStreamLocked(id uint32) bool {
	if c.cfg.client {
		return id%2 == 0 || id >= c.nextID
	}
	return id > c.lastPeerID
}

// readData reads a DATA frame's payload (RFC 9113 §6.1) and hands it to
// its stream.
func (c *conn) readData(fh http2.FrameHeader) error {
	id := fh.StreamID
	n := int64(fh.Length) // flow control counts padding too
	payload, pad := int(fh.Length), 0
	if id == 0 {
		return http2.ConnectionError(http2.ErrCodeProtocol)
	}
	if fh.Flags.Has(http2.FlagDataPadded) {
		var b [1]byte
		if payload == 0 {
			return http2.ConnectionError(http2.ErrCodeProtocol)
		}
		if _, err := io.ReadFull(c.rd, b[:]); err != nil {
			return err
		}
		payload, pad = payload-1, int(b[0])
		if pad > payload {
			return http2.ConnectionError(http2.ErrCodeProtocol)
		}
	}
	empty, end := payload == pad, fh.Flags.Has(http2.FlagDataEndStream)
	c.mu.Lock()
	if n > c.recvWindow {
		c.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeFlowControl)
	}
	c.recvWindow -= n
	s := c.streams[id]
	idle := s == nil && c.idleStreamLocked(id)
	c.mu.Unlock()
	if idle {
		return http2.ConnectionError(http2.ErrCodeProtocol)
	}
	if s == nil {
		// A stream we already closed or reset: drop the data, but give the
		// connection window back. If the peer had ended the stream itself,
		// it must not send more (RFC 9113 §5.1): STREAM_CLOSED.
		c.credit(0, 0, n)
		if err := c.skip(payload); err != nil {
			return err
		}
		if c.peerClosedRecently(id) {
			// resetStream charges the junk budget for it.
			return http2.StreamError{StreamID: id, Code: http2.ErrCodeStreamClosed}
		}
		if empty {
			// Even with END_STREAM, which ends nothing here: the ring of
			// streams the peer closed is short, and older ids must not
			// make free frames.
			return c.spendJunk("empty DATA on closed streams")
		}
		return nil
	}
	if empty && !end {
		if err := c.spendJunk("empty DATA"); err != nil {
			return err
		}
	}
	if payload-pad < directReadMin {
		// Small payloads go through a pooled scratch buffer and are packed
		// into the stream's last chunk, so small messages do not each take
		// a chunk.
		bp := frameBufPool.Get().(*[]byte)
		defer frameBufPool.Put(bp)
		small := (*bp)[:payload-pad]
		if _, err := io.ReadFull(c.rd, small); err != nil {
			return err
		}
		if err := c.skip(pad); err != nil {
			return err
		}
		return c.endedByPeer(s, end, s.onData(small, nil, n, end))
	}
	chunks, err := c.readChunks(payload - pad)
	if err != nil {
		return err
	}
	if err := c.skip(pad); err != nil {
		recycleChunks(chunks)
		return err
	}
	return c.endedByPeer(s, end, s.onData(nil, chunks, n, end))
}

// skip discards n payload bytes (padding, data of a closed stream).
func (c *conn) skip(n int) error {
	if n == 0 {
		return nil
	}
	_, err := io.CopyN(io.Discard, c.rd, int64(n))
	return err
}

// readChunks reads n bytes of DATA straight into fresh receive-buffer
// chunks, which then become part of the stream's buffer as they are.
func (c *conn) readChunks(n int) ([]chunk, error) {
	chunks := c.rchunks[:0]
	for n > 0 {
		k := min(n, chunkSize)
		bp := chunkPool.Get().(*[]byte)
		if _, err := io.ReadFull(c.rd, (*bp)[:k]); err != nil {
			chunkPool.Put(bp)
			recycleChunks(chunks)
			return nil, err
		}
		chunks = append(chunks, chunk{b: bp, w: k})
		n -= k
	}
	c.rchunks = chunks
	return chunks, nil
}

func (c *conn) onHeaders(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	c.mu.Lock()
	s := c.streams[id]
	if s != nil {
		c.mu.Unlock()
		return c.endedByPeer(s, f.StreamEnded(), s.onHeaders(f))
	}
	if c.cfg.client {
		idle := c.idleStreamLocked(id)
		c.mu.Unlock()
		if idle {
			return &peerError{reason: fmt.Sprintf("HEADERS on stream %d, which the client never opened", id), err: http2.ConnectionError(http2.ErrCodeProtocol)}
		}
		// A response to a stream we gave up on: in flight when we reset
		// it now and then, but free work for the peer in a flood.
		return c.spendJunk("HEADERS for closed streams")
	}
	if id%2 == 0 {
		c.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeProtocol)
	}
	if id <= c.lastPeerID {
		c.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeStreamClosed) // a stream that was open once (§5.1)
	}
	if f.HasPriority() && f.Priority.StreamDep == id {
		c.mu.Unlock()
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol} // depends on itself (§5.3.1)
	}
	if !c.goAway && c.peerExpiredLocked() {
		// The drain timer is late (see peerExpiredLocked): drain now,
		// before this stream counts as seen, so the GOAWAY tells the
		// client to retry it on a new connection, whose handshake needs
		// a current certificate.
		c.mu.Unlock()
		c.drain()
		c.mu.Lock()
	}
	if !c.goAway && c.presented != nil && !c.presented.stopped.Load() && c.cfg.checkPresented != nil {
		// The same for the certificate we presented.
		c.mu.Unlock()
		c.cfg.checkPresented()
		c.mu.Lock()
	}
	c.lastPeerID = id
	if c.goAway || uint32(c.active) >= c.cfg.maxStreams {
		c.mu.Unlock()
		if c.cfg.onRefused != nil {
			c.cfg.onRefused()
		}
		// Honest clients keep to the limit, and send few requests after
		// our GOAWAY: a refused stream is junk.
		return c.resetStream(id, http2.ErrCodeRefusedStream)
	}
	s = newStream(c, id)
	s.sendWindow = c.peerInitWindow
	s.remoteEnded = f.StreamEnded()
	c.streams[id] = s
	c.lastAccepted = id
	c.addActiveLocked()
	c.mu.Unlock()
	return c.cfg.onRequest(s, f)
}

func (c *conn) onSettings(f *http2.SettingsFrame) error {
	if f.IsAck() {
		if c.settingsUnacked == 0 {
			// An ack of settings we never sent: x/net hangs up too.
			return http2.ConnectionError(http2.ErrCodeProtocol)
		}
		c.settingsUnacked--
		return nil
	}
	if err := c.spendJunk("SETTINGS"); err != nil {
		return err
	}
	if f.NumSettings() > maxSettingsPerFrame {
		// CVE-2020-11080 (nghttp2): one frame of a million settings.
		return &floodError{reason: fmt.Sprintf("SETTINGS frame with %d settings", f.NumSettings())}
	}
	c.mu.Lock()
	// SETTINGS_INITIAL_WINDOW_SIZE is applied once per frame, at its last
	// value: each change walks every open stream, and a frame repeating it
	// up to maxSettingsPerFrame times made that many walks for one frame
	// of the junk budget. Nothing is sent between a frame's settings, so
	// only the last value can be seen.
	initWindow, setInitWindow := uint32(0), false
	err := f.ForeachSetting(func(s http2.Setting) error {
		if err := s.Valid(); err != nil {
			return err
		}
		switch s.ID {
		case http2.SettingEnablePush:
			if c.cfg.client && s.Val != 0 {
				// RFC 9113 §6.5.2: a server must not set it to 1.
				return &peerError{reason: "SETTINGS_ENABLE_PUSH set by a server", err: http2.ConnectionError(http2.ErrCodeProtocol)}
			}
		case http2.SettingMaxFrameSize:
			c.peerMaxFrame.Store(s.Val)
		case http2.SettingMaxConcurrentStreams:
			c.peerMaxStreams = s.Val
		case http2.SettingHeaderTableSize:
			c.peerTableSize.Store(s.Val)
		case http2.SettingInitialWindowSize:
			initWindow, setInitWindow = s.Val, true
		}
		return nil
	})
	if err == nil && setInitWindow {
		err = c.setPeerInitWindowLocked(int64(initWindow))
	}
	c.sawSettings = true
	if err == nil {
		c.acksPending++
	}
	// A server that takes no stream (SETTINGS_MAX_CONCURRENT_STREAMS 0)
	// makes the connection useless to the pool: drained, it closes once
	// its streams end, instead of staying pooled, idle, until the idle
	// timeout, while every new stream dials another.
	zeroLimit := err == nil && c.cfg.client && c.peerMaxStreams == 0 && !c.goAway
	c.mu.Unlock()
	if err != nil {
		return err
	}
	// DATA waits until the ack went out (ctlLoop), so what is sent under
	// the new settings follows their ack on the wire.
	c.queue(ctlFrame{typ: http2.FrameSettings})
	c.ready()
	if zeroLimit {
		if c.cfg.onZeroStreamLimit != nil {
			c.cfg.onZeroStreamLimit()
		}
		c.drain()
	}
	return nil
}

// setPeerInitWindowLocked applies the peer's new
// SETTINGS_INITIAL_WINDOW_SIZE to every open stream's send window (RFC 9113
// §6.9.2): one walk of the streams.
func (c *conn) setPeerInitWindowLocked(v int64) error {
	delta := v - c.peerInitWindow
	c.peerInitWindow = v
	if delta == 0 {
		return nil
	}
	for _, st := range c.streams {
		was := st.sendWindow
		st.sendWindow += delta
		if st.sendWindow > maxWindow {
			return http2.ConnectionError(http2.ErrCodeFlowControl)
		}
		if was <= 0 && st.sendWindow > 0 {
			st.sendCond.Broadcast() // it sends once the ack is out
		}
	}
	return nil
}

func (c *conn) onWindowUpdate(f *http2.WindowUpdateFrame) error {
	inc := int64(f.Increment)
	c.mu.Lock()
	defer c.mu.Unlock()
	if f.StreamID == 0 {
		c.sendWindow += inc
		if c.sendWindow > maxWindow {
			return http2.ConnectionError(http2.ErrCodeFlowControl)
		}
		c.passConnWindowLocked()
		return nil
	}
	s := c.streams[f.StreamID]
	if s == nil {
		if c.idleStreamLocked(f.StreamID) {
			return http2.ConnectionError(http2.ErrCodeProtocol)
		}
		return c.spendJunk("WINDOW_UPDATE for closed streams")
	}
	was := s.sendWindow
	s.sendWindow += inc
	if s.sendWindow > maxWindow {
		return http2.StreamError{StreamID: f.StreamID, Code: http2.ErrCodeFlowControl}
	}
	if was <= 0 {
		// Only a window that was empty has a writer waiting on it: a
		// stream of small updates wakes nobody.
		s.sendCond.Broadcast()
	}
	return nil
}

// onReset handles RST_STREAM. On a server, a reset of a stream that was not
// answered yet is an early reset: a client resets a pending CONNECT when
// its own caller gave up, now and then, but a stream of them is the rapid
// reset attack (CVE-2023-44487), where each reset stream costs us a handler
// and the client nothing.
func (c *conn) onReset(f *http2.RSTStreamFrame) error {
	c.mu.Lock()
	s := c.streams[f.StreamID]
	idle := s == nil && c.idleStreamLocked(f.StreamID)
	c.mu.Unlock()
	if idle {
		return http2.ConnectionError(http2.ErrCodeProtocol) // RFC 9113 §6.4
	}
	if s == nil {
		// Closed here first (answered and ended): the peer still knows it
		// closed, so DATA after this breaks the protocol.
		c.mu.Lock()
		c.notePeerClosedLocked(f.StreamID)
		c.mu.Unlock()
		return c.spendJunk("RST_STREAM for closed streams")
	}
	defer c.endedByPeer(s, true, nil)
	if f := testHookResetFound.get(); f != nil {
		f(c, s.id)
	}
	s.mu.Lock()
	s.peerReset = true
	s.mu.Unlock()
	var err error = &ResetError{Code: f.ErrCode, Remote: true}
	if f.ErrCode == http2.ErrCodeRefusedStream {
		err = fmt.Errorf("%w: %w", errRetry, err)
	}
	// Whether the reset came before the answer is read before abort: abort cancels the
	// handler's context, and a handler that answers at once could otherwise mark the stream
	// answered first and take the reset out of the rapid-reset budget.
	early := !c.cfg.client && !s.answered.Load()
	s.abort(err)
	if early {
		return c.spendEarlyReset("too many streams reset before their response")
	}
	return nil
}

// refuseOpened refuses s, a stream just opened, with REFUSED_STREAM (the
// client may retry it, as one refused over SETTINGS_MAX_CONCURRENT_STREAMS)
// and charges the peer junk for it, as for those. Reader only.
func (c *conn) refuseOpened(s *Stream, why string) error {
	c.sendReset(s, s.id, http2.ErrCodeRefusedStream)
	s.abort(fmt.Errorf("%w: %w", errRetry, &ResetError{Code: http2.ErrCodeRefusedStream}))
	return c.spendJunk(why)
}

// spendEarlyReset counts a reset of a stream not yet answered (server) and
// takes it from the peer's early-reset budget; a peer that spent the budget
// floods. Only the reader calls it.
func (c *conn) spendEarlyReset(reason string) error {
	if c.cfg.onEarlyReset != nil && !c.cfg.onEarlyReset() {
		return &floodError{reason: reason + " from this address, over all its connections"}
	}
	if !c.earlyResets.spend(time.Now().UnixNano()) {
		return &floodError{reason: reason}
	}
	return nil
}

// onGoAway handles GOAWAY; one with an error code is returned as a
// *GoAwayError, which ends the conn.
func (c *conn) onGoAway(f *http2.GoAwayFrame) error {
	if c.goAwayRead {
		// A peer may send a second GOAWAY (a graceful shutdown's final
		// one), but each walks every stream: more are junk.
		if err := c.spendJunk("GOAWAY"); err != nil {
			return err
		}
	}
	c.goAwayRead = true
	c.mu.Lock()
	c.goAway = true
	var unprocessed []*Stream
	for id, s := range c.streams {
		// Only streams we opened can be beyond the peer's last stream.
		if id > f.LastStreamID && (id%2 == 1) == c.cfg.client {
			unprocessed = append(unprocessed, s)
		}
	}
	idle := c.active == len(unprocessed) && c.ending == 0
	c.mu.Unlock()
	for _, s := range unprocessed {
		s.abort(fmt.Errorf("%w: connection going away", errRetry))
	}
	if f.ErrCode != http2.ErrCodeNo {
		return &GoAwayError{Code: f.ErrCode, Debug: string(f.DebugData())}
	}
	if idle {
		c.close(http2.ErrCodeNo, fmt.Errorf("%w: peer sent GOAWAY", ErrConnClosed), true)
	}
	return nil
}

// resetStream answers a stream error the peer caused: RST_STREAM to the
// peer, and the local stream (if any) fails. Only the reader calls it, for
// every stream it resets because of what the peer sent, and it charges the
// peer for the reset: a stream error costs the peer one frame and us a
// handler cancelled mid-dial, as cheap for it as a reset it sends itself
// (MadeYouReset, CVE-2025-8671). So the reset of a stream that was not yet
// answered (server) spends the early-reset budget, as RST_STREAM from the
// peer does (onReset), and any other (a stream already answered or gone,
// a request refused) spends the junk budget. A returned error is a
// flood: the connection goes with GOAWAY ENHANCE_YOUR_CALM.
func (c *conn) resetStream(id uint32, code http2.ErrCode) error {
	return c.resetStreamFor(id, code, nil)
}

// resetStreamFor is resetStream for a stream error whose cause, if any, is
// kept in the stream's ResetError: the caller of a failed Connect learns
// what was wrong with the server's answer.
func (c *conn) resetStreamFor(id uint32, code http2.ErrCode, cause error) error {
	c.mu.Lock()
	s := c.streams[id]
	if !c.cfg.client && s == nil && id%2 == 1 && id > c.lastPeerID {
		c.lastPeerID = id // a malformed request still opened (and closed) the stream
	}
	c.mu.Unlock()
	c.sendReset(s, id, code)
	if s == nil {
		return c.spendJunk("frames that make us reset streams")
	}
	// As in onReset, answered is read before abort cancels the handler.
	early := !c.cfg.client && !s.answered.Load()
	rerr := &ResetError{Code: code}
	if cause != nil {
		rerr.Reason = cause.Error()
	}
	s.abort(rerr)
	if early {
		return c.spendEarlyReset("too many streams we reset, for stream errors, before their response")
	}
	return c.spendJunk("frames that make us reset streams")
}

// sendReset queues the RST_STREAM of stream id (s, nil if no longer
// known). A client's stream is forgotten now but counts toward the server's
// limit until the reset is written: freed at once, its slot let another
// stream's HEADERS out before the RST_STREAM, one stream too many there.
func (c *conn) sendReset(s *Stream, id uint32, code http2.ErrCode) {
	f := ctlFrame{typ: http2.FrameRSTStream, id: id, val: uint32(code)}
	if s != nil && c.cfg.client && c.forgetUntilSent(s) {
		f.release = s
	}
	c.queue(f)
}

// queue hands a control frame to the control writer without blocking.
func (c *conn) queue(f ctlFrame) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	flood := c.queueLocked(f)
	c.mu.Unlock()
	if flood {
		c.closeControlFlood()
		return
	}
	c.wakeCtl()
}

// queueLocked adds f to the control frames and reports whether they are now
// more than maxQueuedControl: the caller then closes the conn
// (closeControlFlood), else wakes the writer (wakeCtl).
func (c *conn) queueLocked(f ctlFrame) (flood bool) {
	c.ctl = append(c.ctl, f)
	return len(c.ctl) > maxQueuedControl
}

// wakeCtl wakes the control writer.
func (c *conn) wakeCtl() {
	select {
	case c.ctlWake <- struct{}{}:
	default:
	}
}

// closeControlFlood closes a conn whose control frames queued beyond
// maxQueuedControl: the peer sends what must be answered faster than it
// reads the answers, or reads nothing of ours at all.
func (c *conn) closeControlFlood() {
	c.cfg.log.Warn("hbone peer reads too few of our control frames, closing its connection", "remote", c.nc.RemoteAddr(), "queued", maxQueuedControl)
	c.close(http2.ErrCodeEnhanceYourCalm, errors.New("peer floods control frames"), true)
}

// credit returns receive window to the peer after n bytes were consumed
// (conn level) and, for streams, after the stream's own threshold.
func (c *conn) credit(id uint32, streamInc uint32, n int64) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	queued := false
	if streamInc > 0 {
		c.ctl = append(c.ctl, ctlFrame{typ: http2.FrameWindowUpdate, id: id, val: streamInc})
		queued = true
	}
	c.recvUnacked += n
	// Returning credit in quarters of the window keeps WINDOW_UPDATE frames
	// rare while the sender never runs dry on a fast link.
	if c.recvUnacked >= c.recvTarget/4 {
		c.ctl = append(c.ctl, ctlFrame{typ: http2.FrameWindowUpdate, val: uint32(c.recvUnacked)})
		c.recvWindow += c.recvUnacked
		c.recvUnacked = 0
		queued = true
	}
	// The window counts as returned once its WINDOW_UPDATE is queued, so a
	// peer that reads nothing of ours (the control writer stuck in a write)
	// may go on sending, and each quarter window it sends would queue
	// another frame for good: these count against the bound of queue.
	flood := len(c.ctl) > maxQueuedControl
	c.mu.Unlock()
	if flood {
		c.closeControlFlood()
		return
	}
	if queued {
		select {
		case c.ctlWake <- struct{}{}:
		default:
		}
	}
}

// ctlLoop writes queued control frames.
func (c *conn) ctlLoop() {
	for {
		select {
		case <-c.ctlWake:
		case <-c.done:
			return
		}
		// The batch is taken under wmu: a close in order (closeConn)
		// takes wmu before it ends the connection, so frames taken here
		// are written before that, not after close_notify and lost.
		c.lockWrite()
		c.mu.Lock()
		batch := c.ctl
		c.ctl, c.ctlSpare = c.ctlSpare[:0], nil
		c.mu.Unlock()
		if len(batch) == 0 {
			c.unlockWrite()
			continue
		}
		if f := testHookCtlBatch.get(); f != nil {
			f(c, batch)
		}
		var err error
		settingsAck, releases := false, false
		for _, f := range batch {
			if err = c.writeCtlLocked(f); err != nil {
				break
			}
			settingsAck = settingsAck || f.typ == http2.FrameSettings
			releases = releases || f.release != nil
		}
		if err == nil {
			err = c.bw.Flush()
		}
		c.unlockWrite()
		c.mu.Lock()
		drained := false
		if releases && err == nil {
			for _, f := range batch {
				if f.release != nil {
					drained = c.releaseLocked(f.release) || drained
				}
			}
		}
		if settingsAck && err == nil {
			for _, f := range batch {
				if f.typ == http2.FrameSettings {
					c.acksPending--
				}
			}
			c.passConnWindowLocked() // the new settings' windows may be used now
		}
		if releases {
			clear(batch) // no stream kept reachable from the spare
		}
		if cap(batch) <= maxKeptControl {
			// A batch grown by a burst (a peer that stopped reading
			// and sent PINGs, up to maxQueuedControl of them) is
			// dropped: kept as the spare, it stayed for the life of
			// the conn.
			c.ctlSpare = batch[:0]
		}
		c.mu.Unlock()
		if err != nil {
			c.close(http2.ErrCodeNo, fmt.Errorf("write control frame: %w", err), false)
			return
		}
		if drained {
			c.close(http2.ErrCodeNo, fmt.Errorf("%w: drained", ErrConnClosed), true)
		}
	}
}

// testHookCtlBatch, if set, runs in ctlLoop once it took a batch of control
// frames, before writing them: tests widen that window.
var testHookCtlBatch testHook[func(c *conn, batch []ctlFrame)]

// testHook is a function a test sets to hold a goroutine in a race window;
// unset in production. It is atomic: goroutines an earlier test left
// running may reach it while the next test sets it.
type testHook[F any] struct{ f atomic.Pointer[F] }

// get returns the hook's function, or nil when none is set.
func (h *testHook[F]) get() F {
	var zero F
	if f := h.f.Load(); f != nil {
		return *f
	}
	return zero
}

func (c *conn) writeCtlLocked(f ctlFrame) error {
	switch f.typ {
	case http2.FrameSettings:
		return c.fr.WriteSettingsAck()
	case http2.FramePing:
		return c.fr.WritePing(f.val != 1, f.ping)
	case http2.FrameWindowUpdate:
		return c.fr.WriteWindowUpdate(f.id, f.val)
	case http2.FrameRSTStream:
		return c.fr.WriteRSTStream(f.id, http2.ErrCode(f.val))
	case http2.FrameGoAway:
		return c.fr.WriteGoAway(f.id, http2.ErrCode(f.val), nil)
	}
	return nil
}

// lockWrite takes wmu for a write and notes when, on a conn whose
// keepalive reads it (a client's; a server's has none: no clock read on its
// writes).
func (c *conn) lockWrite() {
	c.wmu.Lock()
	if c.cfg.pingInterval > 0 {
		c.writing.Store(monotonic())
	}
	if c.cfg.writeStallTimeout > 0 {
		c.writeSeq.Add(1)
	}
}

// unlockWrite ends a write begun with lockWrite.
func (c *conn) unlockWrite() {
	if c.cfg.pingInterval > 0 {
		c.writing.Store(0)
	}
	if c.cfg.writeStallTimeout > 0 {
		c.writeSeq.Add(1)
	}
	c.wmu.Unlock()
}

// lockWriteCtx is lockWrite that gives up when ctx ends: a writer stuck in
// a write to a peer that reads nothing holds wmu until the keepalive or
// the kernel gives up on the peer, and a CONNECT must not wait that long
// past its own deadline.
func (c *conn) lockWriteCtx(ctx context.Context) error {
	if !c.wmu.TryLock() {
		locked := make(chan struct{})
		go func() {
			c.wmu.Lock()
			close(locked)
		}()
		select {
		case <-locked:
		case <-ctx.Done():
			go func() {
				<-locked
				c.wmu.Unlock()
			}()
			return ctx.Err()
		}
	}
	if c.cfg.pingInterval > 0 {
		c.writing.Store(monotonic())
	}
	if c.cfg.writeStallTimeout > 0 {
		c.writeSeq.Add(1)
	}
	return nil
}

// writeStalled reports whether the write in progress, if any, began at
// least d ago.
func (c *conn) writeStalled(d time.Duration) bool {
	w := c.writing.Load()
	return w != 0 && monotonic()-w >= int64(d)
}

// burstGap is how closely a DATA frame must follow the connection's previous
// one for writeData to wait for more before flushing. At one request at a
// time (fortio, 1000 qps, one connection: 1 ms apart) yielding for every
// frame was a tenth of an agent's CPU samples; in a fortio burst of 16 the
// frames come tens of microseconds apart. (A variable for the tests, whose
// single P runs both ends and spaces a burst's frames wider; atomic, as
// relays of a test's server may still write while the test restores it.)
var burstGap atomic.Int64 // nanoseconds

func init() { burstGap.Store(int64(100 * time.Microsecond)) }

// writeData writes one DATA frame. frame holds the 9-byte header space
// followed by the payload, so frame and payload go to TLS in one write.
func (c *conn) writeData(frame []byte, id uint32, end bool) error {
	n := len(frame) - frameHeaderLen
	var flags byte
	if end {
		flags = byte(http2.FlagDataEndStream)
	}
	frame[0], frame[1], frame[2] = byte(n>>16), byte(n>>8), byte(n)
	frame[3] = byte(http2.FrameData)
	frame[4] = flags
	frame[5], frame[6], frame[7], frame[8] = byte(id>>24), byte(id>>16), byte(id>>8), byte(id)
	c.dataWaiters.Add(1)
	c.lockWrite()
	c.dataWaiters.Add(-1)
	// A frame of more than two TLS records leaves in one write (a frame of one full
	// record and the few bytes past it is not worth a batch buffer and a copy).
	batch := c.cfg.batch != nil && len(frame) > 2*maxTLSRecord
	if batch {
		c.cfg.batch.begin()
	}
	_, err := c.bw.Write(frame)
	inBurst := monotonic()-c.lastData.Load() < burstGap.Load()
	if err == nil && c.dataWaiters.Load() == 0 && c.bw.Buffered() > 0 && !batch && inBurst {
		// Nobody queued behind us, but the goroutines the network poller
		// woke with ours (the other requests of a client's burst) may be
		// runnable and not yet here: let them add their frames first, so
		// that the burst leaves in one TLS record and one write(2) and the
		// peer's reader wakes once for it. With nothing runnable, Gosched
		// returns soon, but not for free: it wakes another thread to look
		// for work. So only a frame that follows another closely yields;
		// a lone request (the first of a burst too) is flushed at once.
		c.yields++
		c.unlockWrite()
		runtime.Gosched()
		c.lockWrite()
	}
	if err == nil && c.dataWaiters.Load() == 0 {
		// Nobody queued behind us: send now. Otherwise the last writer
		// of the burst sends everything (every wmu holder but a
		// writeData with a waiter flushes before it is done; one that
		// yielded above took wmu again to do so).
		err = c.bw.Flush()
	}
	if batch {
		if berr := c.cfg.batch.end(); err == nil {
			err = berr
		}
	}
	c.lastData.Store(monotonic())
	c.unlockWrite()
	if err != nil {
		c.close(http2.ErrCodeNo, fmt.Errorf("write data: %w", err), false)
		return fmt.Errorf("%w: %w", ErrConnClosed, err)
	}
	return nil
}

// writeHeadersLocked encodes fields and writes HEADERS (and CONTINUATION
// when the block exceeds the peer's frame size) into bw; the caller holds
// wmu and flushes.
func (c *conn) writeHeadersLocked(id uint32, fields []hpack.HeaderField, end bool) error {
	if limit := c.peerTableSize.Load(); limit != c.hencLimit {
		c.henc.SetMaxDynamicTableSizeLimit(limit)
		c.hencLimit = limit
	}
	c.hbuf.Reset()
	for _, f := range fields {
		if err := c.henc.WriteField(f); err != nil {
			return fmt.Errorf("encode header %s: %w", f.Name, err)
		}
	}
	block := c.hbuf.Bytes()
	max := int(c.peerMaxFrame.Load())
	first := true
	for first || len(block) > 0 {
		frag := block
		if len(frag) > max {
			frag = frag[:max]
		}
		block = block[len(frag):]
		var err error
		if first {
			err = c.fr.WriteHeaders(http2.HeadersFrameParam{
				StreamID:      id,
				BlockFragment: frag,
				EndStream:     end,
				EndHeaders:    len(block) == 0,
			})
		} else {
			err = c.fr.WriteContinuation(id, len(block) == 0, frag)
		}
		if err != nil {
			return err
		}
		first = false
	}
	return nil
}

// addActiveLocked counts a new (or reserved) stream.
func (c *conn) addActiveLocked() {
	c.active++
	if c.active == 1 && c.idleTimer != nil {
		c.idleTimer.Stop()
	}
}

// uncount stops counting s, ended both ways (its END_STREAM committed, see
// Stream.commitEnd), toward the peer's concurrent streams, before it is
// forgotten. A draining conn still closes only when forget finds it empty:
// our END_STREAM must go out first.
//
// Only a server does: its count is the limit it enforces on the client.
// A client's count is the server's limit, which the server keeps until it
// reads our END_STREAM, so a client stream counts until forget, after the
// END_STREAM is written; a slot freed at the commit let another stream's
// HEADERS go out before it, one too many there, and refused.
func (c *conn) uncount(s *Stream) {
	if c.cfg.client {
		return
	}
	c.mu.Lock()
	if c.streams[s.id] == s && !s.uncounted {
		s.uncounted = true
		c.active--
		c.ending++
	}
	c.mu.Unlock()
}

// emptyLocked reports whether the conn has no stream at all: none counted
// or reserved, and none whose END_STREAM is still being written (ending).
func (c *conn) emptyLocked() bool { return c.active == 0 && c.ending == 0 }

// releaseLocked uncounts stream s, unless uncount did, or a reserved slot
// that got no stream (s nil), and reports whether the conn, draining, has
// just become empty and should close.
func (c *conn) releaseLocked(s *Stream) (closeNow bool) {
	switch {
	case s == nil:
		c.active--
	case s.uncounted:
		c.ending-- // uncount took it out of active; now it is gone
	default:
		s.uncounted = true
		c.active--
	}
	if !c.emptyLocked() || c.err != nil {
		return false
	}
	if c.goAway {
		return true
	}
	if c.idleTimer != nil {
		c.idleSince = time.Now()
		c.idleTimer.Reset(c.cfg.idleTimeout)
	}
	return false
}

// forget removes a finished stream from the conn.
func (c *conn) forget(s *Stream) { c.remove(s, true, nil) }

// forgetAndReset forgets server stream s and queues its RST_STREAM in one
// step under mu. Forgotten first, the last stream of a draining conn closed
// the conn, and its reset, queued after, was dropped: the client saw the
// connection end rather than its stream reset.
func (c *conn) forgetAndReset(s *Stream, code http2.ErrCode) {
	c.remove(s, true, &ctlFrame{typ: http2.FrameRSTStream, id: s.id, val: uint32(code)})
}

// forgetUntilSent removes client stream s, which is about to be reset, from
// the conn, and reports whether it did; if so, s still counts toward the
// server's concurrent streams until its RST_STREAM is written (the control
// writer releases it). Released at once, its slot went to another stream
// whose HEADERS could be written before the reset: one stream too many at
// the server, refused.
func (c *conn) forgetUntilSent(s *Stream) bool { return c.remove(s, false, nil) }

// remove takes s out of the conn's streams, releasing its count if
// release, and reports whether s was there. reset, if not nil, is queued
// for the control writer in the same step, whether or not s was there:
// before the release can close a draining conn, whose close in order
// sends what is queued.
func (c *conn) remove(s *Stream, release bool, reset *ctlFrame) bool {
	s.mu.Lock()
	peerEnded := s.remoteEnded || s.peerReset
	s.mu.Unlock()
	c.mu.Lock()
	queued, flood := false, false
	if reset != nil && c.err == nil {
		queued, flood = true, c.queueLocked(*reset)
	}
	found := c.streams[s.id] == s
	closeNow := false
	if found {
		delete(c.streams, s.id)
		if peerEnded {
			c.notePeerClosedLocked(s.id)
		}
		closeNow = release && c.releaseLocked(s)
	}
	c.mu.Unlock()
	switch {
	case flood:
		c.closeControlFlood()
	case closeNow:
		c.closeDrained()
	case queued:
		c.wakeCtl()
	}
	return found
}

// idleForLocked reports whether the conn has had no streams for at least d and
// is still open. Timer callbacks use it to ignore stale firings.
func (c *conn) idleForLocked(d time.Duration) bool {
	return c.err == nil && c.emptyLocked() && !c.goAway && time.Since(c.idleSince) >= d
}

// drainAtPeerExpiry drains c when the chain the peer presented in state
// expires: the first end along it (peerChainEnd), since past an
// intermediate's end the leaf verifies no more (a CA need not clamp a
// leaf to its issuer's end). The handshake verified the peer's identity
// at that moment only; a connection can carry new streams for days, so
// without this a peer whose certificate ran out (a node that lost its CA,
// an identity that should be gone) would keep being served, and served as
// that identity. New streams go on a new connection instead, whose
// handshake checks a current certificate against the roots of that
// moment; streams open at expiry run to their end.
//
// end, when not nil, says when the chain stops verifying (PeerExpiry);
// without it the end is found by following issuer names (peerChainEnd),
// which a peer can mislead with certificates of its own making.
func (c *conn) drainAtPeerExpiry(state tls.ConnectionState, end PeerExpiry) {
	if len(state.PeerCertificates) == 0 {
		return
	}
	var notAfter time.Time
	if end != nil {
		notAfter = end(state)
	} else {
		notAfter = peerChainEnd(state.PeerCertificates)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.peerNotAfter = notAfter
		c.expiryTimer = expiryAfterFunc(time.Until(notAfter), c.drain)
	}
}

// PeerExpiry returns when the chain a peer presented in its handshake stops
// verifying; a connection is drained then. The TLS configurations that
// verify peers know the chains that verified; this package sees only what
// was presented.
type PeerExpiry func(tls.ConnectionState) time.Time

// peerChainEnd is the first end along the chain a peer presented, leaf
// first: each step goes to the presented certificate named as the
// current one's issuer (the latest-ending, if several carry that name, as
// cross-signed intermediates do), until none is or the chain reaches a
// self-issued one. Certificates the peer sent that the chain does not go
// through do not count: an expired one left in a CA's answer would
// otherwise make every connection to that peer expired at its handshake.
// Names, not signatures, are followed: the handshake verified a chain,
// and a peer that sends a false issuer only ends its own connection.
func peerChainEnd(certs []*x509.Certificate) time.Time {
	cur := certs[0]
	end := cur.NotAfter
	for range certs[1:] {
		if bytes.Equal(cur.RawIssuer, cur.RawSubject) {
			break
		}
		var next *x509.Certificate
		for _, c := range certs[1:] {
			if bytes.Equal(c.RawSubject, cur.RawIssuer) && (next == nil || c.NotAfter.After(next.NotAfter)) {
				next = c
			}
		}
		if next == nil {
			break
		}
		end = minTime(end, next.NotAfter)
		cur = next
	}
	return end
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// expiryAfterFunc is time.AfterFunc; tests replace it to stand for a timer
// that runs late.
var expiryAfterFunc = time.AfterFunc

// peerExpiredLocked reports whether the peer's chain has expired by the
// wall clock. The drain timer of drainAtPeerExpiry alone is not
// enough: it runs on the monotonic clock, which stops while the machine is
// suspended (a paused VM) and ignores a step of the wall clock, so it can
// fire hours after the certificate ran out. Every new stream asks this
// too, on both sides.
func (c *conn) peerExpiredLocked() bool {
	return !c.peerNotAfter.IsZero() && !time.Now().Before(c.peerNotAfter)
}

// drain stops new streams (GOAWAY) and closes the conn once the last
// stream finishes; one with none is closed now (closeDrained).
func (c *conn) drain() {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.goAway = true
	idle := c.emptyLocked()
	last := c.lastAccepted
	if !idle && !c.goAwaySent {
		c.goAwaySent = true
		c.ctl = append(c.ctl, ctlFrame{typ: http2.FrameGoAway, id: last, val: uint32(http2.ErrCodeNo)})
	}
	c.mu.Unlock()
	if idle {
		c.closeDrained()
		return
	}
	select {
	case c.ctlWake <- struct{}{}:
	default:
	}
}

// closeDrained closes a conn that drained (no new stream, none left), in
// order, on a goroutine of its own. A close in order writes GOAWAY and
// close_notify, and a peer that reads nothing holds each of those writes
// for closeWriteDeadline: run by the caller, the drains of a pod's stop, a
// trust change or a renewal, one connection after another, a Connect that
// drained a stale connection, and the close of a draining connection's
// last stream each waited about two seconds per such connection, so that
// one meshed client holding hundreds of idle ones held a pod's stop for
// minutes (TestDrainIdleStalledPeersBounded).
func (c *conn) closeDrained() {
	go c.close(http2.ErrCodeNo, fmt.Errorf("%w: drained", ErrConnClosed), true)
}

// close kills the conn once: optionally tells the peer why (GOAWAY), closes
// the socket, fails every stream and tells the owner.
func (c *conn) close(code http2.ErrCode, cause error, sendGoAway bool) {
	c.closeConn(code, cause, sendGoAway, false)
}

// closeAll closes conns in order, all at once, and returns once every one is
// closed. A close in order waits for the write lock, which a writer blocked
// on a peer that reads nothing holds until the close's write deadline
// (closeWriteDeadline) fails its write: one after another, those waits
// added up to a second per such connection, and a peer holding hundreds
// held a pod's stop (and the reconcile waiting on it) for minutes.
func closeAll(conns []*conn, code http2.ErrCode, cause error) {
	var wg sync.WaitGroup
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.close(code, cause, true)
		}()
	}
	wg.Wait()
}

// releaseWindowLocked gives the connection's reserved receive window back
// to the process-wide budget, once.
func (c *conn) releaseWindowLocked() {
	if c.windows == nil {
		return // never started
	}
	c.windows.release(c.windowOwner, c.windowRemote, c.recvReserved)
	c.windows.untrack(c.windowOwner, c)
	c.recvReserved = 0
}

// giveBackIfIdle is windowHolder's: an idle conn gives its reserved window
// to another client's new connection and is drained, in order, as an idle
// timeout would. Its peer opens a new connection when it needs one.
func (c *conn) giveBackIfIdle() bool {
	c.mu.Lock()
	if !c.idleForLocked(0) || c.recvReserved == 0 {
		c.mu.Unlock()
		return false
	}
	c.goAway = true // no stream may start on a window no longer reserved
	c.releaseWindowLocked()
	c.mu.Unlock()
	go c.close(http2.ErrCodeNo, fmt.Errorf("%w: idle, its receive window given to another client", ErrConnClosed), true)
	return true
}

// countProtocolError counts the conn as closed because its peer broke
// HTTP/2.
func (c *conn) countProtocolError() {
	if c.cfg.onProtocolError != nil {
		c.cfg.onProtocolError()
	}
}

// closeConn is close; linger (for the reader, closing because of what the
// peer sent) ends the socket with lingerClose.
func (c *conn) closeConn(code http2.ErrCode, cause error, sendGoAway, linger bool) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	if !errors.Is(cause, ErrConnClosed) {
		cause = fmt.Errorf("%w: %w", ErrConnClosed, cause)
	}
	c.err = cause
	c.goAway = true
	c.releaseWindowLocked()
	// A close in order (no error, the peer told) first sends the control
	// frames still queued: the resets of streams given up on just before a
	// drain's close must reach the peer as resets, not as a vanished
	// connection. The control writer stops at done and would drop them.
	var pending []ctlFrame
	inOrder := sendGoAway && code == http2.ErrCodeNo
	if inOrder {
		pending, c.ctl = c.ctl, nil
	}
	sendGoAway = sendGoAway && !c.goAwaySent
	last := c.lastAccepted
	var debug []byte
	if code != http2.ErrCodeNo {
		debug = []byte(c.goAwayDebug)
	}
	streams := make([]*Stream, 0, len(c.streams))
	for _, s := range c.streams {
		streams = append(streams, s)
		s.sendCond.Broadcast()
	}
	for _, s := range c.connWaiters {
		s.sendCond.Broadcast()
	}
	if c.idleTimer != nil {
		c.idleTimer.Stop()
	}
	if c.expiryTimer != nil {
		c.expiryTimer.Stop()
	}
	if c.pingTimer != nil {
		c.pingTimer.Stop()
	}
	if c.stallTimer != nil {
		c.stallTimer.Stop()
	}
	c.mu.Unlock()

	close(c.done)
	c.cancel()
	if sendGoAway || len(pending) > 0 || inOrder {
		// Bound the write: a peer that stopped reading must not hold us.
		// In order, wmu is taken even with nothing to write: the control
		// writer may hold frames it took before the close (ctlLoop), which
		// must go out before the connection ends.
		_ = c.nc.SetWriteDeadline(time.Now().Add(closeWriteDeadline))
		c.lockWrite()
		var err error
		for _, f := range pending {
			if err = c.writeCtlLocked(f); err != nil {
				break
			}
		}
		if err == nil && sendGoAway {
			err = c.fr.WriteGoAway(last, code, debug)
		}
		if err == nil {
			_ = c.bw.Flush()
		}
		c.unlockWrite()
	}
	switch {
	case inOrder && !linger:
		// As lingerClose, by the reader: the peer gets close_notify after our
		// last frames, and the reader reads until the peer closes (or a
		// second passes) and then closes the socket. Closing now, with bytes
		// of the peer's unread, would make the kernel answer with a TCP reset,
		// which can destroy those frames before the peer read them.
		c.closeByReader.Store(true)
		c.closeWrite(time.Now().Add(closeWriteDeadline))
	case !linger:
		if c.cfg.batch != nil {
			c.cfg.batch.abort()
			// The socket first: no close_notify is owed to a peer closed
			// on an error, and tls.Conn.Close, with no Write of ours in
			// flight, waits for crypto/tls's write lock to send one; the
			// reader may hold that lock in a write that never ends (the
			// answer to a KeyUpdate, to a peer that stopped reading), and
			// the streams would fail only when TCP gave up.
			_ = c.cfg.batch.Conn.Close()
		}
		_ = c.nc.Close()
	}
	for _, s := range streams {
		s.abort(cause)
	}
	if code != http2.ErrCodeNo {
		c.cfg.log.Debug("hbone connection closed", "remote", c.nc.RemoteAddr(), "code", code, "err", cause)
	}
	c.ready()
	if c.cfg.onClose != nil {
		c.cfg.onClose(c)
	}
	if linger {
		c.lingerClose()
	}
}

// lingerClose ends the socket of a conn closed while the peer may still be
// sending: it tells the peer (TLS close_notify) and reads what is in
// flight, for at most a second and 1 MiB, before closing. Closing with
// unread bytes would make the kernel answer with a TCP reset, which can
// destroy the GOAWAY that says why before the peer read it.
func (c *conn) lingerClose() {
	c.closeWrite(time.Now().Add(closeWriteDeadline))
	_, _ = io.CopyN(io.Discard, c.nc, 1<<20)
	_ = c.nc.Close()
}

// closeWrite sends close_notify, its write bounded by deadline (a peer that
// stopped reading must not hold us), and gives the peer until deadline to
// close its side. crypto/tls sets a write deadline of its own on
// close_notify, 5 s, over ours: so the socket is closed under a write still
// blocked at deadline, as nothing more can reach that peer anyway.
func (c *conn) closeWrite(deadline time.Time) {
	if cw, ok := c.nc.(interface{ CloseWrite() error }); ok {
		_ = c.nc.SetWriteDeadline(deadline)
		if c.cfg.batch != nil {
			raw := c.cfg.batch.Conn
			t := time.AfterFunc(time.Until(deadline), func() { _ = raw.Close() })
			defer t.Stop()
		}
		_ = cw.CloseWrite()
	}
	_ = c.nc.SetReadDeadline(deadline)
}

// ready calls onReady once.
func (c *conn) ready() {
	if c.cfg.onReady != nil {
		c.readyOnce.Do(func() { c.cfg.onReady(c) })
	}
}
