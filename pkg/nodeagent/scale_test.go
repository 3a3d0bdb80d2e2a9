package nodeagent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/nodeagent"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// listenServer is a nodeagent.PodServer that opens the same three listeners per
// pod as the tunnel does (outbound and inbound transparent, HBONE), so that
// the scale benchmark pays what the agent pays for a pod's listeners.
type listenServer struct {
	mu   sync.Mutex
	pods map[string]servedPod
}

type servedPod struct {
	path string
	lns  []net.Listener
}

func newListenServer() *listenServer { return &listenServer{pods: map[string]servedPod{}} }

func (s *listenServer) ServePod(ctx context.Context, uid, path string, _ []netip.Addr) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.pods[uid]; ok {
		if p.path == path {
			return nil
		}
		closeAll(p.lns)
	}
	var lns []net.Listener
	for _, port := range []struct {
		port        int
		transparent bool
	}{{15001, true}, {15006, true}, {15008, false}} {
		l, err := netns.Listen(ctx, path, "tcp", "[::]:"+strconv.Itoa(port.port), netns.SocketOptions{Transparent: port.transparent, Mark: loadertest.TunnelMark})
		if err != nil {
			closeAll(lns)
			return err
		}
		lns = append(lns, l)
	}
	s.pods[uid] = servedPod{path: path, lns: lns}
	return nil
}

func (s *listenServer) StopPod(_ context.Context, uid string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.pods[uid]; ok {
		closeAll(p.lns)
		delete(s.pods, uid)
	}
	return nil
}

func (s *listenServer) PodReady(uid string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.pods[uid]
	return ok
}

func (s *listenServer) ServedPods() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.pods))
	for uid := range s.pods {
		out = append(out, uid)
	}
	return out
}

func (s *listenServer) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for uid, p := range s.pods {
		closeAll(p.lns)
		delete(s.pods, uid)
	}
}

func closeAll(lns []net.Listener) {
	for _, l := range lns {
		l.Close()
	}
}

// cpuTime is the process's user+system CPU time so far.
func cpuTime() time.Duration {
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkEnrollScale measures enrollment at 10, 50, 100 and 250 local
// pods (REDIRECTOR_SCALE_PODS=n,m,... for other sizes): the first
// enrollment of every pod, readiness after a restart (Load plus the full
// reconcile against pinned state, with fresh listeners as a new agent
// process opens them), one more pod (netns path given, as the CNI plugin
// gives it, and found by address, as the file source needs), a periodic
// full reconcile with nothing drifted, and the CPU the loader uses while
// idle. It prints the numbers; timings are never asserted.
//
// The loader runs as the agent does, in the simulated node's namespace
// (the host ends of the pods' veths are there, and get the host-probe
// links): the benchmark builds the pods, then runs itself again under
// nsenter with the pods' list in a file.
//
//	go test -run '^$' -bench EnrollScale -benchtime 1x ./pkg/loader/
func BenchmarkEnrollScale(b *testing.B) {
	if file := os.Getenv(scalePodsFileEnv); file != "" {
		enrollScaleInNode(b, file)
		return
	}
	sizes := os.Getenv("REDIRECTOR_SCALE_PODS")
	if sizes == "" {
		sizes = "10,50,100,250"
	}
	largest := 0
	for _, f := range strings.Split(sizes, ",") {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 || n > 250 {
			b.Fatalf("REDIRECTOR_SCALE_PODS: %q is not a number from 1 to 250", f)
		}
		largest = max(largest, n)
	}
	topo := netnstest.New(b, 1)
	node := topo.Nodes[0]
	// Two extra pods, for the one-more-pod measurements.
	var pods []scalePod
	for i := range largest + 2 {
		p := node.AddPod(fmt.Sprintf("p%d", i))
		pods = append(pods, scalePod{Name: p.Name, Path: p.Path(), Addrs: p.Addrs()})
	}
	file := filepath.Join(b.TempDir(), "pods.json")
	data, _ := json.Marshal(scaleInput{Sizes: sizes, Pods: pods})
	if err := os.WriteFile(file, data, 0o600); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command("nsenter", "--net="+node.Path(), "--", os.Args[0], "-test.run=^$", "-test.bench=^BenchmarkEnrollScale$", "-test.benchtime=1x")
	cmd.Env = append(os.Environ(), scalePodsFileEnv+"="+file)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		b.Fatalf("benchmark in the node's namespace: %v", err)
	}
}

const scalePodsFileEnv = "REDIRECTOR_SCALE_PODS_FILE"

type scalePod struct {
	Name  string
	Path  string
	Addrs []netip.Addr
}

type scaleInput struct {
	Sizes string
	Pods  []scalePod
}

