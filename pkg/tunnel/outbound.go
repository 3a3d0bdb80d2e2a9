package tunnel

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// handleOutbound serves one connection the pod opened and the BPF programs
// captured. The accepted socket's local address is the original destination.
func (p *pod) handleOutbound(c net.Conn) {
	defer c.Close()
	t := p.t
	src, dst := addrPortOf(c.RemoteAddr()), addrPortOf(c.LocalAddr())
	ctx := p.ctx
	srcW, srcID, err := t.localWorkload(src.Addr())
	if err != nil {
		// Fail closed: without the source identity nothing may leave.
		t.cfg.Metrics.failClosed.WithLabelValues("unknown_source").Inc()
		t.log.WarnContext(ctx, "outbound refused", "src", src, "dst", dst, "error", err)
		resetConn(c)
		return
	}
	state := t.State()
	if svc, ok := state.Dir.ServiceByVIP(dst.Addr()); ok {
		p.handleService(ctx, c, svc, src, dst)
		return
	}
	dstW, meshed := state.Dir.ByAddr(dst.Addr())
	if !meshed || !dstW.Enrolled {
		p.passthrough(ctx, c, srcW, dstW, src, dst)
		return
	}
	dstID := t.identityOf(dstW)
	conn := connInfo{reporter: "source", src: srcW, srcID: srcID, dst: dstW, dstID: dstID, secure: true}
	stream, err := p.dialHBONE(ctx, srcID, dstID, src, dst, "")
	if err != nil {
		t.cfg.Metrics.failed(conn)
		t.log.WarnContext(ctx, "HBONE connect failed", "src", srcW, "dst", dstW, "authority", dst, "error", err)
		resetConn(c)
		return
	}
	closed := t.cfg.Metrics.open(conn)
	reqBytes, respBytes, _ := hbone.Relay(c, stream)
	closed(reqBytes, respBytes)
}

// dialHBONE opens a CONNECT stream to dst through the destination pod's
// HBONE port, from inside the source pod's namespace, on a pooled
// connection keyed by both identities and the destination pod.
func (p *pod) dialHBONE(ctx context.Context, srcID, dstID identity.ID, src, dst netip.AddrPort, host string) (*hbone.Stream, error) {
	t := p.t
	hboneAddr := netip.AddrPortFrom(dst.Addr(), t.cfg.HBONEPort)
	key := hbone.PoolKey{SrcIdentity: srcID.String(), DstIdentity: dstID.String(), DstAddr: hboneAddr}
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		return netns.Dial(ctx, p.netns, network, addr, netns.SocketOptions{Mark: t.cfg.TunnelMark})
	}
	fwd := "for=" + strconv.Quote(forwardedAddr(src.Addr()))
	if host != "" {
		fwd += ";host=" + host
	}
	req := hbone.Request{Authority: dst, Forwarded: fwd}
	tlsConf := identity.ClientConfig(t.cfg.Certs, srcID, dstID)
	// The timeout bounds dial, handshake and response, not the stream.
	ctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	stream, err := t.cfg.Pool.Connect(ctx, key, dial, tlsConf, req)
	if err != nil {
		return nil, fmt.Errorf("HBONE to %s via %s: %w", dst, hboneAddr, err)
	}
	return stream, nil
}

// passthrough connects to a destination outside the mesh in plain TCP, from
// the pod's own namespace and address, as if the tunnel were not there.
func (p *pod) passthrough(ctx context.Context, c net.Conn, srcW, dstW *workload.Workload, src, dst netip.AddrPort) {
	t := p.t
	conn := connInfo{reporter: "source", src: srcW, srcID: t.identityOf(srcW), dst: dstW}
	up, err := p.dialPlain(ctx, dst)
	if err != nil {
		t.cfg.Metrics.failed(conn)
		t.log.DebugContext(ctx, "passthrough connect failed", "src", src, "dst", dst, "error", err)
		resetConn(c)
		return
	}
	closed := t.cfg.Metrics.open(conn)
	reqBytes, respBytes, _ := hbone.Relay(c, up)
	closed(reqBytes, respBytes)
}

// connectTimeout bounds establishing an upstream connection.
const connectTimeout = 5 * time.Second

// dialPlain connects to dst in plain TCP from inside the pod, with the
// tunnel mark so the pod's own programs let it go.
func (p *pod) dialPlain(ctx context.Context, dst netip.AddrPort) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	return netns.Dial(ctx, p.netns, "tcp", dst.String(), netns.SocketOptions{Mark: p.t.cfg.TunnelMark})
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
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
}
