package netns

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestIndex: the index finds namespaces by address like Finder, enters a
// namespace once (a second lookup of a known address enters none), finds a
// namespace made after it started, an address added to a namespace it had
// listed, and never returns a path that now names another namespace.
func TestIndex(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	prefix := fmt.Sprintf("rdidx%04x", rand.IntN(0xffff))
	ip := netip.MustParseAddr
	a := testNS(t, prefix+"-a", "198.18.1.1/32", "2001:db8:1::1/128")
	b := testNS(t, prefix+"-b", "198.18.1.2/32")
	dir := t.TempDir()
	link := func(ns, name string) string {
		p := filepath.Join(dir, name)
		if err := os.Symlink(ns, p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	pa, pb := link(a, "a"), link(b, "b")
	x := NewIndex(&Finder{NetNSDirs: []string{dir}})
	got, err := x.ScanFor([]netip.Addr{ip("198.18.1.1"), ip("::ffff:198.18.1.2")})
	if err != nil || got[ip("198.18.1.1")] != pa || got[ip("198.18.1.2")] != pb {
		t.Fatalf("first lookup: %v %v", got, err)
	}
	if x.Len() != 2 {
		t.Fatalf("index remembers %d namespaces, want 2", x.Len())
	}

	// A new namespace is found; a known address comes from the index.
	c := testNS(t, prefix+"-c", "198.18.1.3/32")
	pc := link(c, "c")
	got, err = x.ScanFor([]netip.Addr{ip("198.18.1.3"), ip("2001:db8:1::1")})
	if err != nil || got[ip("198.18.1.3")] != pc || got[ip("2001:db8:1::1")] != pa {
		t.Fatalf("lookup of a new namespace: %v %v", got, err)
	}

	// An address added after the namespace was listed: found by the
	// last-resort pass over known namespaces.
	if out, err := exec.Command("ip", "-n", prefix+"-b", "addr", "add", "198.18.1.22/32", "dev", "d0").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if got, err = x.ScanFor([]netip.Addr{ip("198.18.1.22")}); err != nil || got[ip("198.18.1.22")] != pb {
		t.Fatalf("lookup of an added address: %v %v", got, err)
	}

	// The path of a now reads another namespace: a's addresses are no
	// longer found there, and the gone namespace is forgotten.
	if out, err := exec.Command("ip", "netns", "del", prefix+"-a").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	testNS(t, prefix+"-a", "198.18.1.9/32")
	got, err = x.ScanFor([]netip.Addr{ip("198.18.1.1"), ip("198.18.1.9")})
	if _, stale := got[ip("198.18.1.1")]; err != nil || stale || got[ip("198.18.1.9")] != pa {
		t.Fatalf("lookup after the path was reused: %v %v", got, err)
	}
	if x.Len() != 3 {
		t.Errorf("index remembers %d namespaces, want 3 (the replaced one forgotten)", x.Len())
	}
	// Unknown addresses: none found, no error.
	if got, err = x.ScanFor([]netip.Addr{ip("198.18.9.9")}); err != nil || len(got) != 0 {
		t.Errorf("lookup of an unknown address: %v %v", got, err)
	}
}

// TestIndexInodeReused: the kernel gives a new namespace the inode number
// of one that was freed, so a pod's namespace may come with the number of
// a namespace the index knew under another path, now gone. Before the fix
// the index took it for the old one, never entered it, and the new pod's
// addresses were never found (seen in the churn soak, test/netns).
func TestIndexInodeReused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	prefix := fmt.Sprintf("rdidx%04x", rand.IntN(0xffff))
	ip := netip.MustParseAddr
	ns := testNS(t, prefix+"-r", "198.18.2.1/32")
	dir := t.TempDir()
	old, reused := filepath.Join(dir, "old"), filepath.Join(dir, "new")
	if err := os.Symlink(ns, old); err != nil {
		t.Fatal(err)
	}
	x := NewIndex(&Finder{NetNSDirs: []string{dir}})
	if got, err := x.ScanFor([]netip.Addr{ip("198.18.2.1")}); err != nil || got[ip("198.18.2.1")] != old {
		t.Fatalf("first lookup: %v %v", got, err)
	}
	// The old path goes; the same inode number comes back under a new
	// path, with the new pod's address.
	if err := os.Remove(old); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(ns, reused); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("ip", "-n", prefix+"-r", "addr", "add", "198.18.2.2/32", "dev", "d0").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if got, err := x.ScanFor([]netip.Addr{ip("198.18.2.2")}); err != nil || got[ip("198.18.2.2")] != reused {
		t.Fatalf("lookup of a namespace whose inode number the index knew at a gone path: %v %v", got, err)
	}
	if x.Len() != 1 {
		t.Errorf("index remembers %d namespaces, want 1", x.Len())
	}
}
