package maps

import (
	"net/netip"
	"testing"
)

// TestPodNetNS: an entry is removed only by the pod that owns it, so a pod's
// detach never removes the entry of a pod that took the namespace's inode
// number (or the namespace) since.
func TestPodNetNS(t *testing.T) {
	m := newTestMaps(t)
	a, b := netip.MustParseAddr("10.1.0.2"), netip.MustParseAddr("fd00::2")
	if err := m.SetPodNetNS(7, a, 1); err != nil {
		t.Fatal(err)
	}
	if err := m.SetPodNetNS(8, b, 2); err != nil {
		t.Fatal(err)
	}
	if err := m.DeletePodNetNS(7, 2); err != nil {
		t.Fatal(err)
	}
	got, err := m.ListPodNetNS()
	if err != nil || len(got) != 2 || got[7] != (PodNetNS{a, 1}) || got[8] != (PodNetNS{b, 2}) {
		t.Fatalf("entries %v %v", got, err)
	}
	for _, ino := range []uint32{7, 7, 9} { // again, and absent: no error
		if err := m.DeletePodNetNS(ino, 1); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := m.ListPodNetNS(); err != nil || len(got) != 1 {
		t.Fatalf("entries after delete %v %v", got, err)
	}
	// A pin root of an older agent has no such map: reads are empty,
	// deletes succeed, writes fail.
	old := &Maps{}
	if got, err := old.ListPodNetNS(); err != nil || len(got) != 0 {
		t.Errorf("without the map: %v %v", got, err)
	}
	if err := old.DeletePodNetNS(7, 1); err != nil {
		t.Error(err)
	}
	if err := old.SetPodNetNS(7, a, 1); err == nil {
		t.Error("write without the map succeeded")
	}
}
