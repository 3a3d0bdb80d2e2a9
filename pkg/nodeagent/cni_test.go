package nodeagent

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestWithCNIAddrs: a pod the rules select but whose source knows no
// address yet is enrolled with the CNI plugin's addresses, under its
// pending reason; so is one whose source still has an earlier sandbox's
// addresses (before, it was attached in its new sandbox at the old
// address, which dropped its traffic, until the kubelet reported the new
// one, which it does only after the ADD succeeds); a pod of another uid,
// one whose source agrees with the report, and one the rules leave out
// are untouched; an address that cannot be a pod's keeps the pod out,
// with the reason.
func TestWithCNIAddrs(t *testing.T) {
	a := netip.MustParseAddr
	pending := &workload.Workload{Namespace: "mesh", Name: "new", UID: "u1", Pending: "namespace label istio.io/dataplane-mode=ambient", Reason: "pod has no IP yet"}
	otherUID := &workload.Workload{Namespace: "mesh", Name: "again", UID: "u2", Pending: "x", Reason: "pod has no IP yet"}
	agrees := &workload.Workload{Namespace: "mesh", Name: "same", UID: "u3", Enrolled: true, Addrs: []netip.Addr{a("fd00::3"), a("10.0.0.3")}}
	out := &workload.Workload{Namespace: "mesh", Name: "out", UID: "u4", Reason: "pod label istio.io/dataplane-mode=none"}
	bad := &workload.Workload{Namespace: "mesh", Name: "bad", UID: "u5", Pending: "x", Reason: "pod has no IP yet"}
	resandboxed := &workload.Workload{Namespace: "mesh", Name: "again-here", UID: "u6", Enrolled: true, Reason: "namespace label", Addrs: []netip.Addr{a("10.0.0.6")}}
	resandboxedBad := &workload.Workload{Namespace: "mesh", Name: "again-bad", UID: "u7", Enrolled: true, Reason: "namespace label", Addrs: []netip.Addr{a("10.0.0.7")}}
	ws := []*workload.Workload{pending, otherUID, agrees, out, bad, resandboxed, resandboxedBad}
	got := withCNIAddrs(ws, map[string]cniPod{
		"mesh/new":        {uid: "u1", addrs: []netip.Addr{a("10.0.0.1"), a("fd00::1")}},
		"mesh/again":      {uid: "u-old", addrs: []netip.Addr{a("10.0.0.2")}},
		"mesh/same":       {uid: "u3", addrs: []netip.Addr{a("10.0.0.3"), a("fd00::3")}},
		"mesh/out":        {uid: "u4", addrs: []netip.Addr{a("10.0.0.4")}},
		"mesh/bad":        {uid: "u5", addrs: []netip.Addr{a("127.0.0.1")}},
		"mesh/again-here": {uid: "u6", addrs: []netip.Addr{a("10.0.0.16")}},
		"mesh/again-bad":  {uid: "u7", addrs: []netip.Addr{a("169.254.0.7")}},
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
	if w := got[5]; !w.Enrolled || len(w.Addrs) != 1 || w.Addrs[0] != a("10.0.0.16") || !strings.Contains(w.Reason, "earlier sandbox") {
		t.Errorf("pod in a new sandbox, the API at its old address: %+v, want enrolled at the CNI's address, the reason saying why", w)
	}
	if len(resandboxed.Addrs) != 1 || resandboxed.Addrs[0] != a("10.0.0.6") {
		t.Errorf("the source's workload was modified: %+v", resandboxed)
	}
	if w := got[6]; w.Enrolled || len(w.Addrs) != 0 || w.Pending == "" {
		t.Errorf("pod in a new sandbox with a link-local address from the CNI: %+v, want not enrolled and still pending (its ADD fails)", w)
	}
}
