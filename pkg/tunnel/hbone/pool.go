package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
)

// Dialer opens the TCP connection under an HBONE connection. The caller
// supplies it so the socket is made where it must be (inside the source
// pod's network namespace, with the tunnel's socket mark).
type Dialer func(ctx context.Context, network, addr string) (net.Conn, error)

// PoolKey identifies the connections streams may share: streams between the
// same identities to the same HBONE endpoint.
type PoolKey struct {
	// Src names the source pod instance (not its address: a new pod may
	// reuse a departed one's). Connections are dialled from the pod's own
	// network namespace, so pods never share one, even with the same
	// identity: a connection must not outlive, or leave from, a pod other
	// than the one whose traffic it carries.
	Src         string
	SrcIdentity string
	DstIdentity string
	// DstAddr is the HBONE endpoint, the destination pod's ip:15008.
	DstAddr netip.AddrPort
}

// PoolOptions configure a Pool. Zero values pick the defaults.
type PoolOptions struct {
	// MaxStreamsPerConn caps concurrent streams on one connection; more
	// open another connection for the same key. Default 100, as ztunnel.
	MaxStreamsPerConn int
	// ConnsPerKey spreads a key's streams over up to this many connections:
	// once every connection of the key carries a stream, one more is dialled
	// in the background, and each new stream goes to the least loaded. Each
	// connection has its own reader, writer and TCP congestion state, so a
	// key's bulk flows are not all carried by one core and one paced socket.
	// Default 1: a key's streams share one connection until it is full.
	ConnsPerKey int
	// IdleTimeout closes a connection that carried no stream for this
	// long. Default 30s: long enough to reuse connections across bursts,
	// short enough not to hold sockets to pods that went quiet.
	IdleTimeout time.Duration
	// PingInterval and PingTimeout are the keepalive of pooled
	// connections: a PING goes out when nothing arrived for PingInterval,
	// and a connection from which nothing arrived for PingTimeout after it
	// is closed, failing its streams, so a peer that vanished without a
	// word does not hold them until TCP gives up. Defaults 10s and 20s, as
	// ztunnel; a negative PingInterval turns keepalive off.
	PingInterval time.Duration
	PingTimeout  time.Duration
	Logger       *slog.Logger
}

// PoolStats is a snapshot for metrics and tests.
type PoolStats struct {
	Conns         int    // open connections
	ActiveStreams int    // streams open or being opened
	DialsTotal    uint64 // connections dialled since the pool was made
	// FloodCloses counts connections closed with GOAWAY ENHANCE_YOUR_CALM
	// because the server flooded them with frames that carry nothing.
	FloodCloses uint64
	// ZeroStreamLimitDrains counts connections drained because the server
	// set SETTINGS_MAX_CONCURRENT_STREAMS to 0: they can carry no new
	// stream, and would otherwise stay pooled until the idle timeout.
	ZeroStreamLimitDrains uint64
	// ProtocolErrorCloses counts connections closed because the server
	// broke HTTP/2 (a malformed or truncated response, a push, frames on
	// streams never opened, ...): GOAWAY with the error's code.
	ProtocolErrorCloses uint64
	// OwnCertificateDrains counts connections given no new stream because
	// of the certificate we presented on them: its chain ended, a new
	// handshake would present another, or a trust change refused it
	// (presented.go).
	OwnCertificateDrains uint64
}

// Pool is the HBONE client: it multiplexes streams over pooled TLS
// connections, one or more per PoolKey.
type Pool struct {
	opts  PoolOptions
	log   *slog.Logger
	dials atomic.Uint64
	// trust sees a trust change that DrainPeers applied while one of the
	// pool's handshakes was under way.
	trust trustChanges
	// peerExpiry is SetPeerExpiry's.
	peerExpiry atomic.Pointer[PeerExpiry]
	// floods counts conns closed because the server flooded.
	floods atomic.Uint64
	// zeroLimits counts conns drained for a stream limit of 0.
	zeroLimits atomic.Uint64
	// protocolErrors counts conns closed because the server broke HTTP/2.
	protocolErrors atomic.Uint64
	// presentedTrust sees a DrainPresented that came while one of the
	// pool's handshakes was under way; ownDrains counts conns stopped for
	// the certificate they presented.
	presentedTrust presentedChanges
	ownDrains      atomic.Uint64

	mu      sync.Mutex
	entries map[PoolKey]*poolEntry
	closed  bool
}

