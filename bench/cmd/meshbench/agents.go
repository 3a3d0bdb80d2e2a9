package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// Measurements of the agents themselves: memory per idle connection, the
// time from enrollment to capture, and CPU profiles under load.

// measureIdle opens n idle connections from the meshed client to the
// cross-node server and returns each agent's VmRSS before, and its growth
// per 1000 connections.
func (c *cluster) measureIdle(ctx context.Context, r *netnstest.Runner, n int) (before, per1000 map[string]float64, err error) {
	v := c.variant("meshed-cross")
	before = map[string]float64{}
	for i, pid := range c.agentPID {
		mb, err := rssMB(pid)
		if err != nil {
			return nil, nil, err
		}
		before[fmt.Sprintf("node%d", i+1)] = mb
	}
	idle, err := startChild(r, v.client.Path(), "idle connections", selfPath(), "idle",
		"-addr", hostPort(v.server, echoPort), "-n", strconv.Itoa(n))
	if err != nil {
		return nil, nil, err
	}
	defer idle.kill()
	if _, err := idle.waitLine(ctx, "ready", 2*time.Minute); err != nil {
		return nil, nil, err
	}
	time.Sleep(time.Second) // let the agents' goroutines park
	per1000 = map[string]float64{}
	for i, pid := range c.agentPID {
		mb, err := rssMB(pid)
		if err != nil {
			return nil, nil, err
		}
		node := fmt.Sprintf("node%d", i+1)
		per1000[node] = (mb - before[node]) * 1000 / float64(n)
	}
	idle.stdin.Close()
	select {
	case <-idle.done:
	case <-time.After(10 * time.Second):
	}
	return before, per1000, nil
}

// measureEnrollment adds a fresh pod to the mesh and measures how long it
// takes until its connections are captured. A probe in the pod dials the
// echo server in namespace "strict" (STRICT mTLS) every millisecond: before
// the pod is enrolled, its plaintext connection is refused by the server's
// agent; the first connection that gets its echo went through the mesh. So
// the start of the first successful attempt is the first captured SYN (to
// within one attempt: see probeResult.PrevStart). Time zero is the write of
// the manifest that adds the pod, so the figure includes the agent noticing
// the file change, reconciling, attaching and opening the listeners.
// It returns, in milliseconds: [to first captured SYN, to its answer,
// resolution (the gap since the previous, failed, attempt), to the agent's
// "pod enrolled" log line (millisecond timestamps; -1 if not found)].
func (c *cluster) measureEnrollment(ctx context.Context, r *netnstest.Runner) ([4]float64, error) {
	var ms [4]float64
	c.late++
	p := c.topo.Nodes[0].AddPod(fmt.Sprintf("late%d", c.late))
	if err := setCongestion(ctx, p.Path(), c.cfg.Congestion); err != nil {
		return ms, err
	}
	probe, err := startChild(r, p.Path(), "enrollment probe", selfPath(), "probe", "-addr", hostPort(c.sserver.IPv4, echoPort))
	if err != nil {
		return ms, err
	}
	defer probe.kill()
	if _, err := probe.waitLine(ctx, "ready", 10*time.Second); err != nil {
		return ms, err
	}
	c.manifest.Pod(p, "mesh", "late-sa", "app=late")
	t0 := time.Now()
	if err := c.manifest.Write(c.manPath); err != nil {
		return ms, fmt.Errorf("write manifest: %w", err)
	}
	line, err := probe.waitLine(ctx, "{", 30*time.Second)
	if err != nil {
		return ms, err
	}
	var res probeResult
	if err := json.Unmarshal([]byte(line), &res); err != nil {
		return ms, fmt.Errorf("probe output %q: %w", line, err)
	}
	ms[0] = float64(res.SuccessStart-t0.UnixNano()) / 1e6
	ms[1] = float64(res.SuccessEnd-t0.UnixNano()) / 1e6
	ms[2] = float64(res.SuccessStart-res.PrevStart) / 1e6
	// The agent logs `pod enrolled` once the whole enrollment is done,
	// which can be after the first captured SYN: wait for the line a bit.
	ms[3] = -1
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if at, ok := loggedEnrolled(c.agents[0].Log(), "mesh/"+p.Name); ok {
			ms[3] = float64(at.Sub(t0)) / 1e6
			break
		}
	}
	if ms[0] > 1000 { // far off the usual tens of ms: keep the agents' logs to see why
		for i, a := range c.agents {
			f := filepath.Join(c.cfg.Out, fmt.Sprintf("enroll-slow-%s-node%d.log", p.Name, i+1))
			if err := os.WriteFile(f, []byte(a.Log()), 0o644); err == nil {
				logf("enrollment of %s took %.0f ms; agent log saved as %s", p.Name, ms[0], f)
			}
		}
	}
	return ms, nil
}

// loggedEnrolled finds when the agent logged `pod enrolled` for pod
// (namespace/name), from the slog time= field.
func loggedEnrolled(log, pod string) (time.Time, bool) {
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, `msg="pod enrolled"`) || !strings.Contains(line+" ", "pod="+pod+" ") {
			continue
		}
		ts, _, _ := strings.Cut(strings.TrimPrefix(line, "time="), " ")
		if at, err := time.Parse(time.RFC3339Nano, ts); err == nil {
			return at, true
		}
	}
	return time.Time{}, false
}

// profileResult is one agent's CPU profile under one load.
type profileResult struct {
	Load string `json:"load"`
	Node string `json:"node"`
	File string `json:"file"`
	Top  string `json:"top"`     // by own (flat) time
	Cum  string `json:"top_cum"` // by cumulative time: which paths the flat time is on
}

