//go:build e2enode && linux

package e2enode

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// hostState is what the node must leave as it found it.
type hostState struct {
	sysctls map[string]string
	missing []string // host mount points that did not exist
}

func readHostState(t *testing.T) hostState {
	t.Helper()
	s := hostState{sysctls: map[string]string{}}
	for _, k := range kubeletSysctls {
		b, err := os.ReadFile(sysctlPath(k))
		if err != nil {
			t.Fatal(err)
		}
		s.sysctls[k] = strings.TrimSpace(string(b))
	}
	for _, d := range hostMountpoints {
		if _, err := os.Stat(d); err != nil {
			s.missing = append(s.missing, d)
		}
	}
	return s
}

// checkClean fails the test if the stopped node left anything behind: a global sysctl, its
// network namespace, a cgroup, a mount, a directory, a process.
func checkClean(t *testing.T, n *Node, before hostState) {
	t.Helper()
	after := readHostState(t)
	// The values the node saved at start, after sweeping a crashed run's node (whose kubelet
	// may have changed them before this test read them).
	saved := before.sysctls
	if len(n.rec.Sysctls) > 0 {
		saved = n.rec.Sysctls
	}
	for k, v := range saved {
		if after.sysctls[k] != v {
			t.Errorf("sysctl %s is %s after the node stopped, was %s", k, after.sysctls[k], v)
		}
	}
	for _, d := range before.missing {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("mount point %s left on the host", d)
		}
	}
	for _, p := range []string{"/run/netns/" + n.Name, n.Dir} {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%s left behind", p)
		}
	}
	for _, h := range n.hierarchy {
		if _, err := os.Stat(filepath.Join(h, n.cgroupRoot)); err == nil {
			t.Errorf("cgroup %s left behind", filepath.Join(h, n.cgroupRoot))
		}
	}
	if b, err := os.ReadFile("/proc/self/mountinfo"); err == nil && strings.Contains(string(b), n.Name) {
		t.Errorf("mounts of %s left in the host's mount namespace", n.Name)
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err == nil && strings.Contains(string(b), n.Name) {
			t.Errorf("process %s still runs: %q", filepath.Dir(p), strings.ReplaceAll(string(b), "\x00", " "))
		}
	}
}