type poolEntry struct {
	conns   []*conn
	dialing *dialCall // non-nil while a connection for the key is being made
	// evicted: Evict removed the key while a dial was under way; the dial's
	// connection is closed when it is made, not pooled.
	evicted bool
}

// errEvicted fails the dials and streams of a source that Evict removed.
var errEvicted = ErrEvicted

// dialCall lets concurrent Connects for a new key wait for one dial instead
// of each dialling.
type dialCall struct {
	done chan struct{}
	err  error
}

// maxConnectAttempts bounds retries of streams the peer refused unprocessed
// (GOAWAY race, REFUSED_STREAM).
const maxConnectAttempts = 3

// NewPool returns an empty pool.
func NewPool(opts PoolOptions) *Pool {
	if opts.MaxStreamsPerConn <= 0 {
		opts.MaxStreamsPerConn = 100
	}
	if opts.ConnsPerKey <= 0 {
		opts.ConnsPerKey = 1
	}
	if opts.IdleTimeout <= 0 {
		opts.IdleTimeout = 30 * time.Second
	}
	if opts.PingInterval == 0 {
		opts.PingInterval = 10 * time.Second
	}
	if opts.PingTimeout <= 0 {
		opts.PingTimeout = 20 * time.Second
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Pool{opts: opts, log: log, entries: make(map[PoolKey]*poolEntry)}
}

// Connect opens a CONNECT stream to req.Authority through the HBONE
// endpoint key.DstAddr, reusing a pooled connection for key when one has
// room and otherwise dialling with dial and tlsConf (ALPN h2 is added when
// missing). ctx bounds the dial, the handshake and the wait for the
// response, not the returned stream. A non-200 answer is a *StatusError.
//
// A pooled connection takes the stream only while the certificate it
// presented is the one tlsConf would present now (its
// GetClientCertificate, asked without the server's request info, must
// not depend on it, nor call into the pool: it runs under the pool's lock)
// and its chain has not ended; see presented.go.
func (p *Pool) Connect(ctx context.Context, key PoolKey, dial Dialer, tlsConf *tls.Config, req Request) (*Stream, error) {
	fields, err := req.fields()
	if err != nil {
		return nil, err
	}
	if len(req.EarlyData) > MaxEarlyData {
		return nil, fmt.Errorf("hbone early data of %d bytes exceeds %d", len(req.EarlyData), MaxEarlyData)
	}
	cur := &currentCert{conf: tlsConf}
	for attempt := 1; ; attempt++ {
		c, err := p.reserve(ctx, key, dial, tlsConf, cur)
		if err != nil {
			return nil, err
		}
		if f := testHookReserved.get(); f != nil {
			f(p, c)
		}
		s, err := c.roundTrip(ctx, fields, req.EarlyData)
		if err == nil {
			return s, nil
		}
		if !errors.Is(err, errRetry) || attempt == maxConnectAttempts || ctx.Err() != nil {
			return nil, fmt.Errorf("hbone connect %v via %v: %w", req.Authority, key.DstAddr, err)
		}
	}
}

// testHookDialWait, if set, runs in reserve before it waits for another
// Connect's dial.
var testHookDialWait testHook[func()]

// testHookReserved, if set, runs in Connect once a stream slot was reserved
// on c, before the stream is opened: tests widen that window.
var testHookReserved testHook[func(p *Pool, c *conn)]

// reserve returns a connection for key with a stream slot reserved on it.
// cur is what tlsConf presents now: conns that presented another
// certificate, or one whose chain ended, are drained instead.
func (p *Pool) reserve(ctx context.Context, key PoolKey, dial Dialer, tlsConf *tls.Config, cur *currentCert) (*conn, error) {
	var stale []staleConn
	defer func() { p.stopStale(stale) }() // the returns below
	p.mu.Lock()
	for {
		if p.closed {
			p.mu.Unlock()
			return nil, ErrPoolClosed
		}
		e := p.entries[key]
		if e == nil {
			e = &poolEntry{}
			p.entries[key] = e
		}
		stale = p.stopStaleLocked(e.conns, cur, stale)
		if c, others := p.reserveLeastLoaded(e.conns); c != nil {
			if others && len(e.conns) < p.opts.ConnsPerKey && e.dialing == nil {
				p.spreadLocked(key, e, dial, tlsConf)
			}
			p.mu.Unlock()
			return c, nil
		}
		if d := e.dialing; d != nil {
			p.mu.Unlock()
			stale = p.stopStale(stale)
			if f := testHookDialWait.get(); f != nil {
				f()
			}
			select {
			case <-d.done:
			case <-ctx.Done():
				return nil, fmt.Errorf("waiting for the connection being dialled to send its SETTINGS: %w", ctx.Err())
			}
			// Another caller's cancelled dial says nothing about ours.
			if d.err != nil && !errors.Is(d.err, context.Canceled) && !errors.Is(d.err, context.DeadlineExceeded) {
				return nil, d.err
			}
			p.mu.Lock()
			if e.evicted {
				// Evict closed the dial's connection before its SETTINGS
				// came (the dial ends without an error then): the key is
				// gone, and going round would dial it anew from the
				// evicted source.
				p.mu.Unlock()
				return nil, errEvicted
			}
			continue
		}

		d := &dialCall{done: make(chan struct{})}
		e.dialing = d
		p.mu.Unlock()
		stale = p.stopStale(stale)
		// The dialler's stream goes out at once, pipelined with the peer's
		// SETTINGS. Others keep waiting on d until the SETTINGS tell the
		// real stream limit (onReady), so a burst neither overfills the
		// conn nor dials more conns than it needs.
		c, err := p.dialInto(ctx, key, e, d, dial, tlsConf, true)
		if err != nil {
			return nil, err
		}
		go c.readLoop()
		return c, nil
	}
}

// dialInto makes e's connection for its dial d and adds it to e.conns,
// with a stream slot taken on it first if reserve is set. A connection made
// after the pool closed or Evict removed the key is closed, not added.
// Called, and returns, without p.mu.
func (p *Pool) dialInto(ctx context.Context, key PoolKey, e *poolEntry, d *dialCall, dial Dialer, tlsConf *tls.Config, reserve bool) (*conn, error) {
	gen, ownGen := p.trust.generation(), p.presentedTrust.generation()
	c, err := p.dial(ctx, key, e, dial, tlsConf, d)
	if err == nil {
		// Once pooled, below, where a DrainPeers or DrainPresented finds it.
		defer p.trust.recheck(gen, c)
		defer p.recheckPresented(ownGen, c)
	}
	p.mu.Lock()
	if err == nil {
		if err = p.goneLocked(e); err != nil {
			defer c.closeUnused(err)
		}
	}
	if err != nil {
		p.dialDoneLocked(key, e, d, err)
		p.mu.Unlock()
		return nil, err
	}
	if reserve {
		c.tryReserve(p.opts.MaxStreamsPerConn)
	}
	e.conns = append(e.conns, c)
	// Once pooled (and reserved): a drain that closes the conn at once
	// must find it in e.conns, or onClose would leave it there.
	var end PeerExpiry
	if f := p.peerExpiry.Load(); f != nil {
		end = *f
	}
	c.drainAtPeerExpiry(*c.tlsState, end)
	p.mu.Unlock()
	return c, nil
}

// SetPeerExpiry sets how the pool learns when a server's chain stops
// verifying, which its connections are drained at (see
// ServerOptions.PeerExpiry); connections made before keep theirs. Without
// it the presented chain is followed by issuer names.
func (p *Pool) SetPeerExpiry(f PeerExpiry) {
	if f == nil {
		p.peerExpiry.Store(nil)
		return
	}
	p.peerExpiry.Store(&f)
}

// reserveLeastLoaded reserves a stream slot for a new stream and reports
// whether the conn it chose already carried others (then every conn of the
// key does). The key's first ConnsPerKey conns are its own: the least loaded
// of them with room gets the stream. Conns past those were dialled because
// all of them were full (a burst of more than ConnsPerKey × MaxStreamsPerConn
// streams); they get a stream only while the first ones stay full, the
// earliest with room first, so that once the burst is over they empty and
// close at IdleTimeout. Spread over every conn instead, the streams of a
// later, ordinary load kept a dozen conns of one or two streams each busy for
// good: a burst's frames no longer shared TLS records and writes, and the
// agents' CPU at 1000 HTTP requests a second stayed 1.4× what it was before
// the burst (meshbench, 3 December: 1000 idle connections at the start of a
// run).
func (p *Pool) reserveLeastLoaded(conns []*conn) (c *conn, others bool) {
	type loaded struct {
		c      *conn
		active int
	}
	own := conns[:min(len(conns), p.opts.ConnsPerKey)]
	byLoad := make([]loaded, len(own))
	for i, c := range own {
		c.mu.Lock()
		byLoad[i] = loaded{c, c.active}
		c.mu.Unlock()
	}
	slices.SortStableFunc(byLoad, func(a, b loaded) int { return a.active - b.active })
	for _, l := range byLoad {
		if l.c.tryReserve(p.opts.MaxStreamsPerConn) {
			return l.c, l.active > 0
		}
	}
	for _, c := range conns[len(own):] {
		if c.tryReserve(p.opts.MaxStreamsPerConn) {
			return c, true
		}
	}
	return nil, false
}

// spreadDialTimeout bounds a dial made in the background to spread a key's
// streams; no caller waits on it unless every conn of the key is full.
const spreadDialTimeout = 10 * time.Second

// spreadLocked dials one more connection for key in the background
// (ConnsPerKey). Streams that find every conn full meanwhile wait for it, as
// for any dial, and share its error.
func (p *Pool) spreadLocked(key PoolKey, e *poolEntry, dial Dialer, tlsConf *tls.Config) {
	d := &dialCall{done: make(chan struct{})}
	e.dialing = d
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), spreadDialTimeout)
		defer cancel()
		c, err := p.dialInto(ctx, key, e, d, dial, tlsConf, false)
		if err != nil {
			p.log.Debug("hbone connection to spread streams over not made", "dst", key.DstAddr, "err", err)
			return
		}
		c.readLoop()
	}()
}

