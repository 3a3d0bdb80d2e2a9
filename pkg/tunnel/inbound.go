package tunnel

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/netip"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// inboundRequest is one connection arriving for the pod, over HBONE or in
// plaintext, after the transport-specific checks.
type inboundRequest struct {
	dst     netip.AddrPort // the pod address and port the client asked for
	client  netip.Addr     // the client's address, preserved towards the app
	peer    identity.ID    // verified client identity (zero for plaintext)
	secure  bool           // arrived over mTLS
	srcW    *workload.Workload
	podW    *workload.Workload
	podID   identity.ID
	service string
}

// authorize applies AuthorizationPolicy to an inbound connection.
func (p *pod) authorize(r *inboundRequest) policy.Verdict {
	st := p.t.State()
	src := policy.Peer{Addr: r.client, Authenticated: r.secure}
	if r.secure {
		src.Principal = r.peer.Principal()
		src.Namespace = r.peer.Namespace
	}
	dst := policy.Target{Namespace: r.podW.Namespace, Labels: r.podW.Labels, Port: r.dst.Port(), Addr: r.dst.Addr()}
	return policy.Authorize(st.AuthorizationPolicies, p.t.cfg.RootNamespace, dst, src)
}

// dialApp connects to the app in the pod from the client's own address
// (IP_TRANSPARENT bind), so the app sees the real peer. The egress program
// steers the app's replies back to this socket.
func (p *pod) dialApp(ctx context.Context, r *inboundRequest) (net.Conn, error) {
	opts := netns.SocketOptions{Transparent: true, Mark: p.t.cfg.TunnelMark}
	if r.client.IsValid() && !p.owns(r.client) {
		opts.Local = &net.TCPAddr{IP: r.client.AsSlice()}
	}
	return p.wrap(netns.Dial(ctx, p.netns, "tcp", r.dst.String(), opts))
}

// newHBONEServer builds the pod's HBONE server: TLS with the pod's own
// identity, client certificates verified against the trust domain.
func (t *Tunnel) newHBONEServer(p *pod) (*hbone.Server, error) {
	tlsConf := &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			_, id, err := t.localWorkload(p.addrs[0])
			if err != nil {
				return nil, fmt.Errorf("pod %s has no identity: %w", p.uid, err)
			}
			return identity.ServerConfig(t.cfg.Certs, id), nil
		},
	}
	return hbone.NewServer(hbone.ServerOptions{
		TLSConfig: tlsConf,
		Handler:   p.handleHBONE,
		Logger:    t.log,
	})
}

// handleHBONE decides one CONNECT stream: the authority must be an address
// of this pod (the tunnel is never an open proxy), the client identity must
// pass authorization, then the app is dialled.
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
	if port := dst.Port(); port == t.cfg.OutboundPort || port == t.cfg.InboundPort || port == t.cfg.HBONEPort {
		t.cfg.Metrics.denied("tunnel_port")
		return hbone.Response{Status: http.StatusBadRequest, Reason: fmt.Sprintf("authority port %d is the tunnel's own", port)}
	}
	peer, err := identity.PeerID(*req.TLS)
	if err != nil {
		t.cfg.Metrics.denied("no_peer_identity")
		return hbone.Response{Status: http.StatusForbidden, Reason: "no verified client identity"}
	}
	podW, podID, err := t.localWorkload(dst.Addr())
	if err != nil {
		t.cfg.Metrics.denied("unknown_destination")
		return hbone.Response{Status: http.StatusServiceUnavailable, Reason: "destination pod not in the workload directory"}
	}
	client := addrPortOf(req.RemoteAddr).Addr()
	srcW, _ := t.State().Dir.ByAddr(client)
	r := &inboundRequest{dst: dst, client: client, peer: peer, secure: true, srcW: srcW, podW: podW, podID: podID}
	conn := connInfo{reporter: "destination", src: srcW, srcID: peer, dst: podW, dstID: podID, secure: true}
	if v := p.authorize(r); !v.Allowed {
		t.cfg.Metrics.denied("authorization")
		t.log.InfoContext(ctx, "HBONE connection denied", "client", peer.String(), "dst", dst, "reason", v.Reason, "policy", v.Policy)
		return hbone.Response{Status: http.StatusForbidden, Reason: "denied by authorization policy: " + v.Reason}
	}
	app, err := p.dialApp(ctx, r)
	if err != nil {
		t.cfg.Metrics.failed(conn)
		return hbone.Response{Status: http.StatusServiceUnavailable, Reason: fmt.Sprintf("connect to %s: %v", dst, err)}
	}
	t.log.DebugContext(ctx, "HBONE connection accepted", "client", peer.String(), "dst", dst)
	closed := t.cfg.Metrics.open(conn)
	return hbone.Response{Upstream: app, Done: func(fromClient, toClient int64, _ error) { closed(fromClient, toClient) }}
}

// handleInboundPlaintext serves a plaintext connection to the pod that the
// ingress program captured. PeerAuthentication STRICT refuses it with a
// reset; PERMISSIVE and DISABLE forward it after authorization.
func (p *pod) handleInboundPlaintext(c net.Conn) {
	t := p.t
	ctx := p.ctx
	dst, client := addrPortOf(c.LocalAddr()), addrPortOf(c.RemoteAddr())
	podW, podID, err := t.localWorkload(dst.Addr())
	if err != nil {
		t.cfg.Metrics.failClosed.WithLabelValues("unknown_destination").Inc()
		resetConn(c)
		return
	}
	st := t.State()
	srcW, _ := st.Dir.ByAddr(client.Addr())
	conn := connInfo{reporter: "destination", src: srcW, dst: podW, dstID: podID}
	mode := policy.EffectiveMode(st.PeerAuthentications, t.cfg.RootNamespace, podW.Namespace, podW.Labels, dst.Port())
	if mode.Strict() {
		t.cfg.Metrics.denied("strict_plaintext")
		t.log.InfoContext(ctx, "plaintext connection refused: mTLS is STRICT", "client", client, "dst", dst, "policy", mode.Source)
		resetConn(c)
		return
	}
	r := &inboundRequest{dst: dst, client: client.Addr(), srcW: srcW, podW: podW, podID: podID}
	if v := p.authorize(r); !v.Allowed {
		t.cfg.Metrics.denied("authorization")
		t.log.InfoContext(ctx, "plaintext connection denied", "client", client, "dst", dst, "reason", v.Reason, "policy", v.Policy)
		resetConn(c)
		return
	}
	app, err := p.dialApp(ctx, r)
	if err != nil {
		t.cfg.Metrics.failed(conn)
		resetConn(c)
		return
	}
	p.relay(c, app, t.cfg.Metrics.open(conn))
}
