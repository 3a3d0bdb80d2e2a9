package nodeagent

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// fakePodProcess makes procDir hold a process of the Kubernetes pod uid
// whose network namespace is the one at path (read when asked: a symlink),
// as netns.PodUIDsIn reads the kubelet's cgroups.
func fakePodProcess(t *testing.T, procDir, pid, path, uid string) {
	t.Helper()
	dir := filepath.Join(procDir, pid)
	if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(path, filepath.Join(dir, "ns", "net")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte("0::/kubepods/besteffort/pod"+uid+"/c0ffee\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestLinkCheckRequeueTakesNoStaleReport: pod a was enrolled at its CNI
// ADD, so its wanted state names the namespace path the ADD gave and the
// inode it named then. The path is then given to another pod's sandbox,
// with a's address (a reused /proc/<pid>/ns/net and a reused address,
// a's DEL never having reached the agent), whose processes run in that
// pod's kubelet cgroup. The link check sees the path name another
// namespace and queues a; its worker must not take the report, which
// speaks of another namespace, as the word for what the path names now:
// the namespace is judged as any namespace found by address is, and this
// one is another pod's. Seen failing: the worker attached a at the path
// from the last apply, with no check, so the other pod's traffic was
// captured with a's identity (and its own ADD refused as a's namespace).
func TestLinkCheckRequeueTakesNoStaleReport(t *testing.T) {
	tp := netnstest.New(t, 1)
	node := tp.Nodes[0]
	sandbox := node.AddPod("a")
	proc := t.TempDir()
	// The process of pod b that will run in the namespace at a's path.
	fakePodProcess(t, proc, "4242", sandbox.Path(), "0b0b0b0b-0000-4000-8000-000000000b0b")

	log := slog.New(slog.DiscardHandler)
	ld := loadertest.Load(t, loadertest.TempBPFFS(t))
	t.Cleanup(func() { ld.Close() })
	tun, certs := netnstest.FileCATunnel(t, log)
	rec := NewReconciler(ld, tun, netns.DefaultFinder(), log)
	a := New(Config{Node: "node1", TrustDomain: "cluster.local", ProcDir: proc, ReconcilePeriod: time.Hour, Tunnel: tun, Loader: ld, Reconciler: rec, Certs: certs, Logger: log})
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{pendingPod("a", "uid-a")}})
	ctx := runWorker(t, a)
	var ips []netip.Prefix
	for _, ad := range sandbox.Addrs() {
		ips = append(ips, netip.PrefixFrom(ad, ad.BitLen()))
	}
	resp, err := a.HandleCNI(ctx, cni.PodEvent{Command: cni.CommandAdd, PodName: "a", PodNamespace: "shop", PodUID: "uid-a",
		ContainerID: "ca", NetNS: sandbox.Path(), IfName: "eth0", IPs: ips})
	if err != nil || !resp.Enrolled {
		t.Fatalf("ADD of a: %+v, %v; want enrolled", resp, err)
	}

	rctx, cancel := context.WithCancel(ctx)
	repairDone := make(chan struct{})
	go func() { defer close(repairDone); rec.RepairLinks(rctx, 50*time.Millisecond) }()
	defer func() { cancel(); <-repairDone }()

	recreateSandbox(t, node, sandbox) // now b's, with a's addresses
	newIno, err := netns.Inode(sandbox.Path())
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for rec.Stats().NetNSMoved == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the link check did not queue a")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The worker has had its go (and a retry or two).
	time.Sleep(time.Second)
	if ino, ok := ld.AttachedNetNS("uid-a"); ok && ino == newIno {
		t.Errorf("pod a is attached in pod b's namespace (inode %d): b's traffic leaves with a's identity", ino)
	}
	if progs := loadertest.TCXPrograms(t, sandbox.Path()); len(progs) != 0 {
		t.Errorf("pod b's eth0 carries pod a's programs %v", progs)
	}
	if podListens(t, sandbox.Path(), 15008) {
		t.Errorf("pod b's namespace has the tunnel's listeners for pod a")
	}
}

// TestLinkCheckFollowsEachNewNamespaceAtPath: a pod found by address has
// its sandbox replaced at the same path twice: first by a namespace
// without its addresses (its reconcile fails, and is retried with
// backoff), then by its own new sandbox, made empty and given the pod's
// addresses a moment later, as a runtime makes a namespace before its CNI
// plugins configure it. The link check must queue the pod again for the
// second namespace, and a try made before the addresses were there must
// not send the pod back to its long backoff: the new sandbox is captured
// within a moment of getting its addresses, not after the backoff (up to
// 30 s). Seen failing: requeueMoved queued a record once, whatever the
// path named after, so the new sandbox waited out the pod's backoff
// uncaptured; and, queued again but with its backoff, the pod's try at
// the empty namespace sent it back to that backoff.
func TestLinkCheckFollowsEachNewNamespaceAtPath(t *testing.T) {
	tp := netnstest.New(t, 1)
	node := tp.Nodes[0]
	sandbox := node.AddPod("p")
	a, ld, _, rec := testAgent(t)
	w := &workload.Workload{Name: "p", Namespace: "shop", UID: "uid-p", ServiceAccount: "default", Node: "node1", Addrs: sandbox.Addrs(), Enrolled: true, Reason: "ns label"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
	ctx := runWorker(t, a)
	a.applyLatest(ctx, false)
	eventually(t, 10*time.Second, "pod attached", func() bool { _, ok := ld.AttachedNetNS("uid-p"); return ok })
	runRepair(t, ctx, rec, 50*time.Millisecond)

	// A namespace at the path without the pod's addresses: the pod's
	// reconcile fails until its backoff is long.
	replaceNetNS(t, sandbox)
	eventually(t, 20*time.Second, "the pod's reconcile retried with a long backoff", func() bool { return a.queue.NumRequeues("uid-p") >= 5 })

	// The pod's own sandbox, empty at first: the link check queues the
	// pod, whose try fails.
	moved := rec.Stats().NetNSMoved
	replaceNetNS(t, sandbox)
	newIno, err := netns.Inode(sandbox.Path())
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the pod queued for its new namespace", func() bool { return rec.Stats().NetNSMoved > moved })
	time.Sleep(100 * time.Millisecond) // its try, before the addresses
	wireSandbox(t, node, sandbox)
	start := time.Now()
	eventually(t, 20*time.Second, "pod attached in its new sandbox", func() bool {
		ino, ok := ld.AttachedNetNS("uid-p")
		return ok && ino == newIno
	})
	took := time.Since(start)
	t.Logf("new sandbox captured %s after it got its addresses; pod queued %d times by the link check", took, rec.Stats().NetNSMoved)
	if took > 2*time.Second {
		t.Errorf("the pod's new sandbox was captured only %s after it got its addresses (its backoff), not within a moment", took)
	}
}

// TestMovedPathWhileDetaching: a pod's sandbox is re-created at its path
// while the pod opts out (the source still lists it): the link check
// queues it for the new namespace as its worker detaches it, in either
// order. It ends detached, unserved and forgotten, with no programs in
// the new namespace; run under -race, the reconciler's locks are checked
// too.
func TestMovedPathWhileDetaching(t *testing.T) {
	tp := netnstest.New(t, 1)
	node := tp.Nodes[0]
	a, ld, tun, rec := testAgent(t)
	ctx := runWorker(t, a)
	runRepair(t, ctx, rec, 10*time.Millisecond)
	for i := range 3 {
		sandbox := node.AddPod(fmt.Sprintf("p%d", i))
		uid := "uid-" + sandbox.Name
		w := &workload.Workload{Name: sandbox.Name, Namespace: "shop", UID: uid, ServiceAccount: "default", Node: "node1", Addrs: sandbox.Addrs(), Enrolled: true, Reason: "ns label"}
		a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
		a.applyLatest(ctx, false)
		eventually(t, 10*time.Second, "pod attached", func() bool { _, ok := ld.AttachedNetNS(uid); return ok && tun.PodReady(uid) })
		out := *w
		out.Enrolled, out.Reason = false, "opted out"
		done := make(chan struct{})
		go func() {
			defer close(done)
			a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{&out}})
			a.applyLatest(ctx, false)
		}()
		recreateSandbox(t, node, sandbox)
		<-done
		var state string
		deadline := time.Now().Add(10 * time.Second)
		for {
			_, attached, _ := ld.PodState(uid)
			rec.nsMu.Lock()
			_, recorded := rec.ns[uid]
			_, sealed := rec.sealed[uid]
			rec.nsMu.Unlock()
			served := tun.PodReady(uid)
			if !attached && !served && !recorded {
				break
			}
			state = fmt.Sprintf("attached %v, served %v, recorded %v, sealed %v", attached, served, recorded, sealed)
			if time.Now().After(deadline) {
				t.Fatalf("round %d: pod not detached and forgotten within 10s: %s", i, state)
			}
			time.Sleep(20 * time.Millisecond)
		}
		if progs := loadertest.TCXPrograms(t, sandbox.Path()); len(progs) != 0 {
			t.Errorf("round %d: the new namespace carries %v", i, progs)
		}
	}
}

