package nodeagent

import (
	"context"
	"errors"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// hungAnnotator stands for an API server that takes requests and never
// answers (a dead load balancer in front of it): each call waits for its
// context.
type hungAnnotator struct{ calls atomic.Int64 }

func (h *hungAnnotator) SetRedirection(ctx context.Context, _, _, _ string, _ bool) error {
	h.calls.Add(1)
	<-ctx.Done()
	return ctx.Err()
}

// TestCNIAddDoesNotWaitForTheAPIServer: the redirection annotation is the
// API server's business, not the CNI ADD's. With the API server hung, and
// an enrolled pod whose annotation is not written yet, an ADD of another
// pod (one the agent answers at once: of an excluded namespace) is
// answered at once, and another pod of the mesh is enrolled (seen failing:
// every apply, the one each ADD and DEL makes included, patched the
// annotations under the agent's lock, so each ADD waited for the API
// server until its plugin gave up, and no pod of the node, in the mesh or
// not, could start; and a pod worker patched the annotation of the pod it
// converged, so with the workers held no pod was enrolled).
func TestCNIAddDoesNotWaitForTheAPIServer(t *testing.T) {
	tp := netnstest.New(t, 1)
	sandbox, dns, other := tp.Nodes[0].AddPod("p"), tp.Nodes[0].AddPod("coredns"), tp.Nodes[0].AddPod("r")
	a, ld, _, _ := testAgent(t)
	api := &hungAnnotator{}
	a.cfg.Annotator = api
	a.cfg.Selection.ExcludeNamespaces = []string{"kube-system"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p"), pendingPod("r", "uid-r")}})
	ctx := runWorker(t, a)
	go a.runAnnotations(ctx)
	prefixes := func(p *netnstest.Pod) []netip.Prefix {
		var out []netip.Prefix
		for _, ad := range p.Addrs() {
			out = append(out, netip.PrefixFrom(ad, ad.BitLen()))
		}
		return out
	}
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if resp, err := a.HandleCNI(actx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c1", NetNS: sandbox.Path(), IPs: prefixes(sandbox)}); err != nil || !resp.Enrolled {
		t.Fatalf("ADD of p: %+v, %v", resp, err)
	}
	if _, attached, _ := ld.PodState("uid-p"); !attached {
		t.Fatal("p not attached")
	}
	start := time.Now()
	dctx, dcancel := context.WithTimeout(ctx, 5*time.Second)
	defer dcancel()
	resp, err := a.HandleCNI(dctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "coredns-1", PodNamespace: "kube-system", PodUID: "uid-dns", ContainerID: "c-dns", NetNS: dns.Path(), IPs: prefixes(dns)})
	took := time.Since(start)
	if err != nil || resp.Enrolled {
		t.Errorf("ADD of an excluded namespace's pod: %+v, %v; want answered, not enrolled", resp, err)
	}
	if took > 2*time.Second {
		t.Errorf("the ADD took %v with the API server hung (%d annotation calls), want it answered at once", took.Round(time.Millisecond), api.calls.Load())
	}
	// Nor do the pod workers wait for it: another pod of the mesh is
	// enrolled (the test runs one worker).
	rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
	defer rcancel()
	start = time.Now()
	if resp, err := a.HandleCNI(rctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "r", PodNamespace: "shop", PodUID: "uid-r", ContainerID: "c-r", NetNS: other.Path(), IPs: prefixes(other)}); err != nil || !resp.Enrolled {
		t.Errorf("ADD of r with the API server hung: %+v, %v after %v; want enrolled", resp, err, time.Since(start).Round(time.Millisecond))
	}
	if api.calls.Load() == 0 {
		t.Error("no annotation was tried")
	}
}

// brokenSource fails at once.
type brokenSource struct{}

func (brokenSource) Run(context.Context, func(source.Snapshot)) error {
	return errors.New("source broke")
}

// TestCloseAfterSourceFailure: Run returns with its source's error while
// its context lives on, and Close, which waits for what Run started (the
// annotation writer included), returns.
func TestCloseAfterSourceFailure(t *testing.T) {
	a, _, _, _ := testAgent(t)
	a.cfg.Annotator = &hungAnnotator{}
	if err := a.Run(t.Context(), brokenSource{}); err == nil {
		t.Fatal("Run with a broken source returned nil")
	}
	closed := make(chan struct{})
	go func() { a.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return after Run failed")
	}
}
