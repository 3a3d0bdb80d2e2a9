package nodeagent

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// claimAddrs gives each address of this node's enrolled pods to one pod.
// Two local pods cannot both be attached at one address: the enrollment
// entry is per address, so each attach would take it from the other and
// its inbound capture flip at every pass. The directory already keeps one
// pod per address for the tunnel; this keeps one for the loader, the same
// one.
//
// The owner is, in this order: a pod not being deleted (another pod has a
// terminating pod's address only once its sandbox, and the address with
// it, is gone); a pod already attached (a pod that turns up with an
// attached pod's address, by a manifest typo say, does not unenroll it);
// the first by namespace and name. Each rule is stable (a pod becomes
// terminating once; the refused pod is never attached), so the owner does
// not flap. The other pods are refused: their workloads (copies; ws is not
// modified) are not enrolled, with the reason, and lose the address, so
// that the directory names the owner too; refused maps their keys to an
// error naming both pods and the address.
func (a *Agent) claimAddrs(ws []*workload.Workload) (out []*workload.Workload, refused map[string]error) {
	claims := map[netip.Addr][]int{}
	for i, w := range ws {
		if w.Node == a.cfg.Node && w.Enrolled {
			for _, ad := range w.Addrs {
				claims[ad] = append(claims[ad], i)
			}
		}
	}
	var involved []int // pods with an address another pod claims too
	for _, idx := range claims {
		if len(idx) > 1 {
			involved = append(involved, idx...)
		}
	}
	if len(involved) == 0 {
		return ws, nil
	}
	slices.Sort(involved)
	involved = slices.Compact(involved)
	attached := make(map[int]bool, len(involved))
	if a.cfg.Loader != nil {
		for _, i := range involved {
			_, attached[i], _ = a.cfg.Loader.PodState(ws[i].Key())
		}
	}
	rank := func(i, j int) int {
		wi, wj := ws[i], ws[j]
		return cmp.Or(
			compareBool(wi.Terminating, wj.Terminating),
			compareBool(!attached[i], !attached[j]),
			cmp.Compare(wi.Namespace, wj.Namespace), cmp.Compare(wi.Name, wj.Name), cmp.Compare(wi.UID, wj.UID))
	}
	slices.SortFunc(involved, rank)
	// Pods outside a conflict hold their addresses alone.
	owner := map[netip.Addr]int{}
	for ad, idx := range claims {
		if len(idx) == 1 {
			owner[ad] = idx[0]
		}
	}
	refused = map[string]error{}
	var lost []int
	for _, i := range involved {
		w := ws[i]
		taken := slices.IndexFunc(w.Addrs, func(ad netip.Addr) bool { o, ok := owner[ad]; return ok && o != i })
		if taken < 0 {
			for _, ad := range w.Addrs {
				owner[ad] = i
			}
			continue
		}
		ad, o := w.Addrs[taken], owner[w.Addrs[taken]]
		why := "first by namespace and name"
		switch {
		case w.Terminating && !ws[o].Terminating:
			why = "this pod is terminating"
		case attached[o] && !attached[i]:
			why = "already attached"
		}
		refused[w.Key()] = fmt.Errorf("pod %s not enrolled: address %s belongs to pod %s (%s); one address can be one pod's only", w, ad, ws[o], why)
		lost = append(lost, i)
	}
	out = slices.Clone(ws)
	for _, i := range lost {
		c := *ws[i]
		c.Enrolled, c.Reason = false, refused[c.Key()].Error()
		c.Addrs = slices.DeleteFunc(slices.Clone(c.Addrs), func(ad netip.Addr) bool { o, ok := owner[ad]; return ok && o != i })
		out[i] = &c
	}
	return out, refused
}

// compareBool orders false before true.
func compareBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// localAddrsFirst gives the addresses of this node's pods that are not
// terminating to those pods in the directory, whatever other node's object
// claims them too: this node knows what is at its own pods' addresses (the
// CNI plugin reported them), and a pod of another node at one of them is a
// stale object or a lie (any node's kubelet writes its pods' status.podIPs,
// a manifest may say anything). Kept by name order instead, a remote pod in
// a namespace sorting first took a local pod's address: the local pod's
// inbound was judged by the remote pod's namespace and policies, and its
// outbound refused as a foreign source. The xDS source does the same for
// istiod's workloads. The remote workload (a copy; ws is not modified)
// keeps its other addresses; errs names both and the address. A terminating
// local pod's address may be another node's pod's already (an IPAM that
// moves addresses between nodes), so the directory's rules decide that one.
func (a *Agent) localAddrsFirst(ws []*workload.Workload) (out []*workload.Workload, errs []error) {
	local := map[netip.Addr]*workload.Workload{}
	for _, w := range ws {
		if w.Node == a.cfg.Node && !w.Terminating {
			for _, ad := range w.Addrs {
				if _, ok := local[ad]; !ok {
					local[ad] = w
				}
			}
		}
	}
	if len(local) == 0 {
		return ws, nil
	}
	out, cloned := ws, false
	for i, w := range ws {
		if w.Node == a.cfg.Node || !slices.ContainsFunc(w.Addrs, func(ad netip.Addr) bool { return local[ad] != nil }) {
			continue
		}
		if !cloned {
			out, cloned = slices.Clone(ws), true
		}
		c := *w
		c.Addrs = slices.DeleteFunc(slices.Clone(w.Addrs), func(ad netip.Addr) bool {
			if o := local[ad]; o != nil {
				errs = append(errs, fmt.Errorf("pod %s of node %q claims address %s of pod %s of this node; the address stays this node's pod's", w, w.Node, ad, o))
				return true
			}
			return false
		})
		out[i] = &c
	}
	return out, errs
}
