package probe_test

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/probe"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// pinnedVeths reads the pinned veth map: host ifindex -> pod id.
func pinnedVeths(t *testing.T, root string) map[uint32]uint32 {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, probe.VethsMapName), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	out := map[uint32]uint32{}
	var k, v uint32
	it := m.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func putVeth(t *testing.T, root string, ifindex, podID uint32) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, probe.VethsMapName), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Put(ifindex, podID); err != nil {
		t.Fatal(err)
	}
}

// TestLoadRebuildsVethMap: a SYN starts SNAT only on the host veth the veth
// map names for its pod, so an agent upgraded from a release without that
// map must fill it from the host links pinned before, or no probe would be
// SNATed until each pod is attached again; and a record of a pod detached
// while no agent ran must go. DetachHost deletes the pod's record.
func TestLoadRebuildsVethMap(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app := node.AddPod("app")
	serveApp(t, app)
	root := tempBPFFS(t)
	a := load(t, probe.Config{PinRoot: root})
	const id = 7
	enroll(t, root, app, id)
	if err := attachHost(a, app, id); err != nil {
		t.Fatal(err)
	}
	want := map[uint32]uint32{hostIndex(t, app): id}
	if got := pinnedVeths(t, root); !maps.Equal(got, want) {
		t.Fatalf("veth map %v after attach, want %v", got, want)
	}

	// The release before pinned no veth map.
	a.Close()
	if err := os.Remove(filepath.Join(root, probe.VethsMapName)); err != nil {
		t.Fatal(err)
	}
	a = load(t, probe.Config{PinRoot: root})
	if got := pinnedVeths(t, root); !maps.Equal(got, want) {
		t.Errorf("veth map %v after the upgrade, want %v from the pinned links", got, want)
	}
	for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		if got, err := dialPeer(node.Path(), f.pod(app), netns.SocketOptions{}); err != nil || got != f.snat {
			t.Errorf("%s: after the upgrade the app saw %v (%v), want the SNAT address %s", f.name, got, err, f.snat)
		}
	}

	// A pod whose links went while no agent ran.
	putVeth(t, root, 9999, 77)
	a.Close()
	a = load(t, probe.Config{PinRoot: root})
	if got := pinnedVeths(t, root); !maps.Equal(got, want) {
		t.Errorf("veth map %v after a load, want only the pinned links' %v", got, want)
	}

	if err := a.DetachHost(id); err != nil {
		t.Fatal(err)
	}
	if got := pinnedVeths(t, root); len(got) != 0 {
		t.Errorf("veth map %v after detach, want it empty", got)
	}
}

// TestLoadKeepsVethOfAttachInFlight: an upgrade starts the new agent beside
// the old one, which keeps attaching pods until the new one claims the
// node, each attach under a shared lock of the pin root (maps.Claim.Guard).
// AttachHost records the pod's veth first and pins its links after. A Load
// that rebuilt the veth map in between found no pinned link for the pod
// and deleted its record: the pod was enrolled with host links and no veth
// record, so no probe to it was SNATed (refused under STRICT) until the
// new agent attached it again. Load now rebuilds the map under the
// exclusive lock, after the attach under way.
func TestLoadKeepsVethOfAttachInFlight(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app := node.AddPod("app")
	serveApp(t, app)
	root := tempBPFFS(t)
	old := load(t, probe.Config{PinRoot: root})
	const id = 7
	enroll(t, root, app, id)

	// The old agent, mid-attach: it holds the shared lock, has recorded
	// the veth, and has not pinned the links yet (they are moved aside
	// here, and put back before the lock is released).
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := attachHost(old, app, id); err != nil {
		t.Fatal(err)
	}
	want := map[uint32]uint32{hostIndex(t, app): id}
	if err := unix.Flock(fd, unix.LOCK_SH); err != nil {
		t.Fatal(err)
	}
	podDir := filepath.Join(root, "pods", "7")
	aside := filepath.Join(root, "pods-aside")
	if err := os.Rename(podDir, aside); err != nil {
		t.Fatal(err)
	}

	loaded := make(chan *probe.Attacher, 1)
	go func() {
		a, err := probe.Load(context.Background(), probe.Config{PinRoot: root})
		if err != nil {
			t.Error(err)
		}
		loaded <- a
	}()
	time.Sleep(500 * time.Millisecond)
	if err := os.Rename(aside, podDir); err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(fd, unix.LOCK_UN); err != nil {
		t.Fatal(err)
	}
	a := <-loaded
	if a == nil {
		return
	}
	defer a.Close()
	if got := pinnedVeths(t, root); !maps.Equal(got, want) {
		t.Errorf("veth map %v after a load beside an attach under way, want %v", got, want)
	}
	for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		if got, err := dialPeer(node.Path(), f.pod(app), netns.SocketOptions{}); err != nil || got != f.snat {
			t.Errorf("%s: the app saw %v (%v), want the SNAT address %s", f.name, got, err, f.snat)
		}
	}
}
