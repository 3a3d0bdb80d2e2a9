package probe_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/probe"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// synproxy has node's netfilter answer the handshakes of connections from
// its uplink itself (SYNPROXY, as a node guarding its pods against SYN
// floods does) and open the connection to the pod only once the client
// completed it: the kernel then builds the SYN to the pod, in a fresh packet
// with the client's source, that no socket sent and no device received.
func synproxy(t *testing.T, node *netnstest.Node) {
	t.Helper()
	ctx := context.Background()
	if _, err := netnstest.Exec(ctx, node.Path(), "sh", "-c", "echo 0 > /proc/sys/net/netfilter/nf_conntrack_tcp_loose"); err != nil {
		t.Fatal(err)
	}
	for _, ipt := range []string{"iptables", "ip6tables"} {
		for _, rule := range [][]string{
			{"-t", "raw", "-A", "PREROUTING", "-i", "uplink", "-p", "tcp", "--syn", "-j", "CT", "--notrack"},
			{"-A", "FORWARD", "-i", "uplink", "-p", "tcp", "-m", "conntrack", "--ctstate", "INVALID,UNTRACKED",
				"-j", "SYNPROXY", "--sack-perm", "--mss", "1400"},
			{"-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"},
		} {
			if _, err := netnstest.Exec(ctx, node.Path(), ipt, rule...); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestSynproxySYNNotTranslated: a client on another node connects to an
// enrolled pod through a node whose netfilter proxies handshakes
// (SYNPROXY). The SYN the node's kernel then sends the pod on the client's
// behalf is a fresh packet with the client's source, no socket and no
// ingress device, like the copy of a node SYN a flooding bridge makes.
// Before the fix rd_host_egress translated it to the probe SNAT address:
// the app accepted the remote client's connection from that address (which
// the pod-side capture passes as a kubelet probe, past STRICT mTLS) and the
// client read the app's bytes in plaintext. A SYN without a socket now
// starts SNAT only when the node holds the connecting socket of its tuple;
// this one reaches the pod with the client's own address.
func TestSynproxySYNNotTranslated(t *testing.T) {
	topo := netnstest.New(t, 2)
	node, remote := topo.Nodes[0], topo.Nodes[1]
	app := node.AddPod("app")
	got := holdApp(t, app)
	root := tempBPFFS(t)
	a := load(t, probe.Config{PinRoot: root})
	const id = 7
	enroll(t, root, app, id)
	if err := attachHost(a, app, id); err != nil {
		t.Fatal(err)
	}
	synproxy(t, node)
	for i, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		client := []netip.Addr{remote.IPv4, remote.IPv6}[i]
		t.Run(f.name, func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod(app), holdPort)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			c, clientEnd := dialFrom(ctx, t, remote.Path(), dst)
			if clientEnd.Addr() != client {
				t.Fatalf("the remote node dialled from %s, want %s", clientEnd, client)
			}
			if _, err := c.Write([]byte("hello")); err != nil {
				t.Fatal(err)
			}
			// SYNPROXY opens the connection to the pod once the client's
			// handshake is done: the client's bytes then arrive from its
			// own address.
			if b := got.wait(clientEnd, "hello", 3*time.Second); b != "hello" {
				t.Errorf("the app read %q from the client's own address %s, want its %q", b, clientEnd, "hello")
			}
			snatted := netip.AddrPortFrom(f.snat, clientEnd.Port())
			if conn := got.conn(snatted); conn != nil {
				conn.Write([]byte("banner"))
				t.Errorf("the app accepted the remote client's connection from %s, the probe SNAT address; the client read %q from it",
					snatted, readFor(c, 6, time.Second))
			}
			entries, err := a.NAT()
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range entries {
				if e.Node.Addr().Unmap() == client {
					t.Errorf("NAT entry %+v for the remote client's connection", e)
				}
			}
		})
	}
}
