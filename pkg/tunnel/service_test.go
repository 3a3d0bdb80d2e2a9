package tunnel

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

func TestBalancerRoundRobinSkipsFailed(t *testing.T) {
	now := time.Unix(1000, 0)
	b := newBalancer()
	b.now = func() time.Time { return now }
	svc := &workload.Service{Name: "web", Namespace: "shop", Endpoints: []workload.Endpoint{
		{Addr: netip.MustParseAddr("10.0.0.1"), Ready: true},
		{Addr: netip.MustParseAddr("10.0.0.2"), Ready: true},
		{Addr: netip.MustParseAddr("10.0.0.3"), Ready: false},
	}}
	port := workload.ServicePort{Port: 80, TargetPort: 8080}
	first := map[string]int{}
	for i := 0; i < 4; i++ {
		order := b.order(nil, svc, port, nil)
		if len(order) != 2 {
			t.Fatalf("order %v: the not-ready endpoint must be left out", order)
		}
		first[order[0].addr.String()]++
	}
	if first["10.0.0.1:8080"] != 2 || first["10.0.0.2:8080"] != 2 {
		t.Errorf("round-robin firsts %v, want 2 each", first)
	}
	b.fail(netip.MustParseAddrPort("10.0.0.1:8080"))
	for i := 0; i < 3; i++ {
		if got := b.order(nil, svc, port, nil)[0].addr.String(); got != "10.0.0.2:8080" {
			t.Fatalf("a failed endpoint came first: %s", got)
		}
	}
	now = now.Add(failureMemory + time.Second)
	seen := map[string]bool{}
	for i := 0; i < 2; i++ {
		seen[b.order(nil, svc, port, nil)[0].addr.String()] = true
	}
	if !seen["10.0.0.1:8080"] {
		t.Error("the failed endpoint is not tried again after failureMemory")
	}
}

// TestBalancerPrunesGoneServices checks that the round-robin cursors of
// services that left the directory are dropped, and the ranked endpoints
// of the directory before, so services that come and go leave nothing
// behind.
func TestBalancerPrunesGoneServices(t *testing.T) {
	b := newBalancer()
	port := workload.ServicePort{Name: "http", Port: 80, TargetPort: 8080}
	for _, name := range []string{"a", "b", "c"} {
		svc := &workload.Service{Name: name, Namespace: "shop", Endpoints: []workload.Endpoint{{Addr: netip.MustParseAddr("10.0.0.1"), Ready: true}}}
		b.order(nil, svc, port, nil)
	}
	if len(b.next) != 3 || len(b.ranked) != 3 {
		t.Fatalf("cursors and ranked endpoints before pruning: %d, %d, want 3 each", len(b.next), len(b.ranked))
	}
	b.prune(&workload.Directory{}) // no service left
	if len(b.next) != 0 || len(b.ranked) != 0 || b.rankedCost != 0 {
		t.Errorf("cursors %v and ranked endpoints %v after every service left, want none", b.next, b.ranked)
	}
}

// TestContestedVIPRefused: a VIP that services claim and none can be told
// the owner of is a Contested stand-in: connections to it are reset and
// counted, never sent in plaintext to the address as to no service's (and
// past the waypoint of the service that should have it).
func TestContestedVIPRefused(t *testing.T) {
	t.Run("contested", func(t *testing.T) {
		refusedStandIn(t, &workload.Service{Name: "contested 10.96.0.99", Contested: true}, "contested_vip")
	})
	// A workload or service the source rejected, of which it holds no
	// accepted version (the xDS source's Rejected stand-in).
	t.Run("rejected", func(t *testing.T) {
		refusedStandIn(t, &workload.Service{Name: "rejected shop/future.shop.svc.cluster.local", Contested: true, Rejected: true}, "rejected_resource")
	})
}