// goneLocked says why a connection just dialled for e may not be pooled:
// the pool closed, or Evict removed the key meanwhile.
func (p *Pool) goneLocked(e *poolEntry) error {
	switch {
	case p.closed:
		return ErrPoolClosed
	case e.evicted:
		return errEvicted
	}
	return nil
}

// closeUnused closes a conn dialled but never served (its reader not
// started): in order, with a reader that ends the socket once the peer
// closes or the close's deadline passes.
func (c *conn) closeUnused(cause error) {
	c.close(http2.ErrCodeNo, cause, true)
	go c.readLoop()
}

// dialDoneLocked ends e's dial d and wakes the Connects waiting for it.
func (p *Pool) dialDoneLocked(key PoolKey, e *poolEntry, d *dialCall, err error) {
	if e.dialing != d {
		return
	}
	e.dialing = nil
	d.err = err
	close(d.done)
	p.dropEntryLocked(key, e)
}

// dial makes and handshakes a new connection for key.
func (p *Pool) dial(ctx context.Context, key PoolKey, e *poolEntry, dial Dialer, tlsConf *tls.Config, d *dialCall) (*conn, error) {
	p.dials.Add(1)
	raw, err := dial(ctx, "tcp", key.DstAddr.String())
	if err != nil {
		return nil, fmt.Errorf("dial hbone %v: %w", key.DstAddr, err)
	}
	batch := newBatchConn(raw)
	var presented *presentedCert
	tc := tls.Client(batch, presenting(tlsConf, &presented))
	batch.limitRead(maxServerHandshake, errServerHandshakeTooLarge)
	err = tc.HandshakeContext(ctx)
	batch.unlimitRead()
	if err != nil {
		_ = raw.Close()
		return nil, fmt.Errorf("tls handshake with hbone %v: %w", key.DstAddr, err)
	}
	if proto := tc.ConnectionState().NegotiatedProtocol; proto != "h2" {
		_ = tc.Close()
		return nil, fmt.Errorf("hbone %v negotiated ALPN %q, want h2", key.DstAddr, proto)
	}
	c := newConn(context.Background(), tc, connConfig{
		client:          true,
		batch:           batch,
		idleTimeout:     p.opts.IdleTimeout,
		pingInterval:    max(p.opts.PingInterval, 0),
		pingTimeout:     p.opts.PingTimeout,
		log:             p.log,
		onIdle:          p.onIdle,
		onClose:         p.onClose,
		onFlood:         func() { p.floods.Add(1) },
		onProtocolError: func() { p.protocolErrors.Add(1) },
		onZeroStreamLimit: func() {
			p.zeroLimits.Add(1)
			p.log.Debug("hbone server takes no streams (SETTINGS_MAX_CONCURRENT_STREAMS 0), draining its connection", "dst", key.DstAddr)
		},
		onReady: func(*conn) {
			p.mu.Lock()
			p.dialDoneLocked(key, e, d, nil)
			p.mu.Unlock()
		},
	})
	c.poolKey = key
	c.presented = presented
	if err := c.start(); err != nil {
		_ = tc.Close()
		return nil, err
	}
	state := tc.ConnectionState()
	c.tlsState = &state
	p.log.Debug("hbone connection opened", "dst", key.DstAddr, "src_identity", key.SrcIdentity, "dst_identity", key.DstIdentity)
	return c, nil
}

