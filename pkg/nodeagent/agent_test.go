package nodeagent

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/tunnel"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// testAgent is a node agent over a real loader (temp pin root) and tunnel,
// with a file CA; no workers run unless the test runs them.
func testAgent(t *testing.T) (*Agent, *loader.Loader, *tunnel.Tunnel, *Reconciler) {
	log := slog.New(slog.DiscardHandler)
	ld := loadertest.Load(t, loadertest.TempBPFFS(t))
	t.Cleanup(func() { ld.Close() })
	tun, certs := netnstest.FileCATunnel(t, log)
	rec := NewReconciler(ld, tun, netns.DefaultFinder(), log)
	a := New(Config{Node: "node1", TrustDomain: "cluster.local", ReconcilePeriod: time.Hour, Tunnel: tun, Loader: ld, Reconciler: rec, Certs: certs, Logger: log})
	return a, ld, tun, rec
}

// TestNoListenersAfterDrain: a pod queued before SIGTERM is not served
// again by a worker once the tunnel drained (seen failing before the
// workers stopped at shutdown and the tunnel refused to serve while
// draining: the worker reopened the listeners).
func TestNoListenersAfterDrain(t *testing.T) {
	tp := netnstest.New(t, 1)
	pod := tp.Nodes[0].AddPod("p")
	a, _, tun, _ := testAgent(t)
	w := &workload.Workload{Name: "p", Namespace: "shop", UID: "uid-p", ServiceAccount: "default", Node: "node1", Addrs: pod.Addrs(), Enrolled: true, Reason: "test"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
	a.applyLatest(context.Background(), false) // queues uid-p
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	a.queue.ShutDown() // Run's defer
	dctx, dcancel := context.WithTimeout(context.Background(), time.Second)
	defer dcancel()
	tun.Drain(dctx, nil)
	if got := tun.ServedPods(); len(got) != 0 {
		t.Fatalf("served after drain: %v", got)
	}
	// What the worker goroutine does next.
	for a.processNext(ctx) {
	}
	if got := tun.ServedPods(); len(got) != 0 {
		t.Errorf("after Drain a worker opened listeners again for %v", got)
	}
}

// TestCNIAddWaitsForItsSandbox: a CNI ADD for a pod whose uid is still
// attached in its old sandbox is not answered "enrolled" until the new
// sandbox is attached (seen failing when the ADD only asked whether the
// uid had any attachment).
func TestCNIAddWaitsForItsSandbox(t *testing.T) {
	tp := netnstest.New(t, 1)
	oldSandbox, newSandbox := tp.Nodes[0].AddPod("old"), tp.Nodes[0].AddPod("new")
	a, ld, _, rec := testAgent(t)
	ctx := context.Background()
	// The old sandbox is attached under the pod's uid.
	if res := rec.Reconcile(ctx, []loader.Pod{{UID: "uid-p", Namespace: "shop", Name: "p", NetNS: oldSandbox.Path(), Addrs: oldSandbox.Addrs(), CaptureInbound: true}}, true); len(res.Errors) > 0 {
		t.Fatal(res.Errors)
	}
	// The source knows the pod, selected, no IP yet.
	w := &workload.Workload{Name: "p", Namespace: "shop", UID: "uid-p", ServiceAccount: "default", Node: "node1", Pending: "ns label", Reason: "pod has no IP yet"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
	var ips []netip.Prefix
	for _, ad := range newSandbox.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	runWorker(t, a) // converges the pod meanwhile, as in the agent
	resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", NetNS: newSandbox.Path(), IPs: ips})
	st, _, _ := ld.PodState("uid-p")
	t.Logf("resp=%+v err=%v attached netns=%s (new sandbox %s)", resp, err, st.Meta.NetNS, newSandbox.Path())
	if err != nil || !resp.Enrolled {
		t.Fatalf("CNI ADD: %+v, %v; want enrolled once the new sandbox is attached", resp, err)
	}
	if st.Meta.NetNS != newSandbox.Path() {
		t.Errorf("CNI ADD answered enrolled while the pod is attached only in its old sandbox")
	}
}

// TestCNIAddNewSandboxWhileAPIHasOldAddress: a pod whose sandbox is
// recreated (a runtime restart, a crashed pause container) gets a new
// address while the API still has the old one: the kubelet reports the new
// address only after the ADD succeeded. The new sandbox is attached at the
// address the CNI plugin reported (before: at the API's old address, so the
// pod's traffic from its real address was dropped as unenrolled until the
// API caught up).
func TestCNIAddNewSandboxWhileAPIHasOldAddress(t *testing.T) {
	tp := netnstest.New(t, 1)
	oldSandbox, newSandbox := tp.Nodes[0].AddPod("old"), tp.Nodes[0].AddPod("new")
	a, ld, _, rec := testAgent(t)
	ctx := context.Background()
	if res := rec.Reconcile(ctx, []loader.Pod{{UID: "uid-p", Namespace: "shop", Name: "p", NetNS: oldSandbox.Path(), Addrs: oldSandbox.Addrs(), CaptureInbound: true}}, true); len(res.Errors) > 0 {
		t.Fatal(res.Errors)
	}
	// The source (the API) still has the old sandbox's address.
	w := &workload.Workload{Name: "p", Namespace: "shop", UID: "uid-p", ServiceAccount: "default", Node: "node1", Addrs: oldSandbox.Addrs(), Enrolled: true, Reason: "ns label"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
	var ips []netip.Prefix
	for _, ad := range newSandbox.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	runWorker(t, a)
	resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", NetNS: newSandbox.Path(), IPs: ips})
	if err != nil || !resp.Enrolled {
		t.Fatalf("CNI ADD: %+v, %v; want enrolled", resp, err)
	}
	st, _, err := ld.PodState("uid-p")
	if err != nil {
		t.Fatal(err)
	}
	if st.Meta.NetNS != newSandbox.Path() || fmt.Sprint(st.Meta.Addrs) != fmt.Sprint(newSandbox.Addrs()) {
		t.Errorf("attached in %s at %v; want the new sandbox %s at the CNI's %v", st.Meta.NetNS, st.Meta.Addrs, newSandbox.Path(), newSandbox.Addrs())
	}
}

// recAnn records the annotation changes asked for.
type recAnn struct{ calls []string }

func (r *recAnn) SetRedirection(_ context.Context, ns, name, _ string, enabled bool) error {
	r.calls = append(r.calls, ns+"/"+name+map[bool]string{true: "=enabled", false: "=removed"}[enabled])
	return nil
}

// TestAnnotationKeptOnNameReuse: a StatefulSet pod recreated under the
// same name keeps its redirection annotation when the worker detaches the
// old uid (seen failing when the detach looked the pod up by name).
func TestAnnotationKeptOnNameReuse(t *testing.T) {
	tp := netnstest.New(t, 1)
	oldP, newP := tp.Nodes[0].AddPod("old"), tp.Nodes[0].AddPod("new")
	a, _, _, rec := testAgent(t)
	ann := &recAnn{}
	a.cfg.Annotator = ann
	ctx := context.Background()
	if res := rec.Reconcile(ctx, []loader.Pod{
		{UID: "uid-old", Namespace: "shop", Name: "web-0", NetNS: oldP.Path(), Addrs: oldP.Addrs(), CaptureInbound: true},
		{UID: "uid-new", Namespace: "shop", Name: "web-0", NetNS: newP.Path(), Addrs: newP.Addrs(), CaptureInbound: true},
	}, true); len(res.Errors) > 0 {
		t.Fatal(res.Errors)
	}
	w := &workload.Workload{Name: "web-0", Namespace: "shop", UID: "uid-new", ServiceAccount: "default", Node: "node1", Addrs: newP.Addrs(), Enrolled: true, Reason: "x", Redirected: true}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
	a.applyLatest(ctx, false)
	a.queue.Add("uid-old") // the old pod left the snapshot
	for a.queue.Len() > 0 {
		a.processNext(ctx)
	}
	a.writeAnnotations(ctx)
	t.Logf("annotation calls: %v", ann.calls)
	for _, c := range ann.calls {
		if c == "shop/web-0=removed" {
			t.Errorf("the new attached pod's annotation was removed by the old uid's detach")
		}
	}
}
