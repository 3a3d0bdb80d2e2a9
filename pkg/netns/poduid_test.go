package netns

import (
	"os"
	"path/filepath"
	"testing"
)

// TestPodUIDsIn reads pod UIDs from the cgroups of the processes in one
// namespace, as both kubelet cgroup drivers name them, and none from a
// process of another namespace or outside a pod.
func TestPodUIDsIn(t *testing.T) {
	own, err := Inode("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	proc := t.TempDir()
	fake := func(pid, cgroup string, ns string) {
		dir := filepath.Join(proc, pid)
		if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(ns, filepath.Join(dir, "ns", "net")); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cgroup), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	fake("10", "0::/kubepods/burstable/pod6d3e1a3c-1b2c-4d5e-8f90-0123456789ab/c0ffee\n", "/proc/self/ns/net")
	fake("11", "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod7e4f2b4d_2c3d_4e5f_9a01_123456789abc.slice/cri-containerd-1.scope\n", "/proc/self/ns/net")
	fake("12", "0::/system.slice/containerd.service\n", "/proc/self/ns/net")
	fake("13", "0::/kubepods/pod00000000-0000-0000-0000-000000000000/x\n", "/proc/1/ns/mnt") // another namespace (not a net one, even)
	fake("self", "0::/kubepods/pod11111111-1111-1111-1111-111111111111/x\n", "/proc/self/ns/net")
	got := PodUIDsIn(proc, own)
	want := map[string]bool{"6d3e1a3c-1b2c-4d5e-8f90-0123456789ab": true, "7e4f2b4d-2c3d-4e5f-9a01-123456789abc": true}
	if len(got) != len(want) || !got["6d3e1a3c-1b2c-4d5e-8f90-0123456789ab"] || !got["7e4f2b4d-2c3d-4e5f-9a01-123456789abc"] {
		t.Errorf("PodUIDsIn = %v, want %v", got, want)
	}
	if got := PodUIDsIn(filepath.Join(proc, "missing"), own); len(got) != 0 {
		t.Errorf("from a missing proc dir: %v", got)
	}
}
