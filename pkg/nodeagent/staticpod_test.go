package nodeagent

import (
	"net/netip"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestStaticPodEnrolledAtCNIAdd: a static pod in an ambient namespace is
// enrolled at its CNI ADD, and its CHECK passes, as Istio enrolls it. The
// API has it as a mirror pod, with a UID of the API server's; the runtime
// reports the static pod's own (K8S_POD_UID). Before, the ADD took the
// source's pod for an earlier pod of the name, waited 20 s and failed, and
// the kubelet retried for ever: the static pod never started. With the
// pod keyed by name, its CHECK then took its own namespace for another
// pod's.
func TestStaticPodEnrolledAtCNIAdd(t *testing.T) {
	tp := netnstest.New(t, 1)
	sandbox := tp.Nodes[0].AddPod("static")
	a, _, _, _ := testAgent(t)
	ns := corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "edge", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}
	mirror := corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "edge", Name: "probe-node1", UID: "9b1f7c52-api-server-uid",
			Annotations: map[string]string{kubeobj.MirrorPodAnnotation: "6c1a5e0e0b2e4c3f9d1e8a7b6c5d4e3f"}},
		Spec:   corev1.PodSpec{NodeName: "node1"},
		Status: corev1.PodStatus{Phase: corev1.PodPending},
	}
	w, err := kubeobj.Pod(selection.Config{}, &ns, &mirror, nil)
	if err != nil || w.Pending == "" {
		t.Fatalf("mirror pod: %+v, %v; want selected, pending its address", w, err)
	}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
	var ips []netip.Prefix
	for _, ad := range sandbox.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	ctx := runWorker(t, a)
	ev := cni.PodEvent{Command: cni.CommandAdd, PodName: "probe-node1", PodNamespace: "edge",
		PodUID: "6c1a5e0e0b2e4c3f9d1e8a7b6c5d4e3f", ContainerID: "c1", NetNS: sandbox.Path(), IPs: ips}
	if resp, err := a.HandleCNI(ctx, ev); err != nil || !resp.Enrolled {
		t.Fatalf("ADD of the static pod: %+v, %v; want enrolled", resp, err)
	}
	ev.Command, ev.IPs = cni.CommandCheck, nil
	if resp, err := a.HandleCNI(ctx, ev); err != nil || !resp.Enrolled {
		t.Errorf("CHECK of the static pod: %+v, %v; want enrolled", resp, err)
	}
}
