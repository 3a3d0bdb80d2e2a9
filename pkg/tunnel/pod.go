package tunnel

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// pathMoved reports whether the pod's path now names another namespace
// than the one it is served in: a new sandbox of the pod put at the old
// one's path (a runtime naming namespaces by pod, a reused
// /proc/<pid>/ns/net). The listeners are in the old namespace, which they
// keep alive, so the new one has none. A path that names nothing is no
// move: there is nothing else to serve.
func (p *pod) pathMoved() bool {
	ino, err := netns.Inode(p.netns)
	return err == nil && ino != p.nsInode
}

// pod is one enrolled pod's listeners and the connections they accepted.
type pod struct {
	t     *Tunnel
	uid   string
	netns string
	addrs []netip.Addr
	// ns is the namespace at netns, held open from start to the end of
	// stop: every dial from the pod (to its apps, to HBONE peers, to
	// passthrough destinations) enters it without opening the path.
	ns *netns.Handle
	// nsInode identifies the namespace to a successor agent asking for
	// the pod's listeners (handover.go).
	nsInode uint64

	ctx    context.Context
	cancel context.CancelFunc
	lns    []net.Listener
	hbone  *hbone.Server
	dns    *net.UDPConn // captured DNS queries (dns.go), if the node answers them
	// dnsPending counts the pod's DNS queries being answered, against
	// dnsMaxPendingPerPod (dispatchDNS).
	dnsPending atomic.Int32
	wg         sync.WaitGroup // accept loops and connection handlers

	// id names this instance of the pod for the HBONE pool: a pod served
	// again from a new namespace, or a new pod on a reused address, never
	// shares the old one's connections.
	id string

	// health of the outbound, inbound and HBONE listeners, for readiness.
	health [3]*listenerHealth
	// dnsDown is set while the pod's DNS socket could not be opened for
	// longer than dnsAwaitReport (awaitDNS), for readiness.
	dnsDown atomic.Pointer[dnsFailure]
	// stopping is set when stop begins: listeners closing then are no
	// failure.
	stopping atomic.Bool
	// open counts the pod's accepted connections per listener, against
	// Limits.PerPod (guarded by the tunnel's limiter).
	open [numListeners]int
	// slots are the pod's evictable limit slots per listener, oldest first
	// (guarded by the tunnel's limiter).
	slots [numListeners]list.List

	mu    sync.Mutex
	conns map[net.Conn]*connRef // accepted connections
	// inbound registers open inbound connections (HBONE and plaintext)
	// so that a policy change can re-check and close them.
	inbound map[*inboundConn]struct{}
	// outbound registers relayed outbound connections, for Connections.
	outbound map[*OpenOutbound]struct{}
}

// connRef counts the goroutines holding an accepted connection; the last
// to let go closes it and releases its limit slots.
type connRef struct {
	holders int
	release func()
	// ctx is the connection's handler's (from the pod's), cancelled when
	// the connection is evicted or let go, so a dial under way for it ends
	// with it.
	ctx    context.Context
	cancel context.CancelFunc
	// up is the other end of the connection's relay, once it has one.
	// stop closes it with the connection: a relay blocked on it (writing to
	// an upstream that reads nothing while reading from it, which sends
	// nothing) never wakes when only the connection closes.
	up io.Closer
}

// podSeq numbers pod instances (pod.id).
var podSeq atomic.Uint64

// listen opens the pod's listeners on the wildcard address: one dual-stack
// IPv6 socket when the namespace has IPv6, else IPv4 only.
func listenWildcard(ctx context.Context, path string, port uint16, opts netns.SocketOptions) (net.Listener, error) {
	l, err := netns.Listen(ctx, path, "tcp", net.JoinHostPort("::", strconv.Itoa(int(port))), opts)
	if err == nil {
		return l, nil
	}
	l4, err4 := netns.Listen(ctx, path, "tcp4", net.JoinHostPort("0.0.0.0", strconv.Itoa(int(port))), opts)
	if err4 != nil {
		return nil, errors.Join(err, err4)
	}
	return l4, nil
}

