package tunnel

import (
	"cmp"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// failureMemory is how long an endpoint that refused a connection is
// skipped while others are available.
const failureMemory = 10 * time.Second

// maxServiceAttempts bounds how many endpoints one connection tries.
const maxServiceAttempts = 3

// balancer picks service endpoints round-robin, skipping endpoints that
// failed recently. It is shared by all pods of the node.
type balancer struct {
	mu     sync.Mutex
	next   map[cursorKey]uint64         // per service port: round-robin cursor
	failed map[netip.AddrPort]time.Time // endpoint -> when it last failed
	pruned time.Time                    // when failed was last pruned
	now    func() time.Time

	// ranked caches each service port's eligible endpoints, by rank for
	// a client locality, for the current directory, rankedDir (prune
	// replaces it and clears the cache): finding them walks every
	// endpoint, and a service may have tens of thousands, which every
	// connection to it walked. Services of another directory (a
	// connection that looked one up before an update) are not cached:
	// nothing would read them again before the next update, yet they
	// would hold the old directory's endpoints and the cache's room.
	// Bounded by maxRankedPicks picks' worth in all (rankedCost: each
	// entry's room for picks, and its key); past that, connections walk.
	rankedMu   sync.Mutex
	rankedDir  *workload.Directory
	ranked     map[rankedKey][][]pick
	rankedCost int
}

// The balancer's lock is shared by every pod's service connections, so
// what it does under it is bounded, whatever size of service a tenant
// makes: order looks at most maxOrderProbes endpoints past the cursor
// (a connection tries maxServiceAttempts), and the failure memory holds at
// most maxFailed endpoints and is pruned once per failureMemory.
const (
	maxOrderProbes = 64
	maxFailed      = 1 << 14
	maxRankedPicks = 1 << 20 // 8 MiB of picks
	// rankedEntryCost is what a cache entry holds besides its picks (its
	// key, about 180 bytes, and slice headers), in picks: an entry with
	// none (no ready endpoint serves the port; STRICT, and a client it
	// cannot place) is not free.
	rankedEntryCost = 32
)

func newBalancer() *balancer {
	return &balancer{next: map[cursorKey]uint64{}, failed: map[netip.AddrPort]time.Time{}, now: time.Now, ranked: map[rankedKey][][]pick{}}
}

// rankedKey names a service port, and the locality of the client its
// endpoints were ranked for (zero when the service has no Routing).
type rankedKey struct {
	svc    *workload.Service
	port   workload.ServicePort
	client clientPlace
}

// clientPlace is what of a client Routing.Rank reads.
type clientPlace struct {
	known                                bool
	region, zone, subzone, node, cluster string
}

// pick is one eligible endpoint: its index in the service's endpoints and
// the port it serves the service port on.
type pick struct {
	ep   int32
	port uint16
}

// cursorKey names one port of one service.
type cursorKey struct{ service, port string }

// prune forgets the cursors of services that are no longer in dir, so the
// balancer holds state only for services that exist.
func (b *balancer) prune(dir *workload.Directory) {
	b.rankedMu.Lock()
	b.rankedDir = dir
	clear(b.ranked)
	b.rankedCost = 0
	b.rankedMu.Unlock()
	live := map[string]bool{}
	for _, s := range dir.Services() {
		live[s.String()] = true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for k := range b.next {
		if !live[k.service] {
			delete(b.next, k)
		}
	}
}

// target is one endpoint able to serve a service port.
type target struct {
	ep   workload.Endpoint
	addr netip.AddrPort // endpoint address and the resolved target port
}

// order returns ready endpoints serving port of svc, a service of dir,
// for a connection from client (nil if unknown), looking at most maxOrderProbes per rank, spread over
// the ring from the service's round-robin cursor: up to
// maxServiceAttempts fresh ones, then as many recently failed ones. A
// service with a Routing preference is served by its best-ranked
// endpoints first; the next rank's fresh ones follow only where those
// are too few or failed recently, so a zone whose endpoints all fail
// hands its connections to the next zone (FAILOVER, as Envoy's outlier
// detection moves a locality's traffic).
func (b *balancer) order(dir *workload.Directory, svc *workload.Service, port workload.ServicePort, client *workload.Workload) []target {
	tiers := b.eligible(dir, svc, port, client)
	if len(tiers) == 0 {
		return nil
	}
	key := cursorKey{svc.String(), port.Name}
	fresh := make([]target, 0, maxServiceAttempts)
	var stale []target
	b.mu.Lock()
	defer b.mu.Unlock()
	cursor := b.next[key]
	b.next[key]++
	now := b.now()
	for _, tier := range tiers {
		if len(fresh) == maxServiceAttempts {
			break
		}
		start := int(cursor % uint64(len(tier)))
		// The looks are spread over the whole ring, not the 64 after
		// the cursor: the endpoints of one failed node are often a
		// contiguous run of addresses, and a window inside it would
		// offer only those.
		step := max(1, len(tier)/maxOrderProbes)
		for i := 0; i < len(tier) && i < maxOrderProbes && len(fresh) < maxServiceAttempts; i++ {
			p := tier[(start+i*step)%len(tier)]
			ep := svc.Endpoints[p.ep]
			t := target{ep: ep, addr: netip.AddrPortFrom(ep.Addr, p.port)}
			if at, bad := b.failed[t.addr]; bad && now.Sub(at) < failureMemory {
				if len(stale) < maxServiceAttempts {
					stale = append(stale, t)
				}
			} else {
				fresh = append(fresh, t)
			}
		}
	}
	return append(fresh, stale...)
}

// eligible returns the ready endpoints serving port, grouped by their
// rank for client under the service's Routing, best first (see rank),
// from the cache when it has them (svc is of dir, the current directory).
func (b *balancer) eligible(dir *workload.Directory, svc *workload.Service, port workload.ServicePort, client *workload.Workload) [][]pick {
	key := rankedKey{svc: svc, port: port}
	if svc.Routing != nil && client != nil {
		key.client = clientPlace{true, client.Region, client.Zone, client.Subzone, client.Node, client.Cluster}
	}
	b.rankedMu.Lock()
	tiers, ok := b.ranked[key]
	b.rankedMu.Unlock()
	if ok {
		return tiers
	}
	tiers = rank(svc, port, client)
	cost := rankedEntryCost
	for _, t := range tiers {
		cost += cap(t) // what append grew it to, not only what is used
	}
	b.rankedMu.Lock()
	if dir == b.rankedDir && b.rankedCost+cost <= maxRankedPicks {
		if _, raced := b.ranked[key]; !raced {
			b.ranked[key] = tiers
			b.rankedCost += cost
		}
	}
	b.rankedMu.Unlock()
	return tiers
}

// rank groups the ready endpoints serving port by their rank for client
// under the service's Routing, best first: one group when the service has
// none (or the client is unknown). A Strict service keeps only the
// endpoints sharing every scope with the client, none when the client is
// unknown. Endpoints that cannot serve (not ready, port missing, or
// naming a pod the directory does not have at their address:
// workload.Endpoint.Unresolved, never dialled) are left out here, so they
// never skew the share of the others in the rotation nor spend a
// connection's attempts, as ztunnel picks only endpoints whose workload it
// knows.
func rank(svc *workload.Service, port workload.ServicePort, client *workload.Workload) [][]pick {
	r := svc.Routing
	if r != nil && client == nil {
		if r.Strict {
			return nil
		}
		r = nil
	}
	var tiers [][]pick
	if r == nil {
		tiers = make([][]pick, 1)
	} else {
		tiers = make([][]pick, len(r.Scopes)+1)
	}
	for i, ep := range svc.Endpoints {
		if !ep.Ready || ep.Unresolved {
			continue
		}
		tp, ok := ep.TargetPort(port)
		if !ok {
			continue
		}
		n := 0
		if r != nil {
			n = r.Rank(client, ep)
			if r.Strict && n < len(r.Scopes) {
				continue
			}
		}
		tiers[n] = append(tiers[n], pick{ep: int32(i), port: tp})
	}
	slices.Reverse(tiers)
	return slices.DeleteFunc(tiers, func(t []pick) bool { return len(t) == 0 })
}

func (b *balancer) fail(a netip.AddrPort) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	if now.Sub(b.pruned) > failureMemory || (len(b.failed) >= maxFailed && now.Sub(b.pruned) > time.Second) {
		b.pruned = now
		for k, at := range b.failed {
			if now.Sub(at) > failureMemory {
				delete(b.failed, k)
			}
		}
	}
	if len(b.failed) < maxFailed {
		b.failed[a] = now
	}
}

func (b *balancer) ok(a netip.AddrPort) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.failed, a)
}

