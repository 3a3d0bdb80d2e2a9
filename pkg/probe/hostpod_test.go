package probe_test

import (
	"context"
	"encoding/hex"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/probe"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// Environment of the helper process of sendFromCgroup (see TestMain).
const (
	envRawPacket = "RD_TEST_RAW_PACKET" // hex of the IP packet to send
	envRawDevice = "RD_TEST_RAW_DEVICE" // send in a frame out of this device (a packet socket); empty: a raw IP socket
	envRawMAC    = "RD_TEST_RAW_MAC"    // the frame's destination
)

// TestMain runs the tests, or, started by sendFromCgroup with the packet in
// its environment, is that helper process: it sends one forged IP packet
// from its own socket and exits.
func TestMain(m *testing.M) {
	if h := os.Getenv(envRawPacket); h != "" {
		pkt, err := hex.DecodeString(h)
		if err == nil {
			err = rawSend(pkt, os.Getenv(envRawDevice), os.Getenv(envRawMAC))
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "send a forged packet:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// rawSend sends pkt from a raw IP socket (the kernel routes it), or in a
// frame to mac out of dev from a packet socket.
func rawSend(pkt []byte, dev, mac string) error {
	v6 := pkt[0]>>4 == 6
	if dev != "" {
		ifi, err := net.InterfaceByName(dev)
		if err != nil {
			return err
		}
		hw, err := net.ParseMAC(mac)
		if err != nil {
			return err
		}
		proto := uint16(unix.ETH_P_IP)
		if v6 {
			proto = unix.ETH_P_IPV6
		}
		proto = proto<<8 | proto>>8
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		sa := &unix.SockaddrLinklayer{Protocol: proto, Ifindex: ifi.Index, Halen: 6}
		copy(sa.Addr[:], hw)
		return unix.Sendto(fd, pkt, 0, sa)
	}
	if v6 {
		fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		return unix.Sendto(fd, pkt, 0, &unix.SockaddrInet6{Addr: [16]byte(pkt[24:40])})
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: [4]byte(pkt[16:20])})
}

// sendFromCgroup sends pkt from a socket of a process of the cgroup dir (it
// is born there), in the network namespace at nsPath: a hostNetwork pod's
// process with CAP_NET_RAW, which container runtimes grant by default.
// dev and mac as for rawSend.
func sendFromCgroup(t *testing.T, nsPath, dir string, pkt []byte, dev, mac string) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd := netnstest.Command(ctx, nsPath, exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), envRawPacket+"="+hex.EncodeToString(pkt), envRawDevice+"="+dev, envRawMAC+"="+mac)
	defer bornIn(t, cmd, dir)()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("send a forged packet from cgroup %s: %v: %s", dir, err, out)
	}
}

// hostPodRig is a node whose pod app (enrolled as id, its host programs
// attached, serving holdPort into got) has the host programs judging
// sockets by a real pods' cgroup, with hostPod a container's cgroup below
// it; root is the pin root.
func hostPodRig(t *testing.T, id uint32) (hostPod string, node *netnstest.Node, app *netnstest.Pod, got *received, root string) {
	t.Helper()
	hierarchy, base := testCgroups(t, "kubepods/besteffort/podA/ctr")
	pc, found, err := probe.FindPodsCgroup(hierarchy, "/"+base+"/kubepods")
	if err != nil || !found || pc.ID == 0 {
		t.Fatalf("FindPodsCgroup: %+v %v %v", pc, found, err)
	}
	hostPod = filepath.Join(hierarchy, base, "kubepods/besteffort/podA/ctr")
	node = netnstest.New(t, 1).Nodes[0]
	app = node.AddPod("app")
	got = holdApp(t, app)
	root = tempBPFFS(t)
	a := load(t, probe.Config{PinRoot: root, PodsCgroupID: pc.ID})
	enroll(t, root, app, id)
	if err := attachHost(a, app, id); err != nil {
		t.Fatal(err)
	}
	return hostPod, node, app, got, root
}

