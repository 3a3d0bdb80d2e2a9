package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

func readFortio(t *testing.T, path string) fortioResult {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var res fortioResult
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return res
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-6*math.Max(math.Abs(a), math.Abs(b)) }

// One run's buckets give fortio's own percentiles: the merge starts from
// what fortio reports (testdata: two real `fortio load -qps 1000 -c 16` runs
// on loopback, their JSON output trimmed to the fields meshbench reads).
func TestHistPercentileIsFortios(t *testing.T) {
	for _, f := range []string{"testdata/fortio-1.json", "testdata/fortio-2.json"} {
		res := readFortio(t, f)
		if len(res.DurationHistogram.Data) == 0 || res.ActualDuration == 0 {
			t.Fatalf("%s: no histogram or duration read", f)
		}
		for _, p := range []float64{50, 90, 99} {
			got, want := histPercentileMs(res.DurationHistogram.Data, p), res.percentileMs(p)
			if !near(got, want) {
				t.Errorf("%s: p%v = %.6f ms, fortio says %.6f", f, p, got, want)
			}
		}
	}
}

// Slices are merged by their requests, not by averaging their percentiles.
func TestSlicesMergeRequests(t *testing.T) {
	ms := 1e-3
	fast := &httpSample{buckets: []histBucket{{Start: 1 * ms, End: 2 * ms, Count: 100}}, requests: 100, measured: 0.1, loaded: 0.1, cpu: []float64{0.01}}
	slow := &httpSample{buckets: []histBucket{{Start: 3 * ms, End: 4 * ms, Count: 100}}, requests: 100, measured: 0.1, loaded: 0.1, cpu: []float64{0.03}}
	var all httpSample
	all.merge(fast)
	all.merge(slow)
	got := all.values(&variant{Name: "v", proxies: []int{1}, names: []string{"relay"}})
	for k, want := range map[string]float64{
		"http_p50":          2,    // the 100th of 200 requests ends the fast slice
		"http_p90":          3.8,  // 180th: 80 into the slow slice's bucket
		"http_p99":          3.98, // 198th
		"http_qps":          1000, // 200 requests in 0.2 s
		"vcpu_at_qps":       0.2,  // 0.04 s of CPU in 0.2 s
		"vcpu_at_qps@relay": 0.2,
	} {
		if !near(got[k], want) {
			t.Errorf("%s = %v, want %v", k, got[k], want)
		}
	}

	// A run merged with itself keeps its percentiles.
	res := readFortio(t, "testdata/fortio-1.json")
	twice := append(append([]histBucket{}, res.DurationHistogram.Data...), res.DurationHistogram.Data...)
	for _, p := range []float64{50, 90, 99} {
		if a, b := histPercentileMs(twice, p), res.percentileMs(p); !near(a, b) {
			t.Errorf("run merged with itself: p%v = %.6f, alone %.6f", p, a, b)
		}
	}
}

// Each slice's own p99 and run-queue wait stay apart, in slice order,
// however the slices' requests are merged.
func TestSlicesKeepEachSlice(t *testing.T) {
	var all httpSample
	for i, p99 := range []float64{2.5, 7.0, 3.1} {
		all.merge(&httpSample{sliceP99: []float64{p99}, sliceRunqMs: []float64{float64(100 * (i + 1))}})
	}
	got := all.perSlice()
	if !slices.Equal(got["http_p99"], []float64{2.5, 7.0, 3.1}) || !slices.Equal(got["proxies_runq_ms"], []float64{100, 200, 300}) {
		t.Errorf("per slice: %v", got)
	}
}

