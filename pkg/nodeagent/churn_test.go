package nodeagent_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/nodeagent"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestPodChurnLeavesNothing: 200 pods come and go through the per-pod
// reconcile, concurrently, as on a busy node: most sandboxes die before
// their pod's detach (the runtime tears the namespace down, the API delete
// comes after), some after, and some pods' namespace paths are given to
// new pods (other uids, same addresses) before the old pod is detached.
// Namespace inode numbers and interface indexes are reused by the kernel
// all along. Afterwards nothing of any pod may be left: enrollment and
// counter entries, rd_pod_netns entries, metadata, pins, held links,
// goroutines, file descriptors; and each new pod at a reused path must
// have been attached in its own namespace.
func TestPodChurnLeavesNothing(t *testing.T) {
	const rounds, perRound = 10, 20
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	root := loadertest.TempBPFFS(t)
	ctx := context.Background()
	l := loadertest.Load(t, root)
	defer l.Close()
	rec := nodeagent.NewReconciler(l, &recordServer{}, netns.DefaultFinder(), nil)

	parallel := func(n int, f func(i int) error) {
		t.Helper()
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() { defer wg.Done(); errs[i] = f(i) }()
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				t.Error(err)
			}
		}
	}
	reconcile := func(uid string, want *loader.Pod) error {
		if res := rec.ReconcilePod(ctx, uid, want); len(res.Errors) > 0 {
			return fmt.Errorf("reconcile %s: %v", uid, res.Errors)
		}
		return nil
	}
	// One warm-up pod, so lazily opened descriptors are in the baseline.
	warm := node.AddPod("warm")
	if err := reconcile("uid-warm", ptr(loadertest.PodOf(warm, true))); err != nil {
		t.Fatal(err)
	}
	if err := reconcile("uid-warm", nil); err != nil {
		t.Fatal(err)
	}
	baseFDs, baseG := openFDs(t), runtime.NumGoroutine()

	start := time.Now()
	n := 0
	for r := range rounds {
		pods := make([]*netnstest.Pod, perRound)
		want := make([]loader.Pod, perRound)
		for i := range pods {
			pods[i] = node.AddPod(fmt.Sprintf("c%d", n))
			n++
			want[i] = loadertest.PodOf(pods[i], i%2 == 0)
		}
		parallel(perRound, func(i int) error { return reconcile(want[i].UID, &want[i]) })
		// Every fourth pod's path goes to a new pod (another uid, the
		// same addresses) before the old pod is detached.
		var reused []loader.Pod
		for i, p := range pods {
			switch i % 4 {
			case 0, 1: // the sandbox dies first
				if out, err := exec.Command("ip", "netns", "del", p.NS).CombinedOutput(); err != nil {
					t.Fatalf("ip netns del: %v: %s", err, out)
				}
			case 2:
				node.RecreatePod(p)
				q := loadertest.PodOf(p, true)
				q.UID, q.Name = q.UID+"-next", q.Name+"-next"
				if err := reconcile(q.UID, &q); err != nil {
					t.Error(err)
				}
				reused = append(reused, q)
			}
		}
		parallel(perRound, func(i int) error { return reconcile(want[i].UID, nil) })
		for _, q := range reused {
			st, ok, err := l.PodState(q.UID)
			if err != nil || !ok || !l.KernelOK(st, true) {
				t.Errorf("round %d: pod %s at a reused path: attached %v (%v), kernel state not as attached after the old pod's detach", r, q.Name, ok, err)
			}
			if ino, ok := l.AttachedNetNS(q.UID); !ok || ino != mustInode(t, q.NetNS) {
				t.Errorf("round %d: pod %s recorded in namespace %d, want its own %d", r, q.Name, ino, mustInode(t, q.NetNS))
			}
			if progs := loadertest.TCXPrograms(t, q.NetNS); len(progs) != 2 {
				t.Errorf("round %d: pod %s's eth0 runs %v after the old pod's detach, want its two programs", r, q.Name, progs)
			}
		}
		parallel(len(reused), func(i int) error { return reconcile(reused[i].UID, nil) })
		for i, p := range pods {
			if i%4 >= 2 {
				_ = exec.Command("ip", "netns", "del", p.NS).Run()
			}
		}
	}
	t.Logf("%d pods came and went in %s", n, time.Since(start).Round(time.Millisecond))

	m := l.Maps()
	if pods, err := m.ListPods(); err != nil || len(pods) != 0 {
		t.Errorf("enrollment entries left: %v (%v)", pods, err)
	}
	if c, err := m.AllCounters(); err != nil || len(c) != 0 {
		t.Errorf("%d counter entries left (%v)", len(c), err)
	}
	if e, err := m.ListPodNetNS(); err != nil || len(e) != 0 {
		t.Errorf("rd_pod_netns entries left: %v (%v)", e, err)
	}
	if metas, err := m.ListMeta(); err != nil || len(metas) != 0 {
		t.Errorf("%d pod records left (%v)", len(metas), err)
	}
	if entries, _ := os.ReadDir(filepath.Join(root, "pods")); len(entries) != 0 {
		t.Errorf("%d pod pin dirs left", len(entries))
	}
	if h := l.HeldLinks(); h != 0 {
		t.Errorf("%d links still held", h)
	}
	if fds := openFDs(t); fds > baseFDs+2 {
		t.Errorf("file descriptors grew from %d to %d", baseFDs, fds)
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > baseG+2 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if g := runtime.NumGoroutine(); g > baseG+2 {
		t.Errorf("goroutines grew from %d to %d", baseG, g)
	}
}

func ptr[T any](v T) *T { return &v }

func openFDs(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

func mustInode(t *testing.T, path string) uint64 {
	t.Helper()
	ino, err := netns.Inode(path)
	if err != nil {
		t.Fatal(err)
	}
	return ino
}