// maxServerHandshake bounds the bytes a client reads from a server during the
// TLS handshake, as maxClientHandshake does on a server: crypto/tls takes a
// Certificate message of up to 256 KiB and parses every certificate in it
// before VerifyConnection can refuse the chain for its length, so a server
// (anything at a destination's HBONE port) sending some 600 small
// certificates made each of our dials to it parse them all, many times the
// cost of an honest handshake, for every connection a pod opened to it.
const maxServerHandshake = 64 << 10

// errServerHandshakeTooLarge fails a dial whose handshake reads more than
// maxServerHandshake.
var errServerHandshakeTooLarge = fmt.Errorf("server sent more than %d bytes in its TLS handshake, more than any honest server", maxServerHandshake)

// withH2 makes sure the config offers ALPN h2, without changing the
// caller's config.
func withH2(conf *tls.Config) *tls.Config {
	if slices.Contains(conf.NextProtos, "h2") {
		return conf
	}
	conf = conf.Clone()
	conf.NextProtos = append([]string{"h2"}, conf.NextProtos...)
	return conf
}

// tryReserve takes a stream slot if the conn is usable and below both our
// cap and the peer's SETTINGS_MAX_CONCURRENT_STREAMS.
func (c *conn) tryReserve(maxStreams int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil || c.goAway || (!c.sawSettings && c.active > 0) {
		return false
	}
	if c.peerExpiredLocked() {
		// The server's certificate ran out and the drain timer is late:
		// no new stream; the conn closes when idle.
		return false
	}
	if c.active >= maxStreams || uint64(c.active) >= uint64(c.peerMaxStreams) {
		return false
	}
	c.addActiveLocked()
	return true
}

