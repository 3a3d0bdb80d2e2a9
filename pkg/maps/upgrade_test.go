package maps

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
)

// TestDropIncompatibleCounters: a reason array pinned by an older agent with
// fewer slots is unpinned so the new objects load; one that matches stays,
// with its counts.
func TestDropIncompatibleCounters(t *testing.T) {
	root := tempBPFFS(t)
	spec, err := bpf.LoadCapture()
	if err != nil {
		t.Fatal(err)
	}
	want := spec.Maps[ReasonsName]

	pinAs := func(entries uint32) {
		t.Helper()
		os.Remove(filepath.Join(root, ReasonsName))
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: want.Type, KeySize: want.KeySize, ValueSize: want.ValueSize, MaxEntries: entries})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		if err := m.Pin(filepath.Join(root, ReasonsName)); err != nil {
			t.Fatal(err)
		}
	}

	pinAs(14) // an agent before the reasons of issue 14
	dropped, err := DropIncompatibleCounters(root, spec)
	if err != nil || len(dropped) != 1 {
		t.Fatalf("old reason array: dropped %v, %v; want it dropped", dropped, err)
	}
	if _, err := os.Stat(filepath.Join(root, ReasonsName)); !os.IsNotExist(err) {
		t.Fatalf("old reason array still pinned: %v", err)
	}

	pinAs(want.MaxEntries)
	dropped, err = DropIncompatibleCounters(root, spec)
	if err != nil || len(dropped) != 0 {
		t.Fatalf("current reason array: dropped %v, %v; want it kept", dropped, err)
	}

	// And the objects load over what is left.
	var objs bpf.CaptureObjects
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: root}}); err != nil {
		t.Fatalf("load over the pin root: %v", err)
	}
	objs.Close()
}
