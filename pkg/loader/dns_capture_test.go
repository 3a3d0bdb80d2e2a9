package loader_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// dnsPort is the tunnel's DNS socket's port (capture.c's dns_port).
const dnsPort = 15053

// TestDNSCaptureEndToEnd proves, in real namespaces, the mechanism the
// tunnel's DNS proxy relies on. In a pod enrolled with CaptureDNS, an app's
// query from a connected UDP socket to <another namespace's address>:53 is
// steered by rd_pod_egress and assigned by rd_pod_ingress to the DNS
// socket ([::]:15053, tunnel mark), which reads the original destination
// from IP_ORIGDSTADDR (IPv4, on the dual-stack socket) or IPV6_ORIGDSTADDR;
// a reply sent from that destination (a transparent socket bound to it)
// reaches the app's connected socket, which takes only replies from the
// address it queried, as dig does. The resolver's namespace never sees the
// query. With CaptureDNS off, the query leaves the pod to the resolver
// uncaptured, and the DNS socket gets nothing. With it on again but no DNS
// socket, or only a socket of the pod's own on 15053 (no tunnel mark), the
// query is dropped: it never reaches the resolver uncaptured.
func TestDNSCaptureEndToEnd(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app := node.AddPod("app")
	resolver := node.AddPod("resolver") // a namespace of the test's: no real resolver is ever reached
	root := loadertest.TempBPFFS(t)
	l := loadertest.Load(t, root)
	defer l.Close()
	if _, err := l.AttachPod(context.Background(), loadertest.PodOf(app, true)); err != nil {
		t.Fatal(err)
	}
	setDNS := func(on bool) {
		t.Helper()
		for _, a := range app.Addrs() {
			s, ok, err := l.Maps().Pod(a)
			if err != nil || !ok {
				t.Fatalf("enrollment of %s: %v (present %v)", a, err, ok)
			}
			s.CaptureDNS = on
			if err := l.Maps().SetPod(a, s); err != nil {
				t.Fatal(err)
			}
		}
	}
	dns, err := openDNSSocket(app.Path())
	if err != nil {
		t.Fatal(err)
	}
	dnsOpen := true
	defer func() {
		if dnsOpen {
			unix.Close(dns)
		}
	}()
	upstream, err := openUDP(resolver.Path(), netip.AddrPortFrom(netip.IPv6Unspecified(), 53), sockOpts{})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(upstream)

	setDNS(true)
	for _, c := range []struct {
		name          string
		client, to    netip.Addr
		origDstLevel  int
		origDstOption int
	}{
		{"ipv4", app.IPv4, resolver.IPv4, unix.SOL_IP, unix.IP_ORIGDSTADDR},
		{"ipv6", app.IPv6, resolver.IPv6, unix.SOL_IPV6, unix.IPV6_ORIGDSTADDR},
	} {
		t.Run(c.name, func(t *testing.T) {
			query := []byte("query " + c.name)
			dst := netip.AddrPortFrom(c.to, 53)
			appFD, err := connectUDP(app.Path(), dst)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(appFD)
			if _, err := unix.Write(appFD, query); err != nil {
				t.Fatalf("send query: %v", err)
			}
			got, from, orig, err := recvWithOrigDst(dns, c.origDstLevel, c.origDstOption)
			if err != nil {
				t.Fatalf("the DNS socket got no query: %v", err)
			}
			appAddr, err := localAddr(appFD)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != string(query) || from != appAddr || orig != dst {
				t.Fatalf("DNS socket got %q from %s for %s, want %q from %s for %s", got, from, orig, query, appAddr, dst)
			}
			// The reply, from the original destination, as the proxy sends it.
			reply := []byte("answer " + c.name)
			if err := replyFrom(app.Path(), orig, from, reply); err != nil {
				t.Fatalf("reply: %v", err)
			}
			buf := make([]byte, 512)
			n, err := unix.Read(appFD, buf)
			if err != nil {
				t.Fatalf("the app got no reply: %v", err)
			}
			if string(buf[:n]) != string(reply) {
				t.Fatalf("the app got %q, want %q", buf[:n], reply)
			}
			if n, _, err := unix.Recvfrom(upstream, buf, unix.MSG_DONTWAIT); err == nil {
				t.Errorf("the resolver's namespace got %q: the query left the pod uncaptured", buf[:n])
			}
		})
	}
	for _, name := range []string{"out_dns_steered", "in_assign_dns"} {
		if n := reasonCount(t, l.Maps(), name); n < 2 {
			t.Errorf("%s counted %d times, want 2 at least", name, n)
		}
	}

	// DNS capture off: the query goes where the app sent it.
	setDNS(false)
	for _, to := range []netip.Addr{resolver.IPv4, resolver.IPv6} {
		appFD, err := connectUDP(app.Path(), netip.AddrPortFrom(to, 53))
		if err != nil {
			t.Fatal(err)
		}
		query := []byte("uncaptured " + to.String())
		if _, err := unix.Write(appFD, query); err != nil {
			t.Fatalf("send query: %v", err)
		}
		unix.Close(appFD)
		buf := make([]byte, 512)
		n, _, err := unix.Recvfrom(upstream, buf, 0)
		if err != nil || string(buf[:n]) != string(query) {
			t.Errorf("capture off: the resolver got %q (%v), want %q", buf[:max(n, 0)], err, query)
		}
		if n, _, err := unix.Recvfrom(dns, buf, unix.MSG_DONTWAIT); err == nil {
			t.Errorf("capture off: the DNS socket got %q", buf[:n])
		}
	}

	// Capture on, and no DNS socket, then a pod's own socket on its port
	// (no tunnel mark): the query is dropped, never sent on uncaptured.
	setDNS(true)
	unix.Close(dns)
	dnsOpen = false
	queryFails := func(reason string) {
		t.Helper()
		before := reasonCount(t, l.Maps(), reason)
		for _, to := range []netip.Addr{resolver.IPv4, resolver.IPv6} {
			appFD, err := connectUDP(app.Path(), netip.AddrPortFrom(to, 53))
			if err != nil {
				t.Fatal(err)
			}
			_, err = unix.Write(appFD, []byte("dropped"))
			unix.Close(appFD)
			if err != nil {
				t.Fatalf("send query: %v", err)
			}
		}
		buf := make([]byte, 512)
		if err := unix.SetsockoptTimeval(upstream, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 300000}); err != nil {
			t.Fatal(err)
		}
		if n, _, err := unix.Recvfrom(upstream, buf, 0); err == nil {
			t.Errorf("%s: the resolver got %q: the query left the pod uncaptured", reason, buf[:n])
		}
		if n := reasonCount(t, l.Maps(), reason) - before; n != 2 {
			t.Errorf("%s counted %d times, want 2", reason, n)
		}
	}
	queryFails("drop_no_dns_socket")
	foreign, err := openUDP(app.Path(), netip.AddrPortFrom(netip.IPv6Unspecified(), dnsPort), sockOpts{origDst: true})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(foreign)
	queryFails("drop_foreign_dns_socket")
	if n, _, err := unix.Recvfrom(foreign, make([]byte, 512), unix.MSG_DONTWAIT); err == nil {
		t.Errorf("a socket of the pod's own on port %d got a query (%d bytes)", dnsPort, n)
	}
}

