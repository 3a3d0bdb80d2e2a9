package nodeagent

import (
	"context"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// inOwnNetNS re-runs the calling test in a network namespace of its own
// (unshare --net) and reports whether this is that run. Tests that hand the
// agent its own namespace use it, so that nothing an unfixed agent does
// there (listeners, sysctls, programs) reaches the machine's.
func inOwnNetNS(t *testing.T) bool {
	t.Helper()
	const env = "REDIRECTOR_TEST_OWN_NETNS"
	if os.Getenv(env) == t.Name() {
		return true
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	cmd := exec.Command("unshare", "--net", os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), env+"="+t.Name())
	out, err := cmd.CombinedOutput()
	t.Logf("in a network namespace of its own:\n%s", out)
	if err != nil || !strings.Contains(string(out), "--- PASS: "+t.Name()) {
		t.Fatalf("the run in its own network namespace failed: %v", err)
	}
	return false
}

func pendingPod(name, uid string) *workload.Workload {
	return &workload.Workload{Name: name, Namespace: "shop", UID: uid, ServiceAccount: "default", Node: "node1",
		Pending: "namespace label istio.io/dataplane-mode=ambient", Reason: "pod has no IP yet"}
}

// TestCNIRefusesAgentNamespace: an ADD naming the agent's own network
// namespace (the host's: /proc/self/ns/net, or a symlink to it), with an
// address that is on the host's eth0, is refused at once with an error that
// names the path, and nothing is attached or served there (seen failing:
// the agent attached its programs to the host's eth0, turned rp_filter off
// and opened its listeners in the host namespace, and answered "enrolled").
func TestCNIRefusesAgentNamespace(t *testing.T) {
	if !inOwnNetNS(t) {
		return
	}
	// This namespace stands in for the host's: an eth0 with an address.
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", "eth0", "type", "veth", "peer", "name", "eth1"},
		{"link", "set", "eth1", "up"},
		{"addr", "add", "10.199.0.5/24", "dev", "eth0"},
		{"link", "set", "eth0", "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	link := filepath.Join(t.TempDir(), "netns-link")
	if err := os.Symlink("/proc/self/ns/net", link); err != nil {
		t.Fatal(err)
	}
	a, ld, tun, _ := testAgent(t)
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p")}})
	ctx := runWorker(t, a)
	for _, path := range []string{"/proc/self/ns/net", "/proc/thread-self/ns/net", link} {
		start := time.Now()
		resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p",
			ContainerID: "c1", NetNS: path, IPs: []netip.Prefix{netip.MustParsePrefix("10.199.0.5/24")}})
		t.Logf("ADD %s: %+v, %v (%s)", path, resp, err, time.Since(start))
		if err == nil || resp.Enrolled {
			t.Errorf("ADD naming the agent's own namespace %s: %+v, %v; want refused", path, resp, err)
		} else if !strings.Contains(err.Error(), path) {
			t.Errorf("ADD naming %s: error %q does not name the path", path, err)
		}
		if time.Since(start) > 5*time.Second {
			t.Errorf("ADD naming %s took %s to be refused", path, time.Since(start))
		}
		if _, attached, _ := ld.PodState("uid-p"); attached {
			t.Errorf("after ADD naming %s the pod is attached in the agent's namespace", path)
		}
		if served := tun.ServedPods(); len(served) > 0 {
			t.Errorf("after ADD naming %s the tunnel serves %v in the agent's namespace", path, served)
		}
	}
}

