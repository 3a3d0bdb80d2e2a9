package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"time"

	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// test is one measurement made on every variant, once per round.
type test struct {
	key  string // what --tests selects it by
	name string
	run  func(ctx context.Context, cfg config, v *variant) (map[string]float64, error)
	// slice, set instead of run, makes one slice of d of a test that runs in
	// slices alternating between the variants (runSliced); sliced says how
	// many slices a variant gets per round, and how long each is.
	slice  func(ctx context.Context, cfg config, v *variant, d time.Duration) (sample, error)
	sliced func(cfg config) (n int, d time.Duration)
	// optIn tests run only when --tests names them.
	optIn bool
}

func bulkSlices(cfg config) (int, time.Duration) {
	return cfg.IperfSlices, cfg.IperfTime / time.Duration(cfg.IperfSlices)
}

// rrSlices cuts --rr-count, not a duration: each slice makes
// RRCount/RRSlices round trips however long they take (runRRSlice).
func rrSlices(cfg config) (int, time.Duration) {
	return cfg.RRSlices, 0
}

func httpSlices(cfg config) (int, time.Duration) {
	return cfg.HTTPSlices, cfg.HTTPTime / time.Duration(cfg.HTTPSlices)
}

var tests = []test{
	{key: "tput1", name: "iperf3 1 flow", slice: runBulkSlice("tput1", 1, true), sliced: bulkSlices},
	{key: "tput8", name: "iperf3 8 flows", slice: runBulkSlice("tput8", 8, false), sliced: bulkSlices},
	{key: "rr", name: "1-byte round trips", slice: runRRSlice, sliced: rrSlices},
	{key: "http", name: "HTTP fixed load", slice: runHTTPSlice, sliced: httpSlices},
	{key: "httpmax", name: "HTTP max qps", run: func(ctx context.Context, cfg config, v *variant) (map[string]float64, error) {
		res, err := runFortio(ctx, cfg, v, 0, cfg.HTTPMaxTime)
		return map[string]float64{"http_maxqps": res.ActualQPS, "http_max_p50": res.percentileMs(50),
			"http_max_p99": res.percentileMs(99)}, err
	}},
	{key: "hops", name: "round-trip hops", run: runHops},
	{key: "httphops", name: "HTTP by stage", run: runHTTPHops, optIn: true},
	{key: "cps", name: "new connections", run: func(ctx context.Context, cfg config, v *variant) (map[string]float64, error) {
		res, err := runCPS(ctx, cfg, v)
		return map[string]float64{"cps": res.PerSec}, err
	}},
}

// testKeys lists the keys --tests accepts, in the order the tests run.
func testKeys() []string {
	keys := make([]string, len(tests))
	for i, t := range tests {
		keys[i] = t.key
	}
	return keys
}

// charged runs f and returns the CPU seconds each of the variant's proxies
// spent meanwhile.
func charged(v *variant, f func() error) ([]float64, error) {
	before := make([]float64, len(v.proxies))
	for i, pid := range v.proxies {
		s, err := cpuSeconds(pid)
		if err != nil {
			return nil, err
		}
		before[i] = s
	}
	if err := f(); err != nil {
		return nil, err
	}
	for i, pid := range v.proxies {
		s, err := cpuSeconds(pid)
		if err != nil {
			return nil, err
		}
		before[i] = s - before[i]
	}
	return before, nil
}

// addProxies records key for the whole path (all proxies) and key@proxy
// for each one.
func addProxies(out map[string]float64, v *variant, key string, cpu []float64, conv func(float64) float64) {
	if len(cpu) == 0 {
		return
	}
	var sum float64
	for i, s := range cpu {
		sum += s
		out[key+"@"+proxyName(v, i)] = conv(s)
	}
	out[key] = conv(sum)
}

// proxyName names the variant's i-th proxy: the node of an agent, or relay.
func proxyName(v *variant, i int) string {
	if i < len(v.names) {
		return v.names[i]
	}
	if v.meshed {
		return fmt.Sprintf("node%d", i+1)
	}
	return "relay"
}

