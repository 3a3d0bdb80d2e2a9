package nodeagent

import (
	"context"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// recreateSandbox destroys the pod's namespace and makes a new one under the
// same name (so the same path), wired to the node's bridge with the same
// addresses: a runtime that names sandboxes' namespaces by the pod, or a
// /proc/<pid>/ns/net path whose pid came round again. The old namespace
// lives on while something holds it (the agent's listeners do); only its
// path is taken from it.
func recreateSandbox(t *testing.T, n *netnstest.Node, p *netnstest.Pod) {
	t.Helper()
	replaceNetNS(t, p)
	wireSandbox(t, n, p)
}

func runIP(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// replaceNetNS puts a new, empty namespace at the pod's path, as a runtime
// makes one before its CNI plugins configure it.
func replaceNetNS(t *testing.T, p *netnstest.Pod) {
	t.Helper()
	// The old namespace is held until the new one exists, so the new one
	// gets another inode number (the kernel reuses freed ones): what is
	// tested is a reused path, not a reused number as well.
	old, err := os.Open(p.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	runIP(t, "netns", "del", p.NS)
	runIP(t, "netns", "add", p.NS)
}

// wireSandbox joins the namespace at the pod's path (made by replaceNetNS)
// to the node's bridge with the pod's addresses.
func wireSandbox(t *testing.T, n *netnstest.Node, p *netnstest.Pod) {
	t.Helper()
	hostVeth := p.HostVeth + "r"
	t.Cleanup(func() { _ = exec.Command("ip", "-n", n.Name, "link", "del", hostVeth).Run() })
	runIP(t, "-n", p.NS, "link", "set", "lo", "up")
	runIP(t, "-n", n.Name, "link", "add", hostVeth, "type", "veth", "peer", "name", "eth0", "netns", p.NS)
	runIP(t, "-n", n.Name, "link", "set", hostVeth, "master", "rdbr", "up")
	runIP(t, "-n", p.NS, "addr", "add", p.IPv4.String()+"/24", "dev", "eth0")
	runIP(t, "-n", p.NS, "addr", "add", p.IPv6.String()+"/64", "dev", "eth0", "nodad")
	runIP(t, "-n", p.NS, "link", "set", "eth0", "up")
}

// podListens reports whether something listens on port in the namespace at
// path.
func podListens(t *testing.T, path string, port int) bool {
	t.Helper()
	out, err := netnstest.Exec(context.Background(), path, "ss", "-Hltn", "sport", "= :"+strconv.Itoa(port))
	if err != nil {
		t.Fatalf("ss in %s: %v", path, err)
	}
	return strings.TrimSpace(string(out)) != ""
}

// TestCNIAddOfSandboxRecreatedAtSamePath: a pod's sandbox is re-created
// and its new namespace gets the old one's path and addresses (a runtime
// naming namespaces by pod, a reused /proc/<pid>/ns/net, a static IP). The
// new sandbox's ADD must be answered "enrolled" only once its own
// interface carries the programs and its own namespace has the tunnel's
// listeners. Seen failing: the ADD was answered "enrolled" at once, since
// the attachment and the tunnel compared the path by name only; the new
// sandbox's containers started with no capture at all (plaintext) until the
// next full pass, and even then the tunnel kept serving the old namespace,
// so every captured connection of the pod was dropped for good.
func TestCNIAddOfSandboxRecreatedAtSamePath(t *testing.T) {
	tp := netnstest.New(t, 1)
	node := tp.Nodes[0]
	sandbox := node.AddPod("p")
	a, ld, _, _ := testAgent(t)
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("p", "uid-p")}})
	ctx := runWorker(t, a)
	var ips []netip.Prefix
	for _, ad := range sandbox.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	add := func(container string) {
		t.Helper()
		resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "p", PodNamespace: "shop", PodUID: "uid-p",
			ContainerID: container, NetNS: sandbox.Path(), IfName: "eth0", IPs: ips})
		if err != nil || !resp.Enrolled {
			t.Fatalf("ADD of %s: %+v, %v; want enrolled", container, resp, err)
		}
	}
	add("c1")
	if progs := loadertest.TCXPrograms(t, sandbox.Path()); len(progs) != 2 {
		t.Fatalf("first sandbox: tcx programs %v, want ingress and egress", progs)
	}
	oldIno, err := netns.Inode(sandbox.Path())
	if err != nil {
		t.Fatal(err)
	}

	recreateSandbox(t, node, sandbox)
	newIno, err := netns.Inode(sandbox.Path())
	if err != nil {
		t.Fatal(err)
	}
	if newIno == oldIno {
		t.Fatalf("the re-created namespace has the old inode %d", oldIno)
	}
	start := time.Now()
	add("c2")
	t.Logf("ADD of the re-created sandbox answered after %s", time.Since(start))
	if progs := loadertest.TCXPrograms(t, sandbox.Path()); len(progs) != 2 {
		t.Errorf("ADD answered enrolled while the re-created sandbox's eth0 has tcx programs %v: it starts uncaptured", progs)
	}
	for _, port := range []int{15001, 15006, 15008} {
		if !podListens(t, sandbox.Path(), port) {
			t.Errorf("ADD answered enrolled while nothing listens on %d in the re-created sandbox", port)
		}
	}
	if st, attached, _ := ld.PodState("uid-p"); !attached || st.Meta.NetNS != sandbox.Path() {
		t.Errorf("pod attached=%v in %q", attached, st.Meta.NetNS)
	}
}

