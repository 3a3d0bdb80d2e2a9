// Package pin keeps BPF objects on a bpffs so they outlive the agent:
// it mounts a bpffs where none is, and attaches tcx links that are pinned,
// updated in place by a new process, and detached by removing the pin.
package pin

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// EnsureBPFFS makes root a directory on a bpffs, mounting one where none is:
// on /sys/fs/bpf when root lies below it (the usual node layout), else on
// root itself (tests and simulated nodes use their own roots).
func EnsureBPFFS(root string) error {
	if OnBPFFS(root) {
		return nil
	}
	const sysBPF = "/sys/fs/bpf"
	if strings.HasPrefix(filepath.Clean(root)+"/", sysBPF+"/") && !OnBPFFS(sysBPF) {
		if err := unix.Mount("bpffs", sysBPF, "bpf", 0, "mode=0700"); err != nil {
			return fmt.Errorf("mount bpffs on %s: %w", sysBPF, err)
		}
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return fmt.Errorf("create pin root %s: %w", root, err)
	}
	if OnBPFFS(root) {
		return nil
	}
	if err := unix.Mount("bpffs", root, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs on %s: %w", root, err)
	}
	return nil
}

// OnBPFFS reports whether path is on a bpffs.
func OnBPFFS(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.BPF_FS_MAGIC
}

// RemoveRoot deletes the (empty) pin root, unmounting it first if it is a
// bpffs mount of its own.
func RemoveRoot(root string) error {
	if isMountPoint(root) {
		if err := unix.Unmount(root, 0); err != nil {
			return fmt.Errorf("unmount %s: %w", root, err)
		}
	}
	if err := os.Remove(root); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove pin root %s: %w", root, err)
	}
	return nil
}

func isMountPoint(path string) bool {
	var st, parent unix.Stat_t
	if unix.Stat(path, &st) != nil || unix.Stat(filepath.Dir(path), &parent) != nil {
		return false
	}
	return st.Dev != parent.Dev
}

// UpdateTCX points the tcx link pinned at path at prog. The link stays
// attached throughout, so no packet goes unhandled. It reports
// os.ErrNotExist when nothing is pinned there, and an error when the link
// is defunct (its interface is gone).
func UpdateTCX(path string, prog *ebpf.Program) error {
	lk, err := link.LoadPinnedLink(path, &ebpf.LoadPinOptions{})
	if err != nil {
		return err
	}
	defer lk.Close()
	if err := lk.Update(prog); err != nil {
		return fmt.Errorf("update pinned link %s: %w", path, err)
	}
	return nil
}

// AttachTCX updates the link pinned at path, or attaches prog to ifindex
// and pins the new link there. The kernel resolves ifindex in the calling
// thread's network namespace. A defunct link or stale pin is replaced.
func AttachTCX(path string, ifindex int, prog *ebpf.Program, attach ebpf.AttachType) error {
	err := UpdateTCX(path, prog)
	if err == nil {
		return nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		_ = os.Remove(path)
	}
	lk, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: attach})
	if err != nil {
		return fmt.Errorf("attach tcx %s: %w", filepath.Base(path), err)
	}
	defer lk.Close()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("create pin dir: %w", err)
	}
	if err := lk.Pin(path); err != nil {
		return fmt.Errorf("pin tcx link %s: %w", path, err)
	}
	return nil
}

// DetachLink removes the pin at path; the kernel detaches the link with its
// last reference. A missing pin is fine.
func DetachLink(path string) error {
	lk, err := link.LoadPinnedLink(path, &ebpf.LoadPinOptions{})
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		// Defunct links cannot be opened as links; the pin is all that is left.
		if rmErr := os.Remove(path); rmErr != nil && !errors.Is(rmErr, os.ErrNotExist) {
			return fmt.Errorf("remove pin %s: %w", path, rmErr)
		}
		return nil
	}
	defer lk.Close()
	if err := lk.Unpin(); err != nil {
		return fmt.Errorf("unpin %s: %w", path, err)
	}
	return nil
}