// profiles takes CPU profiles of both agents (admin endpoint, inside each
// node's namespace) while meshed-cross carries a bulk flow, then requests
// at full speed, then new connections; it saves them and their `pprof -top`.
// Last it takes an execution trace of both agents under the fixed HTTP load,
// whose latency a CPU profile cannot explain: the trace's scheduler-latency
// profile shows where goroutines waited for a CPU.
func (c *cluster) profiles(ctx context.Context, cfg config, stamp string) ([]profileResult, error) {
	v := c.variant("meshed-cross")
	secs := int(cfg.ProfileTime.Round(time.Second) / time.Second)
	loadCPS := cfg
	loadCPS.CPSTime = time.Duration(secs+1) * time.Second
	loads := []struct {
		name string
		run  func() error
	}{
		{"bulk", func() error { _, err := runIperf(ctx, cfg, v, 1, time.Duration(secs+1)*time.Second); return err }},
		{"requests", func() error { _, err := runFortio(ctx, cfg, v, 0, time.Duration(secs+1)*time.Second); return err }},
		{"connections", func() error { _, err := runCPS(ctx, loadCPS, v); return err }},
	}
	var out []profileResult
	for _, l := range loads {
		logf("profiling both agents for %ds under %s load", secs, l.name)
		profs, err := c.recordDuring(ctx, "profile", secs, l.run)
		if err != nil {
			return out, fmt.Errorf("%s load: %w", l.name, err)
		}
		for i := range c.agents {
			node := fmt.Sprintf("node%d", i+1)
			file := filepath.Join(cfg.Out, fmt.Sprintf("%s-%s-%s.pprof", stamp, l.name, node))
			if err := os.WriteFile(file, profs[i], 0o644); err != nil {
				return out, err
			}
			top, err := pprofTop(ctx, file, "-nodecount=25")
			if err != nil {
				return out, err
			}
			cum, err := pprofTop(ctx, file, "-cum", "-nodecount=40")
			if err != nil {
				return out, err
			}
			out = append(out, profileResult{Load: l.name, Node: node, File: file, Top: top, Cum: cum})
		}
	}
	traces, err := c.traceFixedHTTP(ctx, cfg, v, secs, stamp)
	return append(out, traces...), err
}

// traceFixedHTTP takes execution traces of both agents while v carries the
// fixed HTTP load, and summarizes each by its scheduler-latency profile.
func (c *cluster) traceFixedHTTP(ctx context.Context, cfg config, v *variant, secs int, stamp string) ([]profileResult, error) {
	logf("tracing both agents for %ds under HTTP at %d qps", secs, cfg.HTTPQPS)
	traces, err := c.recordDuring(ctx, "trace", secs, func() error {
		_, err := runFortio(ctx, cfg, v, cfg.HTTPQPS, time.Duration(secs+1)*time.Second)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("fixed HTTP load: %w", err)
	}
	var out []profileResult
	for i := range c.agents {
		node := fmt.Sprintf("node%d", i+1)
		file := filepath.Join(cfg.Out, fmt.Sprintf("%s-trace-http-%s.out", stamp, node))
		if err := os.WriteFile(file, traces[i], 0o644); err != nil {
			return out, err
		}
		sched, err := exec.CommandContext(ctx, "go", "tool", "trace", "-pprof=sched", file).Output()
		if err != nil {
			return out, fmt.Errorf("go tool trace -pprof=sched %s: %w", file, err)
		}
		schedFile := strings.TrimSuffix(file, ".out") + "-sched.pprof"
		if err := os.WriteFile(schedFile, sched, 0o644); err != nil {
			return out, err
		}
		top, err := pprofTop(ctx, schedFile, "-cum", "-nodecount=30")
		if err != nil {
			return out, err
		}
		out = append(out, profileResult{Load: "HTTP fixed (execution trace, scheduler latency)", Node: node, File: file, Cum: top})
	}
	return out, nil
}

// recordDuring fetches /debug/pprof/<what> for secs from every agent while
// load runs, and returns the recordings in agent order.
func (c *cluster) recordDuring(ctx context.Context, what string, secs int, load func() error) ([][]byte, error) {
	var wg sync.WaitGroup
	recs := make([][]byte, len(c.agents))
	errs := make([]error, len(c.agents))
	for i, a := range c.agents {
		wg.Go(func() { recs[i], errs[i] = fetchAdmin(ctx, a.Node.Path(), what, secs) })
	}
	time.Sleep(200 * time.Millisecond) // the recordings start before the load
	lerr := load()
	wg.Wait()
	return recs, errors.Join(append([]error{lerr}, errs...)...)
}

func pprofTop(ctx context.Context, file string, args ...string) (string, error) {
	args = append(append([]string{"tool", "pprof", "-top"}, args...), file)
	out, err := exec.CommandContext(ctx, "go", args...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// fetchAdmin GETs /debug/pprof/<what> (a CPU profile or an execution trace)
// from the agent's admin endpoint, which listens on 127.0.0.1:15000 inside
// the node's namespace.
func fetchAdmin(ctx context.Context, nodeNS, what string, secs int) ([]byte, error) {
	client := http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return netns.Dial(ctx, nodeNS, network, addr, netns.SocketOptions{})
		},
	}}
	url := fmt.Sprintf("http://127.0.0.1:15000/debug/pprof/%s?seconds=%d", what, secs)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("fetch %s in %s: %w", what, nodeNS, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("read %s in %s: %w", what, nodeNS, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s in %s: %s: %s", what, nodeNS, resp.Status, strings.TrimSpace(string(body)))
	}
	return body, nil
}
