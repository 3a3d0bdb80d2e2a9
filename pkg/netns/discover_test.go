package netns

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// testNS creates a named network namespace holding addrs on an interface
// (one end of a veth pair, both ends inside); it is deleted when the test
// ends.
func testNS(t *testing.T, name string, addrs ...string) string {
	t.Helper()
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	run("netns", "add", name)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	run("-n", name, "link", "add", "d0", "type", "veth", "peer", "name", "d1")
	run("-n", name, "link", "set", "d0", "up")
	for _, a := range addrs {
		args := []string{"-n", name, "addr", "add", a, "dev", "d0"}
		if strings.Contains(a, ":") {
			args = append(args, "nodad")
		}
		run(args...)
	}
	return filepath.Join("/var/run/netns", name)
}

func TestFinder(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	prefix := fmt.Sprintf("rdfind%04x", rand.IntN(0xffff))
	a := testNS(t, prefix+"-a", "198.18.0.1/32", "2001:db8::1/128")
	b := testNS(t, prefix+"-b", "198.18.0.1/32", "198.18.0.2/32")
	c := testNS(t, prefix+"-c", "198.18.0.3/32")
	// A directory of our own, so that the order is known: 1 < 2 < 3.
	dir := t.TempDir()
	for i, ns := range []string{a, b, c} {
		if err := os.Symlink(ns, filepath.Join(dir, fmt.Sprint(i+1))); err != nil {
			t.Fatal(err)
		}
	}
	at := func(n string) string { return filepath.Join(dir, n) }
	ip := netip.MustParseAddr
	f := &Finder{NetNSDirs: []string{dir}}

	all, err := f.Scan()
	if err != nil {
		t.Fatal(err)
	}
	want := map[netip.Addr]string{ip("198.18.0.1"): at("1"), ip("2001:db8::1"): at("1"), ip("198.18.0.2"): at("2"), ip("198.18.0.3"): at("3")}
	if len(all) != len(want) {
		t.Errorf("Scan found %v, want %v", all, want)
	}
	for a, p := range want {
		if all[a] != p {
			t.Errorf("Scan: %s in %q, want %q (the first namespace holding it)", a, all[a], p)
		}
	}

	for _, tc := range []struct {
		want    []netip.Addr
		visited []string // namespaces whose addresses must be in the result
		skipped []netip.Addr
	}{
		{want: []netip.Addr{ip("198.18.0.1")}, visited: []string{"1"}, skipped: []netip.Addr{ip("198.18.0.2"), ip("198.18.0.3")}},
		{want: []netip.Addr{ip("198.18.0.1"), ip("2001:db8::1")}, visited: []string{"1"}, skipped: []netip.Addr{ip("198.18.0.3")}},
		{want: []netip.Addr{ip("198.18.0.2")}, visited: []string{"1", "2"}, skipped: []netip.Addr{ip("198.18.0.3")}},
		{want: []netip.Addr{ip("::ffff:198.18.0.3")}, visited: []string{"1", "2", "3"}},
		// Not found anywhere: every namespace is visited, as by Scan.
		{want: []netip.Addr{ip("198.18.0.9")}, visited: []string{"1", "2", "3"}},
	} {
		got, err := f.ScanFor(tc.want)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range tc.want {
			if got[w.Unmap()] != all[w.Unmap()] {
				t.Errorf("ScanFor(%v): %s in %q, Scan says %q", tc.want, w, got[w.Unmap()], all[w.Unmap()])
			}
		}
		for _, v := range tc.visited {
			for a, p := range want {
				if p == at(v) && got[a] != p {
					t.Errorf("ScanFor(%v) = %v: namespace %s not visited", tc.want, got, v)
				}
			}
		}
		for _, s := range tc.skipped {
			if _, ok := got[s]; ok {
				t.Errorf("ScanFor(%v) = %v: went on after finding everything", tc.want, got)
			}
		}
	}
	if got, err := f.ScanFor(nil); err != nil || len(got) != 0 {
		t.Errorf("ScanFor(nil) = %v, %v; want nothing", got, err)
	}
}

func TestFinderProc(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	name := fmt.Sprintf("rdfind%04x-p", rand.IntN(0xffff))
	testNS(t, name, "198.18.1.1/32")
	// A process in the namespace; the Finder is not told about the name.
	cmd := exec.Command("ip", "netns", "exec", name, "sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	f := &Finder{ProcDir: "/proc"}
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, err := f.ScanFor([]netip.Addr{netip.MustParseAddr("198.18.1.1")})
		p := got[netip.MustParseAddr("198.18.1.1")]
		if err == nil && p != "" {
			ino, err1 := Inode(p)
			want, err2 := Inode(filepath.Join("/var/run/netns", name))
			if err1 != nil || err2 != nil || ino != want {
				t.Fatalf("found in %s (inode %d, %v), want the namespace %s (inode %d, %v)", p, ino, err1, name, want, err2)
			}
			if !strings.HasPrefix(p, "/proc/") || !strings.HasSuffix(p, "/ns/net") {
				t.Errorf("path %q is not /proc/<pid>/ns/net", p)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("address of a process's namespace not found: %v, %v", got, err)
		}
		time.Sleep(20 * time.Millisecond) // the process may not have entered it yet
	}
}

// TestFinderProcDir: the proc root is a setting (PROC_DIR): the host's /proc mounted at
// /host/proc in a pod without hostPID. A directory laid out as <dir>/<pid>/ns/net is searched
// like /proc, and non-pid entries are ignored.
func TestFinderProcDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	ns := testNS(t, fmt.Sprintf("rdfind%04x-d", rand.IntN(0xffff)), "198.18.2.1/32")
	dir := t.TempDir()
	for _, p := range []string{"4242/ns", "self/ns"} {
		if err := os.MkdirAll(filepath.Join(dir, p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(ns, filepath.Join(dir, p, "net")); err != nil {
			t.Fatal(err)
		}
	}
	got, err := (&Finder{ProcDir: dir}).ScanFor([]netip.Addr{netip.MustParseAddr("198.18.2.1")})
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, "4242", "ns", "net"); got[netip.MustParseAddr("198.18.2.1")] != want {
		t.Errorf("ScanFor = %v, want 198.18.2.1 in %s", got, want)
	}
}

func TestHostPath(t *testing.T) {
	for _, tc := range []struct{ procDir, in, want string }{
		{"/host/proc", "/proc/4242/ns/net", "/host/proc/4242/ns/net"},
		{"/host/proc/", "/proc/1/ns/net", "/host/proc/1/ns/net"},
		{"/host/proc", "/var/run/netns/cni-1234", "/var/run/netns/cni-1234"},
		{"/host/proc", "/procfoo/1/ns/net", "/procfoo/1/ns/net"},
		{"/proc", "/proc/4242/ns/net", "/proc/4242/ns/net"},
		{"", "/proc/4242/ns/net", "/proc/4242/ns/net"},
		// Not clean: left as it is, for CheckPodPath to refuse.
		{"/host/proc", "/proc/../../var/run/netns/x", "/proc/../../var/run/netns/x"},
		{"/host/proc", "/proc/1//ns/net", "/proc/1//ns/net"},
	} {
		if got := HostPath(tc.procDir, tc.in); got != tc.want {
			t.Errorf("HostPath(%q, %q) = %q, want %q", tc.procDir, tc.in, got, tc.want)
		}
	}
}
