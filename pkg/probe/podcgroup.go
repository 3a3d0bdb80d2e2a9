package probe

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/pin"
)

// EnvPodsCgroup names the setting of the pods' cgroup (PodsCgroup).
const EnvPodsCgroup = "HOST_PROBE_POD_CGROUP"

// PodsCgroupOff, as the setting, turns the check off: every process of the
// node's network namespace probes, as under Istio.
const PodsCgroupOff = "none"

// kubeletPodsCgroups are where kubelet puts its pods' cgroups below the
// hierarchy's root, tried in order when the setting is empty: the systemd
// driver's and the cgroupfs driver's names under the default cgroup root,
// then under kind's and other nested nodes' /kubelet root.
var kubeletPodsCgroups = []string{
	"kubepods.slice",
	"kubepods",
	"kubelet.slice/kubelet-kubepods.slice",
	"kubelet/kubepods",
}

// PodsCgroup is the cgroup v2 directory above every pod's cgroup. A SYN to a
// pod from a socket of a process below it is not a probe: that process is a
// pod's that shares the node's network namespace (hostNetwork: an ingress
// controller, a node exporter, a CNI daemon), not kubelet, and its plaintext
// is judged by the pod's capture like any other client's. Without it every
// process of the node's namespace passes as kubelet, past STRICT.
type PodsCgroup struct {
	Dir string // the directory; "" when the check is off
	ID  uint64 // its cgroup id (the directory's inode number); 0 when off
}

// FindPodsCgroup resolves the setting against the cgroup v2 hierarchy at
// cgroupRoot (CGROUP_ROOT; empty: this process's cgroup v2 mount).
// PodsCgroupOff turns the check off. Empty looks for kubelet's usual places
// (kubeletPodsCgroups) and, where none exists, turns it off with found false,
// for the caller to warn. Otherwise it is a cgroup's path in the hierarchy,
// as kubelet's cgroupRoot is written (a leading / is the hierarchy's root),
// and must name a cgroup below the root; the error names the setting and
// what is wrong.
func FindPodsCgroup(cgroupRoot, setting string) (pc PodsCgroup, found bool, err error) {
	if setting == PodsCgroupOff {
		return PodsCgroup{}, true, nil
	}
	root, err := cgroupHierarchy(cgroupRoot)
	if err != nil {
		if setting == "" {
			return PodsCgroup{}, false, nil
		}
		return PodsCgroup{}, false, fmt.Errorf("%s=%s: %w", EnvPodsCgroup, setting, err)
	}
	if setting == "" {
		for _, rel := range kubeletPodsCgroups {
			if pc, err := podsCgroupAt(filepath.Join(root, rel)); err == nil {
				return pc, true, nil
			}
		}
		return PodsCgroup{}, false, nil
	}
	if slices.Contains(strings.Split(setting, "/"), "..") {
		return PodsCgroup{}, false, fmt.Errorf("%s=%s: a cgroup path in the hierarchy may not climb out of it with ..", EnvPodsCgroup, setting)
	}
	if pc, err = podsCgroupAt(filepath.Join(root, setting)); err != nil {
		return PodsCgroup{}, false, fmt.Errorf("%s=%s: %w", EnvPodsCgroup, setting, err)
	}
	return pc, true, nil
}

// cgroupHierarchy is the cgroup v2 hierarchy at dir (or dir/unified), or
// this process's cgroup v2 mount when dir is empty.
func cgroupHierarchy(dir string) (string, error) {
	if dir == "" {
		return pin.CgroupV2Root()
	}
	return pin.Cgroup2Under(dir)
}

// podsCgroupAt checks that dir is a directory of a cgroup v2 hierarchy, not
// its root (every process is below the root), and reads its id.
func podsCgroupAt(dir string) (PodsCgroup, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return PodsCgroup{}, fmt.Errorf("cgroup %s: %w", dir, err)
	}
	if fs.Type != unix.CGROUP2_SUPER_MAGIC {
		return PodsCgroup{}, fmt.Errorf("%s is not on a cgroup v2 file system", dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "cgroup.type")); errors.Is(err, os.ErrNotExist) {
		return PodsCgroup{}, fmt.Errorf("%s is the root of its cgroup hierarchy, above every process, not the pods' cgroup", dir)
	}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return PodsCgroup{}, fmt.Errorf("cgroup %s: %w", dir, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return PodsCgroup{}, fmt.Errorf("%s is not a cgroup directory", dir)
	}
	return PodsCgroup{Dir: dir, ID: st.Ino}, nil
}