func (t *Tunnel) startPod(ctx context.Context, uid, path string, addrs []netip.Addr) (*pod, error) {
	ns, err := netns.Open(path)
	if err != nil {
		return nil, err
	}
	ino, err := ns.Inode()
	if err != nil {
		ns.Close()
		return nil, err
	}
	pctx, cancel := context.WithCancel(context.Background())
	p := &pod{t: t, uid: uid, netns: path, ns: ns, nsInode: ino, addrs: addrs, ctx: pctx, cancel: cancel, conns: map[net.Conn]*connRef{},
		inbound: map[*inboundConn]struct{}{}, outbound: map[*OpenOutbound]struct{}{}, id: uid + "#" + strconv.FormatUint(podSeq.Add(1), 10)}
	for i, port := range []uint16{t.cfg.OutboundPort, t.cfg.InboundPort, t.cfg.HBONEPort} {
		p.health[i] = &listenerHealth{port: port}
	}
	if p.hbone, err = t.newHBONEServer(p); err != nil {
		cancel()
		ns.Close()
		return nil, fmt.Errorf("HBONE server: %w", err)
	}
	lns, err := p.listen(ctx, true)
	if err != nil && !errors.Is(err, syscall.EADDRINUSE) {
		_ = p.hbone.Close()
		cancel()
		ns.Close()
		return nil, err
	}
	if t.cfg.DNS != nil {
		// The DNS socket takes none of the listeners' ports: it opens (or
		// waits for its own port) now, even while another process holds
		// those.
		p.startDNS()
	}
	if err != nil {
		// Another process holds the ports: a predecessor that did not hand
		// them over (a release before hand-over, or the exchange failed).
		// Take them the moment it lets go (handover.go).
		p.awaitPorts(ctx, err)
		return p, nil
	}
	p.serve(lns)
	t.log.InfoContext(ctx, "serving pod", "uid", uid, "netns", path, "addrs", addrs)
	return p, nil
}

// listen takes the pod's three listeners from the predecessor agent, if
// it serves the pod and takeOver is set (handover.go), or else opens them,
// all or none.
func (p *pod) listen(ctx context.Context, takeOver bool) ([]net.Listener, error) {
	t, path := p.t, p.netns
	ports := []uint16{t.cfg.OutboundPort, t.cfg.InboundPort, t.cfg.HBONEPort}
	// No SO_REUSEPORT: nothing else in the pod may bind these ports
	// (handover.go).
	transparent := netns.SocketOptions{Transparent: true, Mark: t.cfg.TunnelMark, KeepAlive: tunnelKeepAlive}
	fromApps := transparent
	fromApps.Congestion = inPodCongestionName() // its connections come from the pod's own apps
	opts := []netns.SocketOptions{fromApps, transparent,
		{Mark: t.cfg.TunnelMark, Congestion: t.cfg.HBONECongestion, KeepAlive: tunnelKeepAlive}}
	if pr := t.cfg.Predecessor; pr != nil && takeOver {
		if lns := p.take(ctx, pr, ports, opts); lns != nil {
			return lns, nil
		}
	}
	var lns []net.Listener
	for i, name := range []string{"outbound", "inbound", "HBONE"} {
		l, err := listenWildcard(ctx, path, ports[i], opts[i])
		if err != nil {
			closeListeners(lns)
			return nil, fmt.Errorf("%s listener: %w", name, err)
		}
		lns = append(lns, l)
	}
	t.checkCongestion(lns[2], "HBONE listener")
	return lns, nil
}

// take takes the pod's listeners from the predecessor and gives them this
// agent's options (the predecessor's release may have set others: the
// sockets outlive it, and accepted sockets inherit from the listener). It
// returns none when they are to be opened anew: no predecessor, the pod not
// served there, or a failure, counted (the pod then binds its own, which
// fails while the predecessor holds the ports, and waits for them).
func (p *pod) take(ctx context.Context, pr *Predecessor, ports []uint16, opts []netns.SocketOptions) []net.Listener {
	t := p.t
	lns, err := pr.take(ctx, p.nsInode, ports, t.cfg.TunnelMark)
	switch {
	case errors.Is(err, errNoPredecessor), err != nil && ctx.Err() != nil:
		return nil // nothing to take, or the pod stopped meanwhile
	case err != nil:
		t.cfg.Metrics.handover.WithLabelValues(handoverFailed).Inc()
		t.log.WarnContext(ctx, "listener hand-over failed; opening the pod's own", "uid", p.uid, "error", err)
		return nil
	case lns == nil:
		t.cfg.Metrics.handover.WithLabelValues(handoverNotServed).Inc()
		return nil
	}
	for i, l := range lns {
		adopted, err := netns.Adopt(l, opts[i])
		if err != nil {
			closeListeners(lns)
			t.cfg.Metrics.handover.WithLabelValues(handoverFailed).Inc()
			t.log.WarnContext(ctx, "listener hand-over failed; opening the pod's own", "uid", p.uid,
				"error", fmt.Errorf("listener taken on port %d: %w", ports[i], err))
			return nil
		}
		lns[i] = adopted
	}
	t.checkCongestion(lns[2], "HBONE listener")
	t.cfg.Metrics.handover.WithLabelValues(handoverTaken).Inc()
	t.log.InfoContext(ctx, "pod listeners taken over from the predecessor", "uid", p.uid, "netns", p.netns)
	return lns
}

