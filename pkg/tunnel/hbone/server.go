package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// ServerRequest is a validated CONNECT request, as the Handler sees it.
type ServerRequest struct {
	// Authority is the raw :authority; Target is it parsed. The Handler
	// still has to check that Target is one of its pods.
	Authority string
	Target    netip.AddrPort
	// Forwarded is the Forwarded header (several joined with ", ").
	Forwarded string
	// Header holds the other regular request headers.
	Header http.Header
	// TLS is the connection's state; TLS.PeerCertificates carry the
	// client's identity.
	TLS        *tls.ConnectionState
	RemoteAddr net.Addr
	LocalAddr  net.Addr
}

// Response is the Handler's decision on a request.
type Response struct {
	// Upstream, when set, accepts the tunnel: the server answers 200 and
	// relays between the stream and Upstream, then closes both.
	Upstream net.Conn
	// Status and Reason refuse the tunnel when Upstream is nil: 403 for
	// policy, 502/503 when the application cannot be reached. Status 0
	// means 503. Reason is sent in ReasonHeader and the body.
	Status int
	Reason string
	// Done, if set, is called after the relay with the bytes that went
	// from the client to Upstream and back, for metrics.
	Done func(fromClient, toClient int64, err error)
	// Counts, if set, are added to as the relay moves bytes (AToB from
	// the client to Upstream), so they can be read while it runs; at
	// Done they equal Done's counts.
	Counts *Counts
}

// Handler decides what to do with a CONNECT: check the target, authorize
// the peer, dial the application. ctx is the stream's: it ends when the
// client resets the stream, the connection dies or the server is closed, so
// the dial must use it. A handler's slot (MaxConcurrentStreams of them per
// connection) is held until it returned and the relay it started ended.
type Handler func(ctx context.Context, req *ServerRequest) Response

// ServerOptions configure a Server. Zero values pick the defaults.
type ServerOptions struct {
	// TLSConfig must require and verify client certificates; ALPN h2 is
	// added when missing.
	TLSConfig *tls.Config
	Handler   Handler
	// MaxConcurrentStreams per connection, advertised in SETTINGS; more
	// are refused with REFUSED_STREAM. It also bounds the handlers (and
	// relays) running for a connection, however quickly their streams were
	// reset; requests beyond wait, up to 4 times as many, and more close
	// the connection with GOAWAY ENHANCE_YOUR_CALM. Default 200, as
	// ztunnel.
	MaxConcurrentStreams uint32
	// MaxEarlyResets is how many streams a client may reset before they
	// were answered, at once and again every 10 s; more close the
	// connection with GOAWAY ENHANCE_YOUR_CALM (rapid reset,
	// CVE-2023-44487). Resets the server sends for stream errors the
	// client caused count too (MadeYouReset, CVE-2025-8671). Default 100,
	// what one pooled client connection (100 streams) can reset when all
	// its CONNECTs time out together.
	MaxEarlyResets int
	// HandshakeTimeout bounds the TLS handshake, and then the HTTP/2
	// preface up to the client's first SETTINGS frame. Default 10s.
	HandshakeTimeout time.Duration
	// Limiter bounds open connections and handshakes. Share one between
	// the Servers of a process; nil gives the Server its own, with the
	// default limits.
	Limiter *ConnLimiter
	// IdleTimeout closes connections without streams for this long.
	// Default 5m, longer than the client pool's, so clients normally close
	// first and never race a server-side close.
	IdleTimeout time.Duration
	// WriteStallTimeout closes a connection when one write to the client
	// has made no progress for this long (at most half as long again): a
	// client that reads nothing of ours. Default 20s, as the pool's
	// keepalive timeout.
	WriteStallTimeout time.Duration
	// PeerExpiry says when a client's chain stops verifying, which its
	// connection is drained at; nil follows the presented chain by
	// issuer names.
	PeerExpiry PeerExpiry
	Logger     *slog.Logger
}