// onIdle closes a conn that stayed without streams for IdleTimeout. The
// pool lock makes the check and the removal atomic against reserve.
func (p *Pool) onIdle(c *conn) {
	p.mu.Lock()
	c.mu.Lock()
	idle := c.idleForLocked(p.opts.IdleTimeout)
	if idle {
		c.goAway = true
	}
	c.mu.Unlock()
	if idle {
		p.removeLocked(c)
	}
	p.mu.Unlock()
	if idle {
		p.log.Debug("hbone connection idle, closing", "dst", c.poolKey.DstAddr)
		c.close(http2.ErrCodeNo, fmt.Errorf("%w: idle", ErrConnClosed), true)
	}
}

func (p *Pool) onClose(c *conn) {
	p.mu.Lock()
	p.removeLocked(c)
	p.mu.Unlock()
}

func (p *Pool) removeLocked(c *conn) {
	e := p.entries[c.poolKey]
	if e == nil {
		return
	}
	if i := slices.Index(e.conns, c); i >= 0 {
		e.conns = slices.Delete(e.conns, i, i+1)
	}
	p.dropEntryLocked(c.poolKey, e)
}

// dropEntryLocked deletes an entry with nothing left in it, so keys of
// pods that went away do not accumulate.
func (p *Pool) dropEntryLocked(key PoolKey, e *poolEntry) {
	if len(e.conns) == 0 && e.dialing == nil && p.entries[key] == e {
		delete(p.entries, key)
	}
}

// Stats returns a snapshot of the pool.
func (p *Pool) Stats() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := PoolStats{DialsTotal: p.dials.Load(), FloodCloses: p.floods.Load(), ZeroStreamLimitDrains: p.zeroLimits.Load(),
		ProtocolErrorCloses: p.protocolErrors.Load(), OwnCertificateDrains: p.ownDrains.Load()}
	for _, e := range p.entries {
		for _, c := range e.conns {
			st.Conns++
			c.mu.Lock()
			st.ActiveStreams += c.active
			c.mu.Unlock()
		}
	}
	return st
}

// Evict closes the pooled connections whose key matches, failing their
// streams (a pod went away: nothing may leave from it any more), and
// returns how many it closed. A dial under way for such a key is not pooled
// when it completes.
func (p *Pool) Evict(match func(PoolKey) bool) int {
	p.mu.Lock()
	var conns []*conn
	for key, e := range p.entries {
		if match(key) {
			conns = append(conns, e.conns...)
			e.evicted = true
			delete(p.entries, key)
		}
	}
	p.mu.Unlock()
	closeAll(conns, http2.ErrCodeNo, errEvicted)
	return len(conns)
}

