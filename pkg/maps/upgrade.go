package maps

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// counterMaps are the pinned maps that only count: losing their contents
// costs a reset of some metrics, nothing else.
var counterMaps = []string{ReasonsName}

// DropIncompatibleCounters unpins each counter map under root whose pinned
// layout differs from the one in spec, so that loading spec creates it anew
// instead of failing. An upgrade that adds a verdict reason may grow
// rd_reasons; without this, the new agent would not start on a node that ran
// the old one. Maps that hold state (enrollment, metadata) are never touched:
// for them a mismatch must fail the load. Programs still attached keep their
// old map until they are replaced. Returns the names it unpinned.
func DropIncompatibleCounters(root string, spec *ebpf.CollectionSpec) ([]string, error) {
	var dropped []string
	for _, name := range counterMaps {
		want, ok := spec.Maps[name]
		if !ok {
			continue
		}
		path := filepath.Join(root, name)
		m, err := ebpf.LoadPinnedMap(path, nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return dropped, fmt.Errorf("open pinned map %s: %w", path, err)
		}
		same := m.Type() == want.Type && m.KeySize() == want.KeySize && m.ValueSize() == want.ValueSize &&
			m.MaxEntries() == want.MaxEntries && m.Flags() == want.Flags
		m.Close()
		if same {
			continue
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return dropped, fmt.Errorf("unpin incompatible counter map %s: %w", path, err)
		}
		dropped = append(dropped, name)
	}
	return dropped, nil
}
