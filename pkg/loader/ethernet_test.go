package loader_test

import (
	"context"
	"net/netip"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestAttachRefusesNonEthernet: a pod whose interface has no Ethernet header
// (here a tun device; WireGuard, IP tunnels and netkit in L3 mode are the
// same) is refused, and nothing of it is left. The programs read the
// EtherType at offset 12 of every frame: on such a device that is part of
// the source address, so nearly every packet, TCP included, passed
// unclassified while the pod looked enrolled. Before, the loader attached
// to any interface.
func TestAttachRefusesNonEthernet(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	pod := node.AddPod("l3")
	ctx := context.Background()
	addr := node.PodAddr4(201)
	t.Cleanup(func() { netnstest.Exec(ctx, pod.Path(), "ip", "link", "del", "rdtun0") })
	for _, args := range [][]string{
		{"ip", "tuntap", "add", "dev", "rdtun0", "mode", "tun"},
		{"ip", "addr", "add", addr.String() + "/32", "dev", "rdtun0"},
		{"ip", "link", "set", "rdtun0", "up"},
	} {
		if out, err := netnstest.Exec(ctx, pod.Path(), args[0], args[1:]...); err != nil {
			t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	l := loadertest.Load(t, loadertest.TempBPFFS(t))
	defer l.Close()

	p := loader.Pod{UID: "uid-l3", Namespace: "test", Name: "l3", NetNS: pod.Path(), Interface: "rdtun0", Addrs: []netip.Addr{addr}, CaptureInbound: true}
	if _, err := l.AttachPod(ctx, p); err == nil || !strings.Contains(err.Error(), "not an Ethernet device") {
		t.Fatalf("attach to a tun device: %v, want refused as not an Ethernet device", err)
	}
	if n := l.PodCount(); n != 0 {
		t.Errorf("%d pods attached after the refused attach, want 0", n)
	}
	if _, found, err := l.PodState(p.UID); err != nil || found {
		t.Errorf("state of the refused pod: found %v, %v; want none", found, err)
	}
	// The pod's Ethernet interface still attaches.
	if _, err := l.AttachPod(ctx, loadertest.PodOf(pod, true)); err != nil {
		t.Fatalf("attach to eth0: %v", err)
	}
	if err := l.DetachPod(ctx, loadertest.PodOf(pod, true).UID); err != nil {
		t.Fatal(err)
	}
}
