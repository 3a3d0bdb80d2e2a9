package dnsproxy

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/miekg/dns"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// manyServices is a directory of n services besides the tests' own.
func manyServices(t testing.TB, n int) *workload.Directory {
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
	cur.Store(manyServices(t, services))
	p, err := New(Config{MaxInFlight: queries, MaxInFlightPerPod: queries}, func() *workload.Directory { return cur.Load() }, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	q := query(t, "reviews.mesh.svc.cluster.local.", dns.TypeA, 1)
	p.Answer(context.Background(), client, "udp", q, dialLoopback)

	// What one build allocates.
	cur.Store(manyServices(t, services))
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	p.Answer(context.Background(), client, "udp", q, dialLoopback)
	runtime.ReadMemStats(&after)
	one := after.TotalAlloc - before.TotalAlloc

	cur.Store(manyServices(t, services))
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
