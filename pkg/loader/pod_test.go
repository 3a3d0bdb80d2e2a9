package loader_test

import (
	"context"
	"net/netip"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestReattachKeepsNewOwnersCounters: a pod attached again without an
// address that another pod has taken meanwhile (a reused address) leaves
// that pod's entry and counters alone. Before, the re-attach deleted the
// counters of the address whatever pod owned it.
func TestReattachKeepsNewOwnersCounters(t *testing.T) {
	topo := netnstest.New(t, 1)
	p, q := topo.Nodes[0].AddPod("p"), topo.Nodes[0].AddPod("q")
	topo.AddAddr(q, p.IPv4.String()+"/32", "eth0") // q takes p's address
	ctx := context.Background()
	l := loadertest.Load(t, loadertest.TempBPFFS(t))
	defer l.Close()
	old := loadertest.PodOf(p, true)
	if _, err := l.AttachPod(ctx, old); err != nil {
		t.Fatal(err)
	}
	reused := loadertest.PodOf(q, true)
	reused.Addrs = []netip.Addr{p.IPv4}
	st, err := l.AttachPod(ctx, reused)
	if err != nil {
		t.Fatal(err)
	}
	old.Addrs = []netip.Addr{p.IPv6}
	if _, err := l.AttachPod(ctx, old); err != nil {
		t.Fatal(err)
	}
	if s, ok, err := l.Maps().Pod(p.IPv4); err != nil || !ok || s.PodID != st.ID {
		t.Errorf("entry of %s: %+v %v %v, want q's (id %d)", p.IPv4, s, ok, err, st.ID)
	}
	if _, ok, err := l.Maps().Counters(p.IPv4); err != nil || !ok {
		t.Errorf("counters of %s, q's address, after p was attached again without it: %v %v", p.IPv4, ok, err)
	}
}

// TestDetachRestoresRPFilter: attaching a pod turns reverse-path filtering
// off (re-injected packets carry the pod's own source), on its interface
// and in the namespace's "all", whose value is the floor of every
// interface's; detaching gives both their old values back. Before, "all"
// stayed 0 after the pod left the mesh.
func TestDetachRestoresRPFilter(t *testing.T) {
	topo := netnstest.New(t, 1)
	p := topo.Nodes[0].AddPod("p")
	ctx := context.Background()
	sysctl := func(args ...string) string {
		t.Helper()
		out, err := netnstest.Exec(ctx, p.Path(), "sysctl", append([]string{"-n"}, args...)...)
		if err != nil {
			t.Fatalf("sysctl %v: %v: %s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	const all, iface = "net.ipv4.conf.all.rp_filter", "net.ipv4.conf.eth0.rp_filter"
	sysctl("-w", all+"=2")
	sysctl("-w", iface+"=1")
	l := loadertest.Load(t, loadertest.TempBPFFS(t))
	defer l.Close()
	pod := loadertest.PodOf(p, true)
	if _, err := l.AttachPod(ctx, pod); err != nil {
		t.Fatal(err)
	}
	if a, i := sysctl(all), sysctl(iface); a != "0" || i != "0" {
		t.Fatalf("attached: all.rp_filter=%s eth0.rp_filter=%s, want 0 and 0", a, i)
	}
	if err := l.DetachPod(ctx, pod.UID); err != nil {
		t.Fatal(err)
	}
	if a, i := sysctl(all), sysctl(iface); a != "2" || i != "1" {
		t.Errorf("detached: all.rp_filter=%s eth0.rp_filter=%s, want the old 2 and 1", a, i)
	}
}

// tcxPrograms names the tcx programs on eth0 of the namespace at path,
// comma-separated.
func tcxPrograms(t *testing.T, path string) string {
	t.Helper()
	return strings.Join(loadertest.TCXPrograms(t, path), ",")
}

// TestAttachInNewSandboxMovesPrograms: a pod attached again in a new
// network namespace (a new sandbox of the same pod) gets its programs
// there, and the old namespace loses them (its rules stay: the runtime
// tears it down, and its path may name another namespace by then). Before, the
// attach updated the pinned links in place, which swapped the programs on
// the old sandbox's interface: the new sandbox ran with none, uncaptured,
// while the pod counted as enrolled there.
func TestAttachInNewSandboxMovesPrograms(t *testing.T) {
	topo := netnstest.New(t, 1)
	oldBox, newBox := topo.Nodes[0].AddPod("old"), topo.Nodes[0].AddPod("new")
	ctx := context.Background()
	l := loadertest.Load(t, loadertest.TempBPFFS(t))
	defer l.Close()
	pod := loadertest.PodOf(oldBox, true)
	if _, err := l.AttachPod(ctx, pod); err != nil {
		t.Fatal(err)
	}
	if got := tcxPrograms(t, oldBox.Path()); got != "rd_pod_ingress,rd_pod_egress" {
		t.Fatalf("old sandbox has %q", got)
	}
	moved := loadertest.PodOf(newBox, true)
	moved.UID, moved.Name = pod.UID, pod.Name
	st, err := l.AttachPod(ctx, moved)
	if err != nil {
		t.Fatal(err)
	}
	if got := tcxPrograms(t, newBox.Path()); got != "rd_pod_ingress,rd_pod_egress" {
		t.Errorf("the new sandbox has programs %q, want both of the pod's", got)
	}
	if got := tcxPrograms(t, oldBox.Path()); got != "" {
		t.Errorf("the old sandbox kept programs %q", got)
	}
	if st.Meta.NetNS != newBox.Path() || !l.KernelOK(st, true) {
		t.Errorf("state %+v: want the new namespace, links in place", st.Meta)
	}
	// Attaching again in the same namespace keeps updating in place.
	if _, err := l.AttachPod(ctx, moved); err != nil {
		t.Fatal(err)
	}
	if got := tcxPrograms(t, newBox.Path()); got != "rd_pod_ingress,rd_pod_egress" {
		t.Errorf("after a second attach in the new sandbox: %q", got)
	}
}