// runSuite builds the cluster, runs the rounds, and reports.
func runSuite(ctx context.Context, r *netnstest.Runner, cfg config) error {
	res := newResults(cfg, time.Now())
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return err
	}
	if cfg.Awake {
		if err := keepCPUsAwake(r); err != nil {
			return err
		}
	}
	logf("meshbench: %d rounds; building the cluster (2 nodes, agents, servers, capture setups)", cfg.Runs)
	t0 := time.Now()
	cl, err := buildCluster(ctx, r, cfg)
	if err != nil {
		return err
	}
	for _, v := range cl.variants {
		res.Variants = append(res.Variants, variantInfo{Name: v.Name, Desc: v.Desc})
	}
	logf("cluster ready in %s", time.Since(t0).Round(time.Millisecond))

	// Idle memory first, while the agents are warm but have carried no load
	// (a Go heap grown by earlier load would absorb the new connections).
	if base, idle, err := cl.measureIdle(ctx, r, cfg.IdleConns); err != nil {
		res.errorf("idle connections: %v", err)
	} else {
		res.Agent.BaselineRSS, res.Agent.IdleRSSPer1000 = base, idle
		logf("agent RSS %v MiB, plus %v MiB per 1000 idle connections", roundMap(base), roundMap(idle))
	}

	for round := range cfg.Runs {
		for _, t := range tests {
			if !cfg.runs(t) {
				continue
			}
			if t.slice != nil {
				runSliced(ctx, cfg, t, cl.variants, round, res)
				continue
			}
			for _, v := range rotate(cl.variants, round) {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				var vals map[string]float64
				err := res.attempt(ctx, round, t.name, v, func() (err error) {
					vals, err = t.run(ctx, cfg, v)
					return err
				})
				if err != nil {
					res.errorf("round %d, %s, %s: %v", round+1, t.name, v.Name, err)
					continue
				}
				for k, x := range vals {
					res.put(v.Name, k, round, x)
				}
			}
		}
		if ms, err := cl.measureEnrollment(ctx, r); err != nil {
			res.errorf("round %d, enrollment: %v", round+1, err)
		} else {
			res.Agent.EnrollToSYNms = append(res.Agent.EnrollToSYNms, ms[0])
			res.Agent.EnrollToAnswerMs = append(res.Agent.EnrollToAnswerMs, ms[1])
			res.Agent.EnrollResolutionMs = append(res.Agent.EnrollResolutionMs, ms[2])
			if ms[3] >= 0 {
				res.Agent.EnrollToLogMs = append(res.Agent.EnrollToLogMs, ms[3])
			}
		}
		logf("round %d/%d done (%s)", round+1, cfg.Runs, time.Since(t0).Round(time.Second))
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if cfg.ProfileTime > 0 {
		profs, err := cl.profiles(ctx, cfg, res.Stamp)
		if err != nil {
			res.errorf("profiles: %v", err)
		}
		res.Profiles = profs
	}
	if cfg.Micro {
		logf("microbenchmarks (go test -bench, benchtime %s)", cfg.BenchTime)
		micro, err := runMicro(ctx, cfg, filepath.Join(cfg.Out, res.Stamp+"-micro.txt"))
		if err != nil {
			res.errorf("microbenchmarks: %v", err)
		}
		res.Micro = micro
	}
	res.Elapsed = time.Since(t0).Round(time.Second).String()
	res.summarize()
	if err := res.report(cfg); err != nil {
		return err
	}
	if cfg.Strict {
		return res.complete()
	}
	return nil
}

// attempt runs f, and once more after a failure, recording the retry: a
// shared machine has hiccups, a broken path fails twice. A failure on a relay
// variant carries the relay's log.
func (r *results) attempt(ctx context.Context, round int, what string, v *variant, f func() error) error {
	err := f()
	if err != nil && ctx.Err() == nil {
		r.Retries = append(r.Retries, fmt.Sprintf("round %d, %s, %s: %v", round+1, what, v.Name, err))
		logf("retrying round %d, %s, %s after: %v", round+1, what, v.Name, err)
		time.Sleep(time.Second)
		err = f()
	}
	if err == nil {
		return nil
	}
	for _, l := range v.logs {
		if log := l.stderr.String(); log != "" {
			err = fmt.Errorf("%w (%s log: %s)", err, l.name, tail(log, 500))
		}
	}
	return err
}

// rotate starts the order at a different variant each round, so no variant
// always runs first (right after another test) or last.
func rotate(vs []*variant, round int) []*variant {
	k := round % len(vs)
	return append(append([]*variant{}, vs[k:]...), vs[:k]...)
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
}

// keepCPUsAwake starts one `meshbench spin` per CPU, stopped by the
// runner's cleanup.
func keepCPUsAwake(r *netnstest.Runner) error {
	for cpu := range runtime.NumCPU() {
		cmd := exec.Command(selfPath(), "spin", "-cpu", strconv.Itoa(cpu))
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("start CPU spinner: %w", err)
		}
		r.Cleanup(func() {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		})
	}
	logf("keeping %d CPUs awake with SCHED_IDLE spinners", runtime.NumCPU())
	return nil
}
