package pin

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

func TestCgroupV2Root(t *testing.T) {
	p, err := CgroupV2Root()
	if err != nil {
		t.Fatal(err)
	}
	if p == "" || p[0] != '/' {
		t.Fatalf("cgroup v2 root %q", p)
	}
}

// TestCgroupV2RootLongLine: a mountinfo line longer than the scanner holds
// is an error naming the file (the scan ended there and said there was no
// cgroup v2 mount); lines before the cgroup2 one are skipped.
func TestCgroupV2RootLongLine(t *testing.T) {
	const cg = "35 24 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
	long := "1 2 0:1 / /" + strings.Repeat("x", 70<<10) + " rw - tmpfs tmpfs rw\n"
	if _, err := cgroupV2Root(strings.NewReader(long+cg), "mountinfo"); err == nil || !strings.Contains(err.Error(), "read mountinfo: bufio.Scanner: token too long") {
		t.Errorf("a long line: %v, want an error naming the file", err)
	}
	if p, err := cgroupV2Root(strings.NewReader("1 2 0:1 / /tmp rw - tmpfs tmpfs rw\n"+cg), "mountinfo"); err != nil || p != "/sys/fs/cgroup" {
		t.Errorf("cgroupV2Root = %q, %v; want /sys/fs/cgroup", p, err)
	}
}

// cgroupRig mounts a bpffs for pins (root) and makes a child cgroup named
// after name under the cgroup v2 root (top), both gone when t ends.
func cgroupRig(t *testing.T, name string) (root, top, child string) {
	t.Helper()
	root = filepath.Join(t.TempDir(), "bpf")
	t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	if err := EnsureBPFFS(root); err != nil {
		t.Fatal(err)
	}
	top, err := CgroupV2Root()
	if err != nil {
		t.Fatal(err)
	}
	child = filepath.Join(top, fmt.Sprintf("%s-%d", name, os.Getpid()))
	if err := os.Mkdir(child, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(child) })
	return root, top, child
}

// TestAttachCgroupFollowsTheSetting: a second attach on the same cgroup
// updates the pinned link in place; on another cgroup the program moves
// there and leaves the first; DetachLink takes it off.
func TestAttachCgroupFollowsTheSetting(t *testing.T) {
	root, top, child := cgroupRig(t, "rd-pin-test")
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SockOps, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	info, err := prog.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	path := filepath.Join(root, "sockops")
	t.Cleanup(func() { _ = DetachLink(path) })

	attached := func(dir string) bool {
		t.Helper()
		f, err := os.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: ebpf.AttachCGroupSockOps})
		if err != nil {
			t.Fatalf("query %s: %v", dir, err)
		}
		for _, p := range res.Programs {
			if p.ID == id {
				return true
			}
		}
		return false
	}
	for i, step := range []struct {
		dir       string
		onTop, on bool
	}{{top, true, false}, {top, true, false}, {child, false, true}} {
		if err := AttachCgroup(path, step.dir, prog, ebpf.AttachCGroupSockOps); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if got := attached(top); got != step.onTop {
			t.Errorf("step %d (attach to %s): on %s = %v, want %v", i, step.dir, top, got, step.onTop)
		}
		if got := attached(child); got != step.on {
			t.Errorf("step %d (attach to %s): on %s = %v, want %v", i, step.dir, child, got, step.on)
		}
	}
	if err := DetachLink(path); err != nil {
		t.Fatal(err)
	}
	if attached(child) {
		t.Error("still attached after DetachLink")
	}
}

// TestAttachCgroupReplacesOtherAttachType: a pin at the link's path that
// holds a link of another attach type on the same cgroup (a program of
// another kind pinned there) was updated with prog, which the kernel
// refuses: the attach failed on every start. It is replaced instead.
func TestAttachCgroupReplacesOtherAttachType(t *testing.T) {
	root, _, child := cgroupRig(t, "rd-pin-type-test")
	path := filepath.Join(root, "sockops")
	t.Cleanup(func() { _ = DetachLink(path) })
	ret1 := asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()}
	skb, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.CGroupSKB, AttachType: ebpf.AttachCGroupInetIngress, License: "GPL", Instructions: ret1})
	if err != nil {
		t.Fatal(err)
	}
	defer skb.Close()
	other, err := link.AttachCgroup(link.CgroupOptions{Path: child, Attach: ebpf.AttachCGroupInetIngress, Program: skb})
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Pin(path); err != nil {
		t.Fatal(err)
	}
	other.Close() // the pin holds it
	sockops, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SockOps, License: "GPL", Instructions: ret1})
	if err != nil {
		t.Fatal(err)
	}
	defer sockops.Close()
	if err := AttachCgroup(path, child, sockops, ebpf.AttachCGroupSockOps); err != nil {
		t.Fatalf("attach over a pin of another attach type: %v", err)
	}
	l, err := link.LoadPinnedLink(path, &ebpf.LoadPinOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil || info.Cgroup() == nil || uint32(info.Cgroup().AttachType) != uint32(ebpf.AttachCGroupSockOps) {
		t.Fatalf("the pin holds %+v (%v), want a sockops link", info, err)
	}
}
