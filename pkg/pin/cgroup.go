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
	"golang.org/x/sys/unix"
)

// AttachCgroup makes the cgroup link pinned at path run prog on the cgroup
// v2 directory dir. A link pinned there by an earlier process on the same
// cgroup, of the same attach type, is updated in place, so the hook never
// goes without a program. On another cgroup (the setting changed), or of
// another attach type, or one whose update fails, the new link is attached
// and pinned first and the old one detached after: a link left on another
// agent's program (an agent taking the node back from a newer one) would
// run it for as long as this one does.
func AttachCgroup(path, dir string, prog *ebpf.Program, attach ebpf.AttachType) error {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return fmt.Errorf("cgroup %s: %w", dir, err)
	}
	old, err := link.LoadPinnedLink(path, &ebpf.LoadPinOptions{})
	if err == nil {
		defer old.Close()
		info, err := old.Info()
		// Updated in place only when it is our kind of link on this
		// cgroup: a pin holding another attach type's link (on the same
		// cgroup) cannot take prog, and would fail the update every start.
		if err == nil && info.Cgroup() != nil && info.Cgroup().CgroupId == st.Ino && uint32(info.Cgroup().AttachType) == uint32(attach) &&
			old.Update(prog) == nil {
			return nil
		}
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: dir, Attach: attach, Program: prog})
	if err != nil {
		return fmt.Errorf("attach %s to cgroup %s: %w", attach, dir, err)
	}
	defer l.Close()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("pin directory of cgroup link %s: %w", path, err)
	}
	if old != nil {
		// Pin over the old link's path: renameat over an existing pin is
		// not allowed on a bpffs, so the old pin goes first; its link stays
		// attached until old is closed, after the new one is pinned.
		if err := old.Unpin(); err != nil {
			return fmt.Errorf("unpin cgroup link %s: %w", path, err)
		}
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

// Cgroup2Under returns the cgroup v2 hierarchy at dir, or at dir/unified
// (where hybrid hosts mount it below their cgroup v1 controllers).
func Cgroup2Under(dir string) (string, error) {
	for _, d := range []string{dir, filepath.Join(dir, "unified")} {
		var fs unix.Statfs_t
		if err := unix.Statfs(d, &fs); err != nil {
			if d == dir {
				return "", fmt.Errorf("cgroup %s: %w", dir, err)
			}
			continue
		}
		if fs.Type == unix.CGROUP2_SUPER_MAGIC {
			return d, nil
		}
	}
	return "", fmt.Errorf("cgroup %s: neither it nor %s/unified is on a cgroup v2 file system", dir, dir)
}