// TestCNIRefusesAnotherPodsNamespace: an ADD for pod a naming the network
// namespace (and addresses) of pod b, which the plugin reported before and
// which is not in the mesh, is refused with an error naming b: a would be
// attached there and b's traffic would leave with a's identity (seen
// failing: a was enrolled in b's namespace). The same holds when b is
// attached, whatever the addresses.
func TestCNIRefusesAnotherPodsNamespace(t *testing.T) {
	tp := netnstest.New(t, 1)
	nsB, nsC := tp.Nodes[0].AddPod("b"), tp.Nodes[0].AddPod("c")
	a, ld, _, _ := testAgent(t)
	b := &workload.Workload{Name: "b", Namespace: "other", UID: "uid-b", ServiceAccount: "default", Node: "node1", Addrs: nsB.Addrs(), Reason: "namespace not ambient"}
	c := &workload.Workload{Name: "c", Namespace: "shop", UID: "uid-c", ServiceAccount: "default", Node: "node1", Addrs: nsC.Addrs(), Enrolled: true, Reason: "ambient"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("a", "uid-a"), b, c}})
	ctx := runWorker(t, a)
	prefixes := func(addrs []netip.Addr) (out []netip.Prefix) {
		for _, ad := range addrs {
			out = append(out, netip.PrefixFrom(ad, ad.BitLen()))
		}
		return out
	}
	// b's sandbox is reported (not in the mesh), c's is enrolled.
	if resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "b", PodNamespace: "other", PodUID: "uid-b", ContainerID: "cb", NetNS: nsB.Path(), IPs: prefixes(nsB.Addrs())}); err != nil || resp.Enrolled {
		t.Fatalf("ADD b: %+v, %v", resp, err)
	}
	if resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "c", PodNamespace: "shop", PodUID: "uid-c", ContainerID: "cc", NetNS: nsC.Path(), IPs: prefixes(nsC.Addrs())}); err != nil || !resp.Enrolled {
		t.Fatalf("ADD c: %+v, %v", resp, err)
	}
	for _, tc := range []struct {
		owner string
		ns    *netnstest.Pod
	}{{"other/b", nsB}, {"shop/c", nsC}} {
		resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "a", PodNamespace: "shop", PodUID: "uid-a", ContainerID: "ca", NetNS: tc.ns.Path(), IPs: prefixes(tc.ns.Addrs())})
		t.Logf("ADD a in %s's namespace: %+v, %v", tc.owner, resp, err)
		if err == nil || resp.Enrolled {
			t.Errorf("ADD a naming %s's namespace: %+v, %v; want refused", tc.owner, resp, err)
		} else if !strings.Contains(err.Error(), tc.owner) || !strings.Contains(err.Error(), tc.ns.Path()) {
			t.Errorf("ADD a naming %s's namespace: error %q does not name the pod and the path", tc.owner, err)
		}
		if _, attached, _ := ld.PodState("uid-a"); attached {
			t.Errorf("pod a is attached in %s's namespace", tc.owner)
		}
	}
}

// TestCNIStaleDelKeepsSandbox: a DEL for an earlier sandbox of the pod
// (another container id: the runtime repeats DEL for a sandbox it tears
// down or garbage-collects late), or for an earlier pod of the same name
// (another uid), arriving after the ADD of the current sandbox, does not
// unenroll the current one while its source knows no address yet (seen
// failing: the DEL dropped the current sandbox's report, the pod went back
// to pending and was detached, so a pod answered "enrolled" ran in
// plaintext). The current sandbox's own DEL still lets it go.
func TestCNIStaleDelKeepsSandbox(t *testing.T) {
	tp := netnstest.New(t, 1)
	sandbox := tp.Nodes[0].AddPod("p")
	a, ld, _, _ := testAgent(t)
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p")}})
	ctx := runWorker(t, a)
	var ips []netip.Prefix
	for _, ad := range sandbox.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	ev := cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c2", NetNS: sandbox.Path(), IPs: ips}
	if resp, err := a.HandleCNI(ctx, ev); err != nil || !resp.Enrolled {
		t.Fatalf("ADD: %+v, %v", resp, err)
	}
	// attached waits for the worker to act on what a DEL changed, then
	// reports whether the pod is attached. The wait ends once the loader
	// has the pod as the agent wants it (HandleCNI records that before it
	// returns), not once the queue is empty: the worker takes the pod off
	// the queue before it detaches it, and a detach slower than a poll (a
	// loaded VM, -race) was read as the pod's own DEL leaving it attached.
	// A stale DEL wrongly honoured changes the want at once, so it is
	// waited for and caught too.
	attached := func() bool {
		var ok bool
		for deadline := time.Now().Add(waitfor.Timeout); ; time.Sleep(10 * time.Millisecond) {
			a.mu.Lock()
			_, want := a.desired["uid-p"]
			a.mu.Unlock()
			_, ok, _ = ld.PodState("uid-p")
			if ok == want && a.queue.Len() == 0 || time.Now().After(deadline) {
				return ok
			}
		}
	}
	for _, stale := range []cni.PodEvent{
		{Command: cni.CommandDel, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c1"},
		{Command: cni.CommandDel, PodName: "p", PodNamespace: "shop", PodUID: "uid-old", ContainerID: "c2"},
	} {
		if _, err := a.HandleCNI(ctx, stale); err != nil {
			t.Fatalf("DEL %+v: %v", stale, err)
		}
		if !attached() {
			t.Fatalf("a DEL of container %s, uid %s unenrolled the current sandbox (container c2, uid uid-p)", stale.ContainerID, stale.PodUID)
		}
	}
	if _, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandDel, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c2", NetNS: sandbox.Path()}); err != nil {
		t.Fatal(err)
	}
	if attached() {
		t.Errorf("the current sandbox's own DEL left the pending pod attached")
	}
}

