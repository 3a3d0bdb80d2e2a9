package nodeagent

import (
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestCNIBadAddKeepsEnrolledPod: an ADD for a pod that is enrolled and
// attached, naming its own namespace but with addresses that are not the
// pod's (loopback, link-local, or not configured there), is refused at once
// with an error naming the prevResult entry, and the pod stays attached and
// enrolled with its addresses (seen failing: the report replaced the pod's
// addresses, a loopback one sent it back to pending and it was detached, so
// a running meshed pod went on in plaintext; a foreign one made the ADD wait
// 20 s and the directory name the pod by that address).
func TestCNIBadAddKeepsEnrolledPod(t *testing.T) {
	tp := netnstest.New(t, 1)
	sandbox := tp.Nodes[0].AddPod("p")
	a, ld, _, _ := testAgent(t)
	w := &workload.Workload{Name: "p", Namespace: "shop", UID: "uid-p", ServiceAccount: "default", Node: "node1", Addrs: sandbox.Addrs(), Enrolled: true, Reason: "ambient"}
	other := tp.Nodes[0].AddPod("q")
	q := &workload.Workload{Name: "q", Namespace: "other", UID: "uid-q", ServiceAccount: "default", Node: "node1", Reason: "namespace not ambient"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w, q}})
	ctx := runWorker(t, a)
	var ips []netip.Prefix
	for _, ad := range sandbox.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	if resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c1", NetNS: sandbox.Path(), IPs: ips}); err != nil || !resp.Enrolled {
		t.Fatalf("ADD: %+v, %v", resp, err)
	}
	// A pod outside the mesh still starts: its addresses are not used.
	if resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "q", PodNamespace: "other", PodUID: "uid-q", ContainerID: "cq", NetNS: other.Path(), IPs: []netip.Prefix{netip.MustParsePrefix("127.0.0.5/8")}}); err != nil || resp.Enrolled {
		t.Errorf("ADD of an unselected pod with a loopback address: %+v, %v; want not enrolled, no error", resp, err)
	}
	for _, bad := range [][]netip.Prefix{
		{netip.MustParsePrefix("10.254.254.254/32")},
		{netip.MustParsePrefix("127.0.0.5/8")},
		append(ips, netip.MustParsePrefix("fe80::1/64")),
	} {
		start := time.Now()
		resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c1", NetNS: sandbox.Path(), IPs: bad})
		t.Logf("ADD with %v: %+v, %v", bad, resp, err)
		if err == nil {
			t.Errorf("ADD with %v succeeded", bad)
		} else if !strings.Contains(err.Error(), "prevResult ips[") {
			t.Errorf("ADD with %v: error %q does not name the prevResult entry", bad, err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("ADD with %v took %s to be refused", bad, d)
		}
		// Let the workers act on what the ADD changed.
		time.Sleep(300 * time.Millisecond)
		for a.queue.Len() > 0 {
			time.Sleep(50 * time.Millisecond)
		}
		if _, attached, _ := ld.PodState("uid-p"); !attached {
			t.Fatalf("after an ADD with %v the enrolled pod is detached", bad)
		}
		if w, ok := a.cfg.Tunnel.State().Dir.Pod("shop", "p"); !ok || !w.Enrolled || !sameAddrs(w.Addrs, sandbox.Addrs()) {
			t.Errorf("after an ADD with %v the directory has the pod as %+v, want enrolled with %v", bad, w, sandbox.Addrs())
		}
	}
}

