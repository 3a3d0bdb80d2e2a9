package probe_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/probe"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

const holdPort = 9191 // TCP: records what each client sends, keeps the connection open

// TestProbeNATTranslatesOnlyNodePackets: a pod on the node's bridge that
// sends a segment with the node's address and port of a probe connection
// (a raw packet: any pod with CAP_NET_RAW, which container runtimes grant
// by default) gets it translated to the probe SNAT address and marked as a
// probe, as if the node had sent it: before the fix, rd_host_egress
// translated every later packet of a connection by its NAT entry, whoever
// sent it, and the pod-side capture passes such a packet to the app in
// plaintext, past STRICT mTLS. Here the injected bytes land in the open
// probe connection, read by the app. Now only packets of a socket of the
// node's own namespace are translated; the spoofed one reaches the pod with
// the node's address, where no socket has its tuple.
func TestProbeNATTranslatesOnlyNodePackets(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app, attacker := node.AddPod("app"), node.AddPod("attacker")
	got, root, _ := probedApp(t, app, 5)
	for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		t.Run(f.name, func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod(app), holdPort)
			// A probe in flight: the node's connection, open.
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			c, nodeEnd := dialFrom(ctx, t, node.Path(), dst)
			if nodeEnd.Addr() != f.node {
				t.Fatalf("the node dialled from %s, want its address %s towards the pods", nodeEnd, f.node)
			}
			// Where the connection stands, as the pod sees it: the
			// sequence numbers of the node's next segment.
			from := netip.AddrPortFrom(f.snat, nodeEnd.Port())
			seq, ack := netnstest.NextSegment(t, app, from, []byte("probe"), func() error {
				_, err := c.Write([]byte("probe"))
				return err
			})
			if b := got.wait(from, "probe", time.Second); !strings.Contains(b, "probe") {
				t.Fatalf("the app read %q from %s, want the node's probe bytes", b, from)
			}

			// The attacker on the bridge sends the node's next segment.
			before := probeSpoofedDrops(t, root)
			seg := netnstest.TCPSegment(nodeEnd, dst, seq, ack, 0x18 /* PSH|ACK */, []byte("INJECTED"))
			netnstest.InjectFrame(t, attacker, app, netnstest.IPPacket(nodeEnd.Addr(), dst.Addr(), seg))
			if b := got.wait(from, "INJECTED", time.Second); strings.Contains(b, "INJECTED") {
				t.Errorf("a segment another pod sent with the node's address was translated as the node's probe: the app read %q from %s", b, from)
			}
			if n := probeSpoofedDrops(t, root) - before; n < 1 {
				t.Errorf("drop_probe_spoofed grew by %d, want >= 1 for the forged segment", n)
			}
			// The node's own packets of the connection still are, and the
			// forged one did not reset it (passed untranslated, it would
			// meet no socket in the pod, whose reset the node takes).
			if _, err := c.Write([]byte("again")); err != nil {
				t.Fatal(err)
			}
			if b := got.wait(from, "again", 2*time.Second); !strings.Contains(b, "again") {
				t.Errorf("the node's own later segment did not reach the app from %s: read %q", from, b)
			}
		})
	}
}

