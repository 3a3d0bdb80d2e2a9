package probe_test

import (
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
	"github.com/redirector-mesh/redirector/pkg/pin"
	"github.com/redirector-mesh/redirector/pkg/probe"
)

// TestLoadReplacesNATMapOfThePreviousLayout: a NAT map pinned by the
// release before the entry carried the probe's veth (a value 4 bytes
// shorter, same size) is replaced at the load, not refused, so an upgrade
// from it starts.
func TestLoadReplacesNATMapOfThePreviousLayout(t *testing.T) {
	root := tempBPFFS(t)
	if err := pin.EnsureBPFFS(root); err != nil {
		t.Fatal(err)
	}
	oldValue := uint32(unsafe.Sizeof(bpf.HostProbePodAddr{})) + 4 // node address, pod id
	old, err := ebpf.NewMap(&ebpf.MapSpec{Name: probe.NATMapName, Type: ebpf.LRUHash,
		KeySize: uint32(unsafe.Sizeof(bpf.HostProbeNatKey{})), ValueSize: oldValue, MaxEntries: probe.DefaultNATSize})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	path := filepath.Join(root, probe.NATMapName)
	if err := old.Pin(path); err != nil {
		t.Fatal(err)
	}
	load(t, probe.Config{PinRoot: root})
	m, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if got, want := m.ValueSize(), uint32(unsafe.Sizeof(bpf.HostProbeNatEntry{})); got != want || got == oldValue {
		t.Errorf("pinned NAT map value size %d after the load, want %d (the old one was %d)", got, want, oldValue)
	}
}
