package dnsproxy

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// bulkServices is a directory of n services besides the tests' own.
func bulkServices(t testing.TB, n int) *workload.Directory {
	svcs := testServices()
	for i := range n {
		name := fmt.Sprintf("svc-%d", i)
		svcs = append(svcs, &workload.Service{Name: name, Namespace: "bulk", Hostname: workload.ClusterHostname(name, "bulk"),
			VIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 100 + byte(i>>16), byte(i >> 8), byte(i)})}})
	}
	dir, errs := workload.NewDirectory([]*workload.Workload{client, otherClient}, svcs)
	if len(errs) > 0 {
		t.Fatalf("directory: %v", errs)
	}
	return dir
}

// TestHostIndexBuiltOncePerDirectory: the queries that arrive together
// after the directory changed share one build of its host index. Before,
// each built its own: with 1024 queries in flight (what the node's pods
// may hold) and a directory of 50k services, a directory change cost up
// to 1024 builds of some 10 MB each at once.
func TestHostIndexBuiltOncePerDirectory(t *testing.T) {
	const services, queries = 50000, 128
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(8))
	var cur atomic.Pointer[workload.Directory]
	cur.Store(bulkServices(t, services))
	p, err := New(Config{MaxInFlight: queries, MaxInFlightPerPod: queries}, func() *workload.Directory { return cur.Load() }, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	q := query(t, "reviews.mesh.svc.cluster.local.", dns.TypeA, 1)
	p.Answer(context.Background(), client, "udp", q, dialLoopback)

	// What one build allocates.
	cur.Store(bulkServices(t, services))
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	p.Answer(context.Background(), client, "udp", q, dialLoopback)
	runtime.ReadMemStats(&after)
	one := after.TotalAlloc - before.TotalAlloc

	cur.Store(bulkServices(t, services))
	runtime.GC()
	runtime.ReadMemStats(&before)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range queries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			p.Answer(context.Background(), client, "udp", q, dialLoopback)
		}()
	}
	close(start)
	wg.Wait()
	runtime.ReadMemStats(&after)
	all := after.TotalAlloc - before.TotalAlloc
	t.Logf("one build: %d KiB; %d queries at once: %d KiB", one>>10, queries, all>>10)
	if all > 3*one {
		t.Errorf("%d queries after a directory change allocated %d KiB, %.0f times one query's (%d KiB): each built the host index", queries, all>>10, float64(all)/float64(one), one>>10)
	}
}

// TestPopularHostCostIndependentOfServices: a ServiceEntry for one host
// name in each of 10k namespaces (every team declaring the same external
// API) made every query for that name, from every pod of every node, walk
// all of them: 2.5 ms a query. Its answer is worked out once per
// directory now.
func TestPopularHostCostIndependentOfServices(t *testing.T) {
	const entries, queries = 10000, 1000
	svcs := testServices()
	for i := range entries {
		svcs = append(svcs, &workload.Service{Name: fmt.Sprint("se-", i), Namespace: fmt.Sprint("team-", i), Hostname: "api.popular.example",
			VIPs: []netip.Addr{netip.AddrFrom4([4]byte{240, 1, byte(i >> 8), byte(i)})}})
	}
	dir, errs := workload.NewDirectory([]*workload.Workload{client, otherClient}, svcs)
	if len(errs) > 0 {
		t.Fatal(errs[0])
	}
	p, err := New(Config{}, func() *workload.Directory { return dir }, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	q := query(t, "api.popular.example.", dns.TypeA, 1)
	if r := unpack(t, p.Answer(context.Background(), client, "udp", q, nil)); len(r.Answer) != 1 || r.Answer[0].(*dns.A).A.String() != "240.1.0.0" {
		t.Fatalf("answer: %v, want the first entry's VIP", r.Answer)
	}
	start := time.Now()
	for range queries {
		p.Answer(context.Background(), client, "udp", q, nil)
	}
	// About 30 µs each; 2.5 ms before.
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Errorf("%d queries for a host of %d services took %v (%v each)", queries, entries, took, took/queries)
	}
}

// TestChooseAgreesWithBest: the answers worked out once for a host name of
// many services are best's, for a client of every namespace, over random
// lists (namespaces, NamespaceOnly, canonical names, VIP-less entries).
func TestChooseAgreesWithBest(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for round := range 500 {
		var list []*workload.Service
		for i := range 1 + r.IntN(20) {
			ns := fmt.Sprint("ns", r.IntN(4))
			s := &workload.Service{Name: fmt.Sprint("s", i), Namespace: ns, NamespaceOnly: r.IntN(3) == 0, Hostname: "h.example"}
			if r.IntN(3) == 0 {
				s.Name = "h"
				s.Hostname = workload.ClusterHostname("h", ns)
			}
			if r.IntN(4) != 0 {
				s.VIPs = []netip.Addr{netip.AddrFrom4([4]byte{240, 0, 0, byte(i)})}
			}
			list = append(list, s)
		}
		c := choose(list)
		for i := range 5 {
			ns := fmt.Sprint("ns", i)
			if got, want := c.pick(ns), best(list, ns); got != want {
				t.Fatalf("round %d, client in %s: %v, want %v", round, ns, got, want)
			}
		}
	}
}
