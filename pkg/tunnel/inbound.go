package tunnel

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// inboundRequest is one connection arriving for the pod, over HBONE or in
// plaintext, after the transport-specific checks.
type inboundRequest struct {
	dst    netip.AddrPort // the pod address and port the client asked for
	client netip.Addr     // the client's address, preserved towards the app
	// clientPort is the client's port when the client's connection ends in
	// this pod's namespace (plaintext inbound): the dial to the app must not
	// take it (SocketOptions.AvoidLocalPort). Zero for HBONE.
	clientPort uint16
	peer       identity.ID // verified client identity (zero for plaintext)
	secure     bool        // arrived over mTLS
	srcW       *workload.Workload
	podW       *workload.Workload
	podID      identity.ID
	service    string
}

// AppDialPorts is where dialApp takes its port on the client's address:
// below every common ephemeral range (Linux 32768-60999, Windows and macOS
// 49152-65535), from which the client picks the ports of its own next
// connections. A dial on a port the client then picks holds that
// connection's 4-tuple in the pod (the app's socket of the relayed
// connection), and the client's SYN is lost for as long as it lives.
var AppDialPorts = [2]uint16{1024, 32767}

// dialApp connects to the app in the pod from the client's own address
// (IP_TRANSPARENT bind), so the app sees the real peer. The egress program
// steers the app's replies back to this socket.
//
// The dial is bounded by connectTimeout: an app whose accept queue is full
// drops the SYNs, and without a bound the kernel would retry them for
// about two minutes while the handler waits.
func (p *pod) dialApp(ctx context.Context, r *inboundRequest) (net.Conn, error) {
	opts := netns.SocketOptions{Transparent: true, Mark: p.t.cfg.TunnelMark, Congestion: inPodCongestionName(), KeepAlive: tunnelKeepAlive}
	if r.client.IsValid() && !p.owns(r.client) {
		opts.Local = &net.TCPAddr{IP: r.client.AsSlice()}
		opts.AvoidLocalPort = r.clientPort
		opts.LocalPorts = AppDialPorts
	}
	ctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	c, err := p.ns.Dial(ctx, "tcp", r.dst.String(), opts)
	if err != nil {
		return nil, err
	}
	return p.wrap(c, nil)
}

// peerDialError is what a remote peer is told when the app cannot be
// reached: the errno's meaning, never the error's text, which names the
// pod's netns path and other local details (those are logged locally).
func peerDialError(err error) string {
	var errno syscall.Errno
	switch {
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded):
		return "connection timed out"
	case errors.Is(err, context.Canceled):
		return "connection canceled"
	case errors.As(err, &errno):
		return errno.Error()
	}
	return "connection failed"
}

// newHBONEServer builds the pod's HBONE server: TLS with the pod's own
// identity, client certificates verified against the trust domain.
func (t *Tunnel) newHBONEServer(p *pod) (*hbone.Server, error) {
	tlsConf := &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			_, id, err := p.self(p.addrs[0])
			if err != nil {
				return nil, fmt.Errorf("pod %s has no identity: %w", p.uid, err)
			}
			return identity.ServerConfig(t.cfg.Certs, id), nil
		},
	}
	return hbone.NewServer(hbone.ServerOptions{
		TLSConfig: tlsConf,
		Limiter:   t.hboneLimits,
		Handler:   p.handleHBONE,
		PeerExpiry: func(cs tls.ConnectionState) time.Time {
			return t.cfg.Certs.PeerChainEnd(cs, x509.ExtKeyUsageClientAuth)
		},
		Logger: t.log,
	})
}