// TestCNICheckOfSandboxRecreatedAtSamePath: a CHECK of a new sandbox that
// was given the path of the namespace the pod is attached in fails: that
// sandbox carries no programs. Seen failing: the CHECK compared the
// inode the path names now with the CHECK's own, which are the same, and
// passed.
func TestCNICheckOfSandboxRecreatedAtSamePath(t *testing.T) {
	tp := netnstest.New(t, 1)
	node := tp.Nodes[0]
	sandbox := node.AddPod("p")
	a, _, _, rec := testAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w := &workload.Workload{Name: "p", Namespace: "shop", UID: "uid-p", ServiceAccount: "default", Node: "node1", Addrs: sandbox.Addrs(), Enrolled: true, Reason: "ns label"}
	if res := rec.Reconcile(ctx, []loader.Pod{{UID: "uid-p", Namespace: "shop", Name: "p", NetNS: sandbox.Path(), Addrs: sandbox.Addrs(), CaptureInbound: true}}, true); len(res.Errors) > 0 {
		t.Fatal(res.Errors)
	}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
	check := func() (cni.Response, error) {
		return a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandCheck, PodName: "p", PodNamespace: "shop", PodUID: "uid-p",
			ContainerID: "c2", NetNS: sandbox.Path(), IfName: "eth0"})
	}
	if resp, err := check(); err != nil || !resp.Enrolled {
		t.Fatalf("CHECK of the attached sandbox: %+v, %v", resp, err)
	}
	recreateSandbox(t, node, sandbox)
	resp, err := check()
	t.Logf("CHECK of the re-created sandbox: %+v, %v", resp, err)
	if err == nil {
		t.Errorf("CHECK of a sandbox with no programs (tcx %v) passed: %+v", loadertest.TCXPrograms(t, sandbox.Path()), resp)
	}
}

