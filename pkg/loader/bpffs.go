package loader

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ensureBPFFS makes root a directory on a bpffs, mounting one where none is:
// on /sys/fs/bpf when root lies below it (the usual node layout), else on
// root itself (tests and simulated nodes use their own roots).
func ensureBPFFS(root string) error {
	if onBPFFS(root) {
		return nil
	}
	const sysBPF = "/sys/fs/bpf"
	if strings.HasPrefix(filepath.Clean(root)+"/", sysBPF+"/") && !onBPFFS(sysBPF) {
		if err := unix.Mount("bpffs", sysBPF, "bpf", 0, "mode=0700"); err != nil {
			return fmt.Errorf("mount bpffs on %s: %w", sysBPF, err)
		}
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return fmt.Errorf("create pin root %s: %w", root, err)
	}
	if onBPFFS(root) {
		return nil
	}
	if err := unix.Mount("bpffs", root, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs on %s: %w", root, err)
	}
	return nil
}

func onBPFFS(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.BPF_FS_MAGIC
}

// removeRoot deletes the (empty) pin root, unmounting it first if it is a
// bpffs mount of its own.
func removeRoot(root string) error {
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
