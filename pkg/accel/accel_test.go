package accel

import "testing"

func TestCgroupV2Root(t *testing.T) {
	p, err := CgroupV2Root()
	if err != nil {
		t.Fatal(err)
	}
	if p == "" || p[0] != '/' {
		t.Fatalf("cgroup v2 root %q", p)
	}
}