// TestCNIRefusesUncleanMappedNetNS: with the host's /proc mounted elsewhere
// (the chart's /host/proc), a CNI_NETNS under /proc/ that is not clean is
// refused with an error naming it, as it is without the mount (seen
// failing: "/proc/../../var/run/netns/x" was mapped out of the mount,
// cleaned on the way, and the pod enrolled there).
func TestCNIRefusesUncleanMappedNetNS(t *testing.T) {
	tp := netnstest.New(t, 1)
	sandbox := tp.Nodes[0].AddPod("p")
	a, ld, _, _ := testAgent(t)
	a.cfg.ProcDir = "/host/proc"
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p")}})
	ctx := runWorker(t, a)
	var ips []netip.Prefix
	for _, ad := range sandbox.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	path := "/proc/../.." + sandbox.Path()
	resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c1", NetNS: path, IPs: ips})
	t.Logf("ADD naming %s: %+v, %v", path, resp, err)
	if err == nil || resp.Enrolled {
		t.Fatalf("ADD naming %s: %+v, %v; want refused", path, resp, err)
	}
	if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "clean") {
		t.Errorf("error %q does not name the path and what is wrong with it", err)
	}
	if _, attached, _ := ld.PodState("uid-p"); attached {
		t.Errorf("the pod is attached")
	}
}

// TestCNIRefusesDeletedPodsLiveNamespace: after pod b's DEL, while b's
// namespace still exists, an ADD for pod a naming it is refused with an
// error naming b, as it is before the DEL (seen failing: a was enrolled in
// b's namespace, and a loop of ADD and DEL under new names piled up one
// report each for as long as the namespace lived).
func TestCNIRefusesDeletedPodsLiveNamespace(t *testing.T) {
	tp := netnstest.New(t, 1)
	nsB := tp.Nodes[0].AddPod("b")
	a, ld, _, _ := testAgent(t)
	b := &workload.Workload{Name: "b", Namespace: "other", UID: "uid-b", ServiceAccount: "default", Node: "node1", Addrs: nsB.Addrs(), Reason: "namespace not ambient"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("a", "uid-a"), b}})
	ctx := runWorker(t, a)
	var ips []netip.Prefix
	for _, ad := range nsB.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	if resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "b", PodNamespace: "other", PodUID: "uid-b", ContainerID: "cb", NetNS: nsB.Path(), IPs: ips}); err != nil || resp.Enrolled {
		t.Fatalf("ADD b: %+v, %v", resp, err)
	}
	if _, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandDel, PodName: "b", PodNamespace: "other", PodUID: "uid-b", ContainerID: "cb", NetNS: nsB.Path()}); err != nil {
		t.Fatalf("DEL b: %v", err)
	}
	resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "a", PodNamespace: "shop", PodUID: "uid-a", ContainerID: "ca", NetNS: nsB.Path(), IPs: ips})
	t.Logf("ADD a in b's namespace after b's DEL: %+v, %v", resp, err)
	if err == nil || resp.Enrolled {
		t.Errorf("ADD a naming b's live namespace after b's DEL: %+v, %v; want refused", resp, err)
	} else if !strings.Contains(err.Error(), "other/b") {
		t.Errorf("error %q does not name pod other/b", err)
	}
	if _, attached, _ := ld.PodState("uid-a"); attached {
		t.Errorf("pod a is attached in b's namespace")
	}
	if n := a.CNIReports(); n != 1 {
		t.Errorf("%d CNI reports for one namespace", n)
	}
}