func closeListeners(lns []net.Listener) {
	for _, l := range lns {
		l.Close()
	}
}

// serve runs the accept loops and the HBONE server on lns (from listen);
// once stop began it closes them instead and returns false.
func (p *pod) serve(lns []net.Listener) bool {
	p.mu.Lock()
	if p.stopping.Load() {
		p.mu.Unlock()
		for _, l := range lns {
			l.Close()
		}
		return false
	}
	p.lns = lns
	p.mu.Unlock()
	p.acceptLoop(lns[0], p.health[0], p.admitter(listenerOutbound), p.handleOutbound)
	p.acceptLoop(lns[1], p.health[1], p.admitter(listenerInbound), p.handleInboundPlaintext)
	p.serveHBONE(lns[2], p.health[2])
	return true
}

// wrap passes a pod-side socket, or the error that came instead, through
// Config.WrapPodSocket.
func (p *pod) wrap(c net.Conn, err error) (net.Conn, error) {
	if err != nil || p.t.cfg.WrapPodSocket == nil {
		return c, err
	}
	return p.t.cfg.WrapPodSocket(c), nil
}

// hold counts a goroutine using c, so stop can close it.
func (p *pod) hold(c net.Conn) { p.holdWith(c, nil) }

// holdWith is hold; release, if not nil, runs once c is closed.
func (p *pod) holdWith(c net.Conn, release func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.conns[c]
	if r == nil {
		r = &connRef{}
		p.conns[c] = r
	}
	r.holders++
	if release != nil {
		r.release = release
	}
}

// closeConn resets c, an accepted connection, and closes its relay's
// upstream: an eviction (limiter.take) ends the relay at once, whatever it
// is blocked on.
func (p *pod) closeConn(c net.Conn) {
	p.mu.Lock()
	var up io.Closer
	if r := p.conns[c]; r != nil {
		up = r.up
	}
	p.mu.Unlock()
	resetConn(c)
	if up != nil {
		_ = up.Close()
	}
}

// holdAccepted is holdWith for a connection an accept loop admitted: it
// gets a context of its own, which evicting it (limiter.take) cancels.
func (p *pod) holdAccepted(c net.Conn, s *slot) {
	ctx, cancel := context.WithCancel(p.ctx)
	p.mu.Lock()
	r := p.conns[c]
	if r == nil {
		r = &connRef{}
		p.conns[c] = r
	}
	r.holders++
	r.release, r.ctx, r.cancel = s.release, ctx, cancel
	p.mu.Unlock()
	s.setClose(func() {
		cancel()
		p.closeConn(c)
	})
}

// connContext is the context of c's handler: its own for an accepted
// connection, else the pod's.
func (p *pod) connContext(c net.Conn) context.Context {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.conns[c]; r != nil && r.ctx != nil {
		return r.ctx
	}
	return p.ctx
}

// release uncounts a goroutine using c and closes c after the last one.
func (p *pod) release(c net.Conn) {
	p.mu.Lock()
	r := p.conns[c]
	var last bool
	if r != nil {
		r.holders--
		if last = r.holders <= 0; last {
			delete(p.conns, c)
		}
	}
	p.mu.Unlock()
	if last {
		c.Close()
		if r.cancel != nil {
			r.cancel()
		}
		if r.release != nil {
			r.release()
		}
	}
}

