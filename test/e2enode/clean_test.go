//go:build e2enode && linux

package e2enode

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// hostState is what the node must leave as it found it.
type hostState struct {
	sysctls map[string]string
	missing []string // host mount points that did not exist
	rootNet rootNetState
}

// rootNetState is what the node must never touch at all: the root network namespace's
// forwarding and firewall (the kubelet and the bridge plugin turn forwarding on and add
// iptables chains in the namespace they run in, which must be the node's own).
type rootNetState struct {
	forwarding map[string]string
	firewall   string
}

// rootNetSysctls are read through /proc/sys/net, which shows the reading thread's network
// namespace: the test's threads are in the root one (DialContext's and Sniff's threads,
// which enter the node's, exit with their goroutines).
var rootNetSysctls = []string{"net.ipv4.ip_forward", "net.ipv4.conf.all.forwarding", "net.ipv6.conf.all.forwarding"}

// counters are the packet and byte counts in a ruleset dump, which traffic changes.
var counters = regexp.MustCompile(`\[\d+:\d+\]|packets \d+ bytes \d+`)

func readRootNet(t *testing.T) rootNetState {
	t.Helper()
	s := rootNetState{forwarding: map[string]string{}}
	for _, k := range rootNetSysctls {
		b, err := os.ReadFile(sysctlPath(k))
		if err != nil {
			t.Fatal(err)
		}
		s.forwarding[k] = strings.TrimSpace(string(b))
	}
	// nft shows every table (iptables-nft's too); the *tables-save tools also show the
	// legacy backend's when it is the default.
	var fw strings.Builder
	for _, c := range [][]string{{"nft", "list", "ruleset"}, {"iptables-save"}, {"ip6tables-save"}} {
		if _, err := exec.LookPath(c[0]); err != nil {
			if c[0] == "nft" {
				continue // Debian's iptables depends on libnftables, not on the nft tool
			}
			t.Fatalf("%s (package iptables): %v", c[0], err)
		}
		out, err := exec.Command(c[0], c[1:]...).Output()
		if err != nil {
			t.Fatalf("%s: %v", strings.Join(c, " "), err)
		}
		fmt.Fprintf(&fw, "== %s\n", strings.Join(c, " "))
		for _, line := range strings.Split(string(out), "\n") {
			if !strings.HasPrefix(line, "#") {
				fw.WriteString(counters.ReplaceAllString(line, "") + "\n")
			}
		}
	}
	s.firewall = fw.String()
	return s
}

// checkRootNet fails the test if the root network namespace's forwarding or firewall changed.
func checkRootNet(t *testing.T, before rootNetState, when string) {
	t.Helper()
	after := readRootNet(t)
	for _, k := range rootNetSysctls {
		if after.forwarding[k] != before.forwarding[k] {
			t.Errorf("%s: the root network namespace's %s is %s, was %s", when, k, after.forwarding[k], before.forwarding[k])
		}
	}
	if after.firewall != before.firewall {
		t.Errorf("%s: the root network namespace's firewall changed:\nbefore:\n%s\nafter:\n%s", when, before.firewall, after.firewall)
	}
}

func readHostState(t *testing.T) hostState {
	t.Helper()
	s := hostState{sysctls: map[string]string{}, rootNet: readRootNet(t)}
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
	checkRootNet(t, before.rootNet, "after the node stopped")
	// The sysctls and the host's mount points are restored by the last node out, which may
	// be another test process's (hostshare.go).
	if others := otherHostUsers(t.Logf); len(others) > 0 {
		t.Logf("nodes %v of another run still use the host: they restore its sysctls and mount points", others)
	} else {
		// The values saved before the first kubelet (after sweeping a crashed run's node,
		// whose kubelet may have changed them before this test read them).
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
