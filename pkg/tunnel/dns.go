package tunnel

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/dnsproxy"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// DNS capture, as istio-cni's ambient DNS capture with ztunnel's proxy: a
// pod whose DNS is captured (POD_CAPTURE_DNS) has its UDP queries to port
// 53 assigned by the capture programs to a UDP socket of the tunnel on
// Config.DNSPort in its namespace, and its TCP connections to port 53
// arrive at the outbound listener like any other. Both are answered by
// Config.DNS: names of the mesh from the directory, the rest forwarded from
// the pod's namespace to the upstream resolvers. An answer over UDP leaves
// from a socket bound to the address and port the query was sent to, so
// the app's resolver, which connected its socket there, takes it.

// dnsBufSize is one byte more than the largest query the resolver takes
// (a query is a few hundred bytes, though EDNS0 lets a client announce up
// to 64 KiB): a longer datagram is read cut to this size, and the resolver
// rejects it as oversized rather than judging its cut.
const dnsBufSize = dnsproxy.MaxQueryLen + 1

// listenDNS opens the pod's DNS socket: dual-stack when the namespace has
// IPv6, else IPv4 only. It is in no reuseport group, as the listeners
// (handover.go): a group admits any socket of the same user, so a process
// in the pod running as root could join it and be handed a share of its
// own pod's captured queries, and answer them. A successor agent takes
// this very socket over (takeDNS); one that cannot waits for the port
// (awaitDNS).
func (p *pod) listenDNS(ctx context.Context) (*net.UDPConn, error) {
	opts := netns.SocketOptions{Transparent: true, Mark: p.t.cfg.TunnelMark, RecvOrigDst: true}
	port := strconv.Itoa(int(p.t.cfg.DNSPort))
	c, err := p.ns.ListenPacket(ctx, "udp", net.JoinHostPort("::", port), opts)
	if err == nil {
		return c, nil
	}
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, err // held, IPv4 included (dual-stack)
	}
	c4, err4 := p.ns.ListenPacket(ctx, "udp4", net.JoinHostPort("0.0.0.0", port), opts)
	if err4 != nil {
		return nil, errors.Join(err, err4)
	}
	return c4, nil
}

// serveDNS reads the pod's captured queries until the socket closes, on
// a goroutine counted in p.wg by the caller. Each query is answered on its
// own goroutine (dispatchDNS): a forwarded one waits for its upstream.
// Those are bounded per pod, and the resolver bounds how many are
// forwarded at once (per pod and for the node).
func (p *pod) serveDNS(c *net.UDPConn) {
	go func() {
		defer p.wg.Done()
		buf := make([]byte, dnsBufSize)
		oob := make([]byte, 128)
		for {
			n, oobn, _, from, err := c.ReadMsgUDPAddrPort(buf, oob)
			if err != nil {
				if !p.stopping.Load() && !errors.Is(err, net.ErrClosed) {
					p.t.log.Error("DNS socket failed: the pod's captured queries go unanswered", "pod", p.uid, "error", err)
				}
				return
			}
			to, ok := origDst(oob[:oobn])
			if !ok {
				continue // no destination to answer from (the kernel names every datagram's)
			}
			p.dispatchDNS(from, to, buf[:n])
		}
	}()
}

// dispatchDNS starts answering one datagram the pod's DNS socket read from
// from, sent to to; query is the reader's buffer, copied here. Only a query
// the capture assigned (sent to port 53: IP_ORIGDSTADDR names every
// datagram's destination, this socket's own port for one sent straight to
// it) from one of the pod's own addresses is answered: the answer leaves
// the pod's namespace with the tunnel mark, past the capture, so one to
// any other address would let a pod (or a peer sending to the socket's
// port) make the agent send "the resolver's" datagrams where it names, and
// forward queries as the pod. At most dnsMaxPendingPerPod are answered at
// once, counted in p.wg so a stopping pod answers them before it goes; the
// rest are dropped. Every drop is counted by reason.
func (p *pod) dispatchDNS(from, to netip.AddrPort, query []byte) {
	from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
	drop := func(reason string) { p.t.cfg.Metrics.dnsDropped.WithLabelValues(reason).Inc() }
	switch {
	case to.Port() != dnsServerPort:
		drop(dnsDropNotCaptured)
		return
	case from.Port() == 0 || !p.owns(from.Addr()):
		drop(dnsDropForeignSource)
		return
	}
	if p.dnsPending.Add(1) > dnsMaxPendingPerPod {
		p.dnsPending.Add(-1)
		drop(dnsDropBusy)
		return
	}
	query = append([]byte(nil), query...)
	p.wg.Add(1) // the reader holds one: the count is not zero
	go func() {
		defer p.wg.Done()
		defer p.dnsPending.Add(-1)
		p.answerDNS(from, to, query)
	}()
}

