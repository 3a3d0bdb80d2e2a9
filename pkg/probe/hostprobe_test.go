package probe_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/bpf"
	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/probe"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

const (
	appPort    = 8080 // HTTP: answers with the client address it sees
	peerPort   = 9090 // TCP: writes the client address it sees and closes
	tunnelMark = 0x539
)

// tempBPFFS is a pin root for one test. Load mounts a bpffs on it; unmounting
// it at the end removes every pin and so detaches every pinned link, also
// when the test failed half-way.
func tempBPFFS(t *testing.T) string {
	root := filepath.Join(t.TempDir(), "bpf")
	t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	return root
}

func load(t *testing.T, cfg probe.Config) *probe.Attacher {
	t.Helper()
	a, err := probe.Load(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

// serveApp runs the "app" of pod: an HTTP server on appPort and a plain TCP
// server on peerPort, both telling the client which address they see.
func serveApp(t *testing.T, pod *netnstest.Pod) {
	t.Helper()
	ctx := context.Background()
	hl, err := netns.Listen(ctx, pod.Path(), "tcp", fmt.Sprintf("[::]:%d", appPort), netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, r.RemoteAddr)
	})}
	go srv.Serve(hl)
	t.Cleanup(func() { srv.Close() })

	pl, err := netns.Listen(ctx, pod.Path(), "tcp", fmt.Sprintf("[::]:%d", peerPort), netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pl.Close() })
	go acceptPeers(pl)
}

func acceptPeers(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		fmt.Fprintf(c, "%s\n", c.RemoteAddr())
		c.Close()
	}
}

func peerAddr(s string) (netip.Addr, error) {
	ap, err := netip.ParseAddrPort(strings.TrimSpace(s))
	if err != nil {
		return netip.Addr{}, fmt.Errorf("bad peer address %q", s)
	}
	return ap.Addr().Unmap(), nil
}

// curlPeer runs curl in the namespace at nsPath, as kubelet's HTTP probe
// would, and returns the client address the app saw.
func curlPeer(nsPath string, dst netip.Addr) (netip.Addr, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	url := fmt.Sprintf("http://%s/", netip.AddrPortFrom(dst, appPort))
	out, err := netnstest.Exec(ctx, nsPath, "curl", "-sS", "-g", "--max-time", "3", url)
	if err != nil {
		return netip.Addr{}, err
	}
	return peerAddr(string(out))
}

// dialPeer connects from the namespace at nsPath to the app's peer port and
// returns the client address the app saw.
func dialPeer(nsPath string, dst netip.Addr, opts netns.SocketOptions) (netip.Addr, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := netns.Dial(ctx, nsPath, "tcp", netip.AddrPortFrom(dst, peerPort).String(), opts)
	if err != nil {
		return netip.Addr{}, err
	}
	defer c.Close()
	return readPeer(c)
}

func readPeer(c net.Conn) (netip.Addr, error) {
	c.SetDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return netip.Addr{}, fmt.Errorf("read from %s: %w", c.RemoteAddr(), err)
	}
	return peerAddr(line)
}

// enroll writes pod's addresses into the pinned enrollment map, as the
// loader does once the pod's own programs and listeners are ready.
func enroll(t *testing.T, root string, pod *netnstest.Pod, id uint32) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, bpf.HostProbeMapRdPods), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	pods := &maps.Maps{Pods: m}
	for _, a := range pod.Addrs() {
		if err := pods.SetPod(a, maps.PodSettings{PodID: id}); err != nil {
			t.Fatal(err)
		}
	}
}

// attachHost finds the pod's host veth and attaches to it, from inside the
// node's namespace, as the agent would.
func attachHost(a *probe.Attacher, pod *netnstest.Pod, id uint32) error {
	return netns.Do(pod.Node.Path(), func() error {
		idx, err := probe.HostPeerIndex(pod.Path(), "eth0")
		if err != nil {
			return err
		}
		return a.AttachHost(id, idx)
	})
}

type family struct {
	name       string
	node, snat netip.Addr // the node's address towards its pods, the SNAT address
	pod        func(*netnstest.Pod) netip.Addr
}