// TestCNIAddWithoutUsableAddressFails: a pod the rules select, whose source
// knows no address yet, fails its ADD when the CNI result carries no
// address for it, or none that can be a pod's (link-local, loopback): it
// cannot be enrolled, and it must not start unmeshed (seen failing: the ADD
// was answered "not enrolled" and the runtime started the pod in
// plaintext). The error says what was wrong.
func TestCNIAddWithoutUsableAddressFails(t *testing.T) {
	a, _, _, _ := testAgent(t)
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p")}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Any existing namespace passes the path check; nothing is attached.
	tp := netnstest.New(t, 1)
	sandbox := tp.Nodes[0].AddPod("p")
	for _, tc := range []struct {
		ips  []netip.Prefix
		want string
	}{
		{nil, "no address"},
		{[]netip.Prefix{netip.MustParsePrefix("fe80::1/64")}, "link-local"},
		{[]netip.Prefix{netip.MustParsePrefix("127.0.0.5/8")}, "loopback"},
	} {
		start := time.Now()
		resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p", ContainerID: "c1", NetNS: sandbox.Path(), IPs: tc.ips})
		t.Logf("ADD with %v: %+v, %v", tc.ips, resp, err)
		if err == nil {
			t.Errorf("ADD of a selected pod with addresses %v succeeded (%+v): it would start unmeshed", tc.ips, resp)
		} else if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ADD with %v: error %q does not say %q", tc.ips, err, tc.want)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("ADD with %v took %s to fail", tc.ips, d)
		}
	}
}

// TestRestartKeepsPendingAttachedPod: an agent that starts while a pod it
// enrolled at its ADD is still unaddressed in its source (the API learns
// a pod's address only after the sandbox is up) keeps the pod attached:
// the plugin's report died with the previous process, but what the loader
// recorded at attach says the same (seen failing: the first full pass
// detached the pod, which had been answered enrolled, and it ran in
// plaintext until its source learnt the address).
func TestRestartKeepsPendingAttachedPod(t *testing.T) {
	tp := netnstest.New(t, 1)
	sandbox := tp.Nodes[0].AddPod("p")
	a, ld, _, rec := testAgent(t)
	ctx := context.Background()
	// The previous process attached it at the pod's ADD.
	if res := rec.Reconcile(ctx, []loader.Pod{{UID: "uid-p", Namespace: "shop", Name: "p", NetNS: sandbox.Path(), Addrs: sandbox.Addrs(), CaptureInbound: true}}, true); len(res.Errors) > 0 {
		t.Fatal(res.Errors)
	}
	// This process starts: its source still has the pod pending.
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p")}})
	a.applyLatest(ctx, true)
	for a.queue.Len() > 0 {
		a.processNext(ctx)
	}
	if _, attached, _ := ld.PodState("uid-p"); !attached {
		t.Fatalf("the restarted agent detached a pod it had enrolled whose source knows no address yet")
	}
	if w, ok := a.cfg.Tunnel.State().Dir.Pod("shop", "p"); !ok || !w.Enrolled {
		t.Errorf("the directory has the pod as %+v, want enrolled with its attached addresses", w)
	}
	// A pod that left while its namespace lives is sealed (attached, not
	// served), and detached once the namespace is gone.
	a.setSnapshot(source.Snapshot{})
	a.applyLatest(ctx, true)
	if _, attached, _ := ld.PodState("uid-p"); !attached || rec.Stats().Sealed != 1 {
		t.Errorf("a pod that left with its namespace alive: attached %v, sealed %d; want it sealed", attached, rec.Stats().Sealed)
	}
	if out, err := exec.Command("ip", "netns", "del", sandbox.NS).CombinedOutput(); err != nil {
		t.Fatalf("ip netns del: %v: %s", err, out)
	}
	a.applyLatest(ctx, true)
	if _, attached, _ := ld.PodState("uid-p"); attached {
		t.Errorf("a pod that left stayed attached after its namespace went")
	}
}

// runWorker runs one queue worker, as the agent does, until the test ends,
// and returns the context the test's calls use (30 s at most). The cleanup
// waits for the worker to return, so the loader closed by an earlier
// cleanup is not in use (CI's race run caught a worker still reconciling).
func runWorker(t *testing.T, a *Agent) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for a.processNext(ctx) {
		}
	}()
	t.Cleanup(func() { a.queue.ShutDown(); cancel(); <-done })
	return ctx
}

