package nodeagent

import (
	"net/netip"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestWithCNIAddrs: a pod the rules select but whose source knows no
// address yet is enrolled with the CNI plugin's addresses, under its
// pending reason; a pod of another uid, one already addressed, and one
// the rules leave out are untouched; an address that cannot be a pod's
// keeps the pod out, with the reason.
func TestWithCNIAddrs(t *testing.T) {
	a := netip.MustParseAddr
	pending := &workload.Workload{Namespace: "mesh", Name: "new", UID: "u1", Pending: "namespace label istio.io/dataplane-mode=ambient", Reason: "pod has no IP yet"}
	otherUID := &workload.Workload{Namespace: "mesh", Name: "again", UID: "u2", Pending: "x", Reason: "pod has no IP yet"}
	addressed := &workload.Workload{Namespace: "mesh", Name: "old", UID: "u3", Enrolled: true, Addrs: []netip.Addr{a("10.0.0.3")}}
	out := &workload.Workload{Namespace: "mesh", Name: "out", UID: "u4", Reason: "pod label istio.io/dataplane-mode=none"}
	bad := &workload.Workload{Namespace: "mesh", Name: "bad", UID: "u5", Pending: "x", Reason: "pod has no IP yet"}
	ws := []*workload.Workload{pending, otherUID, addressed, out, bad}
	got := withCNIAddrs(ws, map[string]cniPod{
		"mesh/new":   {uid: "u1", addrs: []netip.Addr{a("10.0.0.1"), a("fd00::1")}},
		"mesh/again": {uid: "u-old", addrs: []netip.Addr{a("10.0.0.2")}},
		"mesh/old":   {uid: "u3", addrs: []netip.Addr{a("10.0.0.9")}},
		"mesh/out":   {uid: "u4", addrs: []netip.Addr{a("10.0.0.4")}},
		"mesh/bad":   {uid: "u5", addrs: []netip.Addr{a("127.0.0.1")}},
	})
	if w := got[0]; !w.Enrolled || w.Reason != pending.Pending || len(w.Addrs) != 2 || w.Pending != "" {
		t.Errorf("pending pod: %+v, want enrolled with the CNI's addresses under its pending reason", w)
	}
	if pending.Enrolled || len(pending.Addrs) != 0 {
		t.Errorf("the source's workload was modified: %+v", pending)
	}
	for i := 1; i <= 3; i++ {
		if got[i] != ws[i] {
			t.Errorf("workload %s changed: %+v", ws[i], got[i])
		}
	}
	if w := got[4]; w.Enrolled || len(w.Addrs) != 0 || w.Reason == "" {
		t.Errorf("pod with a loopback address from the CNI: %+v, want left out with the reason", w)
	}
}