// ServerStats counts what the server did, for metrics and tests.
type ServerStats struct {
	ConnsAccepted     uint64 // TCP connections accepted
	ConnsActive       uint64 // HTTP/2 connections currently served
	HandshakeFailures uint64 // TLS handshakes (or ALPN) that failed
	StreamsOK         uint64 // tunnels established (200)
	StreamsBadRequest uint64 // malformed requests: 400, 405, 431
	StreamsDenied     uint64 // refused by the Handler
	StreamsRefused    uint64 // REFUSED_STREAM: stream limit or draining
	// ConnsRefused counts connections closed at accept because a
	// ConnLimiter limit was reached.
	ConnsRefused uint64
	// StreamsEarlyReset counts streams reset before they were answered,
	// by the client or by the server for a stream error the client caused
	// (a bad WINDOW_UPDATE, a second HEADERS, DATA beyond the window...);
	// ConnsFlood connections closed with GOAWAY
	// ENHANCE_YOUR_CALM (too many of those, a full handler queue, or a
	// flood of frames that carry nothing).
	StreamsEarlyReset uint64
	ConnsFlood        uint64
	// ConnsProtocolError counts connections closed because the client
	// broke HTTP/2: GOAWAY with the error's code.
	ConnsProtocolError uint64
	// AcceptErrors counts failed Accepts (EMFILE, ENFILE, ENOBUFS, ...),
	// each followed by a backoff.
	AcceptErrors uint64
	// RefusalsCut counts refused streams (4xx, 5xx) reset before their
	// body went out, because the client granted no send window for it
	// within refuseWriteTimeout.
	RefusalsCut uint64
	// ConnsWriteStalled counts connections closed because a write to the
	// client made no progress for WriteStallTimeout.
	ConnsWriteStalled uint64
	// OwnCertificateDrains counts connections drained because of the
	// certificate the server presented on them: its chain ended, a new
	// handshake would present another (renewed, replaced), or a trust
	// change refused it (presented.go).
	OwnCertificateDrains uint64
	// HandlersHeld and HandlersQueued are the streams holding a handler
	// slot now (deciding, dialling, refusing or relaying; at most
	// MaxConcurrentStreams per connection) and those waiting for one (at
	// most 4 times as many).
	HandlersHeld, HandlersQueued uint64
}

type serverCounters struct {
	connsAccepted, connsActive, handshakeFailures        atomic.Uint64
	streamsOK, streamsBadRequest, streamsDenied, refused atomic.Uint64
	connsRefused, earlyResets, floods, acceptErrors      atomic.Uint64
	refusalsCut, protocolErrors, ownDrains, writeStalls  atomic.Uint64
	handlersHeld, handlersQueued                         atomic.Int64
}

// Server accepts HBONE connections and serves their CONNECT streams.
type Server struct {
	opts    ServerOptions
	tlsConf *tls.Config
	log     *slog.Logger
	ctx     context.Context // parent of every conn's context
	cancel  context.CancelFunc
	stats   serverCounters
	// trust sees a trust change that DrainPeers applied while one of the
	// server's handshakes was under way; presentedTrust one that
	// DrainPresented applied. serving is what a new handshake presents.
	trust          trustChanges
	presentedTrust presentedChanges
	serving        servingCert
	limiter        *ConnLimiter
	// backingOff counts Serve loops waiting after an accept error.
	backingOff atomic.Int32

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
	closed    bool
	// wg counts Serve calls, connection goroutines and stream goroutines,
	// so Shutdown knows when everything finished.
	wg sync.WaitGroup
}

