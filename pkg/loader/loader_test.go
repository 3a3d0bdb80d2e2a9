package loader_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

func ap(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

// listenLikeTunnel opens what the tunnel would in client and server
// (transparent, marked listeners: outbound in the client, inbound and HBONE
// in the server) and an app on 8080 in server and other; a connection
// reports which listener took it.
func listenLikeTunnel(t *testing.T, client, server, other *netnstest.Pod) {
	tun := netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark}
	loadertest.Listen(t, client.Path(), "[::]:15001", "outbound", tun)
	loadertest.Listen(t, server.Path(), "[::]:15006", "inbound", tun)
	loadertest.Listen(t, server.Path(), "[::]:15008", "hbone", tun)
	loadertest.Listen(t, server.Path(), "[::]:8080", "server-app", netns.SocketOptions{})
	loadertest.Listen(t, other.Path(), "[::]:8080", "other-app", netns.SocketOptions{})
}

func TestCapture(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	client, server, other := node.AddPod("client"), node.AddPod("server"), node.AddPod("other")
	root := loadertest.TempBPFFS(t)
	l := loadertest.Load(t, root)
	defer l.Close()

	listenLikeTunnel(t, client, server, other)

	ctx := context.Background()
	if _, err := l.AttachPod(ctx, loadertest.PodOf(client, true)); err != nil {
		t.Fatal(err)
	}
	if _, err := l.AttachPod(ctx, loadertest.PodOf(server, true)); err != nil {
		t.Fatal(err)
	}

	for _, fam := range []struct {
		name                  string
		client, server, other netip.Addr
	}{
		{"ipv4", client.IPv4, server.IPv4, other.IPv4},
		{"ipv6", client.IPv6, server.IPv6, other.IPv6},
	} {
		t.Run(fam.name, func(t *testing.T) {
			// Outbound: captured by 15001, original destination as local address.
			r, err := loadertest.Call(client.Path(), ap(fam.other, 8080), netns.SocketOptions{})
			if err != nil {
				t.Fatalf("outbound: %v", err)
			}
			if r.Name != "outbound" || r.Local != ap(fam.other, 8080).String() {
				t.Errorf("outbound conn reached %+v, want the outbound listener with local %s", r, ap(fam.other, 8080))
			}
			// Inbound plaintext from an unenrolled pod: 15006 with the pod's own address.
			r, err = loadertest.Call(other.Path(), ap(fam.server, 8080), netns.SocketOptions{})
			if err != nil {
				t.Fatalf("inbound: %v", err)
			}
			if r.Name != "inbound" || r.Local != ap(fam.server, 8080).String() || !strings.HasPrefix(r.Peer, addrPrefix(fam.other)) {
				t.Errorf("inbound conn reached %+v, want the inbound listener with local %s and peer %s", r, ap(fam.server, 8080), fam.other)
			}
			// HBONE port: the real listener.
			r, err = loadertest.Call(other.Path(), ap(fam.server, 15008), netns.SocketOptions{})
			if err != nil || r.Name != "hbone" {
				t.Errorf("to :15008 reached %+v (%v), want the hbone listener", r, err)
			}
			// Tunnel-marked sockets are never captured.
			r, err = loadertest.Call(client.Path(), ap(fam.other, 8080), netns.SocketOptions{Mark: loadertest.TunnelMark})
			if err != nil || r.Name != "other-app" {
				t.Errorf("marked conn reached %+v (%v), want other-app", r, err)
			}
		})
	}

	// The probe SNAT source passes only when the host-veth program gave it
	// (pkg/probe tests that path): here no host programs run, so a packet
	// that merely carries that source is dropped, not passed as a probe.
	probe := loader.DefaultSettings().ProbeSNATv4
	if _, err := netnstest.Exec(ctx, node.Path(), "ip", "addr", "add", probe.String()+"/32", "dev", "rdbr"); err != nil {
		t.Fatal(err)
	}
	r, err := loadertest.Call(node.Path(), ap(server.IPv4, 8080), netns.SocketOptions{Local: &net.TCPAddr{IP: probe.AsSlice()}})
	if err == nil {
		t.Errorf("a conn from the probe SNAT address that no host program translated reached %+v, want it dropped", r)
	}

	// Counters: the outbound connections above were counted for the client.
	c, ok, err := l.Maps().Counters(client.IPv4)
	if err != nil || !ok || c.OutboundConns < 1 {
		t.Errorf("client v4 counters %+v ok=%v err=%v, want outbound connections counted", c, ok, err)
	}
	before := c.OutboundConns
	const n = 5
	for i := 0; i < n; i++ {
		if _, err := loadertest.Call(client.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	c, _, _ = l.Maps().Counters(client.IPv4)
	if got := c.OutboundConns - before; got != n {
		t.Errorf("after %d captured connections the counter grew by %d", n, got)
	}
	// An unenrolled pod is never touched: no entry, no counters.
	if _, ok, _ := l.Maps().Counters(other.IPv4); ok {
		t.Errorf("unenrolled pod has counters")
	}
	if _, ok, _ := l.Maps().Pod(other.IPv4); ok {
		t.Errorf("unenrolled pod has an enrollment entry")
	}
	c, _, _ = l.Maps().Counters(server.IPv6)
	if c.InboundConns < 1 {
		t.Errorf("server v6 inbound connections not counted: %+v", c)
	}

	// Kill switch: without the entry, the programs pass everything at once.
	if err := l.Maps().DeletePod(client.IPv4); err != nil {
		t.Fatal(err)
	}
	if r, err := loadertest.Call(client.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err != nil || r.Name != "other-app" {
		t.Errorf("after deleting the entry, conn reached %+v (%v), want other-app", r, err)
	}
}

func attachType(d string) ebpf.AttachType {
	if d == "ingress" {
		return ebpf.AttachTCXIngress
	}
	return ebpf.AttachTCXEgress
}

func addrPrefix(a netip.Addr) string {
	if a.Is6() {
		return "[" + a.String() + "]:"
	}
	return a.String() + ":"
}

func TestFailClosedWithoutListener(t *testing.T) {
	topo := netnstest.New(t, 1)
	client, other := topo.Nodes[0].AddPod("client"), topo.Nodes[0].AddPod("other")
	l := loadertest.Load(t, loadertest.TempBPFFS(t))
	defer l.Close()
	loadertest.Listen(t, other.Path(), "[::]:8080", "other-app", netns.SocketOptions{})
	if _, err := l.AttachPod(context.Background(), loadertest.PodOf(client, true)); err != nil {
		t.Fatal(err)
	}
	// No outbound listener: the connection must not leave in plaintext.
	if r, err := loadertest.Call(client.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err == nil {
		t.Fatalf("connection without a tunnel listener reached %+v", r)
	}
	reasons, err := l.Maps().ReasonCounts()
	if err != nil {
		t.Fatal(err)
	}
	var drops uint64
	for r, n := range reasons {
		if maps.ReasonName(r) == "drop_no_listener" {
			drops = n
		}
	}
	if drops == 0 {
		t.Errorf("no drop_no_listener counted: %v", reasons)
	}
}

func TestRestartAndUninstall(t *testing.T) {
	topo := netnstest.New(t, 1)
	client, other := topo.Nodes[0].AddPod("client"), topo.Nodes[0].AddPod("other")
	root := loadertest.TempBPFFS(t)
	ctx := context.Background()
	loadertest.Listen(t, client.Path(), "[::]:15001", "outbound", netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark})
	loadertest.Listen(t, other.Path(), "[::]:8080", "other-app", netns.SocketOptions{})

	l := loadertest.Load(t, root)
	if _, err := l.AttachPod(ctx, loadertest.PodOf(client, true)); err != nil {
		t.Fatal(err)
	}
	// The agent goes away without uninstalling: capture goes on.
	l.Close()
	if r, err := loadertest.Call(client.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err != nil || r.Name != "outbound" {
		t.Fatalf("with no loader running, conn reached %+v (%v), want outbound", r, err)
	}
	// A new loader picks the pinned state up without re-attaching.
	l = loadertest.Load(t, root)
	pods, err := l.Pods()
	if err != nil || len(pods) != 1 || pods[0].Meta.Name != "client" {
		t.Fatalf("pinned pods after restart: %+v %v", pods, err)
	}
	if r, err := loadertest.Call(client.Path(), ap(other.IPv6, 8080), netns.SocketOptions{}); err != nil || r.Name != "outbound" {
		t.Fatalf("after restart, conn reached %+v (%v), want outbound", r, err)
	}
	// bpftool prints field names of the pinned enrollment map (BTF).
	if _, err := exec.LookPath("bpftool"); err == nil {
		out, err := exec.Command("bpftool", "map", "dump", "pinned", filepath.Join(root, maps.PodsName)).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "pod_id") || !strings.Contains(string(out), "flags") {
			t.Errorf("bpftool map dump: %v\n%s", err, out)
		}
	} else {
		t.Error("bpftool not installed (make deps installs it)")
	}
	l.Close()

	if err := loader.Uninstall(ctx, root, loader.DefaultSettings(), nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(root); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin root %s still exists after uninstall (%v)", root, err)
	}
	if r, err := loadertest.Call(client.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err != nil || r.Name != "other-app" {
		t.Errorf("after uninstall, conn reached %+v (%v), want other-app", r, err)
	}
	err = netns.Do(client.Path(), func() error {
		iface, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, attach := range []string{"ingress", "egress"} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: iface.Attrs().Index, Attach: attachType(attach)})
			if err != nil {
				return fmt.Errorf("query tcx %s: %w", attach, err)
			}
			if len(res.Programs) != 0 {
				return fmt.Errorf("%d tcx %s programs left on eth0", len(res.Programs), attach)
			}
		}
		return captureRuleLeft()
	})
	if err != nil {
		t.Error(err)
	}
}

// captureRuleLeft fails if the current namespace holds a routing rule to the
// capture's table: an uninstall, or an attach that failed, must leave none.
func captureRuleLeft() error {
	rules, err := netlink.RuleList(netlink.FAMILY_ALL)
	if err != nil {
		return err
	}
	for _, r := range rules {
		if r.Table == loader.DefaultSettings().RouteTable {
			return fmt.Errorf("rule left behind: %v", r)
		}
	}
	return nil
}

func TestAttachBadInput(t *testing.T) {
	topo := netnstest.New(t, 1)
	pod := topo.Nodes[0].AddPod("pod")
	l := loadertest.Load(t, loadertest.TempBPFFS(t))
	defer l.Close()
	ctx := context.Background()
	cases := []struct {
		name string
		pod  loader.Pod
		want string
	}{
		{"missing netns", loader.Pod{UID: "u1", Namespace: "t", Name: "a", NetNS: "/var/run/netns/does-not-exist", Addrs: pod.Addrs()}, "does-not-exist"},
		{"missing interface", loader.Pod{UID: "u2", Namespace: "t", Name: "b", NetNS: pod.Path(), Interface: "eth9", Addrs: pod.Addrs()}, "eth9"},
		{"foreign address", loader.Pod{UID: "u3", Namespace: "t", Name: "c", NetNS: pod.Path(), Addrs: []netip.Addr{netip.MustParseAddr("10.9.9.9")}}, "10.9.9.9"},
		{"unspecified address", loader.Pod{UID: "u4", Namespace: "t", Name: "d", NetNS: pod.Path(), Addrs: []netip.Addr{netip.MustParseAddr("0.0.0.0")}}, "unspecified"},
		{"mapped loopback", loader.Pod{UID: "u5", Namespace: "t", Name: "e", NetNS: pod.Path(), Addrs: []netip.Addr{netip.MustParseAddr("::ffff:127.0.0.1")}}, "loopback"},
		{"multicast address", loader.Pod{UID: "u6", Namespace: "t", Name: "f", NetNS: pod.Path(), Addrs: []netip.Addr{pod.IPv4, netip.MustParseAddr("ff02::1")}}, "multicast"},
		{"link-local address", loader.Pod{UID: "u7", Namespace: "t", Name: "g", NetNS: pod.Path(), Addrs: []netip.Addr{netip.MustParseAddr("169.254.1.1")}}, "link-local"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := l.AttachPod(ctx, tc.pod)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("AttachPod error %v, want one naming %q", err, tc.want)
			}
			pods, _ := l.Pods()
			entries, _ := l.Maps().ListPods()
			if len(pods) != 0 || len(entries) != 0 {
				t.Errorf("partial state left: pods %+v entries %+v", pods, entries)
			}
		})
	}
	// Nothing in the pod either.
	if err := netns.Do(pod.Path(), captureRuleLeft); err != nil {
		t.Error(err)
	}
	// Detaching twice is fine.
	if err := l.DetachPod(ctx, "never-attached"); err != nil {
		t.Error(err)
	}
}