// TestProbeAnswerOnlyFromTheProbedPodsVeth: another enrolled pod on the
// node forges the probed pod's answer (a raw frame to the node with the
// probed pod's address and port, to the SNAT address and the probe's node
// port, at the sequence numbers of the pod's next segment). Before the fix
// rd_host_ingress on the forger's own host veth found the probe's NAT entry
// by those addresses and ports alone and restored the node's address, so
// kubelet's probe socket took the forged bytes as the probed app's answer: a
// pod could pass or fail its neighbour's liveness probe. Now an entry
// remembers the veth its SYN left by, and a reply by any other is dropped
// (drop_probe_spoofed).
func TestProbeAnswerOnlyFromTheProbedPodsVeth(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app, forger := node.AddPod("app"), node.AddPod("forger")
	got, root, a := probedApp(t, app, 5)
	const forgerID = 6
	enroll(t, root, forger, forgerID)
	if err := attachHost(a, forger, forgerID); err != nil {
		t.Fatal(err)
	}
	for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		t.Run(f.name, func(t *testing.T) {
			appEnd := netip.AddrPortFrom(f.pod(app), holdPort)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			c, nodeEnd := dialFrom(ctx, t, node.Path(), appEnd)
			nodePort := nodeEnd.Port()
			probeEnd := netip.AddrPortFrom(f.snat, nodePort)
			if _, err := c.Write([]byte("probe")); err != nil {
				t.Fatal(err)
			}
			if b := got.wait(probeEnd, "probe", time.Second); !strings.Contains(b, "probe") {
				t.Fatalf("the app read %q from %s, want the node's probe bytes", b, probeEnd)
			}
			answer := got.conn(probeEnd)
			// The app answers once, which tells where its side stands.
			seq, ack := netnstest.NextSegment(t, app, appEnd, []byte("alive"), func() error {
				_, err := answer.Write([]byte("alive"))
				return err
			})
			if b := readFor(c, 5, time.Second); b != "alive" {
				t.Fatalf("the node read %q, want the app's answer", b)
			}

			before := probeSpoofedDrops(t, root)
			seg := netnstest.TCPSegment(appEnd, probeEnd, seq, ack, 0x18 /* PSH|ACK */, []byte("FORGED"))
			netnstest.InjectFrameToNode(t, forger, netnstest.IPPacket(appEnd.Addr(), probeEnd.Addr(), seg))
			if b := readFor(c, 64, 500*time.Millisecond); b != "" {
				t.Errorf("the node's probe socket read %q, sent by another pod with the probed pod's address", b)
			}
			if n := probeSpoofedDrops(t, root) - before; n < 1 {
				t.Errorf("drop_probe_spoofed grew by %d, want >= 1 for the forged answer", n)
			}
			// The probed pod's own answers still arrive.
			if _, err := answer.Write([]byte("still")); err != nil {
				t.Fatal(err)
			}
			if b := readFor(c, 5, 2*time.Second); b != "still" {
				t.Errorf("the node read %q after the forgery, want the app's own %q", b, "still")
			}
		})
	}
}

// probedApp serves holdPort in app, loads the probe programs into a fresh
// bpffs, enrols app as id and attaches the host programs to its veth: the
// pod whose probes every test here watches. It returns what the app
// receives, the pin root and the attacher.
func probedApp(t *testing.T, app *netnstest.Pod, id uint32) (got *received, root string, a *probe.Attacher) {
	t.Helper()
	got = holdApp(t, app)
	root = tempBPFFS(t)
	a = load(t, probe.Config{PinRoot: root})
	enroll(t, root, app, id)
	if err := attachHost(a, app, id); err != nil {
		t.Fatal(err)
	}
	return got, root, a
}

// readFor reads from c until it holds want bytes or d passed, and returns
// what it read.
func readFor(c net.Conn, want int, d time.Duration) string {
	c.SetReadDeadline(time.Now().Add(d))
	defer c.SetReadDeadline(time.Time{})
	var out []byte
	b := make([]byte, 256)
	for len(out) < want {
		n, err := c.Read(b)
		out = append(out, b[:n]...)
		if err != nil {
			break
		}
	}
	return string(out)
}