// errNoEndpoint means a service has nothing to send the connection to.
var errNoEndpoint = errors.New("no ready endpoint")

// handleService serves an outbound connection to a service VIP. kube-proxy
// never sees it (it was captured in the pod), so the tunnel resolves the
// service itself: it picks a ready endpoint, and opens HBONE to it when the
// endpoint is meshed, plain TCP otherwise. Without an endpoint the
// connection is refused; it is never sent to the VIP in plaintext.
func (p *pod) handleService(ctx context.Context, c net.Conn, dir *workload.Directory, svc *workload.Service, src, dst netip.AddrPort) {
	t := p.t
	srcW, srcID, err := p.self(src.Addr())
	if err != nil {
		t.cfg.Metrics.failClosed.WithLabelValues(sourceFailure(err)).Inc()
		t.failures.note(ctx, "outbound refused: no identity for the source address", "pod", p.uid, "src", src, "dst", dst, "error", err)
		resetConn(c)
		return
	}
	if svc.Rejected {
		t.cfg.Metrics.failClosed.WithLabelValues("rejected_resource").Inc()
		t.failures.note(ctx, "connection refused: the source rejected what it was sent for this address and holds no accepted version of it", "dst", dst, "resource", svc.Name)
		resetConn(c)
		return
	}
	if svc.Contested {
		t.cfg.Metrics.failClosed.WithLabelValues("contested_vip").Inc()
		t.failures.note(ctx, "service connection refused: services that cannot be told apart claim this VIP", "vip", dst)
		resetConn(c)
		return
	}
	var port *workload.ServicePort
	for i := range svc.Ports {
		if svc.Ports[i].Port == int32(dst.Port()) && (svc.Ports[i].Protocol == "" || svc.Ports[i].Protocol == "TCP") {
			port = &svc.Ports[i]
		}
	}
	conn := connInfo{reporter: "source", src: srcW, srcID: srcID, service: svc, srcAddr: src}
	if port == nil {
		t.cfg.Metrics.failClosed.WithLabelValues("no_service_port").Inc()
		t.failures.note(ctx, "service connection refused: the service has no such port", "service", svc.String(), "vip", dst)
		resetConn(c)
		return
	}
	candidates := inFamilyOf(dir, t.lb.order(dir, svc, *port, srcW), dst.Addr())
	if len(candidates) == 0 {
		if unresolvedServe(svc, *port) {
			t.cfg.Metrics.failClosed.WithLabelValues("endpoint_unresolved").Inc()
			t.failures.note(ctx, "service connection refused: its ready endpoints name pods the directory does not have at their addresses (not seen yet, or another workload keeps the address); not dialled in plain TCP", "service", svc.String(), "port", port.Port)
		} else {
			t.cfg.Metrics.failClosed.WithLabelValues("no_endpoint").Inc()
			t.failures.note(ctx, "service connection refused: no ready endpoint serves the port", "service", svc.String(), "port", port.Port, "target_port", cmp.Or(port.TargetPortName, strconv.Itoa(int(port.TargetPort))))
		}
		resetConn(c)
		return
	}
	var lastErr error
	trace := newTraceparent()
	for i, cand := range candidates {
		if i == maxServiceAttempts {
			break
		}
		up, meshed, err := p.dialEndpoint(ctx, srcW, srcID, svc, cand, src, trace)
		if err != nil {
			lastErr = err
			if endpointFailed(err) {
				t.lb.fail(cand.addr)
			}
			t.refusals.note(ctx, "service endpoint failed; trying the next", "service", svc.String(), "endpoint", cand.addr, "error", err)
			continue
		}
		t.lb.ok(cand.addr)
		conn.dst, conn.secure, conn.dstAddr = cand.ep.Workload, meshed, cand.addr
		if meshed {
			conn.dstID = t.identityOf(cand.ep.Workload)
			conn.dstAddr, conn.hboneAddr = netip.AddrPortFrom(cand.addr.Addr(), t.cfg.HBONEPort), cand.addr
		}
		p.relayCounted(ctx, c, up, 0, t.cfg.Metrics.open(conn, traceIDOf(trace)))
		return
	}
	conn.dstAddr = dst
	t.cfg.Metrics.failed(ctx, conn, traceIDOf(trace), lastErr)
	t.failures.note(ctx, "service connection failed on every endpoint tried", "service", svc.String(), "error", lastErr)
	resetConn(c)
}