// NewServer returns a server; call Serve to accept connections.
func NewServer(opts ServerOptions) (*Server, error) {
	if opts.TLSConfig == nil {
		return nil, errors.New("hbone server needs a TLS config")
	}
	if opts.Handler == nil {
		return nil, errors.New("hbone server needs a handler")
	}
	if opts.MaxConcurrentStreams == 0 {
		opts.MaxConcurrentStreams = 200
	}
	if opts.MaxEarlyResets <= 0 {
		opts.MaxEarlyResets = 100
	}
	limiter := opts.Limiter
	if limiter == nil {
		limiter = NewConnLimiter(ConnLimits{})
	}
	if opts.HandshakeTimeout <= 0 {
		opts.HandshakeTimeout = 10 * time.Second
	}
	if opts.IdleTimeout <= 0 {
		opts.IdleTimeout = 5 * time.Minute
	}
	if opts.WriteStallTimeout <= 0 {
		opts.WriteStallTimeout = 20 * time.Second
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	tlsConf := withH2(opts.TLSConfig)
	return &Server{
		opts:      opts,
		tlsConf:   tlsConf,
		serving:   servingCert{conf: tlsConf},
		log:       log,
		ctx:       ctx,
		cancel:    cancel,
		limiter:   limiter,
		listeners: make(map[net.Listener]struct{}),
		conns:     make(map[*conn]struct{}),
	}, nil
}

// Stats returns a snapshot of the counters.
func (srv *Server) Stats() ServerStats {
	st := &srv.stats
	return ServerStats{
		ConnsAccepted:        st.connsAccepted.Load(),
		ConnsActive:          st.connsActive.Load(),
		HandshakeFailures:    st.handshakeFailures.Load(),
		StreamsOK:            st.streamsOK.Load(),
		StreamsBadRequest:    st.streamsBadRequest.Load(),
		StreamsDenied:        st.streamsDenied.Load(),
		StreamsRefused:       st.refused.Load(),
		ConnsRefused:         st.connsRefused.Load(),
		StreamsEarlyReset:    st.earlyResets.Load(),
		ConnsFlood:           st.floods.Load(),
		ConnsProtocolError:   st.protocolErrors.Load(),
		AcceptErrors:         st.acceptErrors.Load(),
		RefusalsCut:          st.refusalsCut.Load(),
		ConnsWriteStalled:    st.writeStalls.Load(),
		OwnCertificateDrains: st.ownDrains.Load(),
		HandlersHeld:         uint64(max(st.handlersHeld.Load(), 0)),
		HandlersQueued:       uint64(max(st.handlersQueued.Load(), 0)),
	}
}

// Accepting reports whether the server takes new connections: it is not
// closed and no Serve loop is backing off after an accept error (EMFILE,
// ENFILE, ENOBUFS...). Readiness should report it: a listener that does
// not accept leaves captured connections waiting in its backlog.
func (srv *Server) Accepting() bool {
	return srv.backingOff.Load() == 0 && !srv.isClosed()
}

// Serve accepts connections on l until l is closed or the server shuts
// down, then returns ErrServerClosed (or the error for a listener closed
// under it). Any other accept error (EMFILE, ENFILE, ENOBUFS, ENOMEM, a
// connection aborted in the queue) is counted and retried after a backoff
// of 5 ms doubling to 1 s, as net/http does: giving up would leave the
// listener open with nobody accepting, and captured connections would hang.
func (srv *Server) Serve(l net.Listener) error {
	srv.mu.Lock()
	if srv.closed {
		srv.mu.Unlock()
		return ErrServerClosed
	}
	srv.listeners[l] = struct{}{}
	srv.wg.Add(1)
	srv.mu.Unlock()
	defer func() {
		srv.mu.Lock()
		delete(srv.listeners, l)
		srv.mu.Unlock()
		srv.wg.Done()
	}()

	var backoff time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			if srv.isClosed() {
				return ErrServerClosed
			}
			if errors.Is(err, net.ErrClosed) {
				return fmt.Errorf("hbone accept: %w", err)
			}
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			srv.stats.acceptErrors.Add(1)
			srv.log.Warn("hbone accept failed, retrying", "err", err, "backoff", backoff)
			srv.backingOff.Add(1)
			select {
			case <-time.After(backoff):
			case <-srv.ctx.Done():
			}
			srv.backingOff.Add(-1)
			continue
		}
		backoff = 0
		srv.stats.connsAccepted.Add(1)
		src := sourceAddr(nc.RemoteAddr())
		hs, refusedBy := srv.limiter.admit(src, nc)
		if hs == nil {
			srv.log.Debug("hbone connection refused at accept", "remote", nc.RemoteAddr(), "limit", refusedBy)
			// Over a limit: closed at once, so a flood holds no fd.
			srv.stats.connsRefused.Add(1)
			_ = nc.Close()
			continue
		}
		srv.wg.Add(1)
		go srv.serveConn(nc, hs)
	}
}

func (srv *Server) isClosed() bool {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	return srv.closed
}

// maxClientHandshake bounds the bytes a server reads from a client during the
// TLS handshake: its ClientHello (a few KiB, post-quantum key shares
// included; a second after a HelloRetryRequest), certificate chain,
// CertificateVerify and Finished. crypto/tls takes a Certificate message of
// up to 256 KiB and parses every certificate in it before VerifyConnection
// can refuse the chain for its length: a client with no valid certificate
// made each handshake cost several times an honest one (some 1000 small
// certificates), beyond what the handshake rate limit per source was set
// for, and held that much per handshake slot. A chain of 8 certificates
// with RSA keys of 8192 bits (what the identity package accepts at most)
// takes some 20 KiB. The bound is on bytes read from the socket, and the
// handshake's last read may take as much of the client's first application
// data as its buffer holds (up to its largest record so far): twice the
// largest honest handshake, and more.
const maxClientHandshake = 64 << 10

// errHandshakeTooLarge fails a handshake that reads more than maxClientHandshake.
var errHandshakeTooLarge = fmt.Errorf("client sent more than %d bytes in its TLS handshake, more than any honest client", maxClientHandshake)

// serveConn handshakes and then runs the conn's reader on this goroutine.
// The connection holds its handshake slot hs until the client's first
// SETTINGS frame, or its end.
func (srv *Server) serveConn(nc net.Conn, hs *handshakeSlot) {
	defer srv.wg.Done()
	defer srv.limiter.release(hs)
	defer srv.limiter.handshakeDone(hs)
	batch := newBatchConn(nc)
	var presented *presentedCert
	tc := tls.Server(batch, serving(srv.tlsConf, &presented))
	gens := trustGens{peer: srv.trust.generation(), own: srv.presentedTrust.generation()}
	ctx, cancel := context.WithTimeout(srv.ctx, srv.opts.HandshakeTimeout)
	batch.limitRead(maxClientHandshake, errHandshakeTooLarge)
	err := tc.HandshakeContext(ctx)
	batch.unlimitRead()
	cancel()
	if err == nil {
		if proto := tc.ConnectionState().NegotiatedProtocol; proto != "h2" {
			err = fmt.Errorf("client negotiated ALPN %q, want h2", proto)
			answerNoH2(tc, nc)
		}
	} else if answerPlaintext(err, nc) {
		err = fmt.Errorf("client spoke plaintext HTTP: %w", err)
	}
	if err != nil {
		srv.stats.handshakeFailures.Add(1)
		srv.log.Debug("hbone handshake failed", "remote", nc.RemoteAddr(), "err", err)
		_ = nc.Close()
		return
	}
	state := tc.ConnectionState()
	srv.serveHTTP2(tc, &state, presented, batch, gens, func() { srv.limiter.handshakeDone(hs) })
}

