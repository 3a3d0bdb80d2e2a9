package tunnel

import (
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestWaypointIndexBuiltOncePerDirectory: the connections that look a
// waypoint up together after the directory changed share one build of the
// host-name index. Before, each built its own (O(services) each, about
// 10 MB at 50k services), as many as connections to waypoints arrived
// while one ran.
func TestWaypointIndexBuiltOncePerDirectory(t *testing.T) {
	const services, lookups = 50000, 128
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(8))
	newDir := func() *workload.Directory {
		var svcs []*workload.Service
		for i := range services {
			name := fmt.Sprintf("svc-%d", i)
			svcs = append(svcs, &workload.Service{Name: name, Namespace: "bulk", Hostname: workload.ClusterHostname(name, "bulk"),
				VIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 100 + byte(i>>16), byte(i >> 8), byte(i)})}})
		}
		dir, errs := workload.NewDirectory(nil, svcs)
		if len(errs) > 0 {
			t.Fatalf("directory: %v", errs)
		}
		return dir
	}
	var idx waypointIndex
	host := workload.ClusterHostname("svc-7", "bulk")
	dir := newDir()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	if idx.lookup(dir, "bulk", host) == nil {
		t.Fatalf("%s not found", host)
	}
	runtime.ReadMemStats(&after)
	one := after.TotalAlloc - before.TotalAlloc

	dir = newDir()
	runtime.GC()
	runtime.ReadMemStats(&before)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range lookups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			idx.lookup(dir, "bulk", host)
		}()
	}
	close(start)
	wg.Wait()
	runtime.ReadMemStats(&after)
	all := after.TotalAlloc - before.TotalAlloc
	t.Logf("one build: %d KiB; %d lookups at once: %d KiB", one>>10, lookups, all>>10)
	if all > 3*one {
		t.Errorf("%d lookups after a directory change allocated %d KiB, %.0f times one build (%d KiB): each built the index", lookups, all>>10, float64(all)/float64(one), one>>10)
	}
}
