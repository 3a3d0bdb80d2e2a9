package loader_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestSwappedLinkPinsAreReplaced: a pod's ingress and egress link pins
// swapped (renamed into each other's place while no agent ran). Before,
// the next agent swapped its programs into whatever link each path named:
// the egress hook ran the ingress program and the other way round, every
// packet of the pod was dropped, and no repair ever noticed (both links
// attached, both pins present). A pinned link is now updated only when it
// is a tcx link of the path's direction running the program of that name;
// otherwise a new link is attached first and pinned in its place, and the
// misplaced one detached once both directions are in place.
func TestSwappedLinkPinsAreReplaced(t *testing.T) {
	topo := netnstest.New(t, 1)
	client, other := topo.Nodes[0].AddPod("client"), topo.Nodes[0].AddPod("other")
	root := loadertest.TempBPFFS(t)
	ctx := context.Background()
	tun := netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark}
	loadertest.Listen(t, client.Path(), "[::]:15001", "outbound", tun)
	loadertest.Listen(t, client.Path(), "[::]:15006", "inbound", tun)
	loadertest.Listen(t, client.Path(), "[::]:8080", "client-app", netns.SocketOptions{})
	loadertest.Listen(t, other.Path(), "[::]:8080", "other-app", netns.SocketOptions{})

	l := loadertest.Load(t, root)
	st, err := l.AttachPod(ctx, loadertest.PodOf(client, true))
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	pd := filepath.Join(root, "pods", fmt.Sprint(st.ID))
	in, eg, tmp := filepath.Join(pd, "ingress"), filepath.Join(pd, "egress"), filepath.Join(pd, "swap")
	for _, mv := range [][2]string{{in, tmp}, {eg, in}, {tmp, eg}} {
		if err := os.Rename(mv[0], mv[1]); err != nil {
			t.Fatal(err)
		}
	}

	// The next agent: load (upgrade) and the first reconcile.
	l = loadertest.Load(t, root)
	defer l.Close()
	if _, err := l.AttachPod(ctx, loadertest.PodOf(client, true)); err != nil {
		t.Fatal(err)
	}
	if r, err := loadertest.Call(client.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err != nil || r.Name != "outbound" {
		t.Errorf("outbound after the swapped pins: reached %+v (%v), want the outbound listener", r, err)
	}
	if r, err := loadertest.Call(other.Path(), ap(client.IPv6, 8080), netns.SocketOptions{}); err != nil || r.Name != "inbound" {
		t.Errorf("inbound after the swapped pins: reached %+v (%v), want the inbound listener", r, err)
	}
	// Each path names a link of its own direction, and the interface runs
	// one program per direction (the misplaced links are gone).
	for _, d := range []string{"ingress", "egress"} {
		lk, err := link.LoadPinnedLink(filepath.Join(pd, d), nil)
		if err != nil {
			t.Fatal(err)
		}
		info, err := lk.Info()
		lk.Close()
		if err != nil {
			t.Fatal(err)
		}
		if tcx := info.TCX(); tcx == nil || ebpf.AttachType(tcx.AttachType) != attachType(d) {
			t.Errorf("pin %s: link %+v, want a tcx %s link", d, info.TCX(), d)
		}
	}
	err = netns.Do(client.Path(), func() error {
		iface, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, d := range []string{"ingress", "egress"} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: iface.Attrs().Index, Attach: attachType(d)})
			if err != nil {
				return err
			}
			if len(res.Programs) != 1 {
				return fmt.Errorf("%d tcx %s programs on eth0, want 1", len(res.Programs), d)
			}
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
}
