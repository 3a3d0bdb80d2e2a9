package pin

import (
	"strings"
	"testing"
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