// sockOpts are the options of a test UDP socket.
type sockOpts struct {
	mark        int  // SO_MARK
	transparent bool // IP_TRANSPARENT and IPV6_TRANSPARENT
	origDst     bool // IP_RECVORIGDSTADDR and IPV6_RECVORIGDSTADDR
	reuseAddr   bool // SO_REUSEADDR
}

// openDNSSocket opens the tunnel's DNS socket in the namespace at path as
// the agent must: dual-stack [::]:15053 with the tunnel mark (SO_MARK: the
// programs assign only to a socket that has it), and both
// IP_RECVORIGDSTADDR (an IPv4 query on an AF_INET6 socket reports its
// destination only as IP_ORIGDSTADDR) and IPV6_RECVORIGDSTADDR. It sets
// IP_TRANSPARENT too, as the agent's sockets do, though bpf_sk_assign
// delivers to a socket without it (tried on this kernel).
func openDNSSocket(path string) (int, error) {
	return openUDP(path, netip.AddrPortFrom(netip.IPv6Unspecified(), dnsPort),
		sockOpts{mark: loadertest.TunnelMark, transparent: true, origDst: true})
}

// openUDP opens a UDP socket in the namespace at path bound to addr ([::]
// dual-stack), with a receive timeout of two seconds.
func openUDP(path string, addr netip.AddrPort, o sockOpts) (int, error) {
	fd := -1
	err := netns.Do(path, func() error {
		fam := unix.AF_INET6
		var sa unix.Sockaddr = &unix.SockaddrInet6{Port: int(addr.Port()), Addr: addr.Addr().As16()}
		if addr.Addr().Is4() {
			fam, sa = unix.AF_INET, &unix.SockaddrInet4{Port: int(addr.Port()), Addr: addr.Addr().As4()}
		}
		s, err := unix.Socket(fam, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("socket: %w", err)
		}
		fd = s
		opts := [][3]int{{unix.SOL_SOCKET, unix.SO_MARK, o.mark}}
		if fam == unix.AF_INET6 {
			opts = append(opts, [3]int{unix.SOL_IPV6, unix.IPV6_V6ONLY, 0})
		}
		if o.reuseAddr {
			opts = append(opts, [3]int{unix.SOL_SOCKET, unix.SO_REUSEADDR, 1})
		}
		if o.transparent {
			opts = append(opts, [3]int{unix.SOL_IP, unix.IP_TRANSPARENT, 1})
			if fam == unix.AF_INET6 {
				opts = append(opts, [3]int{unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1})
			}
		}
		if o.origDst {
			opts = append(opts, [3]int{unix.SOL_IP, unix.IP_RECVORIGDSTADDR, 1})
			if fam == unix.AF_INET6 {
				opts = append(opts, [3]int{unix.SOL_IPV6, unix.IPV6_RECVORIGDSTADDR, 1})
			}
		}
		for _, opt := range opts {
			if err := unix.SetsockoptInt(s, opt[0], opt[1], opt[2]); err != nil {
				return fmt.Errorf("setsockopt %d/%d: %w", opt[0], opt[1], err)
			}
		}
		tv := unix.NsecToTimeval((2 * time.Second).Nanoseconds())
		if err := unix.SetsockoptTimeval(s, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			return fmt.Errorf("receive timeout: %w", err)
		}
		if err := unix.Bind(s, sa); err != nil {
			return fmt.Errorf("bind %s: %w", addr, err)
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

// connectUDP is the app's socket: a UDP socket of the namespace at path
// connected to dst, so it takes only datagrams from dst.
func connectUDP(path string, dst netip.AddrPort) (int, error) {
	wild := netip.IPv4Unspecified()
	if dst.Addr().Is6() {
		wild = netip.IPv6Unspecified()
	}
	fd, err := openUDP(path, netip.AddrPortFrom(wild, 0), sockOpts{})
	if err != nil {
		return -1, err
	}
	if err := unix.Connect(fd, sockaddr(dst)); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("connect %s: %w", dst, err)
	}
	return fd, nil
}

// replyFrom sends payload to dst from a socket of the namespace at path
// bound to src, an address of another host: IP_TRANSPARENT (or
// IPV6_TRANSPARENT; without, bind fails with EADDRNOTAVAIL) lets it bind
// and send from there; SO_REUSEADDR lets a second reply socket bind the
// same resolver address and port while the first is open (without,
// EADDRINUSE). No mark is needed: the app's address is local, so the reply
// takes lo, never the pod's interface.
func replyFrom(path string, src, dst netip.AddrPort, payload []byte) error {
	fd, err := openUDP(path, src, sockOpts{transparent: true, reuseAddr: true})
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Sendto(fd, payload, 0, sockaddr(dst)); err != nil {
		return fmt.Errorf("send to %s: %w", dst, err)
	}
	return nil
}

// recvWithOrigDst reads one datagram of fd: its payload, its source, and
// the original destination the control message of level and option names.
func recvWithOrigDst(fd, level, option int) ([]byte, netip.AddrPort, netip.AddrPort, error) {
	buf, oob := make([]byte, 512), make([]byte, 512)
	n, oobn, _, from, err := unix.Recvmsg(fd, buf, oob, 0)
	if err != nil {
		return nil, netip.AddrPort{}, netip.AddrPort{}, err
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return nil, netip.AddrPort{}, netip.AddrPort{}, fmt.Errorf("control messages: %w", err)
	}
	var orig netip.AddrPort
	for _, m := range msgs {
		if int(m.Header.Level) != level || int(m.Header.Type) != option {
			continue
		}
		switch {
		case option == unix.IP_ORIGDSTADDR && len(m.Data) >= unix.SizeofSockaddrInet4:
			orig = netip.AddrPortFrom(netip.AddrFrom4([4]byte(m.Data[4:8])), binary.BigEndian.Uint16(m.Data[2:]))
		case option == unix.IPV6_ORIGDSTADDR && len(m.Data) >= unix.SizeofSockaddrInet6:
			orig = netip.AddrPortFrom(netip.AddrFrom16([16]byte(m.Data[8:24])), binary.BigEndian.Uint16(m.Data[2:]))
		}
	}
	if !orig.IsValid() {
		return nil, netip.AddrPort{}, netip.AddrPort{}, errors.New("no original destination in the control messages")
	}
	return buf[:n], addrPortOf(from), orig, nil
}

func sockaddr(a netip.AddrPort) unix.Sockaddr {
	if a.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(a.Port()), Addr: a.Addr().As4()}
	}
	return &unix.SockaddrInet6{Port: int(a.Port()), Addr: a.Addr().As16()}
}

func addrPortOf(sa unix.Sockaddr) netip.AddrPort {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), uint16(sa.Port))
	}
	return netip.AddrPort{}
}

func localAddr(fd int) (netip.AddrPort, error) {
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return netip.AddrPort{}, err
	}
	return addrPortOf(sa), nil
}
