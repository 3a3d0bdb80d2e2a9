package main

import (
	"encoding/json"
	"math"
	"os"
	"testing"
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