func refusedStandIn(t *testing.T, contested *workload.Service, reason string) {
	tun := newTestTunnel(t, nil)
	vip := netip.MustParseAddr("10.96.0.99")
	contested.VIPs = []netip.Addr{vip}
	dir, errs := workload.NewDirectory([]*workload.Workload{podObj("mesh", "a", "a-sa", "127.0.0.1", nil)}, []*workload.Service{contested})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	tun.Update(&State{Dir: dir})
	p := testPod(tun, "uid-a", netip.MustParseAddr("127.0.0.1"))
	svc, ok := dir.ServiceByVIPFor(vip, "mesh")
	if !ok || !svc.Contested {
		t.Fatalf("the VIP resolves to %v", svc)
	}
	c := newFakeConn("10.96.0.99:53", "127.0.0.1:40000")
	p.handleService(context.Background(), c, dir, svc, netip.MustParseAddrPort("127.0.0.1:40000"), netip.MustParseAddrPort("10.96.0.99:53"))
	if !c.closed.Load() {
		t.Error("a connection to a contested VIP was not closed")
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.failClosed.WithLabelValues(reason)); got != 1 {
		t.Errorf(`redirector_fail_closed_total{reason=%q} = %v, want 1`, reason, got)
	}
}

// TestBalancerBoundedWork: the balancer's lock is shared by every pod's
// service connections, so one tenant's huge service must not hold it for
// long. order looks at most maxOrderProbes endpoints past the cursor and
// returns at most maxServiceAttempts fresh ones; the failure memory holds
// at most maxFailed endpoints. Before, order walked and sorted every
// endpoint under the lock (13 ms at 10k, 140 ms at 100k), and every fail
// walked the whole memory.
func TestBalancerBoundedWork(t *testing.T) {
	now := time.Unix(1000, 0)
	b := newBalancer()
	b.now = func() time.Time { return now }
	svc := &workload.Service{Name: "huge", Namespace: "tenant"}
	for i := range 20000 {
		svc.Endpoints = append(svc.Endpoints, workload.Endpoint{Addr: netip.AddrFrom4([4]byte{10, 9, byte(i >> 8), byte(i)}), Ready: true})
	}
	port := workload.ServicePort{Port: 80, TargetPort: 8080}
	// Every endpoint failed recently: still at most maxServiceAttempts
	// come back, after at most maxOrderProbes looks.
	for i := range maxFailed + 100 {
		b.fail(netip.AddrPortFrom(svc.Endpoints[i%len(svc.Endpoints)].Addr, 8080))
	}
	if n := len(b.failed); n > maxFailed {
		t.Errorf("failure memory holds %d endpoints, want at most %d", n, maxFailed)
	}
	if got := b.order(nil, svc, port, nil); len(got) < maxServiceAttempts || len(got) > 2*maxServiceAttempts {
		t.Errorf("order returned %d endpoints, want %d to %d", len(got), maxServiceAttempts, 2*maxServiceAttempts)
	}
	// A contiguous run of failed endpoints (one node's) around the cursor
	// still leaves fresh ones first: the looks are spread over the ring.
	b = newBalancer()
	b.now = func() time.Time { return now }
	for i := range 10000 {
		b.fail(netip.AddrPortFrom(svc.Endpoints[i].Addr, 8080))
	}
	for range 50 {
		got := b.order(nil, svc, port, nil)
		if len(got) == 0 {
			t.Fatal("no endpoint")
		}
		if at, bad := b.failed[got[0].addr]; bad && now.Sub(at) < failureMemory {
			t.Fatalf("a recently failed endpoint came first while 10000 of 20000 are fresh: %s", got[0].addr)
		}
	}
	now = now.Add(failureMemory + time.Second)
	b.fail(netip.MustParseAddrPort("10.8.0.1:8080"))
	if n := len(b.failed); n != 1 {
		t.Errorf("after failureMemory, the memory holds %d endpoints, want the one new failure", n)
	}
}

