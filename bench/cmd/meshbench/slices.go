package main

import (
	"context"
	"fmt"
	"time"
)

// The fixed HTTP load, bulk and round trips run in slices. Their results are
// made by the machine as much as by the variant: the HTTP tail (p99 of 10 s
// at 1000 qps, the 100 slowest requests) by its stalls, bulk by how much of
// the two vCPUs the host leaves the run, round trips by where the scheduler
// happens to put the processes of a path, and on a shared machine all three
// change from one minute to the next. At 13:27 on 2 December direct's p99
// ranged 4–14 ms between rounds and the mesh's ratio to a peer 0.3–1.9×; at
// 13:54 direct's 8 flows ran 9.2 Gbps in round 1 and 18.8 in round 2,
// according to which variant's turn a bad stretch fell on; at 17:42 stunnel's
// round-trip p50 was 190 µs in one round and 329 in another while the mesh's
// stayed at 252–271. Cut into slices that alternate between the variants,
// each variant's time is spread over the whole round, so a bad stretch falls
// on all of them alike; each variant's slices are merged into one sample
// (requests, bytes or round trips added, CPU summed) before anything is
// compared.

// sample is one variant's sliced test in one round, merged over its slices.
type sample interface {
	// merge adds a later slice of the same test.
	merge(later sample)
	values(v *variant) map[string]float64
}

// httpSample is a variant's fixed HTTP load in one round, merged over slices.
type httpSample struct {
	buckets  []histBucket
	requests int64
	measured float64   // fortio's own measured seconds
	loaded   float64   // seconds of load asked for: CPU per second is per these
	cpu      []float64 // seconds, per proxy of the variant
	rss      map[string]float64
	// Per slice, in order: fortio's p99 and how long the proxies' threads
	// waited for a CPU, to tell a round's bad stretch from a bad round.
	sliceP99, sliceRunqMs []float64
}

// runHTTPSlice runs fortio at the fixed rate for d and charges the proxies'
// CPU to it.
func runHTTPSlice(ctx context.Context, cfg config, v *variant, d time.Duration) (sample, error) {
	var res fortioResult
	waited := runqWait(v.proxies)
	cpu, err := charged(v, func() (err error) { res, err = runFortio(ctx, cfg, v, cfg.HTTPQPS, d); return err })
	if err != nil {
		return nil, err
	}
	waited = runqWait(v.proxies) - waited
	s := &httpSample{
		buckets:     res.DurationHistogram.Data,
		requests:    res.DurationHistogram.Count,
		measured:    float64(res.ActualDuration) / 1e9,
		loaded:      d.Seconds(),
		cpu:         cpu,
		rss:         map[string]float64{},
		sliceP99:    []float64{res.percentileMs(99)},
		sliceRunqMs: []float64{waited.Seconds() * 1e3},
	}
	for i, pid := range v.proxies {
		if mb, err := rssMB(pid); err == nil {
			s.rss["rss_at_qps@"+proxyName(v, i)] = mb
		}
	}
	return s, nil
}

// merge adds a later slice into s; RSS is the latest slice's.
func (s *httpSample) merge(later sample) {
	o := later.(*httpSample)
	s.buckets = append(s.buckets, o.buckets...)
	s.requests += o.requests
	s.measured += o.measured
	s.loaded += o.loaded
	s.cpu = addCPU(s.cpu, o.cpu)
	s.rss = o.rss
	s.sliceP99 = append(s.sliceP99, o.sliceP99...)
	s.sliceRunqMs = append(s.sliceRunqMs, o.sliceRunqMs...)
}

// perSlice are the slices' own numbers, in slice order.
func (s *httpSample) perSlice() map[string][]float64 {
	return map[string][]float64{"http_p99": s.sliceP99, "proxies_runq_ms": s.sliceRunqMs}
}

// values are the metrics the merged slices give.
func (s *httpSample) values(v *variant) map[string]float64 {
	out := map[string]float64{
		"http_p50": histPercentileMs(s.buckets, 50),
		"http_p90": histPercentileMs(s.buckets, 90),
		"http_p99": histPercentileMs(s.buckets, 99),
	}
	if s.measured > 0 {
		out["http_qps"] = float64(s.requests) / s.measured
	}
	addProxies(out, v, "vcpu_at_qps", s.cpu, func(c float64) float64 { return c / s.loaded })
	for k, mb := range s.rss {
		out[k] = mb
	}
	return out
}

// sliceDetailed is a sample that also keeps each slice's own numbers.
type sliceDetailed interface {
	perSlice() map[string][]float64
}