// DrainPeers drains the pooled connections whose server, as its handshake
// presented it, keep refuses now (the trust bundle changed: a root it
// chained to may be gone), and returns how many. Their open streams run to
// their end; new streams go on a new connection, verified anew. keep runs
// without the pool's lock.
func (p *Pool) DrainPeers(keep func(tls.ConnectionState) bool) int {
	p.trust.changed(keep)
	p.mu.Lock()
	var conns []*conn
	for _, e := range p.entries {
		conns = append(conns, e.conns...)
	}
	p.mu.Unlock()
	return drainPeers(conns, keep)
}

// drainPeers drains the conns whose handshake state keep refuses.
func drainPeers(conns []*conn, keep func(tls.ConnectionState) bool) int {
	n := 0
	for _, c := range conns {
		if c.tlsState != nil && !keep(*c.tlsState) {
			c.drain()
			n++
		}
	}
	return n
}

// DrainPresented drains the pooled connections whose own certificate, as
// their handshake presented it, keep refuses now (the trust bundle
// changed: the root it was issued under may be gone), and returns how
// many. A server holding the new roots would refuse that certificate in a
// new handshake; one that does not drain such connections itself would
// otherwise go on taking streams as that identity on them. Their open
// streams run to their end. keep runs without the pool's lock, once per
// distinct certificate.
func (p *Pool) DrainPresented(keep func(*tls.Certificate) bool) int {
	p.presentedTrust.changed(keep)
	p.mu.Lock()
	var conns []*conn
	for _, e := range p.entries {
		conns = append(conns, e.conns...)
	}
	p.mu.Unlock()
	return drainRefusedPresented(conns, keep, p.stopPresented)
}

// recheckPresented drains c, pooled now, if a DrainPresented came since
// gen whose check refuses the certificate c presented.
func (p *Pool) recheckPresented(gen uint64, c *conn) {
	if c.presented != nil && p.presentedTrust.refuses(gen, c.presented.cert) {
		p.stopPresented(c, reasonTrustRefuses)
	}
}

// staleConn is a conn stopStaleLocked stopped, to drain once p.mu is
// released (a drain of an idle conn closes it, which takes p.mu).
type staleConn struct {
	c      *conn
	reason string
}

// stopStaleLocked stops the conns whose presented certificate cur says
// must carry no new stream, appending them to stale.
func (p *Pool) stopStaleLocked(conns []*conn, cur *currentCert, stale []staleConn) []staleConn {
	var now time.Time
	for _, c := range conns {
		pc := c.presented
		if pc == nil || pc.stopped.Load() {
			continue
		}
		if now.IsZero() {
			now = time.Now()
		}
		// Read without c.mu: set before the conn was pooled, never after.
		reason := pc.staleReason(now, cur.get)
		if reason != "" && c.markStopped() {
			stale = append(stale, staleConn{c, reason})
		}
	}
	return stale
}

// stopStale drains the conns stopStaleLocked stopped, and returns stale
// emptied; called without p.mu.
func (p *Pool) stopStale(stale []staleConn) []staleConn {
	for _, s := range stale {
		p.drainPresented(s.c, s.reason)
	}
	return stale[:0]
}

// stopPresented stops and drains c for its certificate; false if it was
// stopped already. Called without p.mu.
func (p *Pool) stopPresented(c *conn, reason string) bool {
	if !c.markStopped() {
		return false
	}
	p.drainPresented(c, reason)
	return true
}

func (p *Pool) drainPresented(c *conn, reason string) {
	p.ownDrains.Add(1)
	p.log.Debug("hbone connection drained: no new stream as the certificate it presented", "dst", c.poolKey.DstAddr,
		"src_identity", c.poolKey.SrcIdentity, "reason", reason, "not_after", c.presented.end)
	c.drain()
}

// Close closes every pooled connection, failing their streams, and makes
// later Connects fail with ErrPoolClosed.
func (p *Pool) Close() error {
	p.mu.Lock()
	p.closed = true
	var conns []*conn
	for _, e := range p.entries {
		conns = append(conns, e.conns...)
	}
	p.mu.Unlock()
	closeAll(conns, http2.ErrCodeNo, ErrPoolClosed)
	return nil
}