// TestRestartDoesNotFollowReusedPath: while the agent is down, pod a's
// sandbox goes and its namespace path (and address) is given to pod b's
// new sandbox, outside the mesh, which the CNI plugin reports once the
// agent is back. The restarted agent must not take the path for a's
// namespace: a stays unattached until its own ADD (or a lookup that
// finds a namespace of its own), b's ADD is taken, and b's interface gets
// no programs and b's namespace no listeners under a's identity. Seen
// failing: Load rewrote a's rd_pod_netns record to whatever the path
// named, b's ADD was refused as "the network namespace of pod a", and
// the first full pass attached a in b's namespace: b's traffic left with
// a's identity, its inbound went through a's policy.
func TestRestartDoesNotFollowReusedPath(t *testing.T) {
	tp := netnstest.New(t, 1)
	node := tp.Nodes[0]
	sandbox := node.AddPod("a")
	root := loadertest.TempBPFFS(t)
	// The previous process attached a, and was killed.
	prev := loadertest.Load(t, root)
	if _, err := prev.AttachPod(context.Background(), loader.Pod{UID: "uid-a", Namespace: "shop", Name: "a", NetNS: sandbox.Path(), Interface: "eth0", Addrs: sandbox.Addrs(), CaptureInbound: true}); err != nil {
		t.Fatal(err)
	}
	prev.Close()
	// Meanwhile a's sandbox went, and b's took its path and address.
	recreateSandbox(t, node, sandbox)

	log := slog.New(slog.DiscardHandler)
	ld := loadertest.Load(t, root)
	t.Cleanup(func() { ld.Close() })
	tun, certs := netnstest.FileCATunnel(t, log)
	rec := NewReconciler(ld, tun, netns.DefaultFinder(), log)
	a := New(Config{Node: "node1", TrustDomain: "cluster.local", ReconcilePeriod: time.Hour, Tunnel: tun, Loader: ld, Reconciler: rec, Certs: certs, Logger: log})
	// The API still has a, at its old address.
	wa := &workload.Workload{Name: "a", Namespace: "shop", UID: "uid-a", ServiceAccount: "default", Node: "node1", Addrs: sandbox.Addrs(), Enrolled: true, Reason: "ns label"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{wa}})
	var ips []netip.Prefix
	for _, ad := range sandbox.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	bctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := a.HandleCNI(bctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "b", PodNamespace: "other", PodUID: "uid-b",
		ContainerID: "cb", NetNS: sandbox.Path(), IfName: "eth0", IPs: ips})
	t.Logf("ADD of b (unknown to the source yet): %v", err)
	if err != nil && strings.Contains(err.Error(), "network namespace of pod shop/a") {
		t.Errorf("b's ADD was refused as a's namespace, which a left: %v", err)
	}
	ctx, cancel2 := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel2()
	a.applyLatest(ctx, true)
	rec.repairLinks(ctx, true)
	if progs := loadertest.TCXPrograms(t, sandbox.Path()); len(progs) != 0 {
		t.Errorf("pod b's eth0 carries pod a's programs %v", progs)
	}
	if podListens(t, sandbox.Path(), 15008) {
		t.Errorf("pod b's namespace has the tunnel's listeners for pod a")
	}
	if ino, ok := ld.AttachedNetNS("uid-a"); ok {
		if cur, _ := netns.Inode(sandbox.Path()); cur == ino {
			t.Errorf("pod a is recorded as attached in pod b's namespace (inode %d)", ino)
		}
	}
}

// TestLinkCheckFollowsSandboxRecreatedAtSamePath: a pod found by its
// address (no CNI plugin) has its sandbox re-created at the same path with
// the same addresses, so its source reports nothing. The link check
// (every LinkCheckPeriod) must see that the path names another namespace
// and attach the pod there, its listeners with it, without waiting for a
// full pass. Seen failing before the check: the old namespace lived on,
// held by the tunnel's listeners, so its links looked attached, and the
// new sandbox ran uncaptured (its apps' connections in plaintext) until
// the next full pass (RECONCILE_PERIOD; an hour here).
func TestLinkCheckFollowsSandboxRecreatedAtSamePath(t *testing.T) {
	tp := netnstest.New(t, 1)
	node := tp.Nodes[0]
	sandbox := node.AddPod("p")
	a, ld, _, rec := testAgent(t)
	w := &workload.Workload{Name: "p", Namespace: "shop", UID: "uid-p", ServiceAccount: "default", Node: "node1", Addrs: sandbox.Addrs(), Enrolled: true, Reason: "ns label"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
	ctx := runWorker(t, a)
	a.applyLatest(ctx, false) // queues uid-p: found by its address
	attachedIn := func() (uint64, bool) {
		ino, ok := ld.AttachedNetNS("uid-p")
		return ino, ok && podListens(t, sandbox.Path(), 15001)
	}
	waitUntil := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 10s", what)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitUntil("pod attached in its first sandbox", func() bool { _, ok := attachedIn(); return ok })
	oldIno, _ := ld.AttachedNetNS("uid-p")

	rctx, cancel := context.WithCancel(ctx)
	repairDone := make(chan struct{})
	go func() { defer close(repairDone); rec.RepairLinks(rctx, 50*time.Millisecond) }()
	defer func() { cancel(); <-repairDone }()

	recreateSandbox(t, node, sandbox)
	newIno, err := netns.Inode(sandbox.Path())
	if err != nil || newIno == oldIno {
		t.Fatalf("re-created namespace inode %d (old %d): %v", newIno, oldIno, err)
	}
	start := time.Now()
	waitUntil("pod attached in its re-created sandbox", func() bool {
		ino, ok := attachedIn()
		return ok && ino == newIno && len(loadertest.TCXPrograms(t, sandbox.Path())) == 2
	})
	t.Logf("re-created sandbox captured after %s", time.Since(start))
	for _, port := range []int{15001, 15006, 15008} {
		if !podListens(t, sandbox.Path(), port) {
			t.Errorf("nothing listens on %d in the re-created sandbox", port)
		}
	}
	if got := rec.Stats().NetNSMoved; got != 1 {
		t.Errorf("NetNSMoved = %d, want 1", got)
	}
}
