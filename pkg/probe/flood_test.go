package probe_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/probe"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// floodRig is a node with three enrolled, attached pods on its bridge; the
// probes go to app, the pod added second: the bridge floods to every port,
// and hands the original packet (the one carrying the node's socket) to
// the oldest, other, and clones without a socket to the rest.
type floodRig struct {
	node              *netnstest.Node
	other, app, third *netnstest.Pod
	got               *received
	root              string
	a                 *probe.Attacher
}

func newFloodRig(t *testing.T) *floodRig {
	topo := netnstest.New(t, 1)
	r := &floodRig{node: topo.Nodes[0]}
	r.other, r.app, r.third = r.node.AddPod("other"), r.node.AddPod("app"), r.node.AddPod("third")
	r.got = holdApp(t, r.app)
	r.root = tempBPFFS(t)
	r.a = load(t, probe.Config{PinRoot: r.root})
	for i, p := range []*netnstest.Pod{r.other, r.app, r.third} {
		id := uint32(10 + i)
		enroll(t, r.root, p, id)
		if err := attachHost(r.a, p, id); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// forget makes the bridge forget which port each pod's MAC address is on,
// as it does after 5 minutes of a pod's silence, while the node still knows
// the pod's MAC address (it connected once before): the node's next packet
// to the pod is flooded to every port. The app's port stops learning first,
// so that nothing the app sends between the flush and the probe's SYN (a
// router solicitation or MLD report once its link-local address is out of
// duplicate address detection, about a second after it came up) teaches the
// bridge its port again: that took the flood away from the IPv6 case in CI.
func (r *floodRig) forget(t *testing.T, appEnd netip.AddrPort) {
	t.Helper()
	warm, err := netns.Dial(context.Background(), r.node.Path(), "tcp", appEnd.String(), netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	warm.Close()
	time.Sleep(50 * time.Millisecond)
	ns := filepath.Base(r.node.Path())
	if out, err := exec.Command("bridge", "-n", ns, "link", "set", "dev", r.app.HostVeth, "learning", "off").CombinedOutput(); err != nil {
		t.Fatalf("turn off learning on the app's bridge port: %v: %s", err, out)
	}
	if out, err := exec.Command("bridge", "-n", ns, "fdb", "flush", "dev", "rdbr", "dynamic").CombinedOutput(); err != nil {
		t.Fatalf("flush the bridge's forwarding database: %v: %s", err, out)
	}
}

// probe opens a node connection to appEnd and checks that the app reads the
// node's bytes from the SNAT address and the node reads the app's answer.
// It returns the connection and the node's port.
func (r *floodRig) probe(t *testing.T, appEnd netip.AddrPort, snat netip.Addr) (net.Conn, uint16) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	c, nodeEnd := dialFrom(ctx, t, r.node.Path(), appEnd)
	nodePort := nodeEnd.Port()
	probeEnd := netip.AddrPortFrom(snat, nodePort)
	if _, err := c.Write([]byte("probe")); err != nil {
		t.Fatal(err)
	}
	if b := r.got.wait(probeEnd, "probe", time.Second); !strings.Contains(b, "probe") {
		t.Fatalf("the app read %q from %s, want the node's probe bytes", b, probeEnd)
	}
	answer := r.got.conn(probeEnd)
	if _, err := answer.Write([]byte("alive")); err != nil {
		t.Fatal(err)
	}
	if b := readFor(c, 5, time.Second); b != "alive" {
		t.Fatalf("the node read %q, want the app's answer", b)
	}
	return c, nodePort
}

func hostIndex(t *testing.T, p *netnstest.Pod) uint32 {
	t.Helper()
	var idx int
	if err := netns.Do(p.Node.Path(), func() (err error) {
		idx, err = probe.HostPeerIndex(p.Path(), "eth0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return uint32(idx)
}

// TestProbeThroughAFloodingBridge: a node connection to a pod whose bridge
// forwarding entry aged out is flooded. Before the fix the SYN copy that
// reached the pod, a clone without the node's socket, was not SNATed, while
// the original, with the socket, created the NAT entry on the oldest port's
// veth: the pod answered the node's own address, the node's later packets
// came from the SNAT address, and the probe failed (under STRICT the pod
// refuses the plaintext SYN outright). Now only the copy on the pod's own
// veth starts SNAT, socket or not.
func TestProbeThroughAFloodingBridge(t *testing.T) {
	r := newFloodRig(t)
	appVeth := hostIndex(t, r.app)
	for _, f := range families(r.node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		t.Run(f.name, func(t *testing.T) {
			appEnd := netip.AddrPortFrom(f.pod(r.app), holdPort)
			r.forget(t, appEnd)
			_, nodePort := r.probe(t, appEnd, f.snat)
			entries, err := r.a.NAT()
			if err != nil {
				t.Fatal(err)
			}
			found := false
			for _, e := range entries {
				if e.Pod != appEnd || e.Node.Port() != nodePort {
					continue
				}
				found = true
				if e.HostIfindex != appVeth || e.PodID != 11 || e.Node.Addr() != f.node {
					t.Errorf("NAT entry %+v, want pod 11 from %s on the app's veth %d", e, f.node, appVeth)
				}
			}
			if !found {
				t.Errorf("no NAT entry for the probe from port %d to %s in %+v", nodePort, appEnd, entries)
			}
		})
	}
}

// TestFloodedProbeCopyLeftUntouched: the copies of a flooded probe SYN that
// leave by other pods' veths pass as the node sent them, with the node's
// address, and make no NAT entry there. Before the fix the copy with the
// node's socket (on the oldest port, other's) was translated there and gave
// a pod that is not the probed one a frame with the SNAT source.
func TestFloodedProbeCopyLeftUntouched(t *testing.T) {
	r := newFloodRig(t)
	for _, f := range families(r.node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		t.Run(f.name, func(t *testing.T) {
			appEnd := netip.AddrPortFrom(f.pod(r.app), holdPort)
			r.forget(t, appEnd)
			spoofed := probeSpoofedDrops(t, r.root)
			stopOther := netnstest.Capture(t, r.other.Path(), "eth0")
			stopThird := netnstest.Capture(t, r.third.Path(), "eth0")
			// The connection alone: the copies are what matters here.
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			c, err := netns.Dial(ctx, r.node.Path(), "tcp", appEnd.String(), netns.SocketOptions{})
			if err != nil {
				stopOther()
				stopThird()
				t.Fatal(err)
			}
			defer c.Close()
			nodePort := netip.MustParseAddrPort(c.LocalAddr().String()).Port()
			time.Sleep(50 * time.Millisecond)
			seen := map[string][]byte{"other": stopOther(), "third": stopThird()}

			syn := addrsAndPorts(f.node, appEnd.Addr(), nodePort, appEnd.Port())
			snatted := addrsAndPorts(f.snat, appEnd.Addr(), nodePort, appEnd.Port())
			for name, frames := range seen {
				if !bytes.Contains(frames, syn) {
					t.Errorf("%s's eth0 saw no flooded copy of the node's SYN from %s port %d (the test needs the flood)", name, f.node, nodePort)
				}
				if bytes.Contains(frames, snatted) {
					t.Errorf("%s's eth0 saw the probe with the SNAT source %s: a flooded copy was translated on %s's veth", name, f.snat, name)
				}
			}
			entries, err := r.a.NAT()
			if err != nil {
				t.Fatal(err)
			}
			appVeth := hostIndex(t, r.app)
			for _, e := range entries {
				if e.HostIfindex != appVeth {
					t.Errorf("NAT entry %+v on veth %d, not the app's (%d)", e, e.HostIfindex, appVeth)
				}
			}
			if n := probeSpoofedDrops(t, r.root) - spoofed; n != 0 {
				t.Errorf("drop_probe_spoofed grew by %d for a node connection through a flooding bridge", n)
			}
		})
	}
}

// addrsAndPorts is how an IPv4 (without options) or IPv6 (without extension
// headers) TCP packet from src:sport to dst:dport shows its addresses and
// ports: the end of the IP header, then the start of the TCP header.
func addrsAndPorts(src, dst netip.Addr, sport, dport uint16) []byte {
	var b []byte
	b = append(b, src.AsSlice()...)
	b = append(b, dst.AsSlice()...)
	b = binary.BigEndian.AppendUint16(b, sport)
	return binary.BigEndian.AppendUint16(b, dport)
}