// dnsServerPort is the port of the queries the capture assigns to the DNS
// socket (capture.c's DNS_SERVER_PORT).
const dnsServerPort = 53

// dnsMaxPendingPerPod bounds a pod's queries being answered at once, each
// a goroutine that may hold an upstream socket and then a reply socket in
// the pod's namespace. It is twice the resolver's default bound of queries
// in flight per pod (dnsproxy.DefaultMaxInFlightPerPod), so the resolver's
// REFUSED answers still reach a pod over its bound; what a flood sends
// beyond this is dropped, as a full socket buffer would drop it.
const dnsMaxPendingPerPod = 2 * dnsproxy.DefaultMaxInFlightPerPod

// Reasons of redirector_dns_dropped_total.
const (
	dnsDropNotCaptured   = "not_captured"
	dnsDropForeignSource = "foreign_source"
	dnsDropBusy          = "busy"
)

var dnsDropReasons = []string{dnsDropNotCaptured, dnsDropForeignSource, dnsDropBusy}

// answerDNS answers one query from client, sent to dst.
func (p *pod) answerDNS(client, dst netip.AddrPort, query []byte) {
	w, _ := p.t.State().Dir.ByAddr(client.Addr())
	if w != nil && w.Key() != p.uid {
		w = nil // the directory (lagging) names another pod there: answer as no one's
	}
	ctx, cancel := context.WithTimeout(p.ctx, dnsAnswerTimeout)
	defer cancel()
	answer := p.t.cfg.DNS.Answer(ctx, w, "udp", query, p.dnsDialer())
	if answer == nil {
		return
	}
	if err := p.replyDNS(ctx, dst, client, answer); err != nil {
		p.t.failures.note(ctx, "DNS answer not sent", "pod", p.uid, "client", client, "error", err)
	}
}

// dnsAnswerTimeout bounds one query's answer, forwarding included.
const dnsAnswerTimeout = 10 * time.Second

// replyDNS sends answer to client from from, the address the query was
// sent to: a socket in the pod's namespace bound there (transparent, as
// the address is not the pod's; beside other answers' sockets). It goes
// out over lo, where no capture program runs.
func (p *pod) replyDNS(ctx context.Context, from, client netip.AddrPort, answer []byte) error {
	network := "udp4"
	if from.Addr().Is6() {
		network = "udp6"
	}
	c, err := p.ns.ListenPacket(ctx, network, from.String(), netns.SocketOptions{Transparent: true, Mark: p.t.cfg.TunnelMark, ReuseAddr: true})
	if err != nil {
		return err
	}
	defer c.Close()
	if _, err := c.WriteToUDPAddrPort(answer, client); err != nil {
		return fmt.Errorf("send to %s: %w", client, err)
	}
	return nil
}

// dnsDialer dials upstream resolvers from the pod's namespace, as the pod
// would, with the tunnel mark so the capture lets the query out.
func (p *pod) dnsDialer() dnsproxy.Dialer {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		opts := netns.SocketOptions{Mark: p.t.cfg.TunnelMark}
		if network == "tcp" {
			return p.ns.Dial(ctx, network, addr, opts)
		}
		return p.ns.DialUDP(ctx, network, addr, opts)
	}
}

// capturesDNS reports whether w's TCP connections to port 53 are the DNS
// proxy's: the node's setting, or the pod's own choice over it.
func (t *Tunnel) capturesDNS(w *workload.Workload) bool {
	return t.cfg.DNS != nil && w.DNSCapture.Or(t.cfg.DNSCapture)
}

// origDst reads the original destination from a datagram's control
// messages (IP_ORIGDSTADDR or IPV6_ORIGDSTADDR): a sockaddr_in or
// sockaddr_in6, port at bytes 2-3 in network order, the address at 4 or 8.
func origDst(oob []byte) (netip.AddrPort, bool) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return netip.AddrPort{}, false
	}
	for _, m := range msgs {
		d := m.Data
		switch {
		case m.Header.Level == unix.SOL_IP && m.Header.Type == unix.IP_ORIGDSTADDR && len(d) >= unix.SizeofSockaddrInet4:
			return netip.AddrPortFrom(netip.AddrFrom4([4]byte(d[4:8])), binary.BigEndian.Uint16(d[2:4])), true
		case m.Header.Level == unix.SOL_IPV6 && m.Header.Type == unix.IPV6_ORIGDSTADDR && len(d) >= unix.SizeofSockaddrInet6:
			return netip.AddrPortFrom(netip.AddrFrom16([16]byte(d[8:24])).Unmap(), binary.BigEndian.Uint16(d[2:4])), true
		}
	}
	return netip.AddrPort{}, false
}

