package pin_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/pin"
)

// TestEnsureBPFFSOnlyOnEmptyDirs: a directory with files in it is never
// mounted over (its files stay visible), the error names it; an empty one
// gets a bpffs, and a second call leaves that alone.
func TestEnsureBPFFSOnlyOnEmptyDirs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a bpffs")
	}
	busy := t.TempDir()
	foreign := filepath.Join(busy, "kubelet-state")
	if err := os.WriteFile(foreign, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(busy, unix.MNT_DETACH) })
	err := pin.EnsureBPFFS(busy)
	if !errors.Is(err, pin.ErrNotEmpty) || !strings.Contains(err.Error(), busy) || !strings.Contains(err.Error(), "kubelet-state") {
		t.Fatalf("EnsureBPFFS on a non-empty directory: %v, want ErrNotEmpty naming %s and its entry", err, busy)
	}
	if pin.OnBPFFS(busy) {
		t.Fatal("a bpffs was mounted over a non-empty directory")
	}
	if b, err := os.ReadFile(foreign); err != nil || string(b) != "keep me" {
		t.Fatalf("foreign file: %q %v", b, err)
	}

	empty := filepath.Join(t.TempDir(), "bpf")
	t.Cleanup(func() { _ = unix.Unmount(empty, unix.MNT_DETACH) })
	if err := os.Mkdir(empty, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := pin.EnsureBPFFS(empty); err != nil || !pin.OnBPFFS(empty) {
		t.Fatalf("EnsureBPFFS on an empty directory: %v (on bpffs: %v)", err, pin.OnBPFFS(empty))
	}
	// Already a bpffs, now with something in it: kept as is.
	if err := os.Mkdir(filepath.Join(empty, "pods"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := pin.EnsureBPFFS(empty); err != nil {
		t.Fatalf("EnsureBPFFS on a bpffs: %v", err)
	}
	// RemoveRootIfEmpty keeps a root with entries, and says which.
	left, err := pin.RemoveRootIfEmpty(empty)
	if err != nil || len(left) != 1 || left[0] != "pods" || !pin.OnBPFFS(empty) {
		t.Fatalf("RemoveRootIfEmpty with an entry: left %v, err %v, still mounted %v", left, err, pin.OnBPFFS(empty))
	}
	if err := os.Remove(filepath.Join(empty, "pods")); err != nil {
		t.Fatal(err)
	}
	if left, err := pin.RemoveRootIfEmpty(empty); err != nil || len(left) != 0 {
		t.Fatalf("RemoveRootIfEmpty on an empty root: left %v, err %v", left, err)
	}
	if _, err := os.Stat(empty); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("empty pin root still there: %v", err)
	}
}
