package pin

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// AttachCgroup makes the cgroup link pinned at path run prog: a link pinned
// there by an earlier process is updated in place (the hook never goes
// without a program), else prog is attached to the cgroup v2 directory dir
// and the new link pinned.
func AttachCgroup(path, dir string, prog *ebpf.Program, attach ebpf.AttachType) error {
	if l, err := link.LoadPinnedLink(path, &ebpf.LoadPinOptions{}); err == nil {
		defer l.Close()
		if err := l.Update(prog); err != nil {
			return fmt.Errorf("update pinned cgroup link %s: %w", path, err)
		}
		return nil
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: dir, Attach: attach, Program: prog})
	if err != nil {
		return fmt.Errorf("attach %s to cgroup %s: %w", attach, dir, err)
	}
	defer l.Close()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	if err := l.Pin(path); err != nil {
		return fmt.Errorf("pin cgroup link %s: %w", path, err)
	}
	return nil
}

// mountinfo is the kernel's list of this process's mounts.
const mountinfo = "/proc/self/mountinfo"

// CgroupV2Root finds the cgroup v2 mount from /proc/self/mountinfo (it is
// /sys/fs/cgroup on unified hosts and /sys/fs/cgroup/unified on hybrid ones).
func CgroupV2Root() (string, error) {
	f, err := os.Open(mountinfo)
	if err != nil {
		return "", err
	}
	defer f.Close()
	return cgroupV2Root(f, mountinfo)
}

// cgroupV2Root scans mountinfo lines from r (named name) for the first
// cgroup2 mount. Its read is bounded without a size limit on the file: the
// scanner holds one line (at most bufio.MaxScanTokenSize), stops at the
// first cgroup2 line, and the kernel writes one line per mount of the
// agent's mount namespace. A line over that size is an error naming the
// file, not a scan that ends early and reports no cgroup v2 mount.
func cgroupV2Root(r io.Reader, name string) (string, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		// "... mountpoint options ... - fstype source superoptions"
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok || !strings.HasPrefix(post, "cgroup2 ") {
			continue
		}
		if fields := strings.Fields(pre); len(fields) >= 5 {
			return fields[4], nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read %s: %w", name, err)
	}
	return "", fmt.Errorf("no cgroup v2 mount in %s", name)
}