// TestFailedMoveLeavesNoRecord: a pod's attach in the new namespace at its
// path fails (the namespace has only one of its addresses), and the
// loader undoes the pod whole, as it does a new pod's failed attach; the
// pod then opts out. The reconciler must keep no record of a pod nothing
// is attached for. Seen failing: the record of the old namespace stayed
// for good (one per such pod, never removed, statted at every link
// check), found by TestMovedPathWhileDetaching now and then.
func TestFailedMoveLeavesNoRecord(t *testing.T) {
	tp := netnstest.New(t, 1)
	node := tp.Nodes[0]
	sandbox := node.AddPod("p")
	a, ld, tun, rec := testAgent(t)
	ctx := runWorker(t, a)
	runRepair(t, ctx, rec, 50*time.Millisecond)
	w := &workload.Workload{Name: "p", Namespace: "shop", UID: "uid-p", ServiceAccount: "default", Node: "node1", Addrs: sandbox.Addrs(), Enrolled: true, Reason: "ns label"}
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{w}})
	a.applyLatest(ctx, false)
	eventually(t, 10*time.Second, "pod attached", func() bool { _, ok := ld.AttachedNetNS("uid-p"); return ok })

	// The new namespace has the pod's IPv4 address only: found by it,
	// refused by the attach.
	replaceNetNS(t, sandbox)
	hostVeth := sandbox.HostVeth + "r"
	t.Cleanup(func() { _ = exec.Command("ip", "-n", node.Name, "link", "del", hostVeth).Run() })
	runIP(t, "-n", node.Name, "link", "add", hostVeth, "type", "veth", "peer", "name", "eth0", "netns", sandbox.NS)
	runIP(t, "-n", sandbox.NS, "addr", "add", sandbox.IPv4.String()+"/24", "dev", "eth0")
	runIP(t, "-n", sandbox.NS, "link", "set", "eth0", "up")
	eventually(t, 10*time.Second, "the loader undid the pod after its failed attach", func() bool {
		_, ok, _ := ld.PodState("uid-p")
		return !ok
	})

	recorded := func() bool {
		rec.nsMu.Lock()
		defer rec.nsMu.Unlock()
		_, ok := rec.ns["uid-p"]
		return ok
	}
	// Still wanted: a full pass forgets what is not attached.
	a.applyLatest(ctx, true)
	if recorded() {
		t.Error("a full pass kept the namespace record of a pod not attached")
	}

	out := *w
	out.Enrolled, out.Reason = false, "opted out"
	a.setSnapshot(source.Snapshot{Workloads: []*workload.Workload{&out}})
	a.applyLatest(ctx, false)
	eventually(t, 10*time.Second, "the pod unserved and forgotten", func() bool {
		return !tun.PodReady("uid-p") && !recorded()
	})
}
