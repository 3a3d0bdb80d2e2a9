package loader_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestPodsSwappedLinkPinsKeepCapture: two pods' link pins swapped with
// each other (a's ingress pin names b's ingress link, and so on). The next
// agent's first attach of a replaces a's pins with new links; b's links,
// whose only pins those were, must stay attached until b's own attach
// replaces them: before, they were detached with a's repair, and b's
// traffic passed uncaptured, in plaintext, until b's turn came.
func TestPodsSwappedLinkPinsKeepCapture(t *testing.T) {
	a, b, other, root := swappedPodPins(t)
	ctx := context.Background()
	captured := func(p *netnstest.Pod, want string) {
		t.Helper()
		if r, err := loadertest.Call(p.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err != nil || r.Name != want {
			t.Errorf("from %s: reached %+v (%v), want %s", p.Name, r, err, want)
		}
	}
	l := loadertest.Load(t, root)
	defer l.Close()
	if _, err := l.AttachPod(ctx, loadertest.PodOf(a, false)); err != nil {
		t.Fatal(err)
	}
	captured(a, "outbound-a")
	captured(b, "outbound-b") // b not repaired yet: its own links still run
	if _, err := l.AttachPod(ctx, loadertest.PodOf(b, false)); err != nil {
		t.Fatal(err)
	}
	captured(a, "outbound-a")
	captured(b, "outbound-b")
	// Each pod's interface runs one program per direction: the misplaced
	// links went once their pods had new ones.
	for _, p := range []*netnstest.Pod{a, b} {
		if got := tcxPrograms(t, p.Path()); got != "rd_pod_ingress,rd_pod_egress" {
			t.Errorf("tcx programs on %s's eth0: %q, want one per direction", p.Name, got)
		}
	}
}

// TestPodsSwappedLinkPinsDetachKeepsOthers: two pods' link pins swapped
// with each other, the next agent attaches a and then detaches b (b left
// the mesh). Before, a's first attach updated and held the link at a's
// path (b's), and detaching b unpinned the link at b's path (a's) and
// closed the descriptors it held of it: a's only links went, a stayed
// enrolled with no program on its interface, its traffic passed in
// plaintext, and the link check saw nothing wrong (the link held for a,
// b's, was still attached).
func TestPodsSwappedLinkPinsDetachKeepsOthers(t *testing.T) {
	a, b, other, root := swappedPodPins(t)
	ctx := context.Background()
	l := loadertest.Load(t, root)
	defer l.Close()
	if _, err := l.AttachPod(ctx, loadertest.PodOf(a, false)); err != nil {
		t.Fatal(err)
	}
	if err := l.DetachPod(ctx, "uid-b"); err != nil {
		t.Fatal(err)
	}
	if r, err := loadertest.Call(a.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err != nil || r.Name != "outbound-a" {
		t.Errorf("from a after b's detach: reached %+v (%v), want outbound-a (captured)", r, err)
	}
	if r, err := loadertest.Call(b.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err != nil || r.Name != "other-app" {
		t.Errorf("from b after its detach: reached %+v (%v), want other-app (no longer captured)", r, err)
	}
	if got := tcxPrograms(t, b.Path()); got != "" {
		t.Errorf("tcx programs left on b's eth0 after its detach: %q", got)
	}
}

// swappedPodPins attaches two pods, a and b, each with a tunnel listener on
// 15001, beside a third pod serving "other-app" on 8080, closes the loader
// and swaps a's and b's link pins (a's ingress pin names b's ingress link,
// and so on). It returns the pods and the pin root.
func swappedPodPins(t *testing.T) (a, b, other *netnstest.Pod, root string) {
	t.Helper()
	topo := netnstest.New(t, 1)
	a, b, other = topo.Nodes[0].AddPod("a"), topo.Nodes[0].AddPod("b"), topo.Nodes[0].AddPod("other")
	root = loadertest.TempBPFFS(t)
	ctx := context.Background()
	tun := netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark}
	loadertest.Listen(t, a.Path(), "[::]:15001", "outbound-a", tun)
	loadertest.Listen(t, b.Path(), "[::]:15001", "outbound-b", tun)
	loadertest.Listen(t, other.Path(), "[::]:8080", "other-app", netns.SocketOptions{})

	l := loadertest.Load(t, root)
	sa, err := l.AttachPod(ctx, loadertest.PodOf(a, false))
	if err != nil {
		t.Fatal(err)
	}
	sb, err := l.AttachPod(ctx, loadertest.PodOf(b, false))
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	da, db := filepath.Join(root, "pods", fmt.Sprint(sa.ID)), filepath.Join(root, "pods", fmt.Sprint(sb.ID))
	for _, d := range []string{"ingress", "egress"} {
		tmp := filepath.Join(da, "swap")
		for _, mv := range [][2]string{{filepath.Join(da, d), tmp}, {filepath.Join(db, d), filepath.Join(da, d)}, {tmp, filepath.Join(db, d)}} {
			if err := os.Rename(mv[0], mv[1]); err != nil {
				t.Fatal(err)
			}
		}
	}
	return a, b, other, root
}