// startDNS takes the pod's DNS socket from the predecessor agent, or
// opens one, and serves it. A pod without one has its captured queries
// dropped by the capture (no socket to assign them to): they fail, as they
// would without a proxy listening, and never leave uncaptured. A socket
// that cannot be opened (a predecessor that did not hand its socket over,
// another process in the pod holding the port) is waited for (awaitDNS).
func (p *pod) startDNS() {
	c := p.takeDNS(p.ctx)
	if c == nil {
		var err error
		if c, err = p.listenDNS(p.ctx); err != nil {
			if p.ctx.Err() == nil {
				p.awaitDNS(err)
			}
			return
		}
	}
	p.useDNS(c)
}

// useDNS makes c the pod's DNS socket and serves it; it reports false (and
// closes c) if the pod is stopping.
func (p *pod) useDNS(c *net.UDPConn) bool {
	p.mu.Lock()
	if p.stopping.Load() {
		p.mu.Unlock()
		c.Close()
		return false
	}
	p.dns = c
	p.wg.Add(1) // under mu: stop waits for it once it has set stopping
	p.mu.Unlock()
	p.serveDNS(c)
	return true
}

// dnsFailure is why the pod has no DNS socket, and since when.
type dnsFailure struct {
	since time.Time
	err   error
}

// problem is the readiness problem of the pod's DNS socket on port.
func (f *dnsFailure) problem(port uint16, now time.Time) string {
	return fmt.Sprintf("port %d: DNS socket not open for %s, the pod's captured queries are dropped (last: %v)",
		port, now.Sub(f.since).Round(time.Second), f.err)
}

// awaitDNS opens the pod's DNS socket again until it opens or the pod
// stops. The port is most often held by a predecessor that did not hand
// its socket over (a release from before the DNS hand-over, or a failed
// exchange), which answers the pod's queries until it closes its socket
// on SIGTERM. As awaitPorts: binding is retried every awaitPortsEvery, the
// predecessor asked again less and less often, and after dnsAwaitReport
// readiness names the pod and port (dnsDown): something else than an agent
// on its way out may hold the port, or the socket fails to open otherwise.
// Before, a failure was logged once and never retried: the pod's captured
// queries were dropped for as long as the agent served it.
func (p *pod) awaitDNS(first error) {
	p.t.log.Warn("DNS socket not opened (a predecessor without DNS hand-over holding the port?): the pod's captured queries go to it or are dropped until it opens; retrying",
		"uid", p.uid, "netns", p.netns, "error", first)
	start := time.Now()
	p.awaitFree(dnsAwaitReport, func(takeOver bool) error {
		var c *net.UDPConn
		if takeOver {
			c = p.takeDNS(p.ctx)
		}
		if c == nil {
			var err error
			if c, err = p.listenDNS(p.ctx); err != nil {
				return err
			}
		}
		if p.useDNS(c) {
			p.dnsDown.Store(nil)
			p.t.log.Info("DNS socket opened", "uid", p.uid, "netns", p.netns, "waited", time.Since(start).Round(time.Millisecond))
		}
		return nil
	}, func(err error) {
		p.dnsDown.Store(&dnsFailure{since: start, err: err})
		p.t.log.Error("DNS socket still not open: the pod's captured queries go to another process's socket or are dropped",
			"uid", p.uid, "netns", p.netns, "error", err)
	})
}

// takeDNS takes the pod's DNS socket from the predecessor agent, with the
// queries queued on it (handover.go), or returns nil when the pod is to
// open its own: no predecessor, one that hands no DNS socket over (a
// release from before: logged once, not counted), none handed over (the
// pod not served there, counted), or a failure, counted and logged. From here
// both agents read the socket until the predecessor closes its
// descriptor; each answers in full what it reads.
func (p *pod) takeDNS(ctx context.Context) *net.UDPConn {
	t := p.t
	pr := t.cfg.Predecessor
	if pr == nil {
		return nil
	}
	c, err := pr.takeDNS(ctx, p.nsInode, t.cfg.DNSPort, t.cfg.TunnelMark)
	switch {
	case errors.Is(err, errDNSRefused):
		t.log.InfoContext(ctx, "the predecessor does not hand DNS sockets over: each pod opens its own once the predecessor closes its socket", "error", err)
		return nil
	case errors.Is(err, errNoPredecessor), errors.Is(err, errNoDNSHandover), err != nil && ctx.Err() != nil:
		// nothing to take (no predecessor, or none that hands DNS sockets
		// over: not counted, as no pod was asked for), or the pod stopped
		// meanwhile
		return nil
	case err != nil:
		t.cfg.Metrics.handover.WithLabelValues(handoverFailed).Inc()
		t.log.WarnContext(ctx, "DNS socket hand-over failed; opening the pod's own", "uid", p.uid, "error", err)
		return nil
	case c == nil:
		t.cfg.Metrics.handover.WithLabelValues(handoverNotServed).Inc()
		return nil
	}
	t.cfg.Metrics.handover.WithLabelValues(handoverTaken).Inc()
	t.log.InfoContext(ctx, "pod DNS socket taken over from the predecessor", "uid", p.uid, "netns", p.netns)
	return c
}
