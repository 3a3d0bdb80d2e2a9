package nodeagent

import (
	"context"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestDNSCaptureAnnotationFlipsFlag: changing a running pod's
// ambient.istio.io/dns-capture choice re-attaches it with the capture
// flag of its addresses flipped, whether the change arrives between full
// passes (queued, converged by a worker) or at one; and unset follows the
// node's setting.
func TestDNSCaptureAnnotationFlipsFlag(t *testing.T) {
	tp := netnstest.New(t, 1)
	pod := tp.Nodes[0].AddPod("p")
	a, ld, _, _ := testAgent(t)
	a.cfg.DNSCapture = true
	ctx := context.Background()
	a.mu.Lock()
	a.cniPods["shop/p"] = cniPod{uid: "uid-p", netns: pod.Path()}
	a.mu.Unlock()
	w := workload.Workload{Name: "p", Namespace: "shop", UID: "uid-p", ServiceAccount: "default", Node: "node1", Addrs: pod.Addrs(), Enrolled: true, Reason: "test"}

	check := func(step string, want bool) {
		t.Helper()
		for _, addr := range pod.Addrs() {
			s, ok, err := ld.Maps().Pod(addr)
			if err != nil || !ok {
				t.Fatalf("%s: no entry for %s: %v", step, addr, err)
			}
			if s.CaptureDNS != want || !s.CaptureOutbound || !s.CaptureInbound {
				t.Fatalf("%s: entry of %s = %+v, want DNS capture %v (outbound and inbound on)", step, addr, s, want)
			}
		}
		st, ok, err := ld.PodState("uid-p")
		if err != nil || !ok || st.Meta.Settings.CaptureDNS != want {
			t.Fatalf("%s: recorded settings %+v (%v, %v), want DNS capture %v", step, st.Meta.Settings, ok, err, want)
		}
	}
	set := func(c workload.Choice, full bool) {
		t.Helper()
		v := w
		v.DNSCapture = c
		a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{&v}})
		a.applyLatest(ctx, full)
		if !full {
			for a.queue.Len() > 0 {
				a.processNext(ctx)
			}
		}
	}

	set(workload.ChoiceUnset, true)
	check("unset, node on", true)
	set(workload.ChoiceOff, false)
	check("annotated false (queued)", false)
	set(workload.ChoiceOn, false)
	check("annotated true (queued)", true)
	set(workload.ChoiceOff, true)
	check("annotated false (full pass)", false)
	set(workload.ChoiceUnset, true)
	check("annotation removed (full pass)", true)
}