func families(n *netnstest.Node, snat4, snat6 netip.Addr) []family {
	return []family{
		{"ipv4", n.Gateway4(), snat4, func(p *netnstest.Pod) netip.Addr { return p.IPv4 }},
		{"ipv6", n.Gateway6(), snat6, func(p *netnstest.Pod) netip.Addr { return p.IPv6 }},
	}
}

func TestHostProbeSNAT(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app, other := node.AddPod("app"), node.AddPod("other")
	serveApp(t, app)
	root := tempBPFFS(t)
	a := load(t, probe.Config{PinRoot: root})
	const id = 7
	enroll(t, root, app, id)
	if err := attachHost(a, app, id); err != nil {
		t.Fatal(err)
	}
	// Attaching again is an in-place update.
	if err := attachHost(a, app, id); err != nil {
		t.Fatalf("second attach: %v", err)
	}

	for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		t.Run(f.name, func(t *testing.T) {
			dst := f.pod(app)
			if got, err := curlPeer(node.Path(), dst); err != nil || got != f.snat {
				t.Errorf("curl from the node: app saw %v (%v), want the SNAT address %s", got, err, f.snat)
			}
			if got, err := dialPeer(node.Path(), dst, netns.SocketOptions{}); err != nil || got != f.snat {
				t.Errorf("dial from the node: app saw %v (%v), want %s", got, err, f.snat)
			}
			// The tunnel's own sockets are never SNATed.
			if got, err := dialPeer(node.Path(), dst, netns.SocketOptions{Mark: tunnelMark}); err != nil || got != f.node {
				t.Errorf("tunnel-marked dial from the node: app saw %v (%v), want the node's %s", got, err, f.node)
			}
			// Bridged from another pod: no local socket, no SNAT.
			if got, err := dialPeer(other.Path(), dst, netns.SocketOptions{}); err != nil || got != f.pod(other) {
				t.Errorf("dial from another pod: app saw %v (%v), want that pod's %s", got, err, f.pod(other))
			}
			// The pod connecting to the node: the node answers from a local
			// socket, but with SYN-ACK, so nothing is SNATed and it works.
			l, err := netns.Listen(context.Background(), node.Path(), "tcp", netip.AddrPortFrom(f.node, 0).String(), netns.SocketOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			go acceptPeers(l)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			c, err := netns.Dial(ctx, app.Path(), "tcp", l.Addr().String(), netns.SocketOptions{})
			if err != nil {
				t.Fatalf("pod -> node: %v", err)
			}
			defer c.Close()
			if got, err := readPeer(c); err != nil || got != dst {
				t.Errorf("pod -> node: node saw %v (%v), want the pod's %s", got, err, dst)
			}
		})
	}

	c, ok, err := a.Counters(id)
	if err != nil || !ok {
		t.Fatalf("counters: %+v %v %v", c, ok, err)
	}
	t.Logf("counters after the family tests: %+v", c)
	if c.Conns < 4 || c.SNATPackets < c.Conns || c.ReplyPackets < c.Conns || c.TunnelMarked < 2 || c.Errors != 0 {
		t.Errorf("counters %+v: want >= 4 connections (2 curl + 2 dial), packets both ways, 2 tunnel-marked SYNs, no errors", c)
	}
	nat, err := a.NAT()
	if err != nil {
		t.Fatal(err)
	}
	var seen int
	for _, e := range nat {
		if e.PodID != id {
			t.Errorf("NAT entry of pod %d, want %d: %+v", e.PodID, id, e)
		}
		if e.Pod.Addr() == app.IPv4 && e.Node.Addr() == app.Node.Gateway4() && e.Pod.Port() == peerPort {
			seen++
		}
	}
	if seen == 0 {
		t.Errorf("NAT map %+v has no entry %s:%d <- %s", nat, app.IPv4, peerPort, app.Node.Gateway4())
	}
	// bpftool prints the pinned NAT map with field names (BTF).
	out, err := exec.Command("bpftool", "map", "dump", "pinned", filepath.Join(root, probe.NATMapName)).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "node_port") || !strings.Contains(string(out), "pod_id") {
		t.Errorf("bpftool map dump %s: %v\n%s", probe.NATMapName, err, out)
	}

	t.Run("checksums computed in software", func(t *testing.T) {
		// With transmit checksum offload off on both ends of the veth, each
		// side computes full checksums and the other verifies them, so a
		// wrong incremental update after the rewrite would drop the packets.
		if err := setTxChecksum(node.Path(), app.HostVeth, false); err != nil {
			t.Fatal(err)
		}
		if err := setTxChecksum(app.Path(), "eth0", false); err != nil {
			t.Fatal(err)
		}
		defer setTxChecksum(node.Path(), app.HostVeth, true)
		defer setTxChecksum(app.Path(), "eth0", true)
		for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
			if got, err := curlPeer(node.Path(), f.pod(app)); err != nil || got != f.snat {
				t.Errorf("%s: app saw %v (%v), want %s", f.name, got, err, f.snat)
			}
		}
	})

	// A new agent with other SNAT addresses swaps its programs into the
	// pinned links: the new addresses are on the wire without re-attaching.
	a.Close()
	custom4, custom6 := netip.MustParseAddr("169.254.1.2"), netip.MustParseAddr("fd99::7")
	b := load(t, probe.Config{PinRoot: root, SNATv4: custom4, SNATv6: custom6})
	for _, f := range families(node, custom4, custom6) {
		if got, err := curlPeer(node.Path(), f.pod(app)); err != nil || got != f.snat {
			t.Errorf("%s with custom SNAT: app saw %v (%v), want %s", f.name, got, err, f.snat)
		}
	}

	// Detach: SNAT stops, the app sees the node itself.
	if err := b.DetachHost(id); err != nil {
		t.Fatal(err)
	}
	if err := b.DetachHost(id); err != nil {
		t.Errorf("second detach: %v", err)
	}
	for _, f := range families(node, custom4, custom6) {
		if got, err := curlPeer(node.Path(), f.pod(app)); err != nil || got != f.node {
			t.Errorf("%s after detach: app saw %v (%v), want the node's %s", f.name, got, err, f.node)
		}
	}
	if _, ok, _ := b.Counters(id); ok {
		t.Errorf("counters left after detach")
	}
	if n, err := b.NATEntries(); err != nil || n != 0 {
		t.Errorf("%d NAT entries (%v) left after detach", n, err)
	}
	if _, err := os.Stat(filepath.Join(root, "pods", fmt.Sprint(id))); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pod pin dir left after detach: %v", err)
	}
}

