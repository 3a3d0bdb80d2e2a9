package probe

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
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
// PodsCgroupOff turns the check off. Empty looks first above this process's
// own cgroup (selfPodsCgroup: the agent runs in a pod, whatever kubelet's
// cgroup root), then in kubelet's usual places (kubeletPodsCgroups), and
// where neither finds it, turns the check off with found false, for the
// caller to warn. Otherwise it is a cgroup's path in the hierarchy,
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
		if dir, ok := selfPodsCgroup(root, os.Getpid()); ok {
			if pc, err := podsCgroupAt(dir); err == nil {
				return pc, true, nil
			}
		}
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

// Bounds of selfPodsCgroup's walk of the hierarchy, which runs once at start:
// a node's cgroups are a few per container.
const (
	maxCgroupWalk  = 100000
	maxCgroupDepth = 32
)

// selfPodsCgroup finds the pods' cgroup above the process pid (as this
// process's PID namespace numbers it): its cgroup is the directory of the
// hierarchy at root whose cgroup.procs lists it (the kernel lists each
// process in the reader's PID namespace), and the pods' cgroup is that
// directory's nearest ancestor named as kubelet names it: kubepods (the
// cgroupfs driver) or a systemd slice ending in kubepods.slice. A process
// outside a pod (the agent run by hand, a test) has no such ancestor.
func selfPodsCgroup(root string, pid int) (string, bool) {
	self, ok := cgroupOf(root, strconv.Itoa(pid))
	if !ok {
		return "", false
	}
	for dir := self; dir != root && strings.HasPrefix(dir, root+"/"); dir = filepath.Dir(dir) {
		if name := filepath.Base(dir); name == "kubepods" || strings.HasSuffix(name, "kubepods.slice") {
			return dir, true
		}
	}
	return "", false
}

// cgroupOf walks the hierarchy at root, depth first and within the walk's
// bounds, for the directory whose cgroup.procs lists pid.
func cgroupOf(root, pid string) (string, bool) {
	var visited int
	var walk func(dir string, depth int) (string, bool)
	walk = func(dir string, depth int) (string, bool) {
		if visited++; visited > maxCgroupWalk || depth > maxCgroupDepth {
			return "", false
		}
		if procs, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err == nil {
			if slices.Contains(strings.Fields(string(procs)), pid) {
				return dir, true
			}
		}
		entries, err := os.ReadDir(dir)
		if err != nil {
			return "", false
		}
		for _, e := range entries {
			if !e.IsDir() {
				continue
			}
			if found, ok := walk(filepath.Join(dir, e.Name()), depth+1); ok {
				return found, true
			}
		}
		return "", false
	}
	return walk(root, 0)
}