// handleHBONE decides one CONNECT stream: the authority must be an address
// of this pod (the tunnel is never an open proxy), the client identity must
// pass authorization, the tunnel must fit the node's, the pod's and the
// source's budgets (Limits), then the app is dialled. The texts sent back to the
// peer name no local detail (netns paths, errors of local calls, policy
// names): those are only logged.
func (p *pod) handleHBONE(ctx context.Context, req *hbone.ServerRequest) hbone.Response {
	t := p.t
	dst := req.Target
	if !dst.IsValid() {
		t.cfg.Metrics.denied("bad_authority")
		return hbone.Response{Status: http.StatusBadRequest, Reason: fmt.Sprintf("authority %q is not ip:port", req.Authority)}
	}
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	if !p.owns(dst.Addr()) {
		t.cfg.Metrics.denied("foreign_authority")
		return hbone.Response{Status: http.StatusBadRequest, Reason: fmt.Sprintf("authority %s is not an address of this pod", dst)}
	}
	if port := dst.Port(); t.cfg.tunnelPort(port) {
		t.cfg.Metrics.denied("tunnel_port")
		return hbone.Response{Status: http.StatusBadRequest, Reason: fmt.Sprintf("authority port %d is the tunnel's own", port)}
	}
	peer, err := identity.PeerID(*req.TLS)
	if err != nil {
		t.cfg.Metrics.denied("no_peer_identity")
		return hbone.Response{Status: http.StatusForbidden, Reason: "no verified client identity"}
	}
	client := addrPortOf(req.RemoteAddr)
	ic := p.track(dst, client, peer, true)
	st := t.State()
	podW, why, detail, pol := t.inboundVerdict(st, p, dst, client.Addr(), peer, true)
	srcW := t.sourceWorkload(st.Dir, client.Addr(), peer)
	// The source labels come from the directory; the client's baggage
	// only names a client the directory does not know.
	var meta *peerMeta
	if srcW == nil {
		meta = parseBaggage(req.Header, peer)
	}
	trace := traceID(req.Header)
	conn := connInfo{reporter: "destination", src: srcW, peer: meta, srcID: peer, dst: podW, secure: true,
		service: inboundService(st.Dir, podW, forwardedHost(req.Forwarded), dst.Port()),
		srcAddr: client, dstAddr: addrPortOf(req.LocalAddr), hboneAddr: dst}
	ic.setService(conn.service)
	switch why {
	case "":
	case "unknown_destination":
		p.untrack(ic)
		t.cfg.Metrics.denied(why)
		return hbone.Response{Status: http.StatusServiceUnavailable, Reason: "destination pod not in the workload directory"}
	case reasonNotThisPod:
		p.untrack(ic)
		t.cfg.Metrics.failClosed.WithLabelValues(why).Inc()
		t.failures.note(ctx, "inbound connection refused: the directory gives its destination to another workload", "client", peer.String(), "dst", dst, "detail", detail)
		return hbone.Response{Status: http.StatusServiceUnavailable, Reason: "destination address belongs to another workload in the directory"}
	default:
		p.untrack(ic)
		conn.dstID = t.identityOf(podW)
		t.cfg.Metrics.deniedConn(ctx, why, conn, trace, fmt.Errorf("denied by %s: %s", cmp.Or(pol, "policy"), detail))
		if !t.cfg.Metrics.accessLogged() {
			t.refusals.note(ctx, "HBONE connection denied", "client", peer.String(), "dst", dst, "reason", detail, "policy", pol)
		}
		// The peer learns that policy refused it, not which policies or
		// rule: those are this side's configuration, and a hostile peer
		// could map them by trying identities and ports. The access log
		// (or the refusal log) has the detail.
		return hbone.Response{Status: http.StatusForbidden, Reason: "denied by authorization policy"}
	}
	podID := t.identityOf(podW)
	conn.dstID = podID
	slot, refusedBy := t.limits.take(listenerHBONE, p, client.Addr(), true)
	if refusedBy != "" {
		p.untrack(ic)
		t.cfg.Metrics.limitRefused.WithLabelValues(listenerHBONE.String(), refusedBy).Inc()
		t.refusals.note(ctx, "HBONE tunnel refused: over the "+refusedBy+" connection limit",
			"pod", p.uid, "client", peer.String(), "source", client, "dst", dst)
		return hbone.Response{Status: http.StatusServiceUnavailable, Reason: limitReason(refusedBy)}
	}
	// Evicted for another pod's tunnel (limiter.take): the dial is
	// cancelled, or the app's socket reset, which ends the relay and the
	// stream.
	dialCtx, cancel := context.WithCancel(ctx)
	var (
		appMu   sync.Mutex
		appConn net.Conn
		evicted bool
	)
	slot.setClose(func() {
		cancel()
		appMu.Lock()
		evicted = true
		c := appConn
		appMu.Unlock()
		if c != nil {
			resetConn(c)
		}
	})
	release := func() {
		cancel()
		slot.release()
	}
	r := &inboundRequest{dst: dst, client: client.Addr(), peer: peer, secure: true, srcW: srcW, podW: podW, podID: podID}
	app, err := p.dialApp(dialCtx, r)
	if err == nil {
		appMu.Lock()
		appConn = app
		if evicted {
			resetConn(app)
			err = errors.New("evicted for another pod's tunnel: over the node connection limit")
		}
		appMu.Unlock()
	}
	if err != nil {
		release()
		p.untrack(ic)
		t.cfg.Metrics.failed(ctx, conn, trace, err)
		t.refusals.note(ctx, "inbound connect to the app failed", "client", peer.String(), "dst", dst, "error", err)
		return hbone.Response{Status: http.StatusServiceUnavailable, Reason: fmt.Sprintf("connect to %s: %s", dst, peerDialError(err))}
	}
	if !ic.connected(func() { resetConn(app) }) {
		release()
		p.untrack(ic)
		t.cfg.Metrics.deniedConn(ctx, "authorization", conn, trace, errors.New("denied by a policy change"))
		return hbone.Response{Status: http.StatusForbidden, Reason: "denied by authorization policy"}
	}
	res := t.cfg.Metrics.open(conn, trace)
	res.opened(ctx)
	return hbone.Response{Upstream: app, Counts: res.counts(), Done: func(fromClient, toClient int64, err error) {
		release()
		p.untrack(ic)
		res.close(ctx, fromClient, toClient, err)
	}}
}

