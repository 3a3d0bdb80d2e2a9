package tunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// handleOutbound serves one connection the pod opened and the BPF programs
// captured. The accepted socket's local address is the original destination.
func (p *pod) handleOutbound(c net.Conn) {
	t := p.t
	src, dst := addrPortOf(c.RemoteAddr()), addrPortOf(c.LocalAddr())
	ctx := p.connContext(c)
	srcW, srcID, err := p.self(src.Addr())
	if err != nil {
		// Fail closed: without the source identity nothing may leave.
		t.cfg.Metrics.failClosed.WithLabelValues(sourceFailure(err)).Inc()
		t.failures.note(ctx, "outbound refused: no identity for the source address", "pod", p.uid, "src", src, "dst", dst, "error", err)
		resetConn(c)
		return
	}
	if dst.Port() == 53 && t.capturesDNS(srcW) {
		t.cfg.DNS.ServeConn(ctx, srcW, c, p.dnsDialer())
		return
	}
	state := t.State()
	if meshPending(state) {
		if _, known := state.Dir.ByAddr(dst.Addr()); !known {
			if state = t.awaitMesh(ctx); state == nil {
				t.cfg.Metrics.failClosed.WithLabelValues("mesh_not_synced").Inc()
				t.failures.note(ctx, "outbound refused: the control plane has not answered yet, so whether the destination is in the mesh is unknown", "pod", p.uid, "src", src, "dst", dst)
				resetConn(c)
				return
			}
		}
	}
	if via := waypointOf(state.Dir, &t.waypoints, srcW, dst.Addr()); via != nil {
		p.handleWaypoint(ctx, c, state.Dir, via, srcW, srcID, src, dst)
		return
	}
	if svc, ok := state.Dir.ServiceByVIPFor(dst.Addr(), namespaceOf(srcW)); ok {
		p.handleService(ctx, c, state.Dir, svc, src, dst)
		return
	}
	dstW, meshed := state.Dir.ByAddr(dst.Addr())
	if !meshed || !dstW.TakesHBONE() {
		p.passthrough(ctx, c, srcW, dstW, src, dst)
		return
	}
	dstID := t.identityOf(dstW)
	conn := connInfo{reporter: "source", src: srcW, srcID: srcID, dst: dstW, dstID: dstID, secure: true,
		srcAddr: src, dstAddr: netip.AddrPortFrom(dst.Addr(), t.cfg.HBONEPort), hboneAddr: dst}
	trace := newTraceparent()
	stream, early, err := p.dialHBONE(ctx, c, srcW, srcID, dstID, src, dst, "", trace)
	for wait, start := refusedRetryFirst, time.Now(); err != nil && errors.Is(err, syscall.ECONNREFUSED) && time.Since(start)+wait <= refusedRetryFor; wait *= 2 {
		// The destination's node does not serve its HBONE port (yet):
		// see refusedRetryFor.
		select {
		case <-ctx.Done():
		case <-time.After(wait):
			stream, early, err = p.dialHBONE(ctx, c, srcW, srcID, dstID, src, dst, "", trace)
			continue
		}
		break
	}
	if err != nil {
		t.cfg.Metrics.failed(ctx, conn, traceIDOf(trace), err)
		t.failures.note(ctx, "HBONE connect failed", "src", srcW, "dst", dstW, "authority", dst, "error", err)
		resetConn(c)
		return
	}
	p.relayCounted(ctx, c, stream, early, t.cfg.Metrics.open(conn, traceIDOf(trace)))
}

// relayCounted relays an outbound connection like relay, with its access
// log lines and its close counted in res, and lists it among the pod's
// open connections (Connections) while it is relayed. early is what of the
// app's bytes went with the CONNECT (dialHBONE): request bytes the relay
// does not copy, counted with those it does.
func (p *pod) relayCounted(ctx context.Context, c net.Conn, up io.ReadWriteCloser, early int, res *connResult) {
	res.opened(ctx)
	res.counts().AToB.Add(int64(early))
	oc := &OpenOutbound{Src: addrPortOf(c.RemoteAddr()), OriginalDst: addrPortOf(c.LocalAddr()), ActualDst: res.c.dstAddr, HBONE: res.c.secure}
	p.mu.Lock()
	if p.outbound == nil {
		p.outbound = map[*OpenOutbound]struct{}{}
	}
	p.outbound[oc] = struct{}{}
	p.mu.Unlock()
	p.relay(c, up, res.counts(), func(reqBytes, respBytes int64, err error) {
		p.mu.Lock()
		delete(p.outbound, oc)
		p.mu.Unlock()
		res.close(ctx, int64(early)+reqBytes, respBytes, err)
	})
}

