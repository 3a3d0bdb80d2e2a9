package probe_test

import (
	"maps"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

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
