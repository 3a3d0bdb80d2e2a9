package nodeagent

import (
	"context"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// runRepair runs the reconciler's link check (and with it the sealed
// pods' sweep and requeueMoved) every period until the test ends.
func runRepair(t *testing.T, ctx context.Context, rec *Reconciler, period time.Duration) {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); rec.RepairLinks(ctx, period) }()
	t.Cleanup(func() { cancel(); <-done })
}

func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(within); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("%s: not within %s", what, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSealedPodListedAgainOptedOut: a pod gone from its source is sealed;
// the source then lists it again (the same uid), opted out of the mesh.
// It must be detached as any pod that opts out is, at once, not held
// sealed: the directory knows it again, so its "refusing" listeners serve
// it under its identity, although it is out of the mesh. Seen failing:
// nothing queued the pod (it was not wanted before and is not now), and
// the sweep leaves a listed pod to its own reconcile, so it stayed sealed
// and attached until the next full pass (RECONCILE_PERIOD).
func TestSealedPodListedAgainOptedOut(t *testing.T) {
	tp := netnstest.New(t, 1)
	sandbox := tp.Nodes[0].AddPod("p")
	a, ld, _, rec := testAgent(t)
	ctx := runWorker(t, a)
	runRepair(t, ctx, rec, 50*time.Millisecond)
	w := &workload.Workload{Name: "p", Namespace: "shop", UID: "uid-p", ServiceAccount: "default", Node: "node1", Addrs: sandbox.Addrs(), Enrolled: true, Reason: "ns label"}
	attached := func() bool { _, ok, _ := ld.PodState("uid-p"); return ok }
	snapshot := func(ws ...*workload.Workload) {
		a.setSnapshot(source.Snapshot{Workloads: ws})
		a.applyLatest(ctx, false)
	}
	snapshot(w)
	eventually(t, 10*time.Second, "pod enrolled", attached)

	snapshot() // deleted: sealed, its namespace lives
	eventually(t, 10*time.Second, "pod sealed", func() bool { return rec.Stats().Sealed == 1 })
	if !attached() {
		t.Fatal("the sealed pod was detached")
	}

	out := *w
	out.Enrolled, out.Reason = false, "no istio.io/dataplane-mode=ambient label on pod or namespace"
	snapshot(&out)
	eventually(t, 5*time.Second, "the pod listed again, opted out, detached", func() bool {
		return !attached() && rec.Stats().Sealed == 0
	})
}
