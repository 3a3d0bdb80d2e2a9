package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"time"
)

// The load generators: iperf3 and fortio (real tools, as users run them)
// and meshbench's own Go clients for round trips and new connections. Each
// runs as its own process in the variant's client pod.

// iperfResult is the part of `iperf3 -J` the suite reads.
type iperfResult struct {
	End struct {
		SumSent struct {
			Bytes float64 `json:"bytes"`
		} `json:"sum_sent"`
		SumReceived struct {
			Bytes   float64 `json:"bytes"`
			Seconds float64 `json:"seconds"`
		} `json:"sum_received"`
	} `json:"end"`
	Error string `json:"error"`
}

// iperfTotals is what one iperf3 run moved.
type iperfTotals struct {
	received, seconds, sent float64 // bytes the server received in seconds; bytes sent
}

// runIperf runs iperf3 for d with the given parallel flows.
func runIperf(ctx context.Context, cfg config, v *variant, flows int, d time.Duration) (iperfTotals, error) {
	secs := int(d / time.Second)
	out, err := output(ctx, v.client.Path(), d+30*time.Second, "iperf3", "-c", v.server.String(),
		"-p", strconv.Itoa(iperfPort), "-t", strconv.Itoa(secs), "-P", strconv.Itoa(flows), "-J")
	var res iperfResult
	if jerr := json.Unmarshal(out, &res); jerr != nil && err == nil {
		err = fmt.Errorf("iperf3 output: %w", jerr)
	}
	if res.Error != "" {
		return iperfTotals{}, fmt.Errorf("iperf3 to %s: %s", v.server, res.Error)
	}
	if err != nil {
		return iperfTotals{}, err
	}
	if res.End.SumReceived.Seconds <= 0 {
		return iperfTotals{}, fmt.Errorf("iperf3 to %s: no receive time in its report", v.server)
	}
	return iperfTotals{received: res.End.SumReceived.Bytes, seconds: res.End.SumReceived.Seconds, sent: res.End.SumSent.Bytes}, nil
}

// fortioResult is the part of fortio's JSON the suite reads.
type fortioResult struct {
	ActualQPS         float64 `json:"ActualQPS"`
	ActualDuration    int64   `json:"ActualDuration"` // nanoseconds
	DurationHistogram struct {
		Count       int64 `json:"Count"`
		Percentiles []struct {
			Percentile float64 `json:"Percentile"`
			Value      float64 `json:"Value"` // seconds
		} `json:"Percentiles"`
		Data []histBucket `json:"Data"`
	} `json:"DurationHistogram"`
	RetCodes map[string]int64 `json:"RetCodes"`
}

// histBucket is one bucket of fortio's latency histogram, in seconds.
type histBucket struct {
	Start float64 `json:"Start"`
	End   float64 `json:"End"`
	Count int64   `json:"Count"`
}

// histPercentileMs is the p-th percentile, in ms, of the requests in
// buckets, which may come from several fortio runs (their buckets overlap).
// Like fortio, it takes a bucket's requests as spread evenly from its Start
// to its End, so for one run's buckets it gives fortio's own percentiles.
func histPercentileMs(buckets []histBucket, p float64) float64 {
	var total int64
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, b := range buckets {
		total += b.Count
		lo, hi = min(lo, b.Start), max(hi, b.End)
	}
	if total == 0 {
		return 0
	}
	// below is how many requests took less than x: monotonic in x, so the
	// percentile is found by bisection.
	below := func(x float64) float64 {
		var n float64
		for _, b := range buckets {
			switch {
			case x >= b.End:
				n += float64(b.Count)
			case x > b.Start:
				n += float64(b.Count) * (x - b.Start) / (b.End - b.Start)
			}
		}
		return n
	}
	want := p / 100 * float64(total)
	for range 100 {
		mid := (lo + hi) / 2
		if below(mid) < want {
			lo = mid
		} else {
			hi = mid
		}
	}
	return (lo + hi) / 2 * 1e3
}

func (f fortioResult) percentileMs(p float64) float64 {
	for _, x := range f.DurationHistogram.Percentiles {
		if x.Percentile == p {
			return x.Value * 1e3
		}
	}
	return 0
}

// fortioResolution is the width in seconds of fortio's smallest histogram
// buckets. Its default, 1 ms, is coarser than what the variants differ by:
// every percentile under a few milliseconds came out as a linear
// interpolation inside one bucket (p99s of 1.95 and 1.96 ms were where the
// 99th request fell between 1 and 2 ms, not times). 10 µs buckets make the
// percentiles measurements again.
const fortioResolution = "0.00001"

// runFortio runs `fortio load` at qps (0: as fast as it goes) with the
// configured connections and payload against the fortio server's /echo.
func runFortio(ctx context.Context, cfg config, v *variant, qps int, d time.Duration) (fortioResult, error) {
	url := fmt.Sprintf("http://%s/echo", hostPort(v.server, fortioPort))
	out, err := output(ctx, v.client.Path(), d+30*time.Second, cfg.Fortio, "load", "-qps", strconv.Itoa(qps),
		"-c", strconv.Itoa(cfg.HTTPConns), "-t", d.String(), "-payload-size", strconv.Itoa(cfg.HTTPPayload),
		"-p", "50,90,99", "-r", fortioResolution, "-loglevel", "error", "-json", "-", url)
	if err != nil {
		return fortioResult{}, err
	}
	var res fortioResult
	if err := json.Unmarshal(out, &res); err != nil {
		return res, fmt.Errorf("fortio output: %w", err)
	}
	if bad := res.DurationHistogram.Count - res.RetCodes["200"]; bad > 0 {
		return res, fmt.Errorf("fortio: %d of %d requests did not get 200 (%v)", bad, res.DurationHistogram.Count, res.RetCodes)
	}
	return res, nil
}

// runRR makes n 1-byte round trips on one connection; with samples, the
// result carries every round trip's latency.
func runRR(ctx context.Context, v *variant, n int, samples bool) (rrResult, error) {
	var res rrResult
	out, err := output(ctx, v.client.Path(), 2*time.Minute, selfPath(), "rr", "-addr", hostPort(v.server, echoPort),
		"-n", strconv.Itoa(n), "-warmup", strconv.Itoa(min(n, 500)), "-samples="+strconv.FormatBool(samples))
	if err != nil {
		return res, err
	}
	if err := json.Unmarshal(out, &res); err != nil {
		return res, fmt.Errorf("rr output %q: %w", out, err)
	}
	if samples && len(res.LatUs) != n {
		return res, fmt.Errorf("rr printed %d latencies, want %d", len(res.LatUs), n)
	}
	return res, nil
}

// runCPS opens new connections (connect, 1-byte echo, close) for d.
func runCPS(ctx context.Context, cfg config, v *variant) (cpsResult, error) {
	var res cpsResult
	out, err := output(ctx, v.client.Path(), cfg.CPSTime+30*time.Second, selfPath(), "cps", "-addr", hostPort(v.server, echoPort),
		"-d", cfg.CPSTime.String(), "-c", strconv.Itoa(cfg.CPSConc))
	if err != nil {
		return res, err
	}
	if err := json.Unmarshal(out, &res); err != nil {
		return res, fmt.Errorf("cps output %q: %w", out, err)
	}
	// A few failures in thousands are the network's; many are a broken path.
	if res.Errors*100 > res.Conns {
		return res, fmt.Errorf("cps: %d of %d connections failed: %s", res.Errors, res.Conns+res.Errors, res.FirstErr)
	}
	return res, nil
}