// inFamilyOf returns cands for a connection to dst: each at its
// workload's address of dst's family where it is of the other (a
// dual-stack service lists a dual-stack pod once per family), without
// repeats, those of dst's family first. kube-proxy never sends a VIP's
// connection to an endpoint of the other family, and ztunnel picks the
// endpoint workload's address of the destination's family: an app that
// listens on IPv4 only refused the connections sent to its IPv6 address,
// which also marked it failed for every pod of the node.
func inFamilyOf(dir *workload.Directory, cands []target, dst netip.Addr) []target {
	out := make([]target, 0, len(cands))
	var other []target
	for _, c := range cands {
		a := c.addr.Addr()
		if w := c.ep.Workload; a.Is4() != dst.Is4() && w != nil {
			if x, ok := ownAddrOfFamily(dir, w, dst.Is4()); ok {
				c.addr = netip.AddrPortFrom(x, c.addr.Port())
			}
		}
		seen := func(t target) bool { return t.addr == c.addr }
		if slices.ContainsFunc(out, seen) || slices.ContainsFunc(other, seen) {
			continue
		}
		if c.addr.Addr().Is4() == dst.Is4() {
			out = append(out, c)
		} else {
			other = append(other, c)
		}
	}
	return append(out, other...)
}

// ownAddrOfFamily returns an address of w in the IPv4 family (v4) or the
// IPv6 one that the directory gives to w. A workload may still list an
// address the directory gives to another (a terminating pod's, which a new
// pod took): what is there now is that other workload, with its own
// identity and protocol, and dialled as w's, a plaintext endpoint's address
// sent the app's bytes in plaintext to a meshed pod.
func ownAddrOfFamily(dir *workload.Directory, w *workload.Workload, v4 bool) (netip.Addr, bool) {
	for _, x := range w.Addrs {
		if owner, ok := dir.ByAddr(x); ok && owner == w && x.Is4() == v4 {
			return x, true
		}
	}
	return netip.Addr{}, false
}

