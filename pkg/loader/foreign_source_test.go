package loader_test

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// freebindSocket opens a socket of typ in the namespace at path bound to
// src with IP_FREEBIND, which any process may set: it binds an address the
// namespace does not have, and the kernel sends from it.
func freebindSocket(path string, typ int, src netip.Addr) (int, error) {
	fd := -1
	err := netns.Do(path, func() error {
		fam := unix.AF_INET6
		if src.Is4() {
			fam = unix.AF_INET
		}
		s, err := unix.Socket(fam, typ|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("socket: %w", err)
		}
		fd = s
		if err := unix.SetsockoptInt(s, unix.SOL_IP, unix.IP_FREEBIND, 1); err != nil {
			return fmt.Errorf("IP_FREEBIND: %w", err)
		}
		tv := unix.NsecToTimeval((time.Second).Nanoseconds())
		for _, o := range []int{unix.SO_RCVTIMEO, unix.SO_SNDTIMEO} {
			if err := unix.SetsockoptTimeval(s, unix.SOL_SOCKET, o, &tv); err != nil {
				return fmt.Errorf("timeout: %w", err)
			}
		}
		if err := unix.Bind(s, sockaddr(netip.AddrPortFrom(src, 0))); err != nil {
			return fmt.Errorf("bind %s: %w", src, err)
		}
		return nil
	})
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return -1, err
	}
	return fd, nil
}

// TestForeignSourceNeverLeavesUncaptured: an app in an enrolled pod can
// bind another enrolled pod's IPv6 address with IPV6_FREEBIND (no capability
// needed) and send from it. Before, the capture judged such a packet by the
// other pod's settings and charged it to that pod: a DNS query of a pod with
// DNS capture, sent "from" a neighbour without it, reached the resolver
// uncaptured, and a SYN was steered and counted as the neighbour's outbound
// connection. Now both are dropped on the sending pod's interface and
// counted there (drop_foreign_src), and the neighbour's counters stay as
// they were. IPv4 is refused by the kernel itself (a freebind address is
// not a source the route lookup takes); the BPF table test covers it.
func TestForeignSourceNeverLeavesUncaptured(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	client, neighbour, server, resolver := node.AddPod("client"), node.AddPod("neighbour"), node.AddPod("server"), node.AddPod("resolver")
	ctx := context.Background()
	l := loadertest.Load(t, loadertest.TempBPFFS(t))
	defer l.Close()

	tun := netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark}
	loadertest.Listen(t, client.Path(), "[::]:15001", "outbound", tun)
	loadertest.Listen(t, server.Path(), "[::]:8080", "server-app", netns.SocketOptions{})
	clientPod := loadertest.PodOf(client, true)
	clientPod.CaptureDNS = true
	for _, p := range []loader.Pod{clientPod, loadertest.PodOf(neighbour, false)} {
		if _, err := l.AttachPod(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	dns, err := openDNSSocket(client.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(dns)
	upstream, err := openUDP(resolver.Path(), netip.AddrPortFrom(netip.IPv6Unspecified(), 53), sockOpts{})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(upstream)

	// The client's own traffic is captured: the test's sockets work.
	if r, err := loadertest.Call(client.Path(), ap(server.IPv6, 8080), netns.SocketOptions{}); err != nil || r.Name != "outbound" {
		t.Fatalf("the client's own connection: %+v %v, want the outbound listener", r, err)
	}
	own, err := connectUDP(client.Path(), netip.AddrPortFrom(resolver.IPv6, 53))
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(own)
	if _, err := unix.Write(own, []byte("own query")); err != nil {
		t.Fatal(err)
	}
	if got, _, _, err := recvWithOrigDst(dns, unix.SOL_IPV6, unix.IPV6_ORIGDSTADDR); err != nil || string(got) != "own query" {
		t.Fatalf("the client's own query: %q %v, want it at the DNS socket", got, err)
	}

	counters := func(p *netnstest.Pod) (sum maps.PodCounters) {
		t.Helper()
		for _, a := range p.Addrs() {
			c, _, err := l.Maps().Counters(a)
			if err != nil {
				t.Fatal(err)
			}
			sum.OutboundConns += c.OutboundConns
			sum.SteeredPackets += c.SteeredPackets
			sum.DroppedPackets += c.DroppedPackets
			sum.BypassedPackets += c.BypassedPackets
		}
		return sum
	}
	before := reasonCount(t, l.Maps(), "drop_foreign_src")
	clientBefore, neighbourBefore := counters(client), counters(neighbour)

	q, err := freebindSocket(client.Path(), unix.SOCK_DGRAM, neighbour.IPv6)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(q)
	if err := unix.Sendto(q, []byte("spoofed query"), 0, sockaddr(netip.AddrPortFrom(resolver.IPv6, 53))); err != nil {
		t.Fatalf("send query: %v", err)
	}
	buf := make([]byte, 512)
	if n, from, err := unix.Recvfrom(upstream, buf, 0); err == nil { // the socket waits 2 s
		t.Errorf("the resolver got %q from %v: the query left the pod uncaptured", buf[:n], addrPortOf(from))
	}
	if n, _, err := unix.Recvfrom(dns, buf, unix.MSG_DONTWAIT); err == nil {
		t.Errorf("the DNS socket got %q from another pod's address", buf[:n])
	}

	c, err := freebindSocket(client.Path(), unix.SOCK_STREAM, neighbour.IPv6)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(c)
	// The SYN-ACK of whatever took the SYN would go to the neighbour, so
	// the connect never completes either way: the counters tell.
	if err := unix.Connect(c, sockaddr(netip.AddrPortFrom(server.IPv6, 8080))); err == nil {
		t.Errorf("a connection from another pod's address was set up")
	}

	if got := reasonCount(t, l.Maps(), "drop_foreign_src") - before; got < 2 {
		t.Errorf("drop_foreign_src grew by %d, want 2 at least (the query and the SYN)", got)
	}
	if got := counters(client); got.DroppedPackets < clientBefore.DroppedPackets+2 {
		t.Errorf("client counters %+v (before %+v): the drops are not the client's", got, clientBefore)
	}
	if got := counters(neighbour); got != neighbourBefore {
		t.Errorf("neighbour counters %+v, were %+v: the client's packets were charged to the neighbour", got, neighbourBefore)
	}
	// IPv4: the kernel sends nothing from a freebind address.
	if fd, err := freebindSocket(client.Path(), unix.SOCK_DGRAM, neighbour.IPv4); err == nil {
		err = unix.Sendto(fd, []byte("spoofed query"), 0, sockaddr(netip.AddrPortFrom(resolver.IPv4, 53)))
		unix.Close(fd)
		t.Logf("IPv4 query from another pod's address: %v", err)
	}
}