// trustGens are the trust changes (DrainPeers, DrainPresented) seen before
// a handshake.
type trustGens struct{ peer, own uint64 }

// serveHTTP2 serves HTTP/2 on an established (TLS) connection until it
// dies; presented is the certificate its handshake presented (nil: none);
// onPreface, if not nil, runs once the client's first SETTINGS frame
// arrived.
func (srv *Server) serveHTTP2(nc net.Conn, state *tls.ConnectionState, presented *presentedCert, batch *batchConn, gens trustGens, onPreface func()) {
	var c *conn
	c = newConn(srv.ctx, nc, connConfig{
		batch:           batch,
		maxStreams:      srv.opts.MaxConcurrentStreams,
		idleTimeout:     srv.opts.IdleTimeout,
		prefaceTimeout:  srv.opts.HandshakeTimeout,
		onPreface:       onPreface,
		log:             srv.log,
		onIdle:          srv.onIdle,
		onClose:         srv.onClose,
		onRequest:       func(s *Stream, f *http2.MetaHeadersFrame) error { return srv.startStream(c, s, f) },
		onRefused:       func() { srv.stats.refused.Add(1) },
		maxEarlyResets:  srv.opts.MaxEarlyResets,
		onEarlyReset:    func() bool { return srv.earlyReset(c) },
		onFlood:         func() { srv.stats.floods.Add(1) },
		onProtocolError: func() { srv.stats.protocolErrors.Add(1) },
		checkPresented:  func() { srv.checkPresented(c) },

		writeStallTimeout: srv.opts.WriteStallTimeout,
		onWriteStall:      func() { srv.stats.writeStalls.Add(1) },
	})
	c.tlsState = state
	c.presented = presented

	// The preface (SETTINGS) goes first, and only then is the conn
	// registered where Shutdown finds and drains it: a GOAWAY must never
	// precede the SETTINGS a client expects first.
	if err := c.start(); err != nil {
		c.close(http2.ErrCodeNo, err, false)
		return
	}
	srv.mu.Lock()
	closing := srv.closed
	srv.conns[c] = struct{}{}
	srv.stats.connsActive.Add(1)
	srv.mu.Unlock()
	srv.trust.recheck(gens.peer, c)
	if presented != nil && srv.presentedTrust.refuses(gens.own, presented.cert) {
		srv.stopPresented(c, reasonTrustRefuses)
	}
	select {
	case <-c.done:
		// Closed before it was registered (its idle timer runs from
		// newConn): its onClose found nothing to remove, so it would
		// stay registered and counted for good.
		srv.onClose(c)
		return
	default:
	}
	if closing {
		// Accepted before Shutdown closed the listener, handshaken after:
		// the client has most likely sent its first request already.
		// Closing without a word would fail it (the client cannot tell
		// it was never processed); GOAWAY says so, and the client retries
		// it elsewhere (in an upgrade, on the successor's listener).
		c.drain()
	}
	// After the registration: a drain that closes the conn at once must
	// find it registered, or onClose would leave it counted.
	if state != nil {
		c.drainAtPeerExpiry(*state, srv.opts.PeerExpiry)
	}
	c.readLoop()
}

// earlyReset counts a stream of c reset before its answer and takes it from
// the budget of c's client address, shared by all its connections to the
// servers of the limiter: false when that address floods.
func (srv *Server) earlyReset(c *conn) bool {
	srv.stats.earlyResets.Add(1)
	return srv.limiter.takeEarlyReset(c.peer)
}

// onIdle closes c if it is still idle. The check and the end of new
// streams are one step under c.mu, as in Pool.onIdle: a CONNECT the reader
// took between them would be accepted, its handler run, and then failed by
// the close under a GOAWAY naming it processed, so its client could not
// retry it. Taken after, it is refused (REFUSED_STREAM) and beyond the
// GOAWAY's last stream.
func (srv *Server) onIdle(c *conn) {
	c.mu.Lock()
	idle := c.idleForLocked(srv.opts.IdleTimeout)
	if idle {
		c.goAway = true
	}
	c.mu.Unlock()
	if f := testHookIdleChecked.get(); idle && f != nil {
		f(c)
	}
	if idle {
		c.close(http2.ErrCodeNo, fmt.Errorf("%w: idle", ErrConnClosed), true)
	}
}

