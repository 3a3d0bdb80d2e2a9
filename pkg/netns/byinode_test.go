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
