package loader_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// olderAgentWithPod loads an agent's programs into a new pin root, claims
// the node for it (relinking, as a start does) and attaches pod p of a new
// node: the older agent of a rollback. st is p's state, dir its pin
// directory.
func olderAgentWithPod(t *testing.T) (root string, p *netnstest.Pod, older *loader.Loader, claim *maps.Claim, st loader.PodState, dir string) {
	t.Helper()
	ctx := context.Background()
	tp := netnstest.New(t, 1)
	p = tp.Nodes[0].AddPod("p")
	root = loadertest.TempBPFFS(t)
	older = loadertest.Load(t, root)
	t.Cleanup(func() { older.Close() })
	claim, err := maps.ClaimNodeThen(ctx, root, nil, func() { older.Relink(ctx) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { claim.Close() })
	older.SetClaim(claim)
	st, err = older.AttachPod(ctx, loadertest.PodOf(p, true))
	if err != nil {
		t.Fatal(err)
	}
	return root, p, older, claim, st, filepath.Join(root, "pods", fmt.Sprint(st.ID))
}

// TestTakeBackRelinksOwnPrograms: an agent that takes the node back from a
// newer one that gave it up (a rolled back upgrade) points the pods' pinned
// links back at its own programs, under the claim's lock. The newer agent
// swapped its programs into them as it loaded, and they stayed there after
// it stopped: a rollback made for a program bug kept the bug on the pods
// until the older agent restarted.
func TestTakeBackRelinksOwnPrograms(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	ctx := context.Background()
	root, p, older, claim, st, dir := olderAgentWithPod(t)
	own := pinnedPrograms(t, dir)

	// A newer agent loads (its programs go into the links), claims the
	// node, and gives it up as it stops.
	newer := loadertest.Load(t, root)
	newerClaim, err := maps.ClaimNode(ctx, root, nil)
	if err != nil {
		t.Fatal(err)
	}
	newer.SetClaim(newerClaim)
	if got := pinnedPrograms(t, dir); got[0] == own[0] || got[1] == own[1] {
		t.Fatalf("the newer agent's load left the pod's links on the older agent's programs %v: the test shows nothing", own)
	}
	if err := newerClaim.Release(ctx); err != nil {
		t.Fatal(err)
	}
	newerClaim.Close()
	newer.Close()

	var res loader.Relinked
	back, err := claim.ReclaimThen(ctx, func() { res = older.Relink(ctx) })
	if err != nil || !back {
		t.Fatalf("take the node back: %v %v", back, err)
	}
	if got := pinnedPrograms(t, dir); got != own {
		t.Errorf("after the take-back the pod's links run programs %v, want the older agent's %v", got, own)
	}
	if got := hookPrograms(t, p.Path()); !slices.Equal(got, own[:]) {
		t.Errorf("programs on the pod's interface after the take-back: %v, want only %v", got, own)
	}
	if res.Updated < 2 || len(res.Failed) != 0 {
		t.Errorf("relink: %+v, want both pod links updated and none failed", res)
	}
	if !older.KernelOK(st, true) {
		t.Error("the pod does not count as converged after the take-back")
	}
}

// TestTakeBackReplacesLinkItCannotUpdate: a pinned link the take-back
// cannot update (here one of a newer release whose program has another
// name, which the update refuses) is not left running the other agent's
// program in silence: the take-back names it, the pod fails its check, and
// the attach the next pass makes replaces the link.
func TestTakeBackReplacesLinkItCannotUpdate(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	ctx := context.Background()
	root, p, older, claim, st, dir := olderAgentWithPod(t)
	own := pinnedPrograms(t, dir)

	// The newer release's ingress program has another name: its agent
	// replaced the pod's link (a new link attached and pinned, the old
	// one let go), then gave the node up.
	newerClaim, err := maps.ClaimNode(ctx, root, nil)
	if err != nil {
		t.Fatal(err)
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "rd_pod_ingress2", Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()}}) // TCX_NEXT
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	pinPath := filepath.Join(dir, "ingress")
	err = netns.Do(p.Path(), func() error {
		iface, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		lk, err := link.AttachTCX(link.TCXOptions{Interface: iface.Attrs().Index, Program: prog, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			return err
		}
		defer lk.Close()
		if err := os.Remove(pinPath); err != nil {
			return err
		}
		return lk.Pin(pinPath)
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := newerClaim.Release(ctx); err != nil {
		t.Fatal(err)
	}
	newerClaim.Close()

	var res loader.Relinked
	if back, err := claim.ReclaimThen(ctx, func() { res = older.Relink(ctx) }); err != nil || !back {
		t.Fatalf("take the node back: %v %v", back, err)
	}
	if len(res.Failed) != 1 || !strings.Contains(res.Failed[0].Error(), "test/p") || !strings.Contains(res.Failed[0].Error(), pinPath) {
		t.Fatalf("relink failures: %v, want one naming the pod and %s", res.Failed, pinPath)
	}
	if older.KernelOK(st, false) {
		t.Fatal("a pod whose link runs another agent's program counts as converged: nothing replaces the link")
	}
	// What the full pass after the take-back does for such a pod.
	if _, err := older.AttachPod(ctx, loadertest.PodOf(p, true)); err != nil {
		t.Fatal(err)
	}
	if got := pinnedPrograms(t, dir); got != own {
		t.Errorf("after the attach the pod's links run programs %v, want %v", got, own)
	}
	if got := hookPrograms(t, p.Path()); !slices.Equal(got, own[:]) {
		t.Errorf("programs on the pod's interface after the attach: %v, want only %v (the other agent's link detached)", got, own)
	}
	if !older.KernelOK(st, false) {
		t.Error("the pod does not count as converged after its attach")
	}
}

// pinnedPrograms are the ids of the programs the links pinned at
// dir/{ingress,egress} run.
func pinnedPrograms(t *testing.T, dir string) [2]ebpf.ProgramID {
	t.Helper()
	var ids [2]ebpf.ProgramID
	for i, name := range []string{"ingress", "egress"} {
		lk, err := link.LoadPinnedLink(filepath.Join(dir, name), &ebpf.LoadPinOptions{})
		if err != nil {
			t.Fatal(err)
		}
		info, err := lk.Info()
		lk.Close()
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = info.Program
	}
	return ids
}

// hookPrograms are the ids of the tcx programs on eth0 of the namespace at
// path, ingress first.
func hookPrograms(t *testing.T, path string) []ebpf.ProgramID {
	t.Helper()
	var ids []ebpf.ProgramID
	err := netns.Do(path, func() error {
		iface, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
			r, err := link.QueryPrograms(link.QueryOptions{Target: iface.Attrs().Index, Attach: at})
			if err != nil {
				return err
			}
			for _, p := range r.Programs {
				ids = append(ids, p.ID)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// TestClaimRelinksAfterTakeBack: an agent that loaded (its programs swapped
// into the links) while an older one took the node back from a third that
// gave it up (the older one pointing the links at its own programs) points
// them at its programs again as it claims the node. Without that, the pods
// ran the older agent's programs for as long as the new one held the node:
// its link checks see attached, pinned links, whatever they run.
func TestClaimRelinksAfterTakeBack(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	ctx := context.Background()
	root, p, older, claim, _, dir := olderAgentWithPod(t)

	// A newer agent claims the node and gives it up (a rollback); the
	// newest loads meanwhile, and the older takes the node back before the
	// newest claims it.
	given, err := maps.ClaimNode(ctx, root, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := given.Release(ctx); err != nil {
		t.Fatal(err)
	}
	given.Close()
	newest := loadertest.Load(t, root)
	t.Cleanup(func() { newest.Close() })
	loaded := pinnedPrograms(t, dir)
	if back, err := claim.ReclaimThen(ctx, func() { older.Relink(ctx) }); err != nil || !back {
		t.Fatalf("take the node back: %v %v", back, err)
	}
	if got := pinnedPrograms(t, dir); got == loaded {
		t.Fatalf("the take-back left the newest agent's programs %v on the pod: the test shows nothing", got)
	}
	newestClaim, err := maps.ClaimNodeThen(ctx, root, nil, func() { newest.Relink(ctx) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { newestClaim.Close() })
	newest.SetClaim(newestClaim)
	if got := pinnedPrograms(t, dir); got != loaded {
		t.Errorf("after the newest agent's claim the pod's links run programs %v, want its own %v", got, loaded)
	}
	if got := hookPrograms(t, p.Path()); !slices.Equal(got, loaded[:]) {
		t.Errorf("programs on the pod's interface: %v, want only %v", got, loaded)
	}
}