// TestLegacyTC attaches with clsact + cls_bpf (the fallback for kernels
// without tcx): capture works the same, and detach leaves no filter.
func TestLegacyTC(t *testing.T) {
	topo := netnstest.New(t, 1)
	client, other := topo.Nodes[0].AddPod("client"), topo.Nodes[0].AddPod("other")
	root := loadertest.TempBPFFS(t)
	ctx := context.Background()
	l, err := loader.Load(ctx, loader.Config{PinRoot: root, Settings: loader.DefaultSettings(), ForceLegacyTC: true})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	loadertest.Listen(t, client.Path(), "[::]:15001", "outbound", netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark})
	loadertest.Listen(t, other.Path(), "[::]:8080", "other-app", netns.SocketOptions{})
	st, err := l.AttachPod(ctx, loadertest.PodOf(client, true))
	if err != nil {
		t.Fatal(err)
	}
	if st.Meta.AttachMode != maps.AttachTCLegacy {
		t.Fatalf("attach mode %s, want tc", st.Meta.AttachMode)
	}
	for _, dst := range []netip.AddrPort{ap(other.IPv4, 8080), ap(other.IPv6, 8080)} {
		if r, err := loadertest.Call(client.Path(), dst, netns.SocketOptions{}); err != nil || r.Name != "outbound" || r.Local != dst.String() {
			t.Errorf("legacy tc: conn to %s reached %+v (%v), want outbound", dst, r, err)
		}
	}
	if err := l.DetachPod(ctx, "uid-client"); err != nil {
		t.Fatal(err)
	}
	err = netns.Do(client.Path(), func() error {
		iface, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			fs, err := netlink.FilterList(iface, parent)
			if err != nil {
				return err
			}
			if len(fs) != 0 {
				return fmt.Errorf("%d tc filters left under parent %x", len(fs), parent)
			}
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
	if r, err := loadertest.Call(client.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err != nil || r.Name != "other-app" {
		t.Errorf("after detach, conn reached %+v (%v), want other-app", r, err)
	}
}

// TestUninstallLeavesForeignFiles: uninstall removes what the agent pinned
// and nothing else. A --bpf-root that is not on a bpffs is refused with its
// files intact (the old code deleted <root>/pods recursively); on a bpffs,
// others' pins and directories under the root and under pods/ survive.
func TestUninstallLeavesForeignFiles(t *testing.T) {
	ctx := context.Background()
	plain := t.TempDir()
	kubeletFile := filepath.Join(plain, "pods", "0d1c-uid", "volumes", "data")
	if err := os.MkdirAll(filepath.Dir(kubeletFile), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kubeletFile, []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := loader.Uninstall(ctx, plain, loader.DefaultSettings(), nil)
	if !errors.Is(err, loader.ErrNotPinRoot) || !strings.Contains(err.Error(), plain) {
		t.Errorf("uninstall of a plain directory: %v, want ErrNotPinRoot naming it", err)
	}
	if b, err := os.ReadFile(kubeletFile); err != nil || string(b) != "precious" {
		t.Fatalf("file under a plain --bpf-root after uninstall: %q %v", b, err)
	}

	topo := netnstest.New(t, 1)
	client := topo.Nodes[0].AddPod("client")
	root := loadertest.TempBPFFS(t)
	l := loadertest.Load(t, root)
	if _, err := l.AttachPod(ctx, loadertest.PodOf(client, true)); err != nil {
		t.Fatal(err)
	}
	l.Close()
	// Others' state on the same bpffs: a pinned map at the root, one in a
	// numeric pod directory the metadata does not list, one next to this
	// agent's pod pins, and a plain directory under pods/.
	foreign := []string{
		filepath.Join(root, "cilium_policy"),
		filepath.Join(root, "pods", "999", "ingress"),
		filepath.Join(root, "pods", "1", "someone-elses"),
		filepath.Join(root, "pods", "notes", "x"),
	}
	for _, p := range foreign {
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Pin(p); err != nil {
			t.Fatal(err)
		}
		m.Close()
	}
	if err := loader.Uninstall(ctx, root, loader.DefaultSettings(), nil); err != nil {
		t.Errorf("uninstall: %v", err)
	}
	for _, p := range foreign {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("foreign pin %s removed by uninstall: %v", p, err)
		}
	}
	for _, p := range []string{maps.PodsName, maps.PodMetaName, "pods/1/ingress", "pods/1/egress"} {
		if _, err := os.Stat(filepath.Join(root, p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("agent pin %s left after uninstall: %v", p, err)
		}
	}
}
