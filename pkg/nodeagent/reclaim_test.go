package nodeagent

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestYieldedAgentTakesNodeBack: an agent a newer one took the node from
// enrolls nothing while the newer one holds it; once that one gives the
// node up as it stops (an upgrade rolled back, a new agent that failed its
// start after claiming), the older one takes it back, undoes its yield
// (OnReclaim) and enrolls the pods that came meanwhile. Before, it stayed
// yielded for as long as it ran: a pod created after the rollback was
// never enrolled, a deleted one never detached, no link repaired.
func TestYieldedAgentTakesNodeBack(t *testing.T) {
	tp := netnstest.New(t, 1)
	p := tp.Nodes[0].AddPod("p")
	log := slog.New(slog.DiscardHandler)
	root := loadertest.TempBPFFS(t)
	ld := loadertest.Load(t, root)
	t.Cleanup(func() { ld.Close() })
	ctx := context.Background()
	claim, err := maps.ClaimNode(ctx, root, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { claim.Close() })
	ld.SetClaim(claim)
	tun, certs := netnstest.FileCATunnel(t, log)
	rec := NewReconciler(ld, tun, netns.DefaultFinder(), log)
	var yields, reclaims int
	a := New(Config{Node: "node1", TrustDomain: "cluster.local", ReconcilePeriod: time.Hour, Tunnel: tun, Loader: ld, Reconciler: rec,
		Certs: certs, Logger: log, Claim: claim,
		OnYield:   func() { yields++ },
		OnReclaim: func() { reclaims++; ld.SetClaim(claim) }})

	// A newer agent claims the node.
	newer, err := maps.ClaimNode(ctx, root, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { newer.Close() })
	if a.checkClaim(ctx, true) || yields != 1 {
		t.Fatalf("after the newer claim: yields %d, want 1", yields)
	}
	w := &workload.Workload{Name: "web", Namespace: "shop", UID: "uid-web", ServiceAccount: "web", Node: "node1", Addrs: p.Addrs(), Enrolled: true, Reason: "test"}
	a.mu.Lock()
	a.cniPods["shop/web"] = cniPod{uid: "uid-web", netns: p.Path()}
	a.mu.Unlock()
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
	a.applyLatest(ctx, true)
	if _, ok, _ := ld.PodState("uid-web"); ok {
		t.Fatal("the yielded agent attached a pod")
	}
	if a.checkClaim(ctx, true) || reclaims != 0 {
		t.Fatal("the yielded agent took the node back while the newer agent held it")
	}

	// The newer agent stops without a successor (a rollback): it gives
	// the node up, and the older one takes it back and enrolls the pod.
	if err := newer.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if !a.checkClaim(ctx, true) || reclaims != 1 {
		t.Fatalf("the newer agent gave the node up: reclaims %d, want 1 (and a full pass asked for)", reclaims)
	}
	if !claim.Held() {
		t.Fatal("the older agent does not hold the node after taking it back")
	}
	a.applyLatest(ctx, true)
	if _, ok, err := ld.PodState("uid-web"); err != nil || !ok {
		t.Fatalf("the pod that came while the newer agent held the node is not enrolled after the older took it back: %v", err)
	}
	if s, ok, err := ld.Maps().Pod(p.IPv4); err != nil || !ok {
		t.Fatalf("no enrollment entry for %s: %+v %v %v", p.IPv4, s, ok, err)
	}

	// Yielding again works as the first time.
	again, err := maps.ClaimNode(ctx, root, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { again.Close() })
	if a.checkClaim(ctx, true) || yields != 2 {
		t.Errorf("after a second newer claim: yields %d, want 2", yields)
	}
}

// TestTakenBackAgentLetsGoOfDetachedLinks: a pod the older agent attached
// and the newer one detached while it held the node stays detached once the
// older agent takes the node back. The newer agent's detach unpins the
// pod's links, but the older agent still held them open, so they stayed
// attached; and its link check, holding the node again, found their pins
// gone and pinned them back (seen failing: 2 links re-pinned under a pod
// id the metadata no longer names).
func TestTakenBackAgentLetsGoOfDetachedLinks(t *testing.T) {
	tp := netnstest.New(t, 1)
	p := tp.Nodes[0].AddPod("p")
	log := slog.New(slog.DiscardHandler)
	root := loadertest.TempBPFFS(t)
	ctx := context.Background()
	older := loadertest.Load(t, root)
	t.Cleanup(func() { older.Close() })
	claim, err := maps.ClaimNode(ctx, root, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { claim.Close() })
	older.SetClaim(claim)
	if _, err := older.AttachPod(ctx, loader.Pod{UID: "uid-p", Namespace: "shop", Name: "p", NetNS: p.Path(), Addrs: p.Addrs(), CaptureInbound: true}); err != nil {
		t.Fatal(err)
	}

	// A newer agent takes the node, detaches the pod and gives the node up.
	newer := loadertest.Load(t, root)
	t.Cleanup(func() { newer.Close() })
	newerClaim, err := maps.ClaimNode(ctx, root, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { newerClaim.Close() })
	newer.SetClaim(newerClaim)
	if err := newer.DetachPod(ctx, "uid-p"); err != nil {
		t.Fatal(err)
	}
	if err := newerClaim.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// The older agent takes it back (as the agent's take-back does).
	if back, err := claim.ReclaimThen(ctx, func() { older.Relink(ctx) }); err != nil || !back {
		t.Fatalf("reclaim: %v %v", back, err)
	}
	if res := older.CheckLinks(ctx, true); res.Repinned != 0 || len(res.Errors) != 0 {
		t.Errorf("link check after taking the node back: %+v; want nothing re-pinned", res)
	}
	if ents, _ := os.ReadDir(filepath.Join(root, "pods")); len(ents) != 0 {
		var names []string
		for _, e := range ents {
			sub, _ := os.ReadDir(filepath.Join(root, "pods", e.Name()))
			for _, s := range sub {
				names = append(names, e.Name()+"/"+s.Name())
			}
		}
		if len(names) > 0 {
			t.Errorf("pins of the detached pod under %s/pods: %v", root, names)
		}
	}
}