// dialFrom opens a connection from the namespace at nsPath to dst (the
// node's: kubelet's probe; this test's process is in no pod), closed when
// the test ends, and returns it with its local end, unmapped.
func dialFrom(ctx context.Context, t *testing.T, nsPath string, dst netip.AddrPort) (net.Conn, netip.AddrPort) {
	t.Helper()
	c, err := netns.Dial(ctx, nsPath, "tcp", dst.String(), netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	local := netip.MustParseAddrPort(c.LocalAddr().String())
	return c, netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
}

// holdApp serves holdPort in pod: it reads from every client and keeps
// what each sent, by the client's address, until the client closes.
func holdApp(t *testing.T, pod *netnstest.Pod) *received {
	t.Helper()
	l, err := netns.Listen(context.Background(), pod.Path(), "tcp", fmt.Sprintf("[::]:%d", holdPort), netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	r := &received{ch: make(chan struct{}, 1), by: map[netip.AddrPort]*bytes.Buffer{}, conns: map[netip.AddrPort]net.Conn{}}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				from := netip.MustParseAddrPort(c.RemoteAddr().String())
				from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
				r.mu.Lock()
				r.conns[from] = c
				r.mu.Unlock()
				b := make([]byte, 4096)
				for {
					n, err := c.Read(b)
					if n > 0 {
						r.add(from, b[:n])
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return r
}

type received struct {
	mu    sync.Mutex
	ch    chan struct{} // a nudge for wait on every add
	by    map[netip.AddrPort]*bytes.Buffer
	conns map[netip.AddrPort]net.Conn
}

// conn is the app's end of the connection from a client.
func (r *received) conn(from netip.AddrPort) net.Conn {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.conns[from]
}

func (r *received) add(from netip.AddrPort, b []byte) {
	r.mu.Lock()
	buf := r.by[from]
	if buf == nil {
		buf = &bytes.Buffer{}
		r.by[from] = buf
	}
	buf.Write(b)
	r.mu.Unlock()
	select {
	case r.ch <- struct{}{}:
	default:
	}
}

// wait returns what from sent so far, once it holds want or timeout passed.
func (r *received) wait(from netip.AddrPort, want string, timeout time.Duration) string {
	deadline := time.Now().Add(timeout)
	for {
		r.mu.Lock()
		var s string
		if b := r.by[from]; b != nil {
			s = b.String()
		}
		r.mu.Unlock()
		if strings.Contains(s, want) || time.Now().After(deadline) {
			return s
		}
		select {
		case <-r.ch:
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// TestProbeNATStaleEntryLeavesTunnelConnection: a NAT entry outlives its
// probe connection (the map is an LRU, nothing deletes on close). A node
// connection the host program must leave alone (the tunnel mark) that
// reuses the tuple of an earlier probe had its SYN left as it was, and
// every later packet translated by the stale entry: the pod's socket,
// which answered the node's address, got the rest from the SNAT address
// and the connection never carried data. A connection is now translated
// from its first packet to its last or not at all.
func TestProbeNATStaleEntryLeavesTunnelConnection(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app := node.AddPod("app")
	got, _, _ := probedApp(t, app, 6)
	for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		t.Run(f.name, func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod(app), holdPort)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			// A probe, closed with a reset so that the node keeps no
			// TIME_WAIT and its port can be taken again at once.
			c, local := dialFrom(ctx, t, node.Path(), dst)
			c.Write([]byte("probe"))
			if b := got.wait(netip.AddrPortFrom(f.snat, local.Port()), "probe", 2*time.Second); b != "probe" {
				t.Fatalf("probe: the app read %q", b)
			}
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
			time.Sleep(100 * time.Millisecond)

			// A tunnel-marked connection from the same address and port.
			m, err := netns.Dial(ctx, node.Path(), "tcp", dst.String(), netns.SocketOptions{Mark: tunnelMark, Local: net.TCPAddrFromAddrPort(local)})
			if err != nil {
				t.Fatalf("tunnel-marked dial from %s, the earlier probe's tuple: %v", local, err)
			}
			defer m.Close()
			if _, err := m.Write([]byte("marked")); err != nil {
				t.Fatal(err)
			}
			if b := got.wait(local, "marked", 2*time.Second); b != "marked" {
				t.Errorf("a tunnel-marked connection on an earlier probe's tuple: the app read %q from the node's %s (and %q from the SNAT address)",
					b, local, got.wait(netip.AddrPortFrom(f.snat, local.Port()), "", 0))
			}
		})
	}
}

// probeSpoofedDrops reads drop_probe_spoofed from the pinned reason counters
// the host programs share with the pod-side ones.
func probeSpoofedDrops(t *testing.T, root string) uint64 {
	return reasonCount(t, root, "drop_probe_spoofed")
}

// reasonCount reads the count of the reason called name (as metrics name
// it) from the pinned reason counters; 0 for a name no reason has.
func reasonCount(t *testing.T, root, name string) uint64 {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, bpf.HostProbeMapRdReasons), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for r := maps.Reason(0); r < bpf.CaptureVerdictReasonREASON_MAX; r++ {
		if maps.ReasonName(r) != name {
			continue
		}
		var per []uint64
		key := uint32(r)
		if err := m.Lookup(&key, &per); err != nil {
			t.Fatal(err)
		}
		var sum uint64
		for _, v := range per {
			sum += v
		}
		return sum
	}
	t.Errorf("no reason is called %s", name)
	return 0
}

// TestProbeSNATAddressNeverLeavesTheNode: the SNAT address is no peer, so a
// pod's packet to it that answers no probe connection the NAT map knows has
// nowhere to go. Before the fix rd_host_ingress passed it to the node, which
// routed it on like any other packet (here via a route, on a real node via
// its default route): the pod-side capture never captures that address, so
// the app's SYN left the node uncaptured (its answer, from the SNAT source,
// is dropped on the way back as spoofed), and a pod's reply to a probe
// whose entry was gone (evicted by newer node connections, forgotten by a
// restart that resized the map) carried the probe's answer off the node in
// plaintext. Now it is dropped at the pod's host veth (drop_probe_unmatched).
func TestProbeSNATAddressNeverLeavesTheNode(t *testing.T) {
	topo := netnstest.New(t, 2)
	node, far := topo.Nodes[0], topo.Nodes[1]
	app := node.AddPod("app")
	got, root, _ := probedApp(t, app, 8)
	for _, f := range []struct {
		name      string
		snat, via netip.Addr
		pod       netip.Addr
		prefix    string
	}{
		{"ipv4", probe.DefaultSNATv4, far.IPv4, app.IPv4, "/32"},
		{"ipv6", probe.DefaultSNATv6, far.IPv6, app.IPv6, "/128"},
	} {
		t.Run(f.name, func(t *testing.T) {
			// Someone off the node answers at the SNAT address, and the
			// node has a route there (a default route would do).
			if _, err := netnstest.Exec(context.Background(), far.Path(), "ip", "addr", "add", f.snat.String()+f.prefix, "dev", "lo"); err != nil {
				t.Fatal(err)
			}
			if _, err := netnstest.Exec(context.Background(), node.Path(), "ip", "route", "add", f.snat.String()+f.prefix, "via", f.via.String()); err != nil {
				t.Fatal(err)
			}
			l, err := netns.Listen(context.Background(), far.Path(), "tcp", netip.AddrPortFrom(f.snat, 7777).String(), netns.SocketOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			go acceptPeers(l)

			// Any packet from the pod to the SNAT address crossing the
			// far node's uplink has the two addresses side by side in its
			// IP header.
			leaked := append(f.pod.AsSlice(), f.snat.AsSlice()...)
			before := reasonCount(t, root, "drop_probe_unmatched")
			wire := netnstest.Capture(t, far.Path(), "uplink")
			if peer, err := dialPeerAt(app.Path(), netip.AddrPortFrom(f.snat, 7777)); err == nil {
				t.Errorf("the pod's app reached a listener at the SNAT address off the node, which saw it as %s", peer)
			}
			if bytes.Contains(wire(), leaked) {
				t.Errorf("the pod's app's SYN to the SNAT address left the node")
			}

			// A probe whose NAT entry is gone by the time the app answers.
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			c, from := dialFrom(ctx, t, node.Path(), netip.AddrPortFrom(f.pod, holdPort))
			probeEnd := netip.AddrPortFrom(f.snat, from.Port())
			c.Write([]byte("probe"))
			if b := got.wait(probeEnd, "probe", 2*time.Second); b != "probe" {
				t.Fatalf("probe: the app read %q", b)
			}
			forgetNAT(t, root)
			wire = netnstest.Capture(t, far.Path(), "uplink")
			conn := got.conn(probeEnd)
			conn.Write([]byte("PROBE-ANSWER"))
			time.Sleep(500 * time.Millisecond)
			if w := wire(); bytes.Contains(w, []byte("PROBE-ANSWER")) || bytes.Contains(w, leaked) {
				t.Errorf("the pod's answer to a probe whose NAT entry was gone left the node towards the SNAT address")
			}
			if n := reasonCount(t, root, "drop_probe_unmatched") - before; n < 2 {
				t.Errorf("drop_probe_unmatched grew by %d, want >= 2 (the app's SYN, the answer)", n)
			}
		})
	}
}

// dialPeerAt connects from the namespace at nsPath to dst and returns the
// client address the peer saw.
func dialPeerAt(nsPath string, dst netip.AddrPort) (netip.Addr, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := netns.Dial(ctx, nsPath, "tcp", dst.String(), netns.SocketOptions{})
	if err != nil {
		return netip.Addr{}, err
	}
	defer c.Close()
	return readPeer(c)
}

// forgetNAT deletes every entry of the pinned NAT map, as eviction would.
func forgetNAT(t *testing.T, root string) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, probe.NATMapName), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var k bpf.HostProbeNatKey
	var keys []bpf.HostProbeNatKey
	var v bpf.HostProbeNatEntry
	for it := m.Iterate(); it.Next(&k, &v); {
		keys = append(keys, k)
	}
	for _, k := range keys {
		m.Delete(&k)
	}
}
