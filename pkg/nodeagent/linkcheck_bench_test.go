package nodeagent

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// nopServer is a PodServer that opens nothing: the link check's cost is
// the reconciler's and the loader's.
type nopServer struct {
	mu   sync.Mutex
	pods map[string]bool
}

func (s *nopServer) ServePod(_ context.Context, uid, _ string, _ []netip.Addr) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pods[uid] = true
	return nil
}

func (s *nopServer) StopPod(_ context.Context, uid string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.pods, uid)
	return nil
}

func (s *nopServer) ServedPods() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.pods))
	for uid := range s.pods {
		out = append(out, uid)
	}
	return out
}

func (s *nopServer) PodReady(uid string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pods[uid]
}

// BenchmarkLinkCheckTick measures what one link check (every
// LinkCheckPeriod, 750 ms) costs with many pods, part by part: the stat of
// every attached pod's namespace path (requeueMoved), the sealed pods'
// sweep with every pod sealed and none to detach, the held links' check,
// and the whole tick. REDIRECTOR_LINKCHECK_PODS sets the pods (default
// 200).
//
//	go test -run '^$' -bench LinkCheckTick ./pkg/nodeagent/
func BenchmarkLinkCheckTick(b *testing.B) {
	n := 200
	if v := os.Getenv("REDIRECTOR_LINKCHECK_PODS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 || n > 1000 {
			b.Fatalf("REDIRECTOR_LINKCHECK_PODS=%q: want 1 to 1000", v)
		}
	}
	topo := netnstest.New(b, 1)
	var want []loader.Pod
	for i := range n {
		p := topo.Nodes[0].AddPod(fmt.Sprintf("p%d", i))
		want = append(want, loader.Pod{UID: "uid-" + p.Name, Namespace: "bench", Name: p.Name, NetNS: p.Path(), Addrs: p.Addrs(), CaptureInbound: true})
	}
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	l, err := loader.Load(ctx, loader.Config{PinRoot: loadertest.TempBPFFS(b), Settings: loader.DefaultSettings(), Logger: log})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	rec := NewReconciler(l, &nopServer{pods: map[string]bool{}}, netns.DefaultFinder(), log)
	listed := true
	rec.SetListed(func(string, []netip.Addr) (bool, bool) { return listed, false })
	queued := 0
	rec.SetRequeue(func(string) { queued++ })
	if res := rec.Reconcile(ctx, want, true); len(res.Errors) > 0 {
		b.Fatalf("%d errors, first: %v", len(res.Errors), res.Errors[0])
	}
	listed = false
	if res := rec.Reconcile(ctx, nil, true); len(res.Sealed) != n {
		b.Fatalf("sealed %d of %d pods: %+v", len(res.Sealed), n, res.Errors)
	}
	perPod := func(b *testing.B) {
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/pod")
	}
	b.Run(fmt.Sprintf("pods=%d/requeueMoved", n), func(b *testing.B) {
		for b.Loop() {
			rec.requeueMoved(ctx)
		}
		perPod(b)
	})
	b.Run(fmt.Sprintf("pods=%d/sweepSealed", n), func(b *testing.B) {
		for b.Loop() {
			rec.sweepSealed(ctx)
		}
		perPod(b)
	})
	b.Run(fmt.Sprintf("pods=%d/CheckLinks", n), func(b *testing.B) {
		for b.Loop() {
			l.CheckLinks(ctx, false)
		}
		perPod(b)
	})
	b.Run(fmt.Sprintf("pods=%d/tick", n), func(b *testing.B) {
		for b.Loop() {
			rec.repairLinks(ctx, false)
		}
		perPod(b)
	})
	if queued > 0 || rec.Stats().Sealed != n {
		b.Errorf("queued %d pods, %d sealed: nothing was to change", queued, rec.Stats().Sealed)
	}
}