// This process's threads have waited for a CPU at some point, and the
// count only grows; a process that is gone counts nothing.
func TestRunqWait(t *testing.T) {
	self := []int{os.Getpid()}
	before := runqWait(self)
	done := make(chan struct{})
	for range 2 * runtime.NumCPU() { // more busy threads than CPUs must queue
		go func() {
			// A thread of its own, past GOMAXPROCS; unlocked again so that
			// the thread stays (and keeps its count) when this returns.
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			for {
				select {
				case <-done:
					return
				default:
				}
			}
		}()
	}
	time.Sleep(100 * time.Millisecond)
	after := runqWait(self)
	close(done)
	if after <= before {
		t.Errorf("run-queue wait went from %v to %v with more busy threads than CPUs", before, after)
	}
	if got := runqWait([]int{-1}); got != 0 {
		t.Errorf("a missing process waited %v", got)
	}
}

// Bulk slices are merged by their bytes and seconds, not by averaging rates.
func TestBulkSlicesMergeBytes(t *testing.T) {
	v := &variant{Name: "v", proxies: []int{1}, names: []string{"relay"}}
	fast := &bulkSample{key: "tput1", perGB: true, received: 1e9, seconds: 1, sent: 1e9, cpu: []float64{1}}
	slow := &bulkSample{key: "tput1", perGB: true, received: 1e9, seconds: 2, sent: 1e9, cpu: []float64{3}}
	fast.merge(slow)
	got := fast.values(v)
	for k, want := range map[string]float64{
		"tput1":            16.0 / 3, // 2 GB in 3 s, not the mean of 8 and 4 Gbps
		"cpu_per_gb":       2,        // 4 s of CPU for 2 GB
		"cpu_per_gb@relay": 2,
	} {
		if !near(got[k], want) {
			t.Errorf("%s = %v, want %v", k, got[k], want)
		}
	}
	eight := &bulkSample{key: "tput8", received: 1e9, seconds: 1, sent: 1e9, cpu: []float64{1}}
	if got := eight.values(v); len(got) != 1 || !near(got["tput8"], 8) {
		t.Errorf("8 flows: %v, want only tput8 = 8", got)
	}
}

// Round-trip slices are merged by their round trips: the percentiles of the
// whole, not the mean of the slices' percentiles.
func TestRRSlicesMergeRoundTrips(t *testing.T) {
	fast := &rrSample{lat: make([]float64, 0, 100)}
	slow := &rrSample{lat: make([]float64, 0, 100)}
	for i := range 100 {
		fast.lat = append(fast.lat, 100+float64(i)) // 100–199 µs
		slow.lat = append(slow.lat, 300+float64(i)) // 300–399 µs
	}
	var all sample = slow
	all.merge(fast)
	got := all.values(&variant{Name: "v"})
	// 200 round trips sorted: the p50 is the 100th (index 99, fast's last),
	// the p99 the 198th (index 197, slow's 98th).
	for k, want := range map[string]float64{"rr_p50": 199, "rr_p99": 397} {
		if got[k] != want {
			t.Errorf("%s = %v µs, want %v", k, got[k], want)
		}
	}
}

// A slice count that leaves a slice under 1000 round trips is refused, and
// the default never does.
func TestRRSlicesConfig(t *testing.T) {
	for _, tc := range []struct {
		args   []string
		slices int
		bad    bool
	}{
		{args: nil, slices: 4},
		{args: []string{"--quick"}, slices: 3},
		{args: []string{"--rr-count", "500"}, slices: 1},
		{args: []string{"--rr-count", "3000", "--rr-slices", "4"}, bad: true},
		{args: []string{"--rr-count", "300", "--rr-slices", "1"}, slices: 1},
	} {
		bin := t.TempDir()
		if err := os.WriteFile(filepath.Join(bin, "redirector"), nil, 0o755); err != nil {
			t.Fatal(err)
		}
		c, err := parseConfig(append([]string{"--fortio", "/bin/true", "--bin", bin}, tc.args...))
		if tc.bad {
			if err == nil || !strings.Contains(err.Error(), "--rr-slices") {
				t.Errorf("%v: err = %v, want one naming --rr-slices", tc.args, err)
			}
			continue
		}
		if err != nil || c.RRSlices != tc.slices {
			t.Errorf("%v: slices %d, err %v; want %d", tc.args, c.RRSlices, err, tc.slices)
		}
	}
}