// An endpoint is tried last by every pod of the node for 10 s once a
// connection to it failed (balancer.fail). A failure that says something
// about the client only marked it all the same, so one pod could steer the
// service connections of every pod of its node to the endpoints it left
// unmarked: with net.ipv4.ip_local_port_range (a sysctl Kubernetes lets any
// pod set) narrowed, the agent's dials from the pod fail with EADDRNOTAVAIL
// wherever no pooled connection is left; past the endpoint node's
// per-source limit, its HBONE connects get 503; a policy refusing its
// identity answers 403; and a pod being stopped cancels its dials. None of
// those may mark the endpoint.
func TestEndpointFailuresOfTheClientAreNotShared(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"refused by the endpoint", fmt.Errorf("dial 10.0.0.1:80: %w", syscall.ECONNREFUSED), true},
		{"endpoint unreachable", fmt.Errorf("dial: %w", syscall.EHOSTUNREACH), true},
		{"connect timeout", fmt.Errorf("dial: %w", context.DeadlineExceeded), true},
		{"app down behind HBONE", &hbone.StatusError{Status: 503, Reason: "connect to 10.0.0.1:80: connection refused"}, true},
		{"endpoint node full", &hbone.StatusError{Status: 503, Reason: "over the node connection limit"}, true},
		{"client out of ports", fmt.Errorf("dial: %w", syscall.EADDRNOTAVAIL), false},
		{"client out of fds", fmt.Errorf("dial: %w", syscall.EMFILE), false},
		{"no route in the client's namespace", fmt.Errorf("dial: %w", syscall.ENETUNREACH), false},
		{"endpoint's pod not seen yet", fmt.Errorf("endpoint: %w", errEndpointUnresolved), false},
		{"client pod stopping", fmt.Errorf("dial: %w", context.Canceled), false},
		{"client over its source limit", fmt.Errorf("hbone: %w", &hbone.StatusError{Status: 503, Reason: "over the source connection limit"}), false},
		{"client's identity denied", &hbone.StatusError{Status: 403, Reason: "denied by authorization policy"}, false},
		{"client's request refused", &hbone.StatusError{Status: 400, Reason: "authority port 15001 is the tunnel's own"}, false},
	} {
		if got := endpointFailed(tc.err); got != tc.want {
			t.Errorf("%s (%v): endpointFailed = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}

	// Through a service connection of a pod whose dials are cancelled.
	tun := newTestTunnel(t, nil)
	app, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()
	ep := netip.MustParseAddrPort(app.Addr().String())
	svc := &workload.Service{Name: "web", Namespace: "mesh", Hostname: "web.mesh.svc.cluster.local",
		VIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.1")},
		Ports:     []workload.ServicePort{{Name: "http", Port: 80, TargetPort: int32(ep.Port())}},
		Endpoints: []workload.Endpoint{{Addr: ep.Addr(), Ready: true}}}
	dir, errs := workload.NewDirectory([]*workload.Workload{podObj("mesh", "a", "a-sa", "127.0.0.1", nil)}, []*workload.Service{svc})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	tun.Update(&State{Dir: dir})
	p := testPod(tun, "uid-a", netip.MustParseAddr("127.0.0.1"))
	inOwnNamespace(t, p)
	p.cancel()
	c := newFakeConn("10.96.0.1:80", "127.0.0.1:40000")
	p.handleService(p.ctx, c, dir, svc, netip.MustParseAddrPort("127.0.0.1:40000"), netip.MustParseAddrPort("10.96.0.1:80"))
	if !c.closed.Load() {
		t.Error("the connection was not closed")
	}
	tun.lb.mu.Lock()
	_, marked := tun.lb.failed[ep]
	tun.lb.mu.Unlock()
	if marked {
		t.Errorf("endpoint %s marked failed for every pod by a dial its own pod's stop cancelled", ep)
	}
}

// TestBalancerPrefersCloseEndpoints: a service with a routing preference
// (istiod's load_balancing for trafficDistribution: PreferClose and
// PreferSameNode, or internalTrafficPolicy: Local) was balanced over
// every endpoint, so a client's connections crossed zones and regions
// that istiod, as ztunnel does, keeps them in. Now the best-ranked
// endpoints serve in turn; a zone counts only inside a shared region;
// the next rank takes a connection's later attempts, and its first
// once the best have failed recently (FAILOVER); STRICT serves only
// endpoints sharing every scope, none for a client it cannot place.
func TestBalancerPrefersCloseEndpoints(t *testing.T) {
	now := time.Unix(1000, 0)
	client := &workload.Workload{Name: "client", Node: "n1", Region: "r1", Zone: "a", Subzone: "s1"}
	ep := func(addr, node, region, zone string) workload.Endpoint {
		return workload.Endpoint{Addr: netip.MustParseAddr(addr), Ready: true,
			Workload: &workload.Workload{Name: addr, Node: node, Region: region, Zone: zone, Subzone: "s1"}}
	}
	endpoints := []workload.Endpoint{
		ep("10.0.0.1", "n2", "r1", "a"),                      // same zone, another node
		ep("10.0.0.2", "n3", "r1", "b"),                      // same region, another zone
		ep("10.0.0.3", "n4", "r2", "a"),                      // a zone named alike in another region
		ep("10.0.0.4", "n1", "r1", "a"),                      // this node
		{Addr: netip.MustParseAddr("10.0.0.5"), Ready: true}, // no workload known: no locality
	}
	port := workload.ServicePort{Port: 80, TargetPort: 8080}
	scopes := func(s ...workload.Scope) []workload.Scope { return s }
	preferClose := &workload.Routing{Scopes: scopes(workload.ScopeNetwork, workload.ScopeRegion, workload.ScopeZone)}
	addrs := func(ts []target) []string {
		var out []string
		for _, t := range ts {
			out = append(out, t.addr.Addr().String())
		}
		return out
	}

	b := newBalancer()
	b.now = func() time.Time { return now }
	svc := &workload.Service{Name: "web", Namespace: "shop", Endpoints: endpoints, Routing: preferClose}
	firsts := map[string]int{}
	for range 10 {
		got := addrs(b.order(nil, svc, port, client))
		firsts[got[0]]++
		// The zone's two, then the region's one: three attempts.
		if len(got) != maxServiceAttempts || got[2] != "10.0.0.2" {
			t.Fatalf("PreferClose order %v, want the zone's two endpoints, then 10.0.0.2", got)
		}
	}
	if firsts["10.0.0.1"] != 5 || firsts["10.0.0.4"] != 5 {
		t.Errorf("PreferClose firsts %v, want the zone's two endpoints 5 times each", firsts)
	}
	// The zone's endpoints failed: the region's takes the connections
	// first, then the rest of the network, the failed ones last.
	b.fail(netip.MustParseAddrPort("10.0.0.1:8080"))
	b.fail(netip.MustParseAddrPort("10.0.0.4:8080"))
	if got := addrs(b.order(nil, svc, port, client)); got[0] != "10.0.0.2" || len(got) != 5 || got[3] == "10.0.0.2" {
		t.Errorf("zone failed: order %v, want 10.0.0.2 first, then the network's two, then the failed zone's two", got)
	}
	now = now.Add(failureMemory + time.Second)
	if got := addrs(b.order(nil, svc, port, client)); got[0] != "10.0.0.1" && got[0] != "10.0.0.4" {
		t.Errorf("after failureMemory: order %v, want the zone's endpoints first again", got)
	}
	// An unknown client (no workload at the source address) is balanced
	// over all: no rank can be told.
	seen := map[string]bool{}
	for range len(endpoints) {
		seen[addrs(b.order(nil, svc, port, nil))[0]] = true
	}
	if len(seen) != len(endpoints) {
		t.Errorf("unknown client: firsts %v, want every endpoint in turn", seen)
	}

	for _, tc := range []struct {
		name    string
		routing *workload.Routing
		client  *workload.Workload
		want    []string // the possible first choices; nil: no endpoint
	}{
		{"PreferSameNode", &workload.Routing{Scopes: scopes(workload.ScopeNetwork, workload.ScopeRegion, workload.ScopeZone, workload.ScopeSubzone, workload.ScopeNode)}, client, []string{"10.0.0.4"}},
		{"STRICT by node", &workload.Routing{Scopes: scopes(workload.ScopeNode), Strict: true}, client, []string{"10.0.0.4"}},
		{"STRICT by zone", &workload.Routing{Scopes: scopes(workload.ScopeRegion, workload.ScopeZone), Strict: true}, client, []string{"10.0.0.1", "10.0.0.4"}},
		{"STRICT by region and zone in another region", &workload.Routing{Scopes: scopes(workload.ScopeRegion, workload.ScopeZone), Strict: true},
			&workload.Workload{Node: "n9", Region: "r3", Zone: "a"}, nil},
		{"STRICT, unknown client", &workload.Routing{Scopes: scopes(workload.ScopeZone), Strict: true}, nil, nil},
		{"by cluster: all share it", &workload.Routing{Scopes: scopes(workload.ScopeCluster)}, client, []string{"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"}},
	} {
		b := newBalancer()
		svc := &workload.Service{Name: "web", Namespace: "shop", Endpoints: endpoints, Routing: tc.routing}
		for range 8 {
			got := addrs(b.order(nil, svc, port, tc.client))
			if tc.want == nil {
				if len(got) != 0 {
					t.Errorf("%s: order %v, want no endpoint", tc.name, got)
				}
				break
			}
			if len(got) == 0 || !slices.Contains(tc.want, got[0]) {
				t.Errorf("%s: order %v, want one of %v first", tc.name, got, tc.want)
				break
			}
			if tc.routing.Strict && len(got) > len(tc.want) {
				t.Errorf("%s: order %v, want only %v (STRICT)", tc.name, got, tc.want)
				break
			}
		}
	}
}

// BenchmarkBalancerOrder is the cost of ordering one connection's
// endpoints, with and without a routing preference (PreferClose, the
// endpoints spread over three zones), for a small and a large service.
func BenchmarkBalancerOrder(b *testing.B) {
	client := &workload.Workload{Name: "client", Node: "n1", Region: "r1", Zone: "z0"}
	preferClose := &workload.Routing{Scopes: []workload.Scope{workload.ScopeNetwork, workload.ScopeRegion, workload.ScopeZone}}
	for _, n := range []int{10, 10000} {
		for _, routing := range []*workload.Routing{nil, preferClose} {
			svc := &workload.Service{Name: "web", Namespace: "shop", Routing: routing}
			for i := range n {
				svc.Endpoints = append(svc.Endpoints, workload.Endpoint{Addr: netip.AddrFrom4([4]byte{10, 9, byte(i >> 8), byte(i)}), Ready: true,
					Workload: &workload.Workload{Node: fmt.Sprintf("n%d", i%30), Region: "r1", Zone: fmt.Sprintf("z%d", i%3)}})
			}
			name := fmt.Sprintf("endpoints=%d/routing=%v", n, routing != nil)
			b.Run(name, func(b *testing.B) {
				bal := newBalancer()
				port := workload.ServicePort{Port: 80, TargetPort: 8080}
				for b.Loop() {
					if len(bal.order(nil, svc, port, client)) == 0 {
						b.Fatal("no endpoint")
					}
				}
			})
		}
	}
}

// TestBalancerConcurrentOrderAndPrune: connections order endpoints while
// directory updates clear the cache under them (run with -race).
func TestBalancerConcurrentOrderAndPrune(t *testing.T) {
	b := newBalancer()
	client := &workload.Workload{Node: "n1", Zone: "a"}
	svc := &workload.Service{Name: "web", Namespace: "shop", Routing: &workload.Routing{Scopes: []workload.Scope{workload.ScopeZone}}}
	for i := range 100 {
		svc.Endpoints = append(svc.Endpoints, workload.Endpoint{Addr: netip.AddrFrom4([4]byte{10, 0, 0, byte(i)}), Ready: true,
			Workload: &workload.Workload{Zone: string(rune('a' + i%2))}})
	}
	port := workload.ServicePort{Port: 80}
	dir := &workload.Directory{} // stands for svc's: the cache takes its services
	b.prune(dir)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for range 200 {
				if g == 0 {
					b.prune(dir)
					continue
				}
				got := b.order(dir, svc, port, client)
				if len(got) == 0 || got[0].ep.Workload.Zone != "a" {
					t.Errorf("order %v, want zone a's endpoints first", got)
					return
				}
			}
		})
	}
	wg.Wait()
}