// relay copies between c and up on a goroutine of its own, adding to
// counts as bytes move (AToB from c), then calls done with the byte counts;
// it returns at once. The goroutine that accepted c
// and set up the upstream (its stack grown deep by the dial and the TLS
// writes) ends instead of idling for the tunnel's life: a fresh goroutine
// keeps a smaller stack, about a third of an idle tunnel's memory.
func (p *pod) relay(c net.Conn, up io.ReadWriteCloser, counts *hbone.Counts, done func(reqBytes, respBytes int64, err error)) {
	p.hold(c)
	// Closed (stopped, evicted) before this: the relay's first read of c
	// fails and closes up.
	p.mu.Lock()
	if r := p.conns[c]; r != nil {
		r.up = up
	}
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer p.release(c)
		reqBytes, respBytes, err := hbone.RelayCounting(c, up, counts)
		done(reqBytes, respBytes, err)
	}()
}

// stopEvictAfter is how long stop waits, once it closed the pod's
// connections, before it closes the pod's pooled HBONE connections too.
const stopEvictAfter = 100 * time.Millisecond

// stop closes the listeners, lets connections finish until ctx ends, then
// closes the rest and waits for every goroutine. It returns how many
// relayed connections were open when it began and how many of them it
// closed at the deadline.
func (p *pod) stop(ctx context.Context) (open, forced int) {
	p.mu.Lock()
	p.stopping.Store(true) // under mu: awaitPorts serves no listener after this
	lns, hb, dns := p.lns, p.hbone, p.dns
	open = len(p.conns)
	p.mu.Unlock()
	for _, l := range lns {
		l.Close()
	}
	if dns != nil {
		dns.Close()
	}
	done := make(chan struct{})
	// The HBONE server closes its streams when hctx ends, after the app
	// sockets below were reset: closed by the server first, its streams'
	// app sockets got a FIN.
	hctx, hcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer hcancel()
	go func() {
		// GOAWAY first: peers open new streams elsewhere (a successor's
		// listener) while these finish.
		if hb != nil {
			_ = hb.Shutdown(hctx)
		}
		p.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
	}
	p.cancel()
	// Both ends of every relay: one blocked in a write to its upstream and
	// a read from it (a plaintext server that stopped reading, an app that
	// reads nothing) does not wake when only the accepted socket closes,
	// and stop, and the reconciler's call of it, waited for it for ever.
	//
	// Sockets that face the pod's apps are reset, not closed with a FIN:
	// an app's socket left in CLOSE_WAIT may still send, and once the pod
	// is detached (StopPod comes first, see nodeagent) what it sends
	// leaves by the pod's interface as it is, in plaintext. A reset
	// leaves it nothing to send. Inbound connections' app sockets (the
	// tunnel's dials, HBONE streams' included) are reset by their closer.
	p.mu.Lock()
	forced = len(p.conns)
	closers := make([]io.Closer, 0, 2*len(p.conns))
	for c, r := range p.conns {
		closers = append(closers, resetter{c})
		if r.up != nil {
			closers = append(closers, r.up)
		}
	}
	var aborts []func()
	for ic := range p.inbound {
		ic.mu.Lock()
		if ic.closer != nil {
			aborts = append(aborts, ic.closer)
		}
		ic.mu.Unlock()
	}
	p.mu.Unlock()
	for _, abort := range aborts {
		abort()
	}
	hcancel()
	for _, c := range closers {
		_ = c.Close()
	}
	select {
	case <-done:
	case <-time.After(stopEvictAfter):
		// Something still runs: a relay or CONNECT blocked in a write to
		// a peer that reads nothing of ours, which closing the app's
		// socket does not end and closing the pod's pooled connections
		// does.
		p.t.evict(ctx, p)
		<-done
	}
	// Dials still under way (a pooled connection spread in the background)
	// fail from here; the pod's pool entries are evicted next.
	_ = p.ns.Close()
	return open, forced
}

// resetter closes a connection with a reset (resetConn).
type resetter struct{ c net.Conn }

func (r resetter) Close() error { resetConn(r.c); return nil }

// owns reports whether a is one of the pod's addresses.
func (p *pod) owns(a netip.Addr) bool {
	a = a.Unmap()
	for _, b := range p.addrs {
		if a == b {
			return true
		}
	}
	return false
}

func addrPortOf(a net.Addr) netip.AddrPort {
	if tcp, ok := a.(*net.TCPAddr); ok {
		ap := tcp.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	ap, _ := netip.ParseAddrPort(a.String())
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}
