package loader_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// BenchmarkAgentScale measures the real agent (file source, no CNI plugin)
// on a simulated node with 10, 50, 100 and 250 local pods
// (REDIRECTOR_SCALE_PODS): readiness after the first start (every pod new),
// readiness after a restart on the same pins, one more pod (from the
// manifest write to its enrollment with inbound capture on, median of
// three: includes the file source's reload), and the agent's CPU over 30 s idle (one full reconcile at the default
// 30 s period included). REDIRECTOR_AGENT_BIN picks the binary (to measure
// an older build); by default this tree's is built. It prints the numbers;
// nothing is asserted about them.
//
//	go test -run '^$' -bench AgentScale -benchtime 1x -timeout 30m ./pkg/loader/
func BenchmarkAgentScale(b *testing.B) {
	bin := os.Getenv("REDIRECTOR_AGENT_BIN")
	if bin == "" {
		dir := b.TempDir()
		if err := netnstest.BuildBinaries(dir); err != nil {
			b.Fatal(err)
		}
		bin = filepath.Join(dir, "redirector")
	}
	sizes := os.Getenv("REDIRECTOR_SCALE_PODS")
	if sizes == "" {
		sizes = "10,50,100,250"
	}
	var ns []int
	largest := 0
	for _, f := range strings.Split(sizes, ",") {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 || n > 250 {
			b.Fatalf("REDIRECTOR_SCALE_PODS: %q is not a number from 1 to 250", f)
		}
		ns = append(ns, n)
		largest = max(largest, n)
	}
	topo := netnstest.New(b, 1)
	node := topo.Nodes[0]
	var pods []*netnstest.Pod
	const extra = 3 // one-more-pod samples
	for i := range largest + extra {
		pods = append(pods, node.AddPod(fmt.Sprintf("p%d", i)))
	}
	ca := filepath.Join(b.TempDir(), "ca")
	if out, err := exec.Command(bin, "ca", "init", "--dir", ca).CombinedOutput(); err != nil {
		b.Fatalf("ca init: %v: %s", err, out)
	}
	client := &http.Client{Timeout: time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return netns.Dial(ctx, node.Path(), network, addr, netns.SocketOptions{})
		},
		DisableKeepAlives: true,
	}}
	ready := func() bool {
		resp, err := client.Get("http://127.0.0.1:15021/healthz/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}
	waitReady := func(ag *netnstest.Agent, start time.Time) time.Duration {
		deadline := start.Add(2 * time.Minute)
		for !ready() {
			if time.Now().After(deadline) {
				b.Fatalf("agent not ready within 2 min:\n%s", tailOf(ag.Log(), 3000))
			}
			time.Sleep(20 * time.Millisecond)
		}
		return time.Since(start)
	}
	var table []string
	for _, n := range ns {
		b.Run(fmt.Sprintf("pods=%d", n), func(b *testing.B) {
			dir := b.TempDir()
			manifest, root := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "bpf")
			write := func(k int) {
				m := (&netnstest.Manifest{}).Namespace("scale", "istio.io/dataplane-mode=ambient")
				for _, p := range pods[:k] {
					m = m.Pod(p, "scale", "default")
				}
				if err := m.Write(manifest); err != nil {
					b.Fatal(err)
				}
			}
			write(n)
			opts := netnstest.AgentOptions{Binary: bin, Manifest: manifest, CADir: ca, BPFRoot: root,
				Args: []string{"--reconcile-period", "30s", "--log-level", "info"}}
			start := time.Now()
			ag := netnstest.StartAgent(b, node, opts)
			first := waitReady(ag, start)

			// Idle: the agent's CPU over 30 s with nothing changing.
			pid := agentPID(b, root)
			cpu0, t0 := procCPU(b, pid), time.Now()
			time.Sleep(30 * time.Second)
			idle := 100 * float64(procCPU(b, pid)-cpu0) / float64(time.Since(t0))

			// One more pod, through the manifest, three times: the median.
			m, err := maps.OpenPinned(root)
			if err != nil {
				b.Fatal(err)
			}
			defer m.Close()
			var samples []time.Duration
			for k := n; k < n+extra; k++ {
				added := pods[k]
				start = time.Now()
				write(k + 1)
				for !enrolled(m, added) {
					if time.Since(start) > time.Minute {
						b.Fatalf("pod %s not enrolled within a minute", added.Name)
					}
					time.Sleep(2 * time.Millisecond)
				}
				samples = append(samples, time.Since(start))
				time.Sleep(200 * time.Millisecond) // past the source's debounce
				loaded, enrolledAt := logTime(ag.Log(), `msg="loaded manifests"`, ""), logTime(ag.Log(), `msg="pod enrolled"`, "pod=scale/"+added.Name)
				fmt.Printf("one more pod (%d): %.1f ms from the write, of which %.0f ms from the source's reload to the agent's \"pod enrolled\"\n",
					n, ms(samples[len(samples)-1]), ms(enrolledAt.Sub(loaded)))
			}
			slices.Sort(samples)
			oneMore := samples[len(samples)/2]

			// Restart on the same pins.
			if err := ag.Stop(15 * time.Second); err != nil {
				b.Error(err)
			}
			start = time.Now()
			ag = netnstest.StartAgent(b, node, opts)
			restart := waitReady(ag, start)

			row := fmt.Sprintf("| %d | %.2f | %.2f | %.0f | %.3f |", n, first.Seconds(), restart.Seconds(), ms(oneMore), idle)
			table = append(table, row)
			fmt.Println(row)
			ag.Kill()
		})
	}
	fmt.Println("| pods | ready after first start s | ready after restart s | one more pod ms | idle CPU % |")
	fmt.Println("| --- | --- | --- | --- | --- |")
	for _, r := range table {
		fmt.Println(r)
	}
}

// enrolled reports whether the pod's enrollment entries are written with
// inbound capture on: the last step of its enrollment.
func enrolled(m *maps.Maps, p *netnstest.Pod) bool {
	for _, a := range p.Addrs() {
		s, ok, err := m.Pod(a)
		if err != nil || !ok || !s.CaptureInbound {
			return false
		}
	}
	return true
}

// agentPID finds the agent running with --bpf-root root.
func agentPID(b *testing.B, root string) int {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := bytes.Split(cmdline, []byte{0})
		if len(args) > 1 && string(args[1]) == "run" && bytes.Contains(cmdline, []byte("\x00"+root+"\x00")) {
			return pid
		}
	}
	b.Fatalf("no agent process with --bpf-root %s", root)
	return 0
}

// procCPU is the process's user+system time.
func procCPU(b *testing.B, pid int) time.Duration {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the command name (which may hold spaces) in parentheses.
	f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+2:]))
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / 100 // USER_HZ
}

func tailOf(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// logTime is the time of the last agent log line holding both needles.
func logTime(log, needle, needle2 string) time.Time {
	var at time.Time
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, needle) || !strings.Contains(line, needle2) {
			continue
		}
		f, _, _ := strings.Cut(strings.TrimPrefix(line, "time="), " ")
		if t, err := time.Parse(time.RFC3339Nano, f); err == nil {
			at = t
		}
	}
	return at
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