// enrollScaleInNode is the part of BenchmarkEnrollScale that runs in the
// node's namespace.
func enrollScaleInNode(b *testing.B, file string) {
	data, err := os.ReadFile(file)
	if err != nil {
		b.Fatal(err)
	}
	var in scaleInput
	if err := json.Unmarshal(data, &in); err != nil {
		b.Fatal(err)
	}
	var sizes []int
	for _, f := range strings.Split(in.Sizes, ",") {
		n, _ := strconv.Atoi(f)
		sizes = append(sizes, n)
	}
	pods := in.Pods
	finder := netns.NewIndex(netns.DefaultFinder()) // as the agent does
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx := context.Background()
	var table []string
	for _, n := range sizes {
		b.Run(fmt.Sprintf("pods=%d", n), func(b *testing.B) {
			root := loadertest.TempBPFFS(b)
			want := func(k int, withPath bool) []loader.Pod {
				out := make([]loader.Pod, 0, k)
				for _, p := range pods[:k] {
					lp := loader.Pod{UID: "uid-" + p.Name, Namespace: "scale", Name: p.Name, Addrs: p.Addrs, CaptureInbound: true}
					if withPath {
						lp.NetNS = p.Path
					}
					out = append(out, lp)
				}
				return out
			}
			check := func(what string, res nodeagent.Result) {
				if len(res.Errors) > 0 {
					b.Fatalf("%s: %d errors, first: %v", what, len(res.Errors), res.Errors[0])
				}
			}
			l, err := loader.Load(ctx, loader.Config{PinRoot: root, Settings: loader.DefaultSettings(), Logger: log})
			if err != nil {
				b.Fatal(err)
			}
			srv := newListenServer()
			rec := nodeagent.NewReconciler(l, srv, finder, log)
			start := time.Now()
			check("first enrollment", rec.Reconcile(ctx, want(n, false), true))
			first := time.Since(start)

			// Restart: a new process loads the pinned state, opens fresh
			// listeners and runs its first full reconcile.
			srv.close()
			l.Close()
			start = time.Now()
			l, err = loader.Load(ctx, loader.Config{PinRoot: root, Settings: loader.DefaultSettings(), Logger: log})
			if err != nil {
				b.Fatal(err)
			}
			srv = newListenServer()
			rec = nodeagent.NewReconciler(l, srv, finder, log)
			check("restart", rec.Reconcile(ctx, want(n, false), true))
			restart := time.Since(start)

			start = time.Now()
			check("one more pod (CNI path)", rec.Reconcile(ctx, want(n+1, true)[:n+1], false))
			oneCNI := time.Since(start)
			start = time.Now()
			check("one more pod (address lookup)", rec.Reconcile(ctx, append(want(n+1, false), want(n+2, false)[n+1]), false))
			oneScan := time.Since(start)

			all := append(want(n+1, false), want(n+2, false)[n+1])
			cpu0, start := cpuTime(), time.Now()
			check("periodic full reconcile", rec.Reconcile(ctx, all, true))
			full, fullCPU := time.Since(start), cpuTime()-cpu0

			// Idle: what the loader's own background work costs with
			// nothing to do, over a few seconds.
			const idleFor = 5 * time.Second
			idleCPU := idleLoad(ctx, rec, idleFor)
			// The periodic full reconcile (30 s by default) adds its CPU.
			idlePct := 100 * (float64(idleCPU)/float64(idleFor) + float64(fullCPU)/float64(30*time.Second))

			b.ReportMetric(float64(restart.Milliseconds()), "restart-ms")
			b.ReportMetric(float64(oneCNI.Microseconds())/1000, "onemore-ms")
			row := fmt.Sprintf("| %d | %.0f | %.0f | %.1f | %.1f | %.0f (%.0f ms CPU) | %.3f |", n,
				ms(first), ms(restart), ms(oneCNI), ms(oneScan), ms(full), ms(fullCPU), idlePct)
			table = append(table, row)
			fmt.Println(row)

			if err := loader.Uninstall(ctx, root, loader.DefaultSettings(), log); err != nil {
				b.Error(err)
			}
			srv.close()
			l.Close()
		})
	}
	fmt.Println("| pods | first enrollment ms | ready after restart ms | one more pod (netns path) ms | one more pod (by address) ms | full reconcile ms | idle CPU % |")
	fmt.Println("| --- | --- | --- | --- | --- | --- | --- |")
	for _, r := range table {
		fmt.Println(r)
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// idleLoad is the process's CPU time over d while the reconciler has
// nothing to do but check the pods' links, as the agent does.
func idleLoad(ctx context.Context, rec *nodeagent.Reconciler, d time.Duration) time.Duration {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	cpu0 := cpuTime()
	rec.RepairLinks(ctx, nodeagent.LinkCheckPeriod)
	return cpuTime() - cpu0
}
