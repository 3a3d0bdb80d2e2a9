package probe_test

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/probe"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestMasqueradedClientPastStaleProbeEntry: a NAT entry outlives its probe
// (nothing deletes it on close; the LRU holds 65536), so after a day of
// probes every few seconds a pod's port has entries for most of the node's
// ephemeral ports. A client from off the node that the node masquerades to
// its own address (kube-proxy's NodePort and LoadBalancer traffic with the
// default externalTrafficPolicy: Cluster) keeps its source port when it is
// free, so its connection can have the tuple of such a stale entry. Its
// packets are forwarded, not sent by the node, and rd_host_egress took every
// one but the SYN for a frame forged with a live probe's tuple and dropped it
// (drop_probe_spoofed): the client's connection hung after the handshake.
// Now a forwarded packet is dropped only while the node holds a socket of
// that tuple (the probe is live); else it passes untouched, as without the
// entry.
func TestMasqueradedClientPastStaleProbeEntry(t *testing.T) {
	topo := netnstest.New(t, 2)
	node, remote := topo.Nodes[0], topo.Nodes[1]
	app := node.AddPod("app")
	got := holdApp(t, app)
	root := tempBPFFS(t)
	a := load(t, probe.Config{PinRoot: root})
	const id = 9
	enroll(t, root, app, id)
	if err := attachHost(a, app, id); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		client := []netip.Addr{remote.IPv4, remote.IPv6}[i]
		port := 41000 + i
		t.Run(f.name, func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod(app), holdPort)
			// A probe from the node's port, done: its entry stays. It ends
			// with a reset, so the node keeps no socket of it (kubelet's
			// own sockets are gone two minutes later at the latest).
			dctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			c, err := netns.Dial(dctx, node.Path(), "tcp", dst.String(),
				netns.SocketOptions{Local: &net.TCPAddr{IP: f.node.AsSlice(), Port: port}})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := c.Write([]byte("probe")); err != nil {
				t.Fatal(err)
			}
			if b := got.wait(netip.AddrPortFrom(f.snat, uint16(port)), "probe", 3*time.Second); b != "probe" {
				t.Fatalf("the app read %q from the probe, want %q from %s", b, "probe", f.snat)
			}
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
			if n, err := a.NATEntries(); err != nil || n == 0 {
				t.Fatalf("no NAT entry left by the probe (%d, %v)", n, err)
			}

			// The node masquerades what it forwards from the remote node to
			// its pods, as kube-proxy does for NodePort traffic.
			ipt, from := "iptables", "192.168.100.0/24"
			if f.name == "ipv6" {
				ipt, from = "ip6tables", "fd00:100::/64"
			}
			if out, err := netnstest.Exec(ctx, node.Path(), ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "rdbr", "-s", from, "-j", "MASQUERADE"); err != nil {
				t.Fatalf("%s: %v: %s", ipt, err, out)
			}
			// From a port no probe used, and from the stale probe's.
			for _, p := range []int{port + 100, port} {
				c2, err := netns.Dial(dctx, remote.Path(), "tcp", dst.String(),
					netns.SocketOptions{Local: &net.TCPAddr{IP: client.AsSlice(), Port: p}})
				if err != nil {
					t.Fatalf("remote client from port %d: %v", p, err)
				}
				defer c2.Close()
				if _, err := c2.Write([]byte("hello")); err != nil {
					t.Fatal(err)
				}
				masq := netip.AddrPortFrom(f.node, uint16(p))
				if b := got.wait(masq, "hello", 3*time.Second); b != "hello" {
					t.Errorf("the app read %q from the masqueraded client %s, want %q", b, masq, "hello")
				}
			}
			entries, err := a.NAT()
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range entries {
				if e.Pod == dst && e.Node == netip.AddrPortFrom(f.node, uint16(port)) {
					t.Errorf("the probe's stale NAT entry %+v outlived a connection of another on its tuple", e)
				}
			}
		})
	}
}
