package netns

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

// podUIDInCgroup finds a Kubernetes pod UID in a /proc/<pid>/cgroup line as
// the kubelet names pod cgroups: kubepods/<qos>/pod<uid> with the cgroupfs
// driver, kubepods-<qos>-pod<uid, '-' as '_'>.slice with systemd's.
var podUIDInCgroup = regexp.MustCompile(`pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})`)

// PodUIDsIn returns the UIDs of the Kubernetes pods whose processes are in
// the network namespace with inode ino, from their cgroups under procDir
// (the host's /proc). A pod's containers share its sandbox's namespace, so
// this is one UID for a pod's namespace, and none where no process runs
// under a kubelet's cgroups (a namespace held only by a bind mount, or a
// node that is not a kubelet's). Processes that vanish meanwhile are
// skipped.
func PodUIDsIn(procDir string, ino uint64) map[string]bool {
	uids := map[string]bool{}
	entries, err := os.ReadDir(procDir)
	if err != nil {
		return uids
	}
	for _, e := range entries {
		pid := e.Name()
		if pid == "" || strings.Trim(pid, "0123456789") != "" {
			continue
		}
		if got, err := Inode(filepath.Join(procDir, pid, "ns", "net")); err != nil || got != ino {
			continue
		}
		b, err := os.ReadFile(filepath.Join(procDir, pid, "cgroup"))
		if err != nil {
			continue
		}
		for _, m := range podUIDInCgroup.FindAllStringSubmatch(string(b), -1) {
			uids[strings.ReplaceAll(m[1], "_", "-")] = true
		}
	}
	return uids
}