// testHookIdleChecked, if set, runs in Server.onIdle between finding the
// conn idle and closing it: tests widen that window.
var testHookIdleChecked testHook[func(c *conn)]

func (srv *Server) onClose(c *conn) {
	srv.mu.Lock()
	if _, ok := srv.conns[c]; ok {
		delete(srv.conns, c)
		srv.stats.connsActive.Add(^uint64(0))
	}
	srv.mu.Unlock()
}

// startStream runs on the conn's reader goroutine: it must not block. It
// admits the request's handler as x/net's scheduleHandler does: at most
// MaxConcurrentStreams handlers run per conn, counted until they end
// whatever their stream did, and a bounded queue waits for them.
func (srv *Server) startStream(c *conn, s *Stream, f *http2.MetaHeadersFrame) error {
	// The stream counts toward its address's handlers from here until
	// handlerDone, run or dropped from the queue.
	if !srv.limiter.takeHandler(c.peer) {
		srv.stats.refused.Add(1)
		return c.refuseOpened(s, "streams over their address's handler limit")
	}
	p := pendingStream{s: s, fields: f.Fields, truncated: f.Truncated}
	limit := int(srv.opts.MaxConcurrentStreams)
	c.mu.Lock()
	if c.handlers < limit {
		c.handlers++
		c.mu.Unlock()
		srv.runHandler(c, p)
		return nil
	}
	if len(c.pending) >= pendingPerStream*limit {
		c.mu.Unlock()
		srv.limiter.releaseHandler(c.peer)
		return &floodError{reason: "handler queue full: streams reset faster than their handlers end"}
	}
	c.pending = append(c.pending, p)
	c.mu.Unlock()
	srv.stats.handlersQueued.Add(1)
	return nil
}

// runHandler starts p's handler on a goroutine holding one of c's handler
// slots.
func (srv *Server) runHandler(c *conn, p pendingStream) {
	srv.wg.Add(1) // the conn goroutine or a handler holds a count, so this cannot race Wait at zero
	srv.stats.handlersHeld.Add(1)
	go srv.serveStream(c, p.s, p.fields, p.truncated)
}

// handlerDone gives back a handler slot and starts the first queued
// request whose stream is still open; requests whose stream ended while
// they waited are dropped without running, and closed, which gives their
// buffered bytes back to the connection window.
func (srv *Server) handlerDone(c *conn) {
	c.mu.Lock()
	c.handlers--
	var next *pendingStream
	var dropped []*Stream
	i := 0
	for ; i < len(c.pending) && next == nil; i++ {
		if p := c.pending[i]; p.s.ctx.Err() == nil {
			next = &p
			c.handlers++
		} else {
			dropped = append(dropped, p.s)
		}
		c.pending[i] = pendingStream{}
	}
	c.pending = c.pending[i:]
	if len(c.pending) == 0 {
		c.pending = nil
	}
	c.mu.Unlock()
	srv.limiter.releaseHandler(c.peer) // the handler that ended
	for range dropped {
		srv.limiter.releaseHandler(c.peer)
	}
	srv.stats.handlersHeld.Add(-1)
	srv.stats.handlersQueued.Add(-int64(i))
	for _, s := range dropped {
		s.Close()
	}
	if next != nil {
		srv.runHandler(c, *next)
	}
}

// releaseQueued closes s, just reset, if it waits in c's handler queue:
// its handler will never run, and nothing else would read or release the
// DATA it buffered, which would hold the connection's receive window
// (shared by every stream of the conn) until a handler slot frees, however
// long the running handlers take. The entry stays queued, as in x/net, so
// streams reset faster than handlers end still fill the queue (handlerDone
// drops it).
func (c *conn) releaseQueued(s *Stream) {
	c.mu.Lock()
	queued := c.err == nil && slices.ContainsFunc(c.pending, func(p pendingStream) bool { return p.s == s })
	c.mu.Unlock()
	if queued {
		s.Close() // reset already: no RST_STREAM, only the window back
	}
}

