package main

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"time"
)

// metricDef describes one number the tests produce per variant and round.
type metricDef struct {
	Key    string `json:"key"`
	Title  string `json:"title"`
	Unit   string `json:"unit"`
	Higher bool   `json:"higher_is_better"`
}

// metricDefs are the table's columns, in order.
func metricDefs(cfg config) []metricDef {
	at := fmt.Sprintf("@%d qps", cfg.HTTPQPS)
	return []metricDef{
		{"tput1", "iperf3 1 flow", "Gbps", true},
		{"tput8", "iperf3 8 flows", "Gbps", true},
		{"rr_p50", "1-byte RR p50", "µs", false},
		{"rr_p99", "1-byte RR p99", "µs", false},
		{"cpu_per_rr", "proxy CPU per round trip", "µs", false},
		{"http_p50", "HTTP p50 " + at, "ms", false},
		{"http_p90", "HTTP p90 " + at, "ms", false},
		{"http_p99", "HTTP p99 " + at, "ms", false},
		{"http_maxqps", "HTTP max", "req/s", true},
		{"cps", "new conns", "conn/s", true},
		{"cpu_per_gb", "proxy CPU, 1 flow", "s/GB", false},
		{"vcpu_at_qps", "proxy CPU " + at, "vCPU", false},
	}
}

// summary is a metric over the rounds: median with min and max, and the
// ratio to direct paired round by round (each round's value divided by
// direct's in the same round), again as median, min and max.
type summary struct {
	N        int     `json:"n"`
	Median   float64 `json:"median"`
	Min      float64 `json:"min"`
	Max      float64 `json:"max"`
	Ratio    float64 `json:"ratio_to_direct,omitempty"`
	RatioMin float64 `json:"ratio_min,omitempty"`
	RatioMax float64 `json:"ratio_max,omitempty"`
}

type variantInfo struct {
	Name string `json:"name"`
	Desc string `json:"description"`
}

// agentResults are the agent-only measurements.
type agentResults struct {
	// BaselineRSS is each agent's VmRSS (by node) once the cluster is up and
	// a few connections went through, before any load, MiB.
	BaselineRSS map[string]float64 `json:"baseline_rss_mib"`
	// IdleRSSPer1000 is the VmRSS growth of each agent (by node) per 1000
	// idle meshed connections, MiB.
	IdleRSSPer1000 map[string]float64 `json:"idle_rss_mib_per_1000_conns"`
	// EnrollToSYNms is, per round, the time from writing a new pod into the
	// manifest to the start of the first connection the mesh carried;
	// EnrollToAnswerMs to that connection's answer.
	EnrollToSYNms    []float64 `json:"enroll_to_first_captured_syn_ms"`
	EnrollToAnswerMs []float64 `json:"enroll_to_first_meshed_answer_ms"`
	// EnrollResolutionMs is the gap between the last failed attempt and the
	// first successful one: the capture began somewhere in it.
	EnrollResolutionMs []float64 `json:"enroll_resolution_ms"`
	// EnrollToLogMs is the time to the agent's "pod enrolled" log line: the
	// rest, to the first captured SYN, is the probe's next attempt.
	EnrollToLogMs []float64 `json:"enroll_to_pod_enrolled_log_ms"`
	EnrollSummary *summary  `json:"enroll_to_first_captured_syn,omitempty"`
}

// results is everything a run produced; it is written as JSON.
type results struct {
	Date     string        `json:"date"`
	Stamp    string        `json:"-"`
	Elapsed  string        `json:"elapsed"`
	Machine  machine       `json:"machine"`
	Config   config        `json:"config"`
	Variants []variantInfo `json:"variants"`
	Metrics  []metricDef   `json:"metrics"`
	// Samples[variant][metric][round]; null where a round failed.
	Samples map[string]map[string][]*float64 `json:"samples"`
	Summary map[string]map[string]summary    `json:"summary"`
	// MeshToPeer["<meshed variant>/<peer>"][metric] is the per-round
	// ratio of a meshed variant to a peer relay (see peerRatios), in round
	// order.
	MeshToPeer map[string]map[string][]float64 `json:"mesh_to_peer,omitempty"`
	// Slices[variant][metric][round] are a sliced test's numbers per slice,
	// in slice order, where a test keeps them (the fixed HTTP load): is a
	// round's tail one bad stretch or every slice?
	Slices   map[string]map[string][][]float64 `json:"slices,omitempty"`
	Agent    agentResults                      `json:"agent"`
	Profiles []profileResult                   `json:"profiles"`
	Micro    []microResult                     `json:"microbenchmarks"`
	Errors   []string                          `json:"errors"`
	// Retries are measurements that failed once and were repeated.
	Retries []string `json:"retries"`

	cfg config
}