// TestCNIConcurrentAddsForOnePod: two ADDs for one pod from two sandboxes
// (a runtime that retried a sandbox while the first ADD still waited) both
// wait for the source; once the pod is attached in the second sandbox, the
// first ADD fails naming the second container instead of answering
// "enrolled" (seen failing: both answered enrolled, so the first sandbox
// would start its containers unmeshed).
func TestCNIConcurrentAddsForOnePod(t *testing.T) {
	tp := netnstest.New(t, 1)
	nsA, nsB := tp.Nodes[0].AddPod("a"), tp.Nodes[0].AddPod("b")
	a, ld, _, _ := testAgent(t)
	a.setSnapshot(source.Snapshot{})
	ctx := runWorker(t, a)
	prefixes := func(addrs []netip.Addr) (out []netip.Prefix) {
		for _, ad := range addrs {
			out = append(out, netip.PrefixFrom(ad, ad.BitLen()))
		}
		return out
	}
	type result struct {
		resp cni.Response
		err  error
	}
	add := func(container string, ns *netnstest.Pod) <-chan result {
		ch := make(chan result, 1)
		go func() {
			resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: container, NetNS: ns.Path(), IPs: prefixes(ns.Addrs())})
			ch <- result{resp, err}
		}()
		return ch
	}
	// Each ADD's report is waited for, not slept for: an ADD checks its
	// namespace and addresses (netlink in the pod's namespace) before it
	// records the report, and a loaded VM could let c2's report in first,
	// making c1 the current sandbox.
	reported := func(container string) {
		t.Helper()
		waitfor.Until(t, "the report of container "+container, func() bool {
			a.mu.Lock()
			defer a.mu.Unlock()
			return a.cniPods["shop/p"].container == container
		})
	}
	first := add("c1", nsA)
	reported("c1") // the source does not know the pod: c1's ADD waits
	second := add("c2", nsB)
	reported("c2")
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p")}})
	a.applyLatest(ctx, false)
	r1, r2 := <-first, <-second
	t.Logf("ADD c1: %+v, %v; ADD c2: %+v, %v", r1.resp, r1.err, r2.resp, r2.err)
	if r2.err != nil || !r2.resp.Enrolled {
		t.Errorf("ADD of the current sandbox c2: %+v, %v; want enrolled", r2.resp, r2.err)
	}
	if r1.err == nil || r1.resp.Enrolled {
		t.Errorf("ADD of the superseded sandbox c1: %+v, %v; want refused", r1.resp, r1.err)
	} else if !strings.Contains(r1.err.Error(), "c2") {
		t.Errorf("error %q does not name the container that superseded it", r1.err)
	}
	if st, _, _ := ld.PodState("uid-p"); st.Meta.NetNS != nsB.Path() {
		t.Errorf("attached in %q, want the current sandbox %s", st.Meta.NetNS, nsB.Path())
	}
}

// TestCNICheckOfOtherSandboxFails: a CHECK naming a namespace the pod is
// not attached in (an earlier or stray sandbox of the pod) fails naming
// both namespaces, and a CHECK of the attached one passes (seen failing:
// the CHECK passed because the pod was attached somewhere).
func TestCNICheckOfOtherSandboxFails(t *testing.T) {
	tp := netnstest.New(t, 1)
	nsA, nsB := tp.Nodes[0].AddPod("a"), tp.Nodes[0].AddPod("b")
	a, _, _, _ := testAgent(t)
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p")}})
	ctx := runWorker(t, a)
	var ips []netip.Prefix
	for _, ad := range nsB.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	if resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c2", NetNS: nsB.Path(), IPs: ips}); err != nil || !resp.Enrolled {
		t.Fatalf("ADD: %+v, %v", resp, err)
	}
	resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandCheck, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c1", NetNS: nsA.Path()})
	t.Logf("CHECK of %s: %+v, %v", nsA.Path(), resp, err)
	if err == nil {
		t.Errorf("CHECK of a sandbox the pod is not attached in passed: %+v", resp)
	} else if !strings.Contains(err.Error(), nsA.Path()) || !strings.Contains(err.Error(), nsB.Path()) {
		t.Errorf("error %q does not name both namespaces", err)
	}
	if resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandCheck, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c2", NetNS: nsB.Path()}); err != nil || !resp.Enrolled {
		t.Errorf("CHECK of the attached sandbox: %+v, %v", resp, err)
	}
}

