package nodeagent

import (
	"context"
	"log/slog"
	"net/netip"
	"os/exec"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/internal/syncbuf"
	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestOneLocalPodPerAddress: two enrolled pods of this node with one
// address are never both attached. The pod attached first keeps the
// address, though the newcomer sorts first by name; the newcomer is
// refused with an error naming both pods and the address, shown as not
// enrolled in the directory, which names the owner at the address, and its
// CNI ADD fails rather than start it unmeshed. The entry does not flap
// over full passes. Once the owner is terminating, the other pod takes the
// address, once. Before, both were attached and each pass took the entry
// from one to give it to the other.
func TestOneLocalPodPerAddress(t *testing.T) {
	tp := netnstest.New(t, 1)
	p, q := tp.Nodes[0].AddPod("p"), tp.Nodes[0].AddPod("q")
	if out, err := exec.Command("ip", "-n", p.NS, "addr", "add", q.IPv4.String()+"/32", "dev", "eth0").CombinedOutput(); err != nil {
		t.Fatalf("give p q's address: %v %s", err, out)
	}
	a, ld, tun, _ := testAgent(t)
	var logs syncbuf.Buffer
	a.log = slog.New(slog.NewTextHandler(&logs, nil))
	ctx := context.Background()
	// b (in q) is enrolled and attached first; then a (in p) appears
	// with b's IPv4 address as well as its own, and inbound capture off
	// (so that the flags of the entry tell the two apart).
	b := &workload.Workload{Name: "b", Namespace: "shop", UID: "uid-b", ServiceAccount: "default", Node: "node1", Addrs: q.Addrs(), Enrolled: true, Reason: "test"}
	aw := &workload.Workload{Name: "a", Namespace: "shop", UID: "uid-a", ServiceAccount: "default", Node: "node1",
		Addrs: []netip.Addr{p.IPv4, q.IPv4}, Enrolled: true, Reason: "test", BypassInbound: true}
	a.mu.Lock()
	a.cniPods["shop/a"] = cniPod{uid: "uid-a", netns: p.Path()}
	a.cniPods["shop/b"] = cniPod{uid: "uid-b", netns: q.Path()}
	a.mu.Unlock()
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{b}})
	a.applyLatest(ctx, true)
	bState, ok, err := ld.PodState("uid-b")
	if err != nil || !ok {
		t.Fatalf("b not attached: %v", err)
	}

	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{aw, b}})
	for pass := range 3 {
		logs.Take()
		a.applyLatest(ctx, true)
		if _, ok, _ := ld.PodState("uid-a"); ok {
			t.Fatalf("pass %d: a attached at b's address too", pass)
		}
		if s, ok, err := ld.Maps().Pod(q.IPv4); err != nil || !ok || s.PodID != bState.ID || !s.CaptureInbound {
			t.Fatalf("pass %d: entry of %s = %+v %v %v, want b's (id %d, inbound capture on)", pass, q.IPv4, s, ok, err, bState.ID)
		}
		if out := logs.Take(); !strings.Contains(out, "pod shop/a not enrolled: address "+q.IPv4.String()+" belongs to pod shop/b (already attached)") {
			t.Errorf("pass %d: log does not name both pods and the address:\n%s", pass, out)
		}
	}
	dir := tun.State().Dir
	if w, ok := dir.ByAddr(q.IPv4); !ok || w.Name != "b" {
		t.Errorf("directory at %s: %v, want shop/b", q.IPv4, w)
	}
	if w, ok := dir.Pod("shop", "a"); !ok || w.Enrolled || !strings.Contains(w.Reason, "belongs to pod shop/b") {
		t.Errorf("shop/a in the directory: %+v, want not enrolled with the reason", w)
	}
	var ips []netip.Prefix
	for _, ad := range aw.Addrs {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	if resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "a", PodNamespace: "shop", PodUID: "uid-a", NetNS: p.Path(), IPs: ips}); err == nil || !strings.Contains(err.Error(), "belongs to pod shop/b") {
		t.Errorf("CNI ADD of the refused pod: %+v, %v; want an error naming the owner", resp, err)
	}

	// b is being deleted: its address now is a's.
	bt := *b
	bt.Terminating = true
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{aw, &bt}})
	for pass := range 3 {
		a.applyLatest(ctx, true)
		aState, ok, _ := ld.PodState("uid-a")
		if !ok {
			t.Fatalf("pass %d: a not attached once b is terminating", pass)
		}
		if _, ok, _ := ld.PodState("uid-b"); ok {
			t.Fatalf("pass %d: b still attached", pass)
		}
		if s, ok, err := ld.Maps().Pod(q.IPv4); err != nil || !ok || s.PodID != aState.ID || s.CaptureInbound {
			t.Fatalf("pass %d: entry of %s = %+v %v %v, want a's (id %d, inbound capture off)", pass, q.IPv4, s, ok, err, aState.ID)
		}
	}
}

// TestRemotePodNeverTakesLocalPodsAddress: an object of another node
// claiming the address of an enrolled pod of this node (a hostile node
// writing its pod's status.podIPs, or a stale object) does not take that
// address in this node's directory. Before, the directory kept the first
// by namespace and name among two enrolled claimants, so a remote pod in a
// namespace that sorts first ("aaa") became the workload at the local
// pod's address: the local pod's inbound connections were judged by the
// remote pod's namespace, labels and policies (its own STRICT and DENY
// policies no longer applied), and its outbound failed as a foreign
// source. The remote object keeps its other addresses, the error names
// both, and the local pod stays attached.
func TestRemotePodNeverTakesLocalPodsAddress(t *testing.T) {
	tp := netnstest.New(t, 1)
	p := tp.Nodes[0].AddPod("p")
	a, ld, tun, _ := testAgent(t)
	var logs syncbuf.Buffer
	a.log = slog.New(slog.NewTextHandler(&logs, nil))
	ctx := context.Background()
	web := &workload.Workload{Name: "web", Namespace: "prod", UID: "uid-web", ServiceAccount: "web", Node: "node1", Addrs: p.Addrs(), Enrolled: true, Reason: "test",
		Labels: map[string]string{"app": "web"}}
	other := netip.MustParseAddr("10.250.0.7")
	intruder := &workload.Workload{Name: "intruder", Namespace: "aaa", UID: "uid-x", ServiceAccount: "default", Node: "node2",
		Addrs: []netip.Addr{p.IPv4, other}, Enrolled: true, Reason: "test"}
	a.mu.Lock()
	a.cniPods["prod/web"] = cniPod{uid: "uid-web", netns: p.Path()}
	a.mu.Unlock()
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{intruder, web}})
	for pass := range 2 {
		logs.Take()
		a.applyLatest(ctx, true)
		if _, ok, err := ld.PodState("uid-web"); err != nil || !ok {
			t.Fatalf("pass %d: web not attached: %v", pass, err)
		}
		dir := tun.State().Dir
		for _, ad := range p.Addrs() {
			if w, ok := dir.ByAddr(ad); !ok || w.Key() != "uid-web" {
				t.Errorf("pass %d: directory at %s: %v, want this node's pod prod/web", pass, ad, w)
			}
		}
		if w, ok := dir.ByAddr(other); !ok || w.Name != "intruder" {
			t.Errorf("pass %d: directory at %s: %v, want aaa/intruder (its other address)", pass, other, w)
		}
		if out := logs.Take(); !strings.Contains(out, "aaa/intruder") || !strings.Contains(out, "prod/web") || !strings.Contains(out, p.IPv4.String()) {
			t.Errorf("pass %d: log does not name both pods and the address:\n%s", pass, out)
		}
	}
}