// bulkSample is a variant's iperf3 test in one round, merged over slices.
type bulkSample struct {
	key      string  // the throughput's name: tput1 or tput8
	perGB    bool    // also report the proxies' CPU per GB sent
	received float64 // bytes the server received
	seconds  float64 // over which it received them
	sent     float64 // bytes the client sent
	cpu      []float64
}

// runBulkSlice runs iperf3 with flows for d and charges the proxies' CPU to it.
func runBulkSlice(key string, flows int, perGB bool) func(context.Context, config, *variant, time.Duration) (sample, error) {
	return func(ctx context.Context, cfg config, v *variant, d time.Duration) (sample, error) {
		var res iperfTotals
		cpu, err := charged(v, func() (err error) { res, err = runIperf(ctx, cfg, v, flows, d); return err })
		if err != nil {
			return nil, err
		}
		return &bulkSample{key: key, perGB: perGB, received: res.received, seconds: res.seconds, sent: res.sent, cpu: cpu}, nil
	}
}

func (s *bulkSample) merge(later sample) {
	o := later.(*bulkSample)
	s.received += o.received
	s.seconds += o.seconds
	s.sent += o.sent
	s.cpu = addCPU(s.cpu, o.cpu)
}

// addCPU adds a later slice's CPU seconds per proxy to the sum so far.
func addCPU(sum, later []float64) []float64 {
	if sum == nil {
		sum = make([]float64, len(later))
	}
	for i, c := range later {
		sum[i] += c
	}
	return sum
}

func (s *bulkSample) values(v *variant) map[string]float64 {
	out := map[string]float64{}
	if s.seconds > 0 {
		out[s.key] = s.received * 8 / s.seconds / 1e9
	}
	if s.perGB && s.sent > 0 {
		addProxies(out, v, "cpu_per_gb", s.cpu, func(c float64) float64 { return c / (s.sent / 1e9) })
	}
	return out
}

// rrSample is a variant's round trips in one round, merged over slices.
type rrSample struct {
	lat []float64 // µs, one per round trip
	cpu []float64 // the proxies' CPU seconds over the slices
}

// runRRSlice makes the slice's share of --rr-count round trips on a new
// connection (after the usual warm-up); d is unused, a slice being a count.
func runRRSlice(ctx context.Context, cfg config, v *variant, _ time.Duration) (sample, error) {
	var res rrResult
	cpu, err := charged(v, func() (err error) { res, err = runRR(ctx, v, cfg.RRCount/cfg.RRSlices, true); return err })
	if err != nil {
		return nil, err
	}
	return &rrSample{lat: res.LatUs, cpu: cpu}, nil
}

func (s *rrSample) merge(later sample) {
	o := later.(*rrSample)
	s.lat = append(s.lat, o.lat...)
	s.cpu = addCPU(s.cpu, o.cpu)
}

// values are the round trip's percentiles and the proxies' CPU per round
// trip (the warm-up's share included, alike for every variant).
func (s *rrSample) values(v *variant) map[string]float64 {
	st := rrStats(s.lat)
	out := map[string]float64{"rr_p50": st.P50us, "rr_p99": st.P99us}
	if len(s.lat) > 0 {
		addProxies(out, v, "cpu_per_rr", s.cpu, func(c float64) float64 { return c / float64(len(s.lat)) * 1e6 })
	}
	return out
}

// runSliced runs a sliced test for one round: n slices of d per variant,
// each slice going round the variants in an order that starts one further
// on than the last. A variant whose slice fails twice gets no sample this
// round; the others go on.
func runSliced(ctx context.Context, cfg config, t test, vs []*variant, round int, res *results) {
	n, d := t.sliced(cfg)
	merged := map[*variant]sample{}
	failed := map[*variant]bool{}
	for slice := range n {
		for _, v := range rotate(vs, round+slice) {
			if ctx.Err() != nil || failed[v] {
				continue
			}
			var part sample
			what := fmt.Sprintf("%s (slice %d/%d)", t.name, slice+1, n)
			err := res.attempt(ctx, round, what, v, func() (err error) {
				part, err = t.slice(ctx, cfg, v, d)
				return err
			})
			if err != nil {
				res.errorf("round %d, %s, %s: %v", round+1, what, v.Name, err)
				failed[v] = true
				continue
			}
			if merged[v] == nil {
				merged[v] = part
			} else {
				merged[v].merge(part)
			}
		}
	}
	if ctx.Err() != nil {
		return
	}
	for v, s := range merged {
		if failed[v] {
			continue
		}
		for k, x := range s.values(v) {
			res.put(v.Name, k, round, x)
		}
		if d, ok := s.(sliceDetailed); ok {
			for k, xs := range d.perSlice() {
				res.putSlices(v.Name, k, round, xs)
			}
		}
	}
}
