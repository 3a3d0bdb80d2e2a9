package loader_test

import (
	"bytes"
	"context"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
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

// lockedBuffer is a bytes.Buffer safe for the loader's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *lockedBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *lockedBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestAttachWarnsOtherInterfaces: a pod with another interface up (a second
// network, as Multus adds) is attached, with a warning that names it: the
// programs are only on the pod interface, so TCP that arrives on the other
// reaches the pod's sockets uncaptured. Interfaces that are down (the
// fallback tunnel devices every namespace gets) are not named. Before, the
// loader said nothing.
func TestAttachWarnsOtherInterfaces(t *testing.T) {
	topo := netnstest.New(t, 1)
	pod := topo.Nodes[0].AddPod("multi")
	ctx := context.Background()
	t.Cleanup(func() { netnstest.Exec(ctx, pod.Path(), "ip", "link", "del", "rdnet1") })
	for _, args := range [][]string{
		{"ip", "link", "add", "rdnet1", "type", "veth", "peer", "name", "rdnet1p"},
		{"ip", "link", "set", "rdnet1", "up"},
	} {
		if out, err := netnstest.Exec(ctx, pod.Path(), args[0], args[1:]...); err != nil {
			t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	var logs lockedBuffer
	l, err := loader.Load(ctx, loader.Config{PinRoot: loadertest.TempBPFFS(t), Settings: loader.DefaultSettings(),
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	p := loadertest.PodOf(pod, true)
	if _, err := l.AttachPod(ctx, p); err != nil {
		t.Fatal(err)
	}
	var warning string
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "other interfaces up") {
			warning = line
		}
	}
	if !strings.Contains(warning, "rdnet1") || strings.Contains(warning, "rdnet1p") || strings.Contains(warning, "eth0]") {
		t.Errorf("warning %q, want one naming rdnet1 only (rdnet1p is down)", warning)
	}
	if err := l.DetachPod(ctx, p.UID); err != nil {
		t.Fatal(err)
	}
}