// sourceWorkload is the workload the directory has at a tunnel client's
// address, if it runs as the identity the client proved. Another identity
// at that address (a gateway or NAT between, an address reused before the
// directory caught up, a forged address) means the address does not say
// who the client is: its connections are counted and logged under its
// own identity (and what its baggage may claim for it), never as that
// workload; the mismatch is counted. Policy never looked at this: it
// matches the proved identity and the address.
func (t *Tunnel) sourceWorkload(dir *workload.Directory, addr netip.Addr, peer identity.ID) *workload.Workload {
	w, ok := dir.ByAddr(addr)
	if !ok {
		return nil
	}
	if t.identityOf(w) != peer {
		t.cfg.Metrics.sourceMismatch.Inc()
		return nil
	}
	return w
}

// forwardedHost returns the host parameter of a Forwarded header: the
// service host name the client asked for, which the source side sends when
// it resolved a service.
func forwardedHost(fwd string) string {
	for _, elem := range strings.Split(fwd, ",") {
		for _, pair := range strings.Split(elem, ";") {
			k, v, ok := strings.Cut(strings.TrimSpace(pair), "=")
			if ok && strings.EqualFold(k, "host") {
				return strings.Trim(v, `"`)
			}
		}
	}
	return ""
}

// inboundService names the service of an inbound connection to podW's
// port, as ztunnel's guess_inbound_service does: among the services podW
// is an endpoint of (so a client cannot name an arbitrary one), the one
// whose host name the client sent, else the first whose target port is
// port. Nil when none fits.
func inboundService(dir *workload.Directory, podW *workload.Workload, host string, port uint16) *workload.Service {
	if podW == nil {
		return nil
	}
	svcs := dir.ServicesOf(podW)
	if host != "" {
		for _, s := range svcs {
			if s.Hostname == host {
				return s
			}
		}
	}
	for _, s := range svcs {
		for _, ep := range s.Endpoints {
			if ep.Workload != podW {
				continue
			}
			for _, sp := range s.Ports {
				if tp, ok := ep.TargetPort(sp); ok && tp == port {
					return s
				}
			}
		}
	}
	return nil
}