// serveStream runs a request's handler and then its relay, holding its
// handler slot (and a count in wg) until both ended.
func (srv *Server) serveStream(c *conn, s *Stream, fields []hpack.HeaderField, truncated bool) {
	relaying := false
	defer func() {
		if !relaying {
			srv.handlerDone(c)
			srv.wg.Done()
		}
	}()
	if s.ctx.Err() != nil {
		// Reset before its handler ran: nothing to answer, nothing to
		// dial, but the DATA it buffered goes back to the connection window.
		s.Close()
		return
	}
	req, status, reason, malformed := parseRequest(fields, truncated)
	if status != 0 {
		srv.stats.streamsBadRequest.Add(1)
		srv.log.Debug("hbone request rejected", "remote", c.nc.RemoteAddr(), "status", status, "reason", reason)
		cut := false
		if malformed {
			cut = s.refuseMalformed(status, reason)
		} else {
			cut = s.refuse(status, reason)
		}
		srv.noteRefusalCut(c, cut)
		return
	}
	req.TLS = c.tlsState
	req.RemoteAddr = c.nc.RemoteAddr()
	req.LocalAddr = c.nc.LocalAddr()

	resp := srv.callHandler(s.ctx, req)
	if resp.Upstream == nil {
		status := resp.Status
		if status < 300 || status > 599 {
			status = http.StatusServiceUnavailable
		}
		srv.stats.streamsDenied.Add(1)
		srv.log.Debug("hbone request denied", "remote", c.nc.RemoteAddr(), "target", req.Target, "status", status, "reason", resp.Reason)
		srv.noteRefusalCut(c, s.refuse(status, resp.Reason))
		return
	}
	if err := s.writeResponse(http.StatusOK, "", false); err != nil {
		_ = resp.Upstream.Close()
		s.Close()
		if resp.Done != nil {
			resp.Done(0, 0, err)
		}
		return
	}
	srv.stats.streamsOK.Add(1)
	// The relay runs on a fresh goroutine and this one ends: its stack grew
	// deep in the handler (the dial) and the response write, and would
	// stay that size for the life of the tunnel. It inherits this
	// goroutine's handler slot and wg count.
	relaying = true
	go func() {
		defer srv.wg.Done()
		defer srv.handlerDone(c)
		fromClient, toClient, err := RelayCounting(s, resp.Upstream, resp.Counts)
		if resp.Done != nil {
			resp.Done(fromClient, toClient, err)
		}
	}()
}

// noteRefusalCut counts and logs a refusal whose body the client granted no
// window for (writeRefusalBody).
func (srv *Server) noteRefusalCut(c *conn, cut bool) {
	if !cut {
		return
	}
	srv.stats.refusalsCut.Add(1)
	srv.log.Debug("hbone refusal body cut: the client granted no flow-control window for it in time, or too many refusals waited for window", "remote", c.nc.RemoteAddr())
}

// refuseWriteTimeout bounds how long a refusal's body waits for the
// client's flow-control window. The body only repeats the reason header, and
// a client that grants no window (SETTINGS_INITIAL_WINDOW_SIZE 0, no
// connection WINDOW_UPDATE) would otherwise hold the refused stream's
// handler slot, which no tunnel limit counts (there is no app socket), for
// as long as the connection lives. A variable for the tests.
var refuseWriteTimeout = 5 * time.Second

// refusalWaits bounds the refusals of the whole process whose body waits for
// a client's window at once; a refusal past it is cut at once (the status
// and reason header went out already). Without it, a peer's refused streams
// held a goroutine each for refuseWriteTimeout: MaxConcurrentStreams per
// connection on MaxConnsPerSource connections per address, some 200,000
// goroutines for one client address, and more for every other one. A client
// that grants window needs no slot (refusalNoWait). A variable for the
// tests.
var refusalWaits = make(chan struct{}, 1024)

// refuse answers with an error status, the reason in a header and the body,
// then closes the stream; RST_STREAM(NO_ERROR) tells a client still sending
// that it can stop (RFC 9113 §8.1). It reports whether the body was cut
// because the client granted no window for it in time.
func (s *Stream) refuse(status int, reason string) (cut bool) {
	reason = sanitizeReason(reason)
	if reason == "" {
		reason = http.StatusText(status)
	}
	if err := s.writeResponse(status, reason, false); err == nil {
		cut = s.writeRefusalBody(reason)
		if !cut {
			_ = s.CloseWrite()
		}
	}
	s.closeWithCode(http2.ErrCodeNo)
	return cut
}

// refuseMalformed answers a malformed request (RFC 9113 §8.1.1): the status
// and reason, then RST_STREAM(PROTOCOL_ERROR) instead of END_STREAM. It
// reports whether the body was cut, as refuse.
func (s *Stream) refuseMalformed(status int, reason string) (cut bool) {
	reason = sanitizeReason(reason)
	if err := s.writeResponse(status, reason, false); err == nil {
		cut = s.writeRefusalBody(reason)
	}
	s.closeWithCode(http2.ErrCodeProtocol)
	return cut
}

// writeRefusalBody writes a refusal's body, and reports whether it was cut:
// a client with window gets it at once; one without gets it if it grants
// window within refuseWriteTimeout and a slot of refusalWaits is free to
// wait with.
func (s *Stream) writeRefusalBody(reason string) (cut bool) {
	body := []byte(reason + "\n")
	_ = s.SetWriteDeadline(time.Now().Add(refusalNoWait))
	n, err := s.Write(body)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		waits := refusalWaits // the slot goes back to the channel it came from
		select {
		case waits <- struct{}{}:
			_ = s.SetWriteDeadline(time.Now().Add(refuseWriteTimeout))
			_, err = s.Write(body[n:])
			<-waits
		default:
		}
	}
	_ = s.SetWriteDeadline(time.Time{})
	return errors.Is(err, os.ErrDeadlineExceeded)
}