// TestCNIAddOfSecondInterfaceKeepsPrimary: with the plugin chained into a
// second network too (Multus runs a network attachment's chain with
// CNI_IFNAME net1 after the pod's eth0 one), the ADD of net1 does not
// replace the pod's report: it is answered as a CHECK of the sandbox, and
// the pod stays enrolled, attached and in the directory with its eth0
// addresses (seen failing: net1's address replaced the pod's eth0 ones in
// the directory, the attach on eth0 failed for want of it, and the net1
// ADD failed after 20 s, so the runtime tore the sandbox down and the pod
// never started). A selected pod whose eth0 ADD did not enroll it fails
// such an ADD naming CNI_IFNAME. The DEL of net1 (the interface unplugged
// from the running pod) leaves the pod's report: before, it marked it
// deleted, and a pod whose address the source did not have yet was
// detached.
func TestCNIAddOfSecondInterfaceKeepsPrimary(t *testing.T) {
	tp := netnstest.New(t, 1)
	sandbox := tp.Nodes[0].AddPod("p")
	second := netip.MustParsePrefix("192.168.77.5/24")
	for _, args := range [][]string{
		{"link", "add", "net1", "type", "veth", "peer", "name", "net1peer"},
		{"addr", "add", second.String(), "dev", "net1"},
		{"link", "set", "net1", "up"},
	} {
		if out, err := exec.Command("ip", append([]string{"-n", sandbox.NS}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	a, ld, _, _ := testAgent(t)
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p")}})
	ctx := runWorker(t, a)
	var ips []netip.Prefix
	for _, ad := range sandbox.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	ev := cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c1", NetNS: sandbox.Path(), IfName: "eth0", IPs: ips}
	if resp, err := a.HandleCNI(ctx, ev); err != nil || !resp.Enrolled {
		t.Fatalf("ADD of eth0: %+v, %v", resp, err)
	}
	net1 := ev
	net1.IfName, net1.IPs = "net1", []netip.Prefix{second}
	start := time.Now()
	resp, err := a.HandleCNI(ctx, net1)
	if err != nil || !resp.Enrolled {
		t.Errorf("ADD of net1 after eth0's enrolled the pod: %+v, %v (after %s); want enrolled", resp, err, time.Since(start).Round(time.Millisecond))
	}
	time.Sleep(300 * time.Millisecond)
	for a.queue.Len() > 0 {
		time.Sleep(50 * time.Millisecond)
	}
	if st, attached, _ := ld.PodState("uid-p"); !attached || !sameAddrs(st.Meta.Addrs, sandbox.Addrs()) {
		t.Errorf("after the net1 ADD the pod is attached %v with %v, want attached with %v", attached, st.Meta.Addrs, sandbox.Addrs())
	}
	if w, ok := a.cfg.Tunnel.State().Dir.Pod("shop", "p"); !ok || !w.Enrolled || !sameAddrs(w.Addrs, sandbox.Addrs()) {
		t.Errorf("after the net1 ADD the directory has the pod as %+v, want enrolled with %v", w, sandbox.Addrs())
	}
	// net1 unplugged from the running pod (Multus's dynamic networks): the
	// pod's eth0 report stays, and so does its enrollment.
	del := net1
	del.Command, del.IPs = cni.CommandDel, nil
	if _, err := a.HandleCNI(ctx, del); err != nil {
		t.Errorf("DEL of net1: %v", err)
	}
	time.Sleep(300 * time.Millisecond)
	for a.queue.Len() > 0 {
		time.Sleep(50 * time.Millisecond)
	}
	a.mu.Lock()
	rec := a.cniPods["shop/p"]
	a.mu.Unlock()
	if rec.deleted || !sameAddrs(rec.addrs, sandbox.Addrs()) {
		t.Errorf("after the net1 DEL the pod's report is %+v, want eth0's, not deleted", rec)
	}
	if _, attached, _ := ld.PodState("uid-p"); !attached {
		t.Errorf("after the net1 DEL the pod is detached")
	}

	// A selected pod whose eth0 ADD never came: the net1 ADD cannot enroll it.
	q := tp.Nodes[0].AddPod("q")
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p"), pendingPod("q", "uid-q")}})
	_, err = a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "q", PodNamespace: "shop", PodUID: "uid-q", ContainerID: "c2", NetNS: q.Path(), IfName: "net1", IPs: []netip.Prefix{netip.PrefixFrom(q.IPv4, 32)}})
	if err == nil || !strings.Contains(err.Error(), "net1") || !strings.Contains(err.Error(), "CNI_IFNAME") {
		t.Errorf("net1 ADD of a pod not enrolled: err = %v, want refused naming CNI_IFNAME net1", err)
	}
}