// handleInboundPlaintext serves a plaintext connection to the pod that the
// ingress program captured. PeerAuthentication STRICT refuses it with a
// reset; PERMISSIVE and DISABLE forward it after authorization.
func (p *pod) handleInboundPlaintext(c net.Conn) {
	t := p.t
	ctx := p.connContext(c)
	dst, client := addrPortOf(c.LocalAddr()), addrPortOf(c.RemoteAddr())
	// Dialled, a tunnel port of the pod's own address is this listener
	// again: a connection to it (the pod's own app over lo, a probe, a SYN
	// from the wire) would open another, and so on without end.
	if t.cfg.tunnelPort(dst.Port()) {
		t.cfg.Metrics.denied("tunnel_port")
		t.refusals.note(ctx, "plaintext connection to a tunnel port refused", "client", client, "dst", dst)
		resetConn(c)
		return
	}
	// The listener is transparent, so it takes a SYN to any address that
	// reaches the pod's interface; one to another pod's address was sent
	// here on purpose (a neighbour routing it via this pod's MAC). Served,
	// this pod's tunnel would dial that pod for the client. The capture
	// drops such SYNs; this is the same rule for anything that got past.
	if !p.owns(dst.Addr()) {
		t.cfg.Metrics.denied("foreign_destination")
		t.refusals.note(ctx, "plaintext connection to an address not of this pod refused", "client", client, "dst", dst)
		resetConn(c)
		return
	}
	ic := p.track(dst, client, identity.ID{}, false)
	st := t.State()
	podW, why, detail, pol := t.inboundVerdict(st, p, dst, client.Addr(), identity.ID{}, false)
	switch why {
	case "":
	case "unknown_destination":
		p.untrack(ic)
		t.cfg.Metrics.failClosed.WithLabelValues(why).Inc()
		resetConn(c)
		return
	case reasonNotThisPod:
		p.untrack(ic)
		t.cfg.Metrics.failClosed.WithLabelValues(why).Inc()
		t.failures.note(ctx, "inbound connection refused: the directory gives its destination to another workload", "client", client, "dst", dst, "detail", detail)
		resetConn(c)
		return
	case "strict_plaintext":
		p.untrack(ic)
		t.cfg.Metrics.deniedConn(ctx, why, plainConn(st, podW, t.identityOf(podW), client, dst), "", fmt.Errorf("plaintext refused: mTLS is STRICT (%s)", pol))
		if !t.cfg.Metrics.accessLogged() {
			t.refusals.note(ctx, "plaintext connection refused: mTLS is STRICT", "client", client, "dst", dst, "policy", pol)
		}
		resetConn(c)
		return
	default:
		p.untrack(ic)
		t.cfg.Metrics.deniedConn(ctx, why, plainConn(st, podW, t.identityOf(podW), client, dst), "", fmt.Errorf("denied by %s: %s", cmp.Or(pol, "policy"), detail))
		if !t.cfg.Metrics.accessLogged() {
			t.refusals.note(ctx, "plaintext connection denied", "client", client, "dst", dst, "reason", detail, "policy", pol)
		}
		resetConn(c)
		return
	}
	podID := t.identityOf(podW)
	conn := plainConn(st, podW, podID, client, dst)
	ic.setService(conn.service)
	r := &inboundRequest{dst: dst, client: client.Addr(), clientPort: client.Port(), srcW: conn.src, podW: podW, podID: podID}
	app, err := p.dialApp(ctx, r)
	if err != nil {
		p.untrack(ic)
		t.cfg.Metrics.failed(ctx, conn, "", err)
		t.refusals.note(ctx, "inbound connect to the app failed", "client", client, "dst", dst, "error", err)
		resetConn(c)
		return
	}
	if !ic.connected(func() { resetConn(c); resetConn(app) }) {
		p.untrack(ic)
		resetConn(c)
		return
	}
	res := t.cfg.Metrics.open(conn, "")
	res.opened(ctx)
	p.relay(c, app, res.counts(), func(reqBytes, respBytes int64, err error) {
		p.untrack(ic)
		res.close(ctx, reqBytes, respBytes, err)
	})
}

// tunnelPort reports whether port is one of the tunnel's own listeners in
// the pod: never a destination the tunnel dials.
func (c Config) tunnelPort(port uint16) bool {
	return port == c.OutboundPort || port == c.InboundPort || port == c.HBONEPort
}

// plainConn describes a plaintext inbound connection for metrics and logs.
func plainConn(st *State, podW *workload.Workload, podID identity.ID, client, dst netip.AddrPort) connInfo {
	srcW, _ := st.Dir.ByAddr(client.Addr())
	return connInfo{reporter: "destination", src: srcW, dst: podW, dstID: podID,
		service: inboundService(st.Dir, podW, "", dst.Port()), srcAddr: client, dstAddr: dst}
}