// dialHBONE opens a CONNECT stream to dst through the destination pod's
// HBONE port, from inside the source pod's namespace, on a pooled
// connection keyed by both identities and the destination pod. The
// request carries ztunnel's metadata: the source workload srcW in baggage
// and trace as traceparent.
//
// What the app already sent on app (if not nil) goes with the request as
// early data: it is only peeked at, and consumed from app once the tunnel
// is up, so a refused attempt loses nothing; early is how many bytes went
// so.
func (p *pod) dialHBONE(ctx context.Context, app net.Conn, srcW *workload.Workload, srcID, dstID identity.ID, src, dst netip.AddrPort, host, trace string) (stream *hbone.Stream, early int, err error) {
	return p.dialHBONEVia(ctx, app, srcW, srcID, dstID, src, dst, netip.AddrPortFrom(dst.Addr(), p.t.cfg.HBONEPort), host, trace)
}

// dialHBONEVia is dialHBONE through the HBONE listener at hboneAddr (a
// waypoint's), dstID the identity it must present; dst stays the
// authority.
func (p *pod) dialHBONEVia(ctx context.Context, app net.Conn, srcW *workload.Workload, srcID, dstID identity.ID, src, dst, hboneAddr netip.AddrPort, host, trace string) (*hbone.Stream, int, error) {
	t := p.t
	key := hbone.PoolKey{Src: p.id, SrcIdentity: srcID.String(), DstIdentity: dstID.String(), DstAddr: hboneAddr}
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := p.ns.Dial(ctx, network, addr, netns.SocketOptions{Mark: t.cfg.TunnelMark, Congestion: t.cfg.HBONECongestion, KeepAlive: tunnelKeepAlive})
		if err == nil {
			t.checkCongestion(c, "HBONE dial")
		}
		return c, err
	}
	fwd := "for=" + strconv.Quote(forwardedAddr(src.Addr()))
	if host != "" {
		fwd += ";host=" + host
	}
	early := peekPool.Get().(*[]byte)
	defer peekPool.Put(early)
	req := hbone.Request{Authority: dst, Forwarded: fwd, EarlyData: peek(app, *early), Header: http.Header{
		headerBaggage:     {baggageOf(srcW, t.cfg.Metrics.cluster)},
		headerTraceparent: {trace},
	}}
	tlsConf := identity.ClientConfig(t.cfg.Certs, srcID, dstID)
	// The timeout bounds dial, handshake and response, not the stream.
	ctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	stream, err := t.cfg.Pool.Connect(ctx, key, dial, tlsConf, req)
	if err != nil {
		return nil, 0, fmt.Errorf("HBONE to %s via %s: %w", dst, hboneAddr, err)
	}
	n := len(req.EarlyData)
	if n == 0 || !stream.EarlyDataSent() {
		return stream, 0, nil
	}
	// The peeked bytes are still first in app's receive queue.
	if _, err := io.ReadFull(app, (*early)[:n]); err != nil {
		stream.Close()
		return nil, 0, fmt.Errorf("consume %d bytes sent early to %s: %w", n, dst, err)
	}
	return stream, n, nil
}

// peekPool holds the buffers early data is peeked into.
var peekPool = sync.Pool{New: func() any {
	b := make([]byte, hbone.MaxEarlyData)
	return &b
}}