func newResults(cfg config, start time.Time) *results {
	return &results{
		Date: start.Format(time.RFC3339), Stamp: start.Format("2006-01-02T150405"),
		Config: cfg, Metrics: metricDefs(cfg), Machine: machineInfo(cfg),
		Samples: map[string]map[string][]*float64{}, Summary: map[string]map[string]summary{},
		Errors: []string{}, Retries: []string{}, cfg: cfg,
	}
}

func (r *results) put(variant, metric string, round int, v float64) {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return
	}
	m := r.Samples[variant]
	if m == nil {
		m = map[string][]*float64{}
		r.Samples[variant] = m
	}
	if m[metric] == nil {
		m[metric] = make([]*float64, r.cfg.Runs)
	}
	m[metric][round] = &v
}

func (r *results) putSlices(variant, metric string, round int, xs []float64) {
	if r.Slices == nil {
		r.Slices = map[string]map[string][][]float64{}
	}
	m := r.Slices[variant]
	if m == nil {
		m = map[string][][]float64{}
		r.Slices[variant] = m
	}
	if m[metric] == nil {
		m[metric] = make([][]float64, r.cfg.Runs)
	}
	m[metric][round] = xs
}

func (r *results) errorf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	r.Errors = append(r.Errors, msg)
	logf("error: %s", msg)
}

// summarize computes every summary from the samples.
func (r *results) summarize() {
	direct := r.Samples["direct"]
	for v, metrics := range r.Samples {
		r.Summary[v] = map[string]summary{}
		for k, rounds := range metrics {
			var vals, ratios []float64
			for i, x := range rounds {
				if x == nil {
					continue
				}
				vals = append(vals, *x)
				if d := direct[k]; d != nil && d[i] != nil && *d[i] != 0 {
					ratios = append(ratios, *x / *d[i])
				}
			}
			if len(vals) == 0 {
				continue
			}
			s := summary{N: len(vals)}
			s.Median, s.Min, s.Max = stats(vals)
			if len(ratios) > 0 {
				s.Ratio, s.RatioMin, s.RatioMax = stats(ratios)
			}
			r.Summary[v][k] = s
		}
	}
	for _, pair := range r.peerPairs() {
		if p := r.peerRatios(pair[0], pair[1]); len(p) > 0 {
			if r.MeshToPeer == nil {
				r.MeshToPeer = map[string]map[string][]float64{}
			}
			r.MeshToPeer[pair[0]+"/"+pair[1]] = p
		}
	}
	if len(r.Agent.EnrollToSYNms) > 0 {
		s := summary{N: len(r.Agent.EnrollToSYNms)}
		s.Median, s.Min, s.Max = stats(r.Agent.EnrollToSYNms)
		r.Agent.EnrollSummary = &s
	}
}

// get returns the summary of variant's metric, if any round produced it.
func (r *results) get(variant, metric string) (summary, bool) {
	s, ok := r.Summary[variant][metric]
	return s, ok
}

// stats returns median, min and max.
func stats(v []float64) (med, lo, hi float64) {
	s := slices.Clone(v)
	sort.Float64s(s)
	n := len(s)
	med = s[n/2]
	if n%2 == 0 {
		med = (s[n/2-1] + s[n/2]) / 2
	}
	return med, s[0], s[n-1]
}

func roundMap(m map[string]float64) map[string]float64 {
	out := map[string]float64{}
	for k, v := range m {
		out[k] = math.Round(v*100) / 100
	}
	return out
}

// complete fails unless every variant produced a number for every test and
// nothing failed: what the CI smoke run asserts (not that it is fast).
func (r *results) complete() error {
	if len(r.Errors) > 0 {
		return fmt.Errorf("%d measurements failed: %v", len(r.Errors), r.Errors)
	}
	for _, v := range r.Variants {
		m := r.Samples[v.Name]
		if len(m) == 0 {
			return fmt.Errorf("variant %s produced no numbers", v.Name)
		}
		for metric, vals := range m {
			for i, x := range vals {
				if x == nil {
					return fmt.Errorf("variant %s: no %s in round %d", v.Name, metric, i+1)
				}
			}
		}
	}
	return nil
}