// TestBalancerCachesOnlyTheCurrentDirectory: a connection that looked its
// service up in the directory before an update orders its endpoints after
// the update cleared the cache. Its ranking was cached under the old
// service until the next update (which may be hours away): nothing read
// it again, yet it held the old service, its endpoints and workloads, and
// a share of the cache's bound that the current directory's services then
// lacked. Only the current directory's services are cached now.
func TestBalancerCachesOnlyTheCurrentDirectory(t *testing.T) {
	svc := &workload.Service{Name: "web", Namespace: "shop", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
		Endpoints: []workload.Endpoint{{Addr: netip.MustParseAddr("10.0.0.1"), Ready: true}}}
	old, _ := workload.NewDirectory(nil, []*workload.Service{svc})
	cur, _ := workload.NewDirectory(nil, []*workload.Service{svc})
	port := workload.ServicePort{Port: 80, TargetPort: 8080}
	b := newBalancer()
	b.prune(old)
	b.order(old, old.Services()[0], port, nil)
	b.prune(cur)
	// In flight across the update: it still holds old's service.
	if got := b.order(old, old.Services()[0], port, nil); len(got) != 1 {
		t.Fatalf("order %v, want the one endpoint", got)
	}
	if len(b.ranked) != 0 || b.rankedCost != 0 {
		t.Errorf("the previous directory's service is cached after the update: %d entries, %d picks", len(b.ranked), b.rankedCost)
	}
	b.order(cur, cur.Services()[0], port, nil)
	if len(b.ranked) != 1 {
		t.Errorf("the current directory's service: %d entries cached, want 1", len(b.ranked))
	}
}

