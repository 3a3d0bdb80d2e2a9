package maps

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

// TestLayoutVersion: a fresh root and a root of this layout pass; maps of
// an agent from before versioning count as layout 1; another layout is
// refused with ErrLayout and a message that says what to do.
func TestLayoutVersion(t *testing.T) {
	root := tempBPFFS(t)

	if err := CheckLayout(root); err != nil {
		t.Fatalf("fresh root: %v", err)
	}
	// Maps pinned by an agent before versioning: layout 1.
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(filepath.Join(root, PodsName)); err != nil {
		t.Fatal(err)
	}
	// Such an agent pinned the metadata map too (a root with pods and no
	// metadata is refused: TestLayoutPartialPinSet).
	meta, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer meta.Close()
	if err := meta.Pin(filepath.Join(root, PodMetaName)); err != nil {
		t.Fatal(err)
	}
	if err := CheckLayout(root); err != nil {
		t.Fatalf("unversioned maps, this build's layout %d: %v", LayoutVersion(), err)
	}
	if err := PinLayout(root); err != nil {
		t.Fatal(err)
	}
	if err := CheckLayout(root); err != nil {
		t.Fatalf("same layout: %v", err)
	}

	// Two agents overlap: the newer claim wins, the older sees it.
	first, err := ClaimNode(context.Background(), root, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if !first.Held() {
		t.Fatal("first claim not held")
	}
	second, err := ClaimNode(context.Background(), root, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	if first.Held() || !second.Held() {
		t.Fatalf("after a second claim: first held %v, second held %v; want only the second", first.Held(), second.Held())
	}

	// A build of another layout (the next release, or an older one).
	defer func(v string) { layoutVersion = v }(layoutVersion)
	layoutVersion = "2"
	err = CheckLayout(root)
	if !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), "layout version 1") ||
		!strings.Contains(err.Error(), "redirector uninstall --bpf-root "+root) {
		t.Fatalf("layout 2 on layout-1 maps: %v; want ErrLayout naming both versions and what to do", err)
	}
	if err := PinLayout(root); err != nil {
		t.Fatal(err)
	}
	layoutVersion = "1"
	if err := CheckLayout(root); !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), "layout version 2") {
		t.Fatalf("downgrade to layout 1 on layout-2 maps: %v; want ErrLayout", err)
	}
}
