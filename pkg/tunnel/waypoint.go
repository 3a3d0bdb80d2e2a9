package tunnel

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Waypoints, as ztunnel routes to them (src/proxy/outbound.rs
// build_request, src/state.rs fetch_waypoint):
//
//   - A connection to a service VIP goes to the service's waypoint; the
//     waypoint of the endpoint picked behind the VIP is never used (the
//     service's waypoint, or none, decides).
//   - A connection to a workload's own address goes to the workload's
//     waypoint, meshed workload or not.
//   - Always over HBONE to the waypoint's HBONE port (15008), the CONNECT
//     :authority the original destination (VIP:port or pod ip:port), the
//     Forwarded host the service's host name when a service was addressed,
//     the server certificate checked against the waypoint workload's SPIFFE
//     identity, and the client certificate the source pod's own.
//   - A waypoint named by host name is the service of that namespace and
//     host name: one of its ready endpoints that serves the HBONE port (by
//     the port mapping of that service port), at an address of the
//     caller's IP family when the endpoint's workload has one. A waypoint
//     named by address is the service with that VIP, else the workload at
//     that address.
//   - Traffic from the waypoint itself (same identity, source address one
//     of the waypoint workload's) does not go to the waypoint again.
//     ztunnel checks this for workload-addressed traffic only; it is
//     checked here for service traffic too, so that an enrolled waypoint
//     calling a VIP never loops.
//   - A waypoint that cannot be resolved refuses the connection (reset,
//     counted in redirector_fail_closed_total by reason): it is never sent
//     to the destination directly, nor in plaintext.
//
// Like ztunnel, the destination side does not reject traffic that did not
// come through the waypoint: Istio leaves that to an L4
// AuthorizationPolicy on the workload (ALLOW only the waypoint's
// principal), which the inbound side enforces as any other.

// Reasons a connection to a waypointed destination is refused, as
// redirector_fail_closed_total labels them.
const (
	reasonWaypointUnknown    = "waypoint_unknown"
	reasonWaypointNoEndpoint = "waypoint_no_endpoint"
)

var (
	// errWaypointUnknown: the waypoint's host name or address is not in
	// the directory.
	errWaypointUnknown = errors.New("waypoint not in the workload directory")
	// errWaypointNoEndpoint: the waypoint's service has no instance to
	// send to (none ready, none serving its HBONE port, or none whose
	// workload, so identity, is known).
	errWaypointNoEndpoint = errors.New("waypoint has no usable instance")
)

// waypointRoute is a connection's waypoint: the waypoint and what the
// client addressed (the service, for service traffic).
type waypointRoute struct {
	wp  *workload.Waypoint
	svc *workload.Service
}

// waypointOf returns the waypoint a connection from srcW to dst must go
// through, or nil when it goes directly.
func waypointOf(dir *workload.Directory, idx *waypointIndex, srcW *workload.Workload, dst netip.Addr) *waypointRoute {
	if svc, ok := dir.ServiceByVIPFor(dst, namespaceOf(srcW)); ok {
		if svc.Waypoint == nil || isWaypoint(dir, idx, svc.Waypoint, srcW) {
			return nil
		}
		return &waypointRoute{wp: svc.Waypoint, svc: svc}
	}
	w, ok := dir.ByAddr(dst)
	if !ok || w.Waypoint == nil || isWaypoint(dir, idx, w.Waypoint, srcW) {
		return nil
	}
	return &waypointRoute{wp: w.Waypoint}
}

// namespaceOf is w's namespace, "" for no workload.
func namespaceOf(w *workload.Workload) string {
	if w == nil {
		return ""
	}
	return w.Namespace
}

// waypointService returns the service wp names (by host name, or by VIP),
// nil if it names none.
func waypointService(dir *workload.Directory, idx *waypointIndex, wp *workload.Waypoint) *workload.Service {
	if wp.Hostname != "" {
		return idx.lookup(dir, wp.Namespace, wp.Hostname)
	}
	if svc, ok := dir.ServiceByVIP(wp.Addr); ok {
		return svc
	}
	return nil
}

// isWaypoint reports whether w is an instance of waypoint wp, as ztunnel's
// check_from_waypoint decides: same identity, and the address w sends from
// is one of the waypoint workload's.
func isWaypoint(dir *workload.Directory, idx *waypointIndex, wp *workload.Waypoint, w *workload.Workload) bool {
	if w == nil {
		return false
	}
	same := func(x *workload.Workload) bool {
		if x == nil || x.Namespace != w.Namespace || x.ServiceAccount != w.ServiceAccount {
			return false
		}
		return slices.ContainsFunc(x.Addrs, func(a netip.Addr) bool { return slices.Contains(w.Addrs, a) })
	}
	if svc := waypointService(dir, idx, wp); svc != nil {
		return slices.ContainsFunc(svc.Endpoints, func(ep workload.Endpoint) bool { return same(ep.Workload) })
	}
	if !wp.Addr.IsValid() {
		return false
	}
	x, _ := dir.ByAddr(wp.Addr)
	return same(x)
}

// waypointHop is one instance of a waypoint to try.
type waypointHop struct {
	w    *workload.Workload // its identity is what the certificate must carry
	addr netip.AddrPort     // its HBONE listener
}

// waypointHops resolves wp to the instances to try, in order, for a
// connection from client to dst.
func (t *Tunnel) waypointHops(dir *workload.Directory, wp *workload.Waypoint, client *workload.Workload, dst netip.Addr) ([]waypointHop, error) {
	port := cmp.Or(wp.HBONEPort, t.cfg.HBONEPort)
	svc := waypointService(dir, &t.waypoints, wp)
	if svc == nil {
		if w, ok := dir.ByAddr(wp.Addr); ok && wp.Hostname == "" {
			// Named by the address of a workload: that address, even
			// of another family than dst's (as ztunnel does).
			return []waypointHop{{w: w, addr: netip.AddrPortFrom(wp.Addr, port)}}, nil
		}
		return nil, fmt.Errorf("%w: %s", errWaypointUnknown, waypointName(wp))
	}
	var sp *workload.ServicePort
	for i := range svc.Ports {
		if svc.Ports[i].Port == int32(port) && (svc.Ports[i].Protocol == "" || svc.Ports[i].Protocol == "TCP") {
			sp = &svc.Ports[i]
		}
	}
	if sp == nil {
		return nil, fmt.Errorf("%w: service %s has no port %d", errWaypointNoEndpoint, svc, port)
	}
	var hops []waypointHop
	for _, c := range t.lb.order(dir, svc, *sp, client) {
		w := c.ep.Workload
		if w == nil {
			continue // no workload, no identity to check its certificate against
		}
		a := c.addr.Addr()
		if a.Is4() != dst.Is4() {
			// Prefer the caller's family, where the instance has it.
			if x, ok := ownAddrOfFamily(dir, w, dst.Is4()); ok {
				a = x
			}
		}
		hops = append(hops, waypointHop{w: w, addr: netip.AddrPortFrom(a, c.addr.Port())})
	}
	if len(hops) == 0 {
		return nil, fmt.Errorf("%w: service %s has no ready endpoint with a known workload on port %d", errWaypointNoEndpoint, svc, port)
	}
	return hops, nil
}

// waypointName names wp in logs and errors.
func waypointName(wp *workload.Waypoint) string {
	if wp.Hostname != "" {
		return wp.Namespace + "/" + wp.Hostname
	}
	return wp.Addr.String()
}

// handleWaypoint serves an outbound connection whose destination has a
// waypoint: it goes to the waypoint over HBONE with the original
// destination as the authority, or is refused.
func (p *pod) handleWaypoint(ctx context.Context, c net.Conn, dir *workload.Directory, via *waypointRoute, srcW *workload.Workload, srcID identity.ID, src, dst netip.AddrPort) {
	t := p.t
	conn := connInfo{reporter: "source", src: srcW, srcID: srcID, service: via.svc, secure: true,
		srcAddr: src, dstAddr: dst, hboneAddr: dst, waypoint: true}
	hops, err := t.waypointHops(dir, via.wp, srcW, dst.Addr())
	if err != nil {
		reason := reasonWaypointNoEndpoint
		if errors.Is(err, errWaypointUnknown) {
			reason = reasonWaypointUnknown
		}
		t.cfg.Metrics.failClosed.WithLabelValues(reason).Inc()
		t.failures.note(ctx, "connection refused: its waypoint cannot be resolved", "src", srcW, "dst", dst, "waypoint", waypointName(via.wp), "error", err)
		resetConn(c)
		return
	}
	host := ""
	if via.svc != nil {
		host = via.svc.Hostname
	}
	// Early data only when there is no second instance to fail over to:
	// bytes sent to one waypoint must not reach a second.
	var app net.Conn
	if len(hops) == 1 {
		app = c
	}
	trace := newTraceparent()
	var lastErr error
	for i, hop := range hops {
		if i == maxServiceAttempts {
			break
		}
		id := t.identityOf(hop.w)
		stream, early, err := p.dialHBONEVia(ctx, app, srcW, srcID, id, src, dst, hop.addr, host, trace)
		if err != nil {
			lastErr = err
			if endpointFailed(err) {
				t.lb.fail(hop.addr)
			}
			t.refusals.note(ctx, "waypoint instance failed; trying the next", "waypoint", waypointName(via.wp), "instance", hop.addr, "error", err)
			continue
		}
		t.lb.ok(hop.addr)
		conn.dst, conn.dstID, conn.dstAddr = hop.w, id, hop.addr
		p.relayCounted(ctx, c, stream, early, t.cfg.Metrics.open(conn, traceIDOf(trace)))
		return
	}
	t.cfg.Metrics.failed(ctx, conn, traceIDOf(trace), lastErr)
	t.failures.note(ctx, "connection through the waypoint failed", "src", srcW, "dst", dst, "waypoint", waypointName(via.wp), "error", lastErr)
	resetConn(c)
}

// waypointIndex finds services by namespace and host name, as waypoints
// name them. It is built once per directory, on the first lookup, and
// replaced when the directory is. The build is O(services), and every
// connection to a waypoint that arrives while it runs wants it: they wait
// for one build (mu) rather than each making its own.
type waypointIndex struct {
	cur atomic.Pointer[hostIndex]
	mu  sync.Mutex // serialises builds
}

type hostIndex struct {
	dir *workload.Directory
	// byHost maps "namespace/hostname" to the service. A waypoint that
	// names no namespace finds none, as in ztunnel: resolved in any
	// namespace, a tenant's service of that host name would become
	// another namespace's waypoint.
	byHost map[string]*workload.Service
}

func (x *waypointIndex) lookup(dir *workload.Directory, namespace, hostname string) *workload.Service {
	idx := x.cur.Load()
	if idx == nil || idx.dir != dir {
		idx = x.build(dir)
	}
	return idx.byHost[namespace+"/"+hostname]
}

// build returns dir's index, built unless another lookup built it while
// this one waited.
func (x *waypointIndex) build(dir *workload.Directory) *hostIndex {
	x.mu.Lock()
	defer x.mu.Unlock()
	if idx := x.cur.Load(); idx != nil && idx.dir == dir {
		return idx
	}
	idx := &hostIndex{dir: dir, byHost: map[string]*workload.Service{}}
	for _, s := range dir.Services() {
		if s.Hostname == "" {
			continue
		}
		if _, dup := idx.byHost[s.Namespace+"/"+s.Hostname]; !dup {
			idx.byHost[s.Namespace+"/"+s.Hostname] = s
		}
	}
	x.cur.Store(idx)
	return idx
}