// TestBalancerCacheChargesWhatItHolds: the cache's bound counted the
// picks in use only. An entry without one (a port no ready endpoint
// serves, a STRICT service for a client it cannot place) was free, so
// entries were bounded by nothing but the directory, and the room tiers
// hold past their length was not counted either. Each entry is charged
// its slices' capacity and its key now.
func TestBalancerCacheChargesWhatItHolds(t *testing.T) {
	b := newBalancer()
	port := workload.ServicePort{Port: 80, TargetPort: 8080}
	for i := range 40 {
		svc := &workload.Service{Name: fmt.Sprint("empty-", i), Namespace: "tenant",
			Endpoints: []workload.Endpoint{{Addr: netip.AddrFrom4([4]byte{10, 0, 0, byte(i)})}}} // not ready
		b.order(nil, svc, port, nil)
	}
	svc := &workload.Service{Name: "web", Namespace: "tenant"}
	for i := range 1000 {
		svc.Endpoints = append(svc.Endpoints, workload.Endpoint{Addr: netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), Ready: true})
	}
	b.order(nil, svc, port, nil)
	held := 0
	for _, tiers := range b.ranked {
		held++ // the entry itself
		for _, tier := range tiers {
			held += cap(tier)
		}
	}
	if len(b.ranked) != 41 || b.rankedCost < held {
		t.Errorf("%d entries holding %d picks' room and their keys, charged %d", len(b.ranked), held, b.rankedCost)
	}
}
