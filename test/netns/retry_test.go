package netnstest

import (
	"context"
	"net/netip"
	"path/filepath"
	"testing"
	"time"
)

// TestPodRetriedWithoutFullPass: a pod whose attach fails (its addresses
// are not on any namespace yet, as when the source knows the pod before
// its network is configured) is retried by the node agent's work queue
// with backoff, and enrolled seconds after its address appears, with no
// new snapshot and the full reconcile an hour away. Before the per-pod
// queue it waited for the next snapshot or full pass. The retries are
// counted in redirector_pod_queue_retries_total.
func TestPodRetriedWithoutFullPass(t *testing.T) {
	tp := New(t, 1)
	pod := tp.Nodes[0].AddPod("late")
	ctx := context.Background()
	// The pod's addresses are taken off its interface: no namespace owns
	// them when the agent first tries.
	for _, a := range pod.Addrs() {
		if out, err := Exec(ctx, pod.Path(), "ip", "addr", "del", addrPrefixOf(a), "dev", "eth0"); err != nil {
			t.Fatalf("take %s off: %v %s", a, err, out)
		}
	}
	dir := t.TempDir()
	manifest, ca := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "ca")
	if err := (&Manifest{}).Namespace("shop", "istio.io/dataplane-mode=ambient").Pod(pod, "shop", "late").Write(manifest); err != nil {
		t.Fatal(err)
	}
	initCA(t, ca)
	ag := StartAgent(t, tp.Nodes[0], AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca, Args: []string{"--reconcile-period", "1h"}})
	ag.WaitLog(t, "no network namespace owns its addresses", 10*time.Second)
	// Let the backoff grow a little, then give the addresses back.
	time.Sleep(2 * time.Second)
	for _, a := range pod.Addrs() {
		if out, err := Exec(ctx, pod.Path(), "ip", "addr", "add", addrPrefixOf(a), "dev", "eth0", "nodad"); err != nil {
			t.Fatalf("give %s back: %v %s", a, err, out)
		}
	}
	waitEnrolled(t, ag.BPFRoot, 20*time.Second, "shop/late")
	if v := metric(t, ag, "redirector_pod_queue_retries_total"); v < 1 {
		t.Errorf("redirector_pod_queue_retries_total = %v, want the failed attempts counted", v)
	}
	if v := metric(t, ag, "redirector_pod_queue_depth"); v != 0 {
		t.Errorf("redirector_pod_queue_depth = %v once the pod is enrolled, want 0", v)
	}
}

// addrPrefixOf is a pod address with the prefix length the topology gives
// it on eth0.
func addrPrefixOf(a netip.Addr) string {
	if a.Is4() {
		return a.String() + "/24"
	}
	return a.String() + "/64"
}