// unresolvedServe reports whether a ready endpoint of svc that would serve
// port was left out for being unresolved: the refusal is then counted as
// such, not as a service without endpoints.
func unresolvedServe(svc *workload.Service, port workload.ServicePort) bool {
	return slices.ContainsFunc(svc.Endpoints, func(ep workload.Endpoint) bool {
		_, ok := ep.TargetPort(port)
		return ep.Ready && ep.Unresolved && ok
	})
}

// errEndpointUnresolved refuses an endpoint that names a pod the directory
// does not know (workload.Endpoint.Unresolved).
var errEndpointUnresolved = errors.New("the endpoint names a pod the directory does not know yet (or not at this address): not dialled in plain TCP")

// dialEndpoint connects to one service endpoint: HBONE with the service host
// name when the endpoint pod is meshed, plain TCP from the pod otherwise. An
// endpoint naming a pod the directory has not seen is not dialled: it may be
// a meshed pod, and plain TCP would put its traffic on the network
// unencrypted (ztunnel's endpoints are workloads, so it skips such one too).
func (p *pod) dialEndpoint(ctx context.Context, srcW *workload.Workload, srcID identity.ID, svc *workload.Service, cand target, src netip.AddrPort, trace string) (io.ReadWriteCloser, bool, error) {
	w := cand.ep.Workload
	if w == nil && cand.ep.Unresolved {
		p.t.cfg.Metrics.failClosed.WithLabelValues("endpoint_unresolved").Inc()
		return nil, false, errEndpointUnresolved
	}
	if w != nil && w.TakesHBONE() {
		// No early data here: after a timeout the bytes may already have
		// reached this endpoint's app, and failing over would send them to
		// a second one.
		s, _, err := p.dialHBONE(ctx, nil, srcW, srcID, p.t.identityOf(w), src, cand.addr, svc.Hostname, trace)
		if err != nil {
			return nil, true, err
		}
		return s, true, nil
	}
	c, err := p.dialPlain(ctx, cand.addr)
	if err != nil {
		return nil, false, err
	}
	return c, false, nil
}

// endpointFailed reports whether err, from a connection attempt to a
// service endpoint or waypoint instance, says that the endpoint failed,
// and so marks it for every pod of the node (balancer.fail). A failure
// that says something about the client only must not: a pod could then
// steer the service connections of every pod of its node to the endpoints
// it left unmarked. Its own namespace out of ports or fds (a pod may
// narrow net.ipv4.ip_local_port_range, and the agent dials from the pod's
// namespace), no route to the endpoint in its namespace (ENETUNREACH is
// the client namespace's own routing table's answer), its pod stopping (the dial cancelled, or
// the Connect failed as its pooled connections were evicted: hbone.ErrEvicted), an endpoint the
// directory cannot resolve yet (not the endpoint's failure), no certificate of its
// own to present (identity.ErrNoCertificate: not issued yet, the CA failing, expired), its identity refused
// by policy, a request refused (4xx), or its address over the endpoint
// node's per-source limit are the client's.
func endpointFailed(err error) bool {
	var st *hbone.StatusError
	if errors.As(err, &st) {
		return st.Status >= 500 && !strings.Contains(st.Reason, sourceLimitReason)
	}
	for _, own := range []error{errEndpointUnresolved, context.Canceled, syscall.EADDRNOTAVAIL, syscall.ENETUNREACH, syscall.EADDRINUSE,
		syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, identity.ErrNoCertificate, hbone.ErrEvicted, hbone.ErrPoolClosed} {
		if errors.Is(err, own) {
			return false
		}
	}
	return true
}