// TestHostNetworkPodCannotInjectIntoProbe: a hostNetwork pod shares the
// node's network namespace, so its raw packet with the node's end of a
// kubelet probe connection (the address and port ss shows it, the
// sequence numbers a packet socket on any node device shows) is a packet
// the node's stack sent, with a socket of the node's namespace. Only the
// SYN was judged by its socket's cgroup: the later packets of a probe
// connection were translated by the NAT entry whoever in the namespace
// sent them, marked as a probe, and the forged bytes reached the STRICT
// pod's app inside kubelet's connection, from the SNAT address. Sent from
// a raw IP socket (routed to the pod's veth) or in a frame from a packet
// socket on the node's bridge, the forged segment is now dropped and
// counted (drop_probe_spoofed), and kubelet's own packets still pass.
func TestHostNetworkPodCannotInjectIntoProbe(t *testing.T) {
	hostPod, node, app, got, root := hostPodRig(t, 31)
	var appMAC string
	if err := netns.Do(app.Path(), func() error {
		ifi, err := net.InterfaceByName("eth0")
		if err == nil {
			appMAC = ifi.HardwareAddr.String()
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}

	for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		t.Run(f.name, func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod(app), holdPort)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			c, nodeEnd := dialFrom(ctx, t, node.Path(), dst) // kubelet's probe, open
			from := netip.AddrPortFrom(f.snat, nodeEnd.Port())
			seq, ack := netnstest.NextSegment(t, app, from, []byte("probe"), func() error {
				_, err := c.Write([]byte("probe"))
				return err
			})
			if b := got.wait(from, "probe", time.Second); b != "probe" {
				t.Fatalf("the app read %q from %s, want kubelet's probe bytes", b, from)
			}

			for _, how := range []struct{ name, dev, mac string }{
				{"raw IP socket", "", ""},
				{"packet socket on the bridge", "rdbr", appMAC},
			} {
				before := probeSpoofedDrops(t, root)
				payload := "INJECTED by " + how.name
				seg := netnstest.TCPSegment(nodeEnd, dst, seq, ack, 0x18 /* PSH|ACK */, []byte(payload))
				sendFromCgroup(t, node.Path(), hostPod, netnstest.IPPacket(nodeEnd.Addr(), dst.Addr(), seg), how.dev, how.mac)
				if b := got.wait(from, "INJECTED", 500*time.Millisecond); strings.Contains(b, "INJECTED") {
					t.Errorf("%s: a hostNetwork pod's segment with kubelet's end of the probe was translated: the app read %q from %s", how.name, b, from)
				}
				if n := probeSpoofedDrops(t, root) - before; n < 1 {
					t.Errorf("%s: drop_probe_spoofed grew by %d, want >= 1", how.name, n)
				}
			}
			// kubelet's own packets of the connection still pass.
			if _, err := c.Write([]byte("again")); err != nil {
				t.Fatal(err)
			}
			if b := got.wait(from, "again", 2*time.Second); !strings.Contains(b, "again") {
				t.Errorf("kubelet's own later segment did not reach the app from %s: read %q", from, b)
			}
		})
	}
}

// TestHostNetworkPodKeepsLiveProbeEntry: the NAT key is the pod's end and
// the node's port (the pod's replies show no more), so a node connection
// from another of the node's addresses with the port of a live probe
// shares the probe's key. A SYN that is not translated deletes the entry of
// its key, left by an earlier probe of the same tuple; it deleted the live
// probe's entry too, whatever the node address. So any hostNetwork pod, no
// capability needed (ss shows kubelet's port; bind takes it on another
// address), failed a neighbour's probe at will: its connection's SYN, from
// a pod's process, is not translated, and kubelet's next segments reached
// the pod untranslated, where no socket had their tuple. An untranslated
// SYN now deletes only an entry of its own node address.
func TestHostNetworkPodKeepsLiveProbeEntry(t *testing.T) {
	hostPod, node, app, got, root := hostPodRig(t, 32)

	for _, f := range []struct {
		family
		other netip.Addr // another of the node's addresses: its uplink's
	}{
		{families(node, probe.DefaultSNATv4, probe.DefaultSNATv6)[0], node.IPv4},
		{families(node, probe.DefaultSNATv4, probe.DefaultSNATv6)[1], node.IPv6},
	} {
		t.Run(f.name, func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod(app), holdPort)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			c, nodeEnd := dialFrom(ctx, t, node.Path(), dst)
			port := nodeEnd.Port()
			from := netip.AddrPortFrom(f.snat, port)
			if _, err := c.Write([]byte("probe")); err != nil {
				t.Fatal(err)
			}
			if b := got.wait(from, "probe", 2*time.Second); b != "probe" {
				t.Fatalf("the app read %q from %s, want kubelet's probe bytes", b, from)
			}

			// The hostNetwork pod's process connects from the node's
			// other address and kubelet's port.
			before := reasonCount(t, root, "host_pod_not_probe")
			url := fmt.Sprintf("http://%s/", dst)
			cmd := netnstest.Command(ctx, node.Path(), "curl", "-sS", "-g", "--max-time", "1",
				"--interface", f.other.String(), "--local-port", fmt.Sprint(port), url)
			release := bornIn(t, cmd, hostPod)
			out, _ := cmd.CombinedOutput() // the app answers nothing: curl times out
			release()
			hostPodEnd := netip.AddrPortFrom(f.other, port)
			if b := got.wait(hostPodEnd, "GET", time.Second); !strings.Contains(b, "GET") {
				t.Fatalf("the hostNetwork pod's connection from %s did not reach the app untranslated: read %q (curl: %s)", hostPodEnd, b, out)
			}
			if n := reasonCount(t, root, "host_pod_not_probe") - before; n < 1 {
				t.Errorf("host_pod_not_probe grew by %d, want >= 1", n)
			}

			// kubelet's probe goes on.
			if _, err := c.Write([]byte("again")); err != nil {
				t.Fatal(err)
			}
			if b := got.wait(from, "again", 2*time.Second); !strings.Contains(b, "again") {
				t.Errorf("after a hostNetwork pod's connection from %s, kubelet's probe segment did not reach the app from %s: read %q", hostPodEnd, from, b)
			}
		})
	}
}