// refusalNoWait is how long a refusal's body waits for window before it
// needs a slot of refusalWaits: long enough for a write that has its window
// to go through, not to wait for one.
const refusalNoWait = time.Millisecond

// sanitizeReason makes reason safe to send to a remote peer: file system
// paths (netns paths, pin and socket files) and source file names are
// replaced, whatever error text a Handler put in it; then it is cut short
// and made a valid header value.
func sanitizeReason(reason string) string {
	const maxReason = 256
	fields := strings.FieldsFunc(reason, func(r rune) bool { return r == ' ' || r == '\t' || r == '\n' })
	redacted := false
	for i, f := range fields {
		if r := redactPath(f); r != f {
			fields[i], redacted = r, true
		}
	}
	if redacted {
		reason = strings.Join(fields, " ")
	}
	if len(reason) > maxReason {
		reason = reason[:maxReason]
	}
	return strings.Map(func(r rune) rune {
		if r < ' ' || r == 0x7f || r > '~' {
			return ' '
		}
		return r
	}, reason)
}

// redactPath replaces a word of an error text that names a file: an
// absolute or home-relative path (`/proc/12/ns/net:`, `"/run/x"`), or a Go
// source position (`dial.go:42`). Punctuation around it stays. Addresses
// and prefixes (`10.0.0.0/8`, `fd00::/64`) and policy names (`ns/name`) do
// not start with a slash and stay as they are.
func redactPath(w string) string {
	core := strings.TrimLeft(w, "\"'([{<=")
	lead := w[:len(w)-len(core)]
	core = strings.TrimRight(core, "\"')]}>,;:.")
	trail := w[len(lead)+len(core):]
	switch {
	case strings.HasPrefix(core, "/"), strings.HasPrefix(core, "~/"), strings.HasPrefix(core, "./"), strings.HasPrefix(core, "../"):
		return lead + "[path]" + trail
	case strings.Contains(core, ".go:"), strings.HasSuffix(core, ".go"):
		return lead + "[file]" + trail
	}
	if i := strings.IndexByte(core, '='); i >= 0 { // key=/path
		if v := redactPath(core[i+1:]); v != core[i+1:] {
			return lead + core[:i+1] + v + trail
		}
	}
	return w
}

// parseRequest checks a CONNECT request's header block. It returns the
// request, or a status (400, 405, 431) and a reason to refuse it with;
// malformed says the block breaks HTTP/2's rules for any request (RFC 9113
// §8.1.1: a stream error, so the refusal ends with RST_STREAM), not just
// this server's. The framer has already rejected invalid field names and
// values and misplaced or duplicate pseudo-headers (with RST_STREAM).
func parseRequest(fields []hpack.HeaderField, truncated bool) (req *ServerRequest, status int, reason string, malformed bool) {
	if truncated {
		return nil, http.StatusRequestHeaderFieldsTooLarge, fmt.Sprintf("request headers exceed %d bytes", maxHeaderListSize), false
	}
	req = &ServerRequest{}
	var method, scheme, path string
	var hasMethod, hasScheme, hasPath, hasProtocol bool
	var forwarded []string
	var bad string
	for _, f := range fields {
		switch f.Name {
		case ":method":
			method, hasMethod = f.Value, true
		case ":authority":
			req.Authority = f.Value
		case ":scheme":
			scheme, hasScheme = f.Value, true
		case ":path":
			path, hasPath = f.Value, true
		case ":protocol":
			// Its presence, whatever its value: an empty one is
			// still extended CONNECT, which we never enabled.
			hasProtocol = true
		case "forwarded":
			forwarded = append(forwarded, f.Value)
		default:
			switch {
			case strings.HasPrefix(f.Name, ":"):
				bad = fmt.Sprintf("unknown pseudo-header %q", f.Name)
			case connectionSpecific(f.Name, f.Value):
				bad = fmt.Sprintf("connection-specific header %q not allowed in HTTP/2", f.Name)
			default:
				if req.Header == nil {
					req.Header = make(http.Header)
				}
				name := http.CanonicalHeaderKey(f.Name)
				req.Header[name] = append(req.Header[name], f.Value)
			}
		}
	}
	switch {
	case bad != "":
	case !hasMethod || method == "":
		bad = "missing :method"
	case method != http.MethodConnect && (!hasScheme || scheme == "" || !hasPath || path == ""):
		bad = "a request other than CONNECT needs :scheme and a non-empty :path"
	case method == http.MethodConnect && !hasProtocol && (hasScheme || hasPath):
		bad = "CONNECT must not carry :scheme or :path"
	}
	if bad != "" {
		return nil, http.StatusBadRequest, bad, true
	}
	if method != http.MethodConnect {
		return nil, http.StatusMethodNotAllowed, fmt.Sprintf("method %q not allowed, only CONNECT", method), false
	}
	if hasProtocol {
		return nil, http.StatusBadRequest, "extended CONNECT (:protocol) is not supported", false
	}
	if req.Authority == "" {
		return nil, http.StatusBadRequest, "missing :authority", true
	}
	target, err := netip.ParseAddrPort(req.Authority)
	if err != nil || target.Addr().Zone() != "" || target.Port() == 0 {
		return nil, http.StatusBadRequest, fmt.Sprintf("malformed :authority %q: want ip:port", req.Authority), false
	}
	req.Target = netip.AddrPortFrom(target.Addr().Unmap(), target.Port())
	req.Forwarded = strings.Join(forwarded, ", ")
	return req, 0, "", false
}