// TestHostProbeManyConnections opens 10,000 probe connections per family in
// a row through a NAT map of 1024 entries: every one must be SNATed and the
// map must stay within its size.
func TestHostProbeManyConnections(t *testing.T) {
	if testing.Short() {
		t.Skip("long")
	}
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app := node.AddPod("app")
	serveApp(t, app)
	root := tempBPFFS(t)
	const natSize = 1024
	a := load(t, probe.Config{PinRoot: root, NATSize: natSize})
	enroll(t, root, app, 1)
	if err := attachHost(a, app, 1); err != nil {
		t.Fatal(err)
	}
	const n = 10000
	for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		t.Run(f.name, func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod(app), peerPort).String()
			start := time.Now()
			var failed int
			var firstErr error
			err := netns.Do(node.Path(), func() error {
				d := net.Dialer{Timeout: 2 * time.Second}
				for i := 0; i < n; i++ {
					c, err := d.Dial("tcp", dst)
					if err == nil {
						var got netip.Addr
						got, err = readPeer(c)
						c.Close()
						if err == nil && got != f.snat {
							err = fmt.Errorf("app saw %s, want %s", got, f.snat)
						}
					}
					if err != nil {
						failed++
						if firstErr == nil {
							firstErr = fmt.Errorf("connection %d: %w", i, err)
						}
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			took := time.Since(start)
			entries, err := a.NATEntries()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d probe connections took %s (%.0f/s); %d failed; NAT entries %d (size %d)",
				n, took.Round(time.Millisecond), n/took.Seconds(), failed, entries, natSize)
			if failed > 0 {
				t.Errorf("%d of %d probe connections failed; first: %v", failed, n, firstErr)
			}
			if entries > natSize || entries == 0 {
				t.Errorf("NAT map holds %d entries, want 1..%d", entries, natSize)
			}
		})
	}
	c, _, err := a.Counters(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("counters: %+v", c)
	if c.Conns < 2*n || c.Errors != 0 {
		t.Errorf("counters %+v: want >= %d connections and no errors", c, 2*n)
	}
}

// TestProbesPassFailClosedCapture combines both halves of the data path: the
// pod is enrolled with inbound capture on and no tunnel listener, so plaintext
// from another pod is dropped (fail closed), yet the node's probes reach the
// app because they come from the SNAT address.
func TestProbesPassFailClosedCapture(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app, other := node.AddPod("app"), node.AddPod("other")
	serveApp(t, app)
	root := tempBPFFS(t)
	ctx := context.Background()
	pod := loader.Pod{UID: "uid-app", Namespace: "test", Name: "app", NetNS: app.Path(), Addrs: app.Addrs(), CaptureInbound: true}

	// setup loads both objects with the same SNAT addresses and attaches
	// both halves; a second call swaps new programs into the pinned links.
	setup := func(snat4, snat6 netip.Addr) (*probe.Attacher, *loader.Loader, uint32) {
		t.Helper()
		// The probe object first: it creates rd_pods, the loader reuses it.
		a := load(t, probe.Config{PinRoot: root, SNATv4: snat4, SNATv6: snat6})
		s := loader.DefaultSettings()
		s.ProbeSNATv4, s.ProbeSNATv6 = snat4, snat6
		l, err := loader.Load(ctx, loader.Config{PinRoot: root, Settings: s})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		st, err := l.AttachPod(ctx, pod)
		if err != nil {
			t.Fatal(err)
		}
		if err := attachHost(a, app, st.ID); err != nil {
			t.Fatal(err)
		}
		return a, l, st.ID
	}
	check := func(t *testing.T, dst, snat netip.Addr) {
		if got, err := dialPeer(other.Path(), dst, netns.SocketOptions{}); err == nil {
			t.Errorf("plaintext from another pod reached the app (as %s) with no inbound listener%s", got, foreignListener(app))
		}
		if got, err := curlPeer(node.Path(), dst); err != nil || got != snat {
			t.Errorf("probe from the node: app saw %v (%v), want %s", got, err, snat)
		}
	}

	a, l, id := setup(probe.DefaultSNATv4, probe.DefaultSNATv6)
	t.Run("ipv4", func(t *testing.T) { check(t, app.IPv4, probe.DefaultSNATv4) })
	t.Run("ipv6 default address", func(t *testing.T) { check(t, app.IPv6, probe.DefaultSNATv6) })
	c, _, _ := l.Maps().Counters(app.IPv4)
	if c.DroppedPackets == 0 || c.BypassedPackets == 0 {
		t.Errorf("pod-side counters %+v: want drops (the other pod) and bypasses (the probe)", c)
	}
	a.Close()
	l.Close()

	custom6 := netip.MustParseAddr("fd16:9254:7127:1337::7f")
	a, l, id = setup(probe.DefaultSNATv4, custom6)
	t.Run("ipv6", func(t *testing.T) { check(t, app.IPv6, custom6) })

	// Without the host programs the node's connection is plaintext like any
	// other, and is dropped: probes pass only thanks to the SNAT.
	if err := a.DetachHost(id); err != nil {
		t.Fatal(err)
	}
	for _, dst := range app.Addrs() {
		if got, err := dialPeer(node.Path(), dst, netns.SocketOptions{}); err == nil {
			t.Errorf("unSNATed connection from the node reached the app at %s (as %s)%s", dst, got, foreignListener(app))
		}
	}

	// Uninstall order: the probe's pins first, then the loader's and the root.
	if err := a.Close(); err != nil {
		t.Error(err)
	}
	l.Close()
	if err := probe.Uninstall(root); err != nil {
		t.Fatal(err)
	}
	if err := loader.Uninstall(ctx, root, loader.DefaultSettings(), nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(root); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin root left after uninstall: %v", err)
	}
}

// foreignListener explains a connection that should have been dropped for
// want of a tunnel listener: on a shared machine, another test's agent may
// find this pod by its address and open listeners in its namespace.
func foreignListener(pod *netnstest.Pod) string {
	out, err := netnstest.Exec(context.Background(), pod.Path(), "ss", "-Htln", "sport = :15006")
	if err == nil && len(strings.TrimSpace(string(out))) > 0 {
		return " (another process opened an inbound listener in this pod's namespace: " + strings.TrimSpace(string(out)) + ")"
	}
	return ""
}

func TestHostPeerIndex(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	pod := node.AddPod("pod")
	err := netns.Do(node.Path(), func() error {
		idx, err := probe.HostPeerIndex(pod.Path(), "eth0")
		if err != nil {
			return err
		}
		want, err := net.InterfaceByName(pod.HostVeth)
		if err != nil {
			return err
		}
		if idx != want.Index {
			return fmt.Errorf("HostPeerIndex = %d, want %s's %d", idx, pod.HostVeth, want.Index)
		}
		if _, err := probe.HostPeerIndex(pod.Path(), "lo"); err == nil || !strings.Contains(err.Error(), "not a veth") {
			return fmt.Errorf("lo: error %v, want one saying it is not a veth", err)
		}
		if _, err := probe.HostPeerIndex(pod.Path(), "eth9"); err == nil || !strings.Contains(err.Error(), "eth9") {
			return fmt.Errorf("eth9: error %v, want one naming eth9", err)
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
	// From a namespace that does not hold the peer.
	if _, err := probe.HostPeerIndex(pod.Path(), "eth0"); err == nil {
		t.Errorf("HostPeerIndex found the peer outside the node's namespace")
	}
}

// TestDetachAfterVethGone: a pod deleted before its host links are detached
// leaves defunct pinned links behind; detaching still succeeds and removes
// them, and the pod id can be attached again elsewhere.
func TestDetachAfterVethGone(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	gone, next := node.AddPod("gone"), node.AddPod("next")
	root := tempBPFFS(t)
	a := load(t, probe.Config{PinRoot: root})
	if err := attachHost(a, gone, 3); err != nil {
		t.Fatal(err)
	}
	if _, err := netnstest.Exec(context.Background(), node.Path(), "ip", "link", "del", gone.HostVeth); err != nil {
		t.Fatal(err)
	}
	// A new agent meets the defunct links while upgrading pinned links.
	a.Close()
	a = load(t, probe.Config{PinRoot: root})
	// Re-attaching the id to another veth replaces the defunct pins.
	if err := attachHost(a, next, 3); err != nil {
		t.Fatalf("attach over defunct links: %v", err)
	}
	if _, err := netnstest.Exec(context.Background(), node.Path(), "ip", "link", "del", next.HostVeth); err != nil {
		t.Fatal(err)
	}
	if err := a.DetachHost(3); err != nil {
		t.Fatalf("detach with the veth gone: %v", err)
	}
	if _, err := os.Stat(filepath.Join(root, "pods", "3")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pins left after detach: %v", err)
	}
}

// setTxChecksum switches transmit checksum offload of iface in the namespace
// at nsPath (the legacy ethtool ioctl, so no ethtool binary is needed).
func setTxChecksum(nsPath, iface string, on bool) error {
	const (
		siocEthtool    = 0x8946
		ethtoolGTXCSUM = 0x16
		ethtoolSTXCSUM = 0x17
	)
	type ethtoolValue struct{ cmd, data uint32 }
	type ifreq struct {
		name [unix.IFNAMSIZ]byte
		data uintptr
		_    [16]byte
	}
	ioctl := func(fd int, cmd, data uint32) (uint32, error) {
		v := ethtoolValue{cmd: cmd, data: data}
		var req ifreq
		copy(req.name[:], iface)
		req.data = uintptr(unsafe.Pointer(&v))
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), siocEthtool, uintptr(unsafe.Pointer(&req)))
		runtime.KeepAlive(&v)
		if errno != 0 {
			return 0, errno
		}
		return v.data, nil
	}
	return netns.Do(nsPath, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		want := uint32(0)
		if on {
			want = 1
		}
		if _, err := ioctl(fd, ethtoolSTXCSUM, want); err != nil {
			return fmt.Errorf("set tx checksumming of %s to %v: %w", iface, on, err)
		}
		got, err := ioctl(fd, ethtoolGTXCSUM, 0)
		if err != nil {
			return fmt.Errorf("read tx checksumming of %s: %w", iface, err)
		}
		if got != want {
			return fmt.Errorf("tx checksumming of %s is %d, want %d", iface, got, want)
		}
		return nil
	})
}