// TestAddressLookupSkipsOtherPodsNamespace: a pod whose sandbox went (DEL,
// namespace destroyed) while the API still has its old address is looked
// up by that address; the runtime gave it to pod b, outside the mesh,
// whose ADD the agent recorded. Before, the full pass attached pod a (its
// identity, its capture) in b's namespace. Now the namespace of another
// reported or attached pod is never taken for this one: a waits for its
// ADD, and b keeps running without the mesh.
func TestAddressLookupSkipsOtherPodsNamespace(t *testing.T) {
	tp := netnstest.New(t, 1)
	nsA, nsB := tp.Nodes[0].AddPod("aold"), tp.Nodes[0].AddPod("b")
	ag, ld, _, _ := testAgent(t)
	x := nsA.Addrs()
	prefixes := func(addrs []netip.Addr) (out []netip.Prefix) {
		for _, a := range addrs {
			out = append(out, netip.PrefixFrom(a, a.BitLen()))
		}
		return out
	}
	wa := &workload.Workload{Name: "a", Namespace: "shop", UID: "uid-a", ServiceAccount: "sa-a", Node: "node1", Addrs: x, Enrolled: true, Reason: "namespace label"}
	wb := &workload.Workload{Name: "b", Namespace: "other", UID: "uid-b", ServiceAccount: "default", Node: "node1", Reason: "no istio.io/dataplane-mode=ambient label on pod or namespace"}
	ag.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{wa, wb}})
	ctx := runWorker(t, ag)
	if resp, err := ag.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "a", PodNamespace: "shop", PodUID: "uid-a", ContainerID: "ca", NetNS: nsA.Path(), IPs: prefixes(x)}); err != nil || !resp.Enrolled {
		t.Fatalf("ADD a: %+v %v", resp, err)
	}
	if _, err := ag.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandDel, PodName: "a", PodNamespace: "shop", PodUID: "uid-a", ContainerID: "ca"}); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("ip", "netns", "del", nsA.NS).CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	tp.AddAddr(nsB, x[0].String()+"/32", "eth0")
	if out, err := exec.Command("ip", "-n", nsB.NS, "addr", "add", x[1].String()+"/128", "dev", "eth0", "nodad").CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	if resp, err := ag.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "b", PodNamespace: "other", PodUID: "uid-b", ContainerID: "cb", NetNS: nsB.Path(), IPs: prefixes(x)}); err != nil || resp.Enrolled {
		t.Fatalf("ADD b (not in the mesh): %+v %v", resp, err)
	}
	ag.applyLatest(ctx, true)
	if st, attached, _ := ld.PodState("uid-a"); attached && st.Meta.NetNS == nsB.Path() {
		t.Errorf("pod shop/a is attached in the namespace of pod other/b, outside the mesh: b's traffic would leave with a's identity")
	}
	if st, attached, _ := ld.PodState("uid-b"); attached {
		t.Errorf("pod other/b, outside the mesh, is attached: %+v", st.Meta)
	}
}

// TestCNIAddOfExcludedNamespaceAnsweredAtOnce: a pod of an excluded
// namespace is never enrolled, so its ADD need not wait for the source to
// know it: after a reboot CoreDNS and the rest of kube-system start while
// the agent's source has not answered yet. Before, such an ADD waited the
// whole cniWait (20 s) and was then refused.
func TestCNIAddOfExcludedNamespaceAnsweredAtOnce(t *testing.T) {
	tp := netnstest.New(t, 1)
	dns := tp.Nodes[0].AddPod("coredns")
	ag, _, _, _ := testAgent(t)
	ag.cfg.Selection.ExcludeNamespaces = []string{"kube-system"}
	ctx := runWorker(t, ag)
	var ips []netip.Prefix
	for _, a := range dns.Addrs() {
		ips = append(ips, netip.PrefixFrom(a, a.BitLen()))
	}
	start := time.Now()
	resp, err := ag.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "coredns-1", PodNamespace: "kube-system", PodUID: "uid-dns",
		ContainerID: "c-dns", NetNS: dns.Path(), IPs: ips})
	if err != nil || resp.Enrolled {
		t.Fatalf("ADD of an excluded namespace's pod unknown to the source: %+v %v, want not enrolled", resp, err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("the ADD took %v, want it answered without waiting for the source", d)
	}
}