// Shutdown stops accepting, tells every connection to finish (GOAWAY) and
// waits until all streams ended or ctx is done; then it closes what is left
// and returns ctx's error.
func (srv *Server) Shutdown(ctx context.Context) error {
	conns := srv.stop()
	for _, c := range conns {
		c.drain()
	}
	done := make(chan struct{})
	go func() {
		srv.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		_ = srv.Close()
		<-done
		return ctx.Err()
	}
}

// DrainPeers drains the connections whose client, as its handshake
// presented it, keep refuses now (the trust bundle changed: a root it
// chained to may be gone), and returns how many. Their open streams run to
// their end; the client's next streams need a new handshake. keep runs
// without the server's lock.
func (srv *Server) DrainPeers(keep func(tls.ConnectionState) bool) int {
	srv.trust.changed(keep)
	srv.mu.Lock()
	conns := make([]*conn, 0, len(srv.conns))
	for c := range srv.conns {
		conns = append(conns, c)
	}
	srv.mu.Unlock()
	return drainPeers(conns, keep)
}

// DrainPresented drains the connections whose own certificate, as their
// handshake presented it, keep refuses now (the trust bundle changed: the
// root it was issued under may be gone), and returns how many. A client
// holding the new roots would refuse that certificate in a new handshake;
// one that does not drain such connections itself (ztunnel, a waypoint,
// curl) would otherwise go on opening streams to us on them. Their open
// streams run to their end. keep runs without the server's lock, once per
// distinct certificate.
func (srv *Server) DrainPresented(keep func(*tls.Certificate) bool) int {
	srv.presentedTrust.changed(keep)
	srv.mu.Lock()
	conns := make([]*conn, 0, len(srv.conns))
	for c := range srv.conns {
		conns = append(conns, c)
	}
	srv.mu.Unlock()
	return drainRefusedPresented(conns, keep, srv.stopPresented)
}

// checkPresented runs on c's reader for a new stream, before it is
// accepted: if the certificate c presented has ended or a new handshake
// would present another, c is drained, so the stream is refused
// (REFUSED_STREAM, beyond the GOAWAY's last stream) and its client retries
// on a new connection, which presents the current certificate.
func (srv *Server) checkPresented(c *conn) {
	pc := c.presented
	if pc == nil || pc.stopped.Load() {
		return
	}
	now := time.Now()
	reason := pc.staleReason(now, func() (*tls.Certificate, bool) { return srv.serving.get(now, c.nc, pc) })
	if reason != "" {
		srv.stopPresented(c, reason)
	}
}

// stopPresented drains c for the certificate it presented, counted and
// logged once; false if it was stopped or draining already.
func (srv *Server) stopPresented(c *conn, reason string) bool {
	if !c.markStopped() {
		return false
	}
	srv.stats.ownDrains.Add(1)
	srv.log.Debug("hbone connection drained: no new stream on the certificate this server presented", "remote", c.nc.RemoteAddr(),
		"reason", reason, "not_after", c.presented.end)
	c.drain()
	return true
}

// Close stops accepting and closes every connection now, failing their
// streams.
func (srv *Server) Close() error {
	conns := srv.stop()
	srv.cancel()
	closeAll(conns, http2.ErrCodeNo, ErrServerClosed)
	return nil
}

// stop marks the server closed, closes its listeners and returns its conns.
func (srv *Server) stop() []*conn {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	srv.closed = true
	for l := range srv.listeners {
		_ = l.Close()
	}
	conns := make([]*conn, 0, len(srv.conns))
	for c := range srv.conns {
		conns = append(conns, c)
	}
	return slices.Clip(conns)
}

// callHandler runs the Handler, turning a panic into a 500 for this stream
// only: one bad request must not take down every tunnel of the node.
func (srv *Server) callHandler(ctx context.Context, req *ServerRequest) (resp Response) {
	defer func() {
		if v := recover(); v != nil {
			srv.log.Error("hbone handler panicked", "target", req.Target, "panic", v)
			resp = Response{Status: http.StatusInternalServerError, Reason: "internal error"}
		}
	}()
	return srv.opts.Handler(ctx, req)
}
