package loader_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// linkLocal waits for the IPv6 link-local address of iface in the namespace
// at path to pass duplicate address detection, and returns it with iface's
// index as its zone, as seen from there (a numeric zone needs no lookup by
// name, which Go caches process-wide, across namespaces).
func linkLocal(t *testing.T, path, iface string) (addr netip.Addr, zone string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := netns.Do(path, func() error {
			l, err := netlink.LinkByName(iface)
			if err != nil {
				return err
			}
			zone = strconv.Itoa(l.Attrs().Index)
			as, err := netlink.AddrList(l, netlink.FAMILY_V6)
			if err != nil {
				return err
			}
			for _, a := range as {
				ip, _ := netip.AddrFromSlice(a.IP)
				if ip.IsLinkLocalUnicast() && a.Flags&unix.IFA_F_TENTATIVE == 0 {
					addr = ip
					return nil
				}
			}
			return fmt.Errorf("no usable link-local address on %s yet: %v", iface, as)
		})
		if err == nil {
			return addr, zone
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// zoned is dst's link-local address with a zone of the caller's namespace.
func zoned(a netip.Addr, zone string, port uint16) netip.AddrPort {
	return netip.AddrPortFrom(a.WithZone(zone), port)
}

// call is loadertest.Call for any destination, zoned ones included
// (netns.Dial takes none): the socket is made by net.Dialer on a thread in
// the namespace at path.
func call(path string, dst netip.AddrPort) (loadertest.Reply, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var c net.Conn
	err := netns.Do(path, func() error {
		var err error
		c, err = (&net.Dialer{}).DialContext(ctx, "tcp", dst.String())
		return err
	})
	if err != nil {
		return loadertest.Reply{}, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		return loadertest.Reply{}, fmt.Errorf("read greeting: %w", err)
	}
	f := strings.Fields(line)
	if len(f) != 3 {
		return loadertest.Reply{}, fmt.Errorf("bad greeting %q", line)
	}
	if _, err := io.WriteString(c, "ping\n"); err != nil {
		return loadertest.Reply{}, err
	}
	if echo, err := r.ReadString('\n'); err != nil || echo != "echo ping\n" {
		return loadertest.Reply{}, fmt.Errorf("echo: %q %v", echo, err)
	}
	return loadertest.Reply{Name: f[0], Local: f[1], Peer: f[2]}, nil
}

func reasonCount(t *testing.T, m *maps.Maps, name string) uint64 {
	t.Helper()
	counts, err := m.ReasonCounts()
	if err != nil {
		t.Fatal(err)
	}
	for r, n := range counts {
		if maps.ReasonName(r) == name {
			return n
		}
	}
	t.Fatalf("no reason %s", name)
	return 0
}

// TestLinkLocalNotPlaintext: a pod's IPv6 link-local address is never
// enrolled (selection refuses it), so before, TCP to it from a neighbour on
// the bridge (another pod, the node) reached the enrolled pod's app in
// plaintext, and the enrolled pod reached a neighbour's link-local address
// in plaintext; so did an address the loader was not given (here a second
// IPv6 address, as SLAAC would add). Now both are dropped on the enrolled
// pod's interface and counted, while the unenrolled pod's own link-local
// address stays reachable, and deleting the enrollment entries (the kill
// switch) or detaching lets the enrolled pod's link-local traffic through
// again.
func TestLinkLocalNotPlaintext(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	client, server, other := node.AddPod("client"), node.AddPod("server"), node.AddPod("other")
	ctx := context.Background()
	extra := node.PodAddr6(200)
	if _, err := netnstest.Exec(ctx, server.Path(), "ip", "addr", "add", extra.String()+"/64", "dev", "eth0", "nodad"); err != nil {
		t.Fatal(err)
	}
	l := loadertest.Load(t, loadertest.TempBPFFS(t))
	defer l.Close()

	listenLikeTunnel(t, client, server, other)
	for _, p := range []*netnstest.Pod{client, server} {
		if _, err := l.AttachPod(ctx, loadertest.PodOf(p, true)); err != nil {
			t.Fatal(err)
		}
	}

	llServer, _ := linkLocal(t, server.Path(), "eth0")
	llOther, _ := linkLocal(t, other.Path(), "eth0")
	_, otherZone := linkLocal(t, other.Path(), "eth0")
	_, clientZone := linkLocal(t, client.Path(), "eth0")
	_, nodeZone := linkLocal(t, node.Path(), "rdbr")

	// Still captured: plaintext to the server's pod address goes to the
	// tunnel's inbound listener.
	if r, err := call(other.Path(), ap(server.IPv6, 8080)); err != nil || r.Name != "inbound" {
		t.Fatalf("to the pod address: %+v %v, want the inbound listener", r, err)
	}
	// An unenrolled pod's link-local address is none of the mesh's business.
	if r, err := call(node.Path(), zoned(llOther, nodeZone, 8080)); err != nil || r.Name != "other-app" {
		t.Fatalf("node to the unenrolled pod's link-local address: %+v %v, want other-app", r, err)
	}

	llBefore, unBefore := reasonCount(t, l.Maps(), "drop_link_local"), reasonCount(t, l.Maps(), "drop_unenrolled_addr")
	for _, c := range []struct {
		name string
		from string
		dst  netip.AddrPort
	}{
		{"neighbour pod to the enrolled pod's link-local address", other.Path(), zoned(llServer, otherZone, 8080)},
		{"node to the enrolled pod's link-local address", node.Path(), zoned(llServer, nodeZone, 8080)},
		{"enrolled pod to a neighbour's link-local address", client.Path(), zoned(llOther, clientZone, 8080)},
		{"neighbour pod to the enrolled pod's unenrolled address", other.Path(), ap(extra, 8080)},
	} {
		if r, err := call(c.from, c.dst); err == nil {
			t.Errorf("%s (%s): reached %+v in plaintext, want it dropped", c.name, c.dst, r)
		}
	}
	if got := reasonCount(t, l.Maps(), "drop_link_local") - llBefore; got < 3 {
		t.Errorf("drop_link_local grew by %d, want at least 3 (one SYN per connection)", got)
	}
	if got := reasonCount(t, l.Maps(), "drop_unenrolled_addr") - unBefore; got < 1 {
		t.Errorf("drop_unenrolled_addr grew by %d, want at least 1", got)
	}
	if c, _, _ := l.Maps().Counters(server.IPv4); c.DroppedPackets == 0 {
		t.Errorf("server counters %+v: the drops are not counted for the pod", c)
	}

	// Detached, the client reaches the neighbour's link-local address, and
	// its namespace entry is gone.
	if err := l.DetachPod(ctx, "uid-client"); err != nil {
		t.Fatal(err)
	}
	if r, err := call(client.Path(), zoned(llOther, clientZone, 8080)); err != nil || r.Name != "other-app" {
		t.Errorf("detached pod to a neighbour's link-local address: %+v %v, want other-app", r, err)
	}
	if ns, err := l.Maps().ListPodNetNS(); err != nil || len(ns) != 1 {
		t.Errorf("namespace entries after detaching one of two pods: %v %v, want one", ns, err)
	}
	// The kill switch: without the enrollment entries, nothing is dropped.
	for _, a := range server.Addrs() {
		if err := l.Maps().DeletePod(a); err != nil {
			t.Fatal(err)
		}
	}
	if r, err := call(other.Path(), zoned(llServer, otherZone, 8080)); err != nil || r.Name != "server-app" {
		t.Errorf("after deleting the entries, to the link-local address: %+v %v, want server-app", r, err)
	}
}

// TestPodNetNSEntries: AttachPod records the pod's namespace in
// rd_pod_netns, and a new loader's Load puts back an entry a pod lacks (as
// for a pod an agent from before the map attached) and removes entries of
// pods that are not attached; a running loader's full kernel check finds
// an entry missing.
func TestPodNetNSEntries(t *testing.T) {
	topo := netnstest.New(t, 1)
	client := topo.Nodes[0].AddPod("client")
	root := loadertest.TempBPFFS(t)
	ctx := context.Background()
	var st unix.Stat_t
	if err := unix.Stat(client.Path(), &st); err != nil {
		t.Fatal(err)
	}
	ino := uint32(st.Ino)

	l := loadertest.Load(t, root)
	ps, err := l.AttachPod(ctx, loadertest.PodOf(client, true))
	if err != nil {
		t.Fatal(err)
	}
	want := maps.PodNetNS{Addr: client.IPv4, PodID: ps.ID}
	if got, err := l.Maps().ListPodNetNS(); err != nil || len(got) != 1 || got[ino] != want {
		t.Fatalf("after attach: %v %v, want {%d: %+v}", got, err, ino, want)
	}
	l.Close()

	m, err := maps.OpenPinned(root)
	if err != nil {
		t.Fatal(err)
	}
	const strayIno, strayID = 4026531, 77
	errs := []error{m.DeletePodNetNS(ino, ps.ID), m.SetPodNetNS(strayIno, client.IPv6, strayID)}
	m.Close()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	l = loadertest.Load(t, root)
	if got, err := l.Maps().ListPodNetNS(); err != nil || len(got) != 1 || got[ino] != want {
		t.Errorf("after Load: %v %v, want {%d: %+v}", got, err, ino, want)
	}
	// While running (a pod an older agent attached during an overlapping
	// upgrade): the full reconcile's check sees the entry missing, and the
	// re-attach it leads to writes it.
	if err := l.Maps().DeletePodNetNS(ino, ps.ID); err != nil {
		t.Fatal(err)
	}
	cur, _, err := l.PodState("uid-client")
	if err != nil {
		t.Fatal(err)
	}
	if !l.KernelOK(cur, false) || l.KernelOK(cur, true) {
		t.Errorf("entry missing: KernelOK quick %v, full %v; want true, false", l.KernelOK(cur, false), l.KernelOK(cur, true))
	}
	if _, err := l.AttachPod(ctx, loadertest.PodOf(client, true)); err != nil {
		t.Fatal(err)
	}
	if cur, _, _ = l.PodState("uid-client"); !l.KernelOK(cur, true) {
		t.Error("after the re-attach: the full check still fails")
	}
	if err := l.DetachPod(ctx, "uid-client"); err != nil {
		t.Fatal(err)
	}
	if got, err := l.Maps().ListPodNetNS(); err != nil || len(got) != 0 {
		t.Errorf("after detach: %v %v, want none", got, err)
	}
	l.Close()
	if err := loader.Uninstall(ctx, root, loader.DefaultSettings(), nil); err != nil {
		t.Error(err)
	}
}