// peek returns what c has received and not yet been read, up to len(buf),
// without consuming it or waiting; nil when there is nothing or c is not a
// socket.
func peek(c net.Conn, buf []byte) []byte {
	if c == nil {
		return nil
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	n := 0
	_ = rc.Read(func(fd uintptr) bool {
		n, _, err = unix.Recvfrom(int(fd), buf, unix.MSG_PEEK|unix.MSG_DONTWAIT)
		return true // never wait: only what is already there goes early
	})
	if err != nil || n <= 0 {
		return nil
	}
	return buf[:n]
}

// passthrough connects to a destination outside the mesh in plain TCP, from
// the pod's own namespace and address, as if the tunnel were not there.
func (p *pod) passthrough(ctx context.Context, c net.Conn, srcW, dstW *workload.Workload, src, dst netip.AddrPort) {
	t := p.t
	conn := connInfo{reporter: "source", src: srcW, srcID: t.identityOf(srcW), dst: dstW, srcAddr: src, dstAddr: dst}
	up, err := p.dialPlain(ctx, dst)
	if err != nil {
		t.cfg.Metrics.failed(ctx, conn, "", err)
		t.log.DebugContext(ctx, "passthrough connect failed", "src", src, "dst", dst, "error", err)
		resetConn(c)
		return
	}
	p.relayCounted(ctx, c, up, 0, t.cfg.Metrics.open(conn, ""))
}

// awaitMesh waits, at most meshWait, for the control plane's first answer
// and returns the state then, nil if it did not come. Until it answers
// (istiod, with SOURCE=xds) the directory holds only this node's pods (the
// source serves them from the node's watch meanwhile, so a CNI ADD never
// waits on istiod), and any other address, a meshed pod of another node
// or a service VIP, would read as outside the mesh and be reached in
// plaintext: an agent restarted or upgraded over meshed pods sent their
// connections out so until istiod answered. A connection made in that
// moment is delayed instead, and refused if the answer does not come.
func (t *Tunnel) awaitMesh(ctx context.Context) *State {
	timer := time.NewTimer(meshWait)
	defer timer.Stop()
	select {
	case <-t.meshSynced:
		return t.State()
	case <-timer.C:
	case <-ctx.Done():
	}
	return nil
}

// meshWait bounds how long an outbound connection waits for the control
// plane's first answer (a variable for tests).
var meshWait = connectTimeout

// refusedRetryFor bounds how long a connection to a pod is retried while
// the pod's HBONE port refuses the dial, first after refusedRetryFirst,
// then twice as long each time. A client takes HBONE to a pod as soon as
// its own agent's rules say the pod is enrolled, and the pod's node serves
// the port only once its agent has acted on the same change (tens of
// milliseconds later), or once its agent is back after a restart (about
// half a second): in between, every new connection of a meshed client to
// that pod was reset (TestHBONERefusedWhileServerNodeRestarts). A pod
// whose node never serves it (not captured there) is still refused, that
// much later. Service connections are not retried: they go on to their
// next endpoint.
const (
	refusedRetryFirst = 25 * time.Millisecond
	refusedRetryFor   = 2 * time.Second
)

// connectTimeout bounds establishing a connection: every dial the tunnel
// makes (apps in the pod, plain TCP upstreams, service endpoints, and for
// HBONE the dial, handshake and CONNECT together). A peer or app that
// drops SYNs (a full accept queue, a blackholed address) would otherwise
// hold the handler, its fds and its limit slot for the kernel's SYN
// retries, about two minutes. ztunnel's is 10 s; pod-to-pod connects on a
// cluster network take milliseconds, so 5 s still allows the SYN
// retransmits at 1 s and 3 s.
const connectTimeout = 5 * time.Second

// dialPlain connects to dst in plain TCP from inside the pod, with the
// tunnel mark so the pod's own programs let it go.
func (p *pod) dialPlain(ctx context.Context, dst netip.AddrPort) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	c, err := p.ns.Dial(ctx, "tcp", dst.String(), netns.SocketOptions{Mark: p.t.cfg.TunnelMark, KeepAlive: tunnelKeepAlive})
	if err != nil {
		return nil, err
	}
	return c, nil
}

func forwardedAddr(a netip.Addr) string {
	if a.Is6() {
		return "[" + a.String() + "]"
	}
	return a.String()
}

// resetConn closes c with an RST instead of a FIN, so the app sees the
// failure at once rather than an orderly, empty answer.
func resetConn(c net.Conn) {
	if l, ok := c.(interface{ SetLinger(int) error }); ok {
		_ = l.SetLinger(0)
	}
	c.Close()
}
