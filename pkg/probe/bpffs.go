package probe

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ensureBPFFS makes root a directory on a bpffs, mounting one where none is,
// the same way the loader does (this package must not import it): on
// /sys/fs/bpf when root lies below it, else on root itself.
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

// removeIfEmpty removes a pod's pin directory once neither this package nor
// the loader has anything left in it.
func removeIfEmpty(dir string) {
	_ = os.Remove(dir) // fails, harmlessly, while the directory holds pins
}
