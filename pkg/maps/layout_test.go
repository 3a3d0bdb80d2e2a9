package maps

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
)

// TestLayoutMatchesELF checks, without privileges, that every map's key and
// value sizes in the compiled object equal the Go types this package reads
// and writes; a drift would corrupt entries silently.
func TestLayoutMatchesELF(t *testing.T) {
	spec, err := bpf.LoadCapture()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]struct{ key, value any }{
		PodsName:     {bpf.CapturePodAddr{}, bpf.CapturePodSettings{}},
		PodStatsName: {bpf.CapturePodAddr{}, bpf.CapturePodCounters{}},
		ReasonsName:  {uint32(0), uint64(0)},
		PodMetaName:  {uint32(0), bpf.CapturePodMeta{}},
		PodNetNSName: {uint32(0), bpf.CapturePodNetns{}},
		CapturedName: {int32(0), uint8(0)}, // socket storage: a socket's fd as key, a flag as value
		DialledName:  {bpf.CaptureDialledKey{}, uint8(0)},
	}
	for name, w := range want {
		ms, ok := spec.Maps[name]
		if !ok {
			t.Errorf("map %s missing from the ELF", name)
			continue
		}
		if got, exp := ms.KeySize, sizeOf(t, w.key); got != exp {
			t.Errorf("map %s: key size %d in ELF, Go type has %d", name, got, exp)
		}
		if got, exp := ms.ValueSize, sizeOf(t, w.value); got != exp {
			t.Errorf("map %s: value size %d in ELF, Go type has %d", name, got, exp)
		}
		if ms.Pinning != ebpf.PinByName {
			t.Errorf("map %s is not pinned by name", name)
		}
	}
	for name := range spec.Maps {
		if _, ok := want[name]; !ok && name != ".rodata" && name != ".bss" && name != ".data" {
			t.Errorf("map %s has no typed view in pkg/maps", name)
		}
	}
}

func sizeOf(t *testing.T, v any) uint32 {
	t.Helper()
	var buf bytes.Buffer
	if err := binary.Write(&buf, binary.LittleEndian, v); err != nil {
		t.Fatal(err)
	}
	return uint32(buf.Len())
}
