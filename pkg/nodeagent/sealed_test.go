package nodeagent_test

import (
	"context"
	"net/netip"
	"os/exec"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/nodeagent"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// listing is what the test's source lists on the node: pod uids and the
// addresses of listed pods (SetListed's check).
type listing struct {
	mu    sync.Mutex
	uids  map[string]bool
	addrs map[netip.Addr]bool
}

func (l *listing) set(pods ...loader.Pod) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.uids, l.addrs = map[string]bool{}, map[netip.Addr]bool{}
	for _, p := range pods {
		l.uids[p.UID] = true
		for _, a := range p.Addrs {
			l.addrs[a] = true
		}
	}
}

func (l *listing) listed(uid string, addrs []netip.Addr) (bool, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.uids[uid] {
		return true, false
	}
	return false, slices.ContainsFunc(addrs, func(a netip.Addr) bool { return l.addrs[a] })
}

// TestSealedPods: at the reconciler, a pod no longer wanted is detached if
// its source still lists it (it opted out) or a listed pod has its address,
// and otherwise sealed: its tunnel stopped and served again, its capture
// kept. A sealed
// pod is detached once its namespace is gone and, past the bound, the
// longest sealed first; one wanted again is served again.
func TestSealedPods(t *testing.T) {
	topo := netnstest.New(t, 1)
	n := topo.Nodes[0]
	deleted, optedOut, displaced, later := n.AddPod("deleted"), n.AddPod("optedout"), n.AddPod("displaced"), n.AddPod("later")
	root := loadertest.TempBPFFS(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l := loadertest.Load(t, root)
	defer l.Close()
	srv := &recordServer{}
	rec := nodeagent.NewReconciler(l, srv, netns.DefaultFinder(), nil)
	src := &listing{}
	rec.SetListed(src.listed)

	pods := []loader.Pod{loadertest.PodOf(deleted, true), loadertest.PodOf(optedOut, true), loadertest.PodOf(displaced, true)}
	src.set(pods...)
	if res := rec.Reconcile(ctx, pods, true); len(res.Errors) > 0 || len(res.Attached) != 3 {
		t.Fatalf("reconcile: %+v", res)
	}
	// deleted leaves the source; optedOut stays listed, unwanted; a new
	// listed pod has displaced's address.
	newcomer := loader.Pod{UID: "uid-newcomer", Addrs: displaced.Addrs()}
	src.set(pods[1], newcomer)
	res := rec.Reconcile(ctx, nil, true)
	slices.Sort(res.Detached)
	if len(res.Errors) > 0 || !slices.Equal(res.Sealed, []string{"test/deleted"}) || !slices.Equal(res.Detached, []string{"test/displaced", "test/optedout"}) {
		t.Fatalf("reconcile: %+v, want deleted sealed, displaced and optedout detached", res)
	}
	attached := func(uid string) bool {
		t.Helper()
		_, ok, err := l.PodState(uid)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	// Sealed: still attached, stopped once (its connections ended) and
	// served again (by listeners the tunnel makes refuse everything).
	srv.mu.Lock()
	stops := srv.stops["uid-deleted"]
	srv.mu.Unlock()
	if !attached("uid-deleted") || stops != 1 || !slices.Contains(srv.ServedPods(), "uid-deleted") {
		t.Fatalf("the sealed pod: attached %v, stopped %d times, served %v; want attached, stopped once, served", attached("uid-deleted"), stops, srv.ServedPods())
	}
	if got := rec.Stats().Sealed; got != 1 {
		t.Errorf("Stats().Sealed = %d, want 1", got)
	}
	// Passes over it change nothing.
	if res := rec.ReconcilePod(ctx, "uid-deleted", nil); len(res.Sealed)+len(res.Detached)+len(res.Errors) > 0 {
		t.Errorf("a second pass over the sealed pod: %+v", res)
	}
	if res := rec.Reconcile(ctx, nil, true); len(res.Sealed)+len(res.Errors) > 0 || srv.stops["uid-deleted"] != 1 {
		t.Errorf("a full pass over the sealed pod: %+v, stopped %d times", res, srv.stops["uid-deleted"])
	}

	// Wanted again: served again, no longer sealed.
	src.set(pods[0])
	if res := rec.ReconcilePod(ctx, "uid-deleted", &pods[0]); len(res.Errors) > 0 || !slices.Contains(srv.ServedPods(), "uid-deleted") || rec.Stats().Sealed != 0 {
		t.Fatalf("the pod wanted again: %+v, served %v, sealed %d", res, srv.ServedPods(), rec.Stats().Sealed)
	}

	// Two sealed, the bound one: the longest sealed is detached.
	rec.SetMaxSealed(1)
	laterPod := loadertest.PodOf(later, true)
	src.set(pods[0], laterPod)
	if res := rec.Reconcile(ctx, []loader.Pod{pods[0], laterPod}, true); len(res.Errors) > 0 {
		t.Fatalf("reconcile: %+v", res)
	}
	src.set()
	if res := rec.ReconcilePod(ctx, "uid-deleted", nil); !slices.Equal(res.Sealed, []string{"test/deleted"}) {
		t.Fatalf("reconcile: %+v, want deleted sealed", res)
	}
	time.Sleep(10 * time.Millisecond) // later is sealed after deleted
	if res := rec.ReconcilePod(ctx, "uid-later", nil); !slices.Equal(res.Sealed, []string{"test/later"}) {
		t.Fatalf("reconcile: %+v, want later sealed", res)
	}
	done := make(chan struct{})
	defer func() { cancel(); <-done }()
	go func() { defer close(done); rec.RepairLinks(ctx, 50*time.Millisecond) }()
	waitFor(t, "the longest sealed pod detached past the bound", func() bool {
		return !attached("uid-deleted") && attached("uid-later") && rec.Stats().Sealed == 1
	})

	// Its namespace gone, the sealed pod is detached.
	if out, err := exec.Command("ip", "netns", "del", later.NS).CombinedOutput(); err != nil {
		t.Fatalf("ip netns del %s: %v: %s", later.NS, err, out)
	}
	waitFor(t, "the sealed pod detached once its namespace went", func() bool {
		return !attached("uid-later") && rec.Stats().Sealed == 0
	})
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
