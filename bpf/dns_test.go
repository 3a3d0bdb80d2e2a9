package bpf

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// udpHdr is a UDP header with ports and a payload.
func udpHdr(sport, dport uint16, payload []byte) []byte {
	h := make([]byte, 8, 8+len(payload))
	binary.BigEndian.PutUint16(h[0:], sport)
	binary.BigEndian.PutUint16(h[2:], dport)
	binary.BigEndian.PutUint16(h[4:], uint16(8+len(payload)))
	return append(h, payload...)
}

// query is a DNS query's UDP header and a few bytes of question.
func query(dport uint16) []byte { return udpHdr(40000, dport, []byte{0x12, 0x34, 1, 0, 0, 1, 0, 0}) }

const (
	dnsFlags   = bothWays | uint32(CapturePodFlagPOD_CAPTURE_DNS)
	tunnelMark = 0x539
	reinject   = 0x111
)

// A pod enrolled without DNS capture, beside pod 1 (pod4, pod6) with it.
var (
	plain4 = netip.MustParseAddr("10.9.5.2")
	plain6 = netip.MustParseAddr("fd00:9:5::2")
)

// loadDNSCapture loads the programs with pod 1 (pod4, pod6) enrolled with
// DNS capture and pod 3 (plain4, plain6) without.
func loadDNSCapture(t *testing.T) *CaptureObjects {
	objs := loadCapture(t)
	for _, e := range []struct {
		a         netip.Addr
		flags, id uint32
	}{{pod4, dnsFlags, 1}, {pod6, dnsFlags, 1}, {plain4, bothWays, 3}, {plain6, bothWays, 3}} {
		k := CapturePodAddr{Addr: e.a.As16()}
		if err := objs.RdPods.Put(&k, &CapturePodSettings{Flags: e.flags, PodId: e.id}); err != nil {
			t.Fatalf("enroll %s: %v", e.a, err)
		}
	}
	return objs
}

// TestCaptureDNSEgress: a UDP query to port 53 of a pod with DNS capture is
// steered to ingress like a SYN; the tunnel's own queries, other UDP, and
// every packet of a pod without DNS capture pass as before. A query the
// programs cannot steer cleanly (a fragment, IPv4 options, IPv6 extension
// headers or a source route, a stacked VLAN tag, a header cut short), or
// to a loopback address, is dropped: it must never reach a resolver
// uncaptured. Without the DNS rules every case below but the "pass" ones
// returned TC_ACT_UNSPEC uncounted.
func TestCaptureDNSEgress(t *testing.T) {
	needRoot(t)
	objs := loadDNSCapture(t)
	q := query(53)
	final := netip.MustParseAddr("fd00:200::5")
	v4ah := append([]byte{pUDP, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1}, q...)
	steered := CaptureVerdictReasonREASON_OUT_DNS_STEERED
	cases := []progCase{
		{"v4 query", 0, ip4(pod4, peer4, pUDP, 0, q), actRedirect, steered},
		{"v4 query with DF", 0, ip4(pod4, peer4, pUDP, 0x4000, q), actRedirect, steered},
		{"v6 query", 0, ip6(pod6, peer6, nil, pUDP, q), actRedirect, steered},
		{"v4 query to the probe address", 0, ip4(pod4, snat4, pUDP, 0, q), actRedirect, steered},
		{"v4 query of the tunnel", tunnelMark, ip4(pod4, peer4, pUDP, 0, q), actUnspec, CaptureVerdictReasonREASON_OUT_PASS_TUNNEL_MARK},
		{"v6 query of the tunnel, other mark bits", 0xf539, ip6(pod6, peer6, nil, pUDP, q), actUnspec, CaptureVerdictReasonREASON_OUT_PASS_TUNNEL_MARK},
		{"v4 query, pod without DNS capture", 0, ip4(plain4, peer4, pUDP, 0, q), actUnspec, noReason},
		{"v6 query, pod without DNS capture", 0, ip6(plain6, peer6, nil, pUDP, q), actUnspec, noReason},
		{"v4 query from an address nobody enrolled, no pod's interface", 0, ip4(other4, peer4, pUDP, 0, q), actUnspec, noReason},
		{"v4 udp to 5353", 0, ip4(pod4, peer4, pUDP, 0, query(5353)), actUnspec, noReason},
		{"v4 reply from port 53", 0, ip4(pod4, peer4, pUDP, 0, udpHdr(53, 40000, nil)), actUnspec, noReason},
		{"v6 udp to 5353 behind hop-by-hop", 0, ip6(pod6, peer6, []ext{opts(pHop, 0)}, pUDP, query(5353)), actUnspec, noReason},
		{"v4 tcp syn to 53, captured as any tcp", 0, ip4(pod4, peer4, pTCP, 0, syn(53)), actRedirect, CaptureVerdictReasonREASON_OUT_SYN_STEERED},
		// loopback only through a socket bound to the device, as for TCP
		{"v4 query to 127.0.0.53", 0, ip4(pod4, netip.MustParseAddr("127.0.0.53"), pUDP, 0, q), actShot, CaptureVerdictReasonREASON_DROP_LOOPBACK},
		{"v6 query to ::1", 0, ip6(pod6, netip.IPv6Loopback(), nil, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_LOOPBACK},
		{"v4 query to 127.0.0.53 of the tunnel", tunnelMark, ip4(pod4, netip.MustParseAddr("127.0.0.53"), pUDP, 0, q), actUnspec, CaptureVerdictReasonREASON_OUT_PASS_TUNNEL_MARK},
		// what cannot be steered cleanly
		{"v4 query with ip options", 0, ip4(pod4, peer4, pUDP, 0, q, 1, 1, 1, 0), actShot, CaptureVerdictReasonREASON_DROP_IP_OPTIONS},
		{"v4 query with a loose source route", 0, ip4(pod4, peer4, pUDP, 0, q, 131, 7, 4, 10, 9, 9, 9), actShot, CaptureVerdictReasonREASON_DROP_IP_OPTIONS},
		{"v4 udp to 5353 with ip options", 0, ip4(pod4, peer4, pUDP, 0, query(5353), 1, 1, 1, 0), actUnspec, noReason},
		{"v4 query behind AH", 0, ip4(pod4, peer4, pAH, 0, v4ah), actShot, CaptureVerdictReasonREASON_DROP_EXTHDR},
		{"v4 first fragment of a query", 0, ip4(pod4, peer4, pUDP, 0x2000, q), actShot, CaptureVerdictReasonREASON_DROP_FRAGMENT},
		{"v4 first fragment, 4 bytes of udp", 0, ip4(pod4, peer4, pUDP, 0x2000, q[:4]), actShot, CaptureVerdictReasonREASON_DROP_TRUNCATED},
		{"v4 first fragment to 5353", 0, ip4(pod4, peer4, pUDP, 0x2000, query(5353)), actUnspec, noReason},
		{"v4 later fragment", 0, ip4(pod4, peer4, pUDP, 0x2000|1, make([]byte, 8)), actUnspec, noReason},
		{"v4 last fragment", 0, ip4(pod4, peer4, pUDP, 2, make([]byte, 8)), actUnspec, noReason},
		{"v4 udp header cut short", 0, ip4(pod4, peer4, pUDP, 0, q[:6]), actShot, CaptureVerdictReasonREASON_DROP_TRUNCATED},
		{"v6 udp header cut short", 0, ip6(pod6, peer6, nil, pUDP, q[:2]), actShot, CaptureVerdictReasonREASON_DROP_TRUNCATED},
		{"v4 udp header cut short, pod without DNS capture", 0, ip4(plain4, peer4, pUDP, 0, q[:6]), actUnspec, noReason},
		{"v6 query behind hop-by-hop", 0, ip6(pod6, peer6, []ext{opts(pHop, 0)}, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_EXTHDR},
		{"v6 query behind destination options", 0, ip6(pod6, peer6, []ext{opts(pDst, 0)}, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_EXTHDR},
		{"v6 query behind a routing header, no segments left", 0, ip6(pod6, peer6, []ext{routing()}, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_EXTHDR},
		{"v6 query behind AH", 0, ip6(pod6, peer6, []ext{ah()}, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_EXTHDR},
		{"v6 atomic fragment of a query", 0, ip6(pod6, peer6, []ext{frag(0, false)}, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_EXTHDR},
		{"v6 query behind eight headers", 0, ip6(pod6, peer6, repeat(opts(pDst, 0), 8), pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_EXTHDR},
		{"v6 first fragment of a query", 0, ip6(pod6, peer6, []ext{frag(0, true)}, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_FRAGMENT},
		{"v6 first fragment, no udp header", 0, ip6(pod6, peer6, []ext{frag(0, true)}, pUDP, nil), actShot, CaptureVerdictReasonREASON_DROP_TRUNCATED},
		{"v6 later fragment", 0, ip6(pod6, peer6, []ext{frag(8, true)}, pUDP, make([]byte, 8)), actUnspec, noReason},
		{"v6 query, source routed", 0, ip6(pod6, peer6, []ext{srh(1, final, peer6)}, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_SOURCE_ROUTE},
		{"v6 udp to 5353, source routed", 0, ip6(pod6, peer6, []ext{srh(1, final, peer6)}, pUDP, query(5353)), actUnspec, noReason},
		{"802.1Q v4 query", 0, vlan(0x8100, ip4(pod4, peer4, pUDP, 0, q)), actShot, CaptureVerdictReasonREASON_DROP_VLAN},
		{"802.1Q v4 udp to 5353", 0, vlan(0x8100, ip4(pod4, peer4, pUDP, 0, query(5353))), actUnspec, noReason},
		{"v6 query behind hop-by-hop, pod without DNS capture", 0, ip6(plain6, peer6, []ext{opts(pHop, 0)}, pUDP, q), actUnspec, noReason},
		{"v4 first fragment of a query, pod without DNS capture", 0, ip4(plain4, peer4, pUDP, 0x2000, q), actUnspec, noReason},
		{"v4 query of the tunnel, first fragment", tunnelMark, ip4(pod4, peer4, pUDP, 0x2000, q), actUnspec, CaptureVerdictReasonREASON_OUT_PASS_TUNNEL_MARK},
	}
	runTable(t, objs.RdPodEgress, objs.RdReasons, cases)

	// On the interface of a pod with DNS capture, a query from one of its
	// addresses that is not enrolled (link-local, SLAAC) cannot be
	// answered by the tunnel from the resolver's address: dropped.
	own := ownNetNS(t, objs, pod6, 1, dnsFlags)
	runTableIn(t, objs.RdPodEgress, objs.RdReasons, own, []progCase{
		{"v6 query from the link-local address", 0, ip6(llPod, llPeer, nil, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_LINK_LOCAL},
		{"v6 query from a SLAAC address", 0, ip6(other6, peer6, nil, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_UNENROLLED_ADDR},
		{"v6 query from the link-local address of the tunnel", tunnelMark, ip6(llPod, llPeer, nil, pUDP, q), actUnspec, noReason},
		{"v6 udp to 5353 from the link-local address", 0, ip6(llPod, llPeer, nil, pUDP, query(5353)), actUnspec, noReason},
		{"v6 query from the pod address", 0, ip6(pod6, peer6, nil, pUDP, q), actRedirect, CaptureVerdictReasonREASON_OUT_DNS_STEERED},
	})
	noDNS := ownNetNS(t, objs, pod6, 1, bothWays)
	runTableIn(t, objs.RdPodEgress, objs.RdReasons, noDNS, []progCase{
		{"v6 query from the link-local address, pod without DNS capture", 0, ip6(llPod, llPeer, nil, pUDP, q), actUnspec, noReason},
	})
}

// TestCaptureDNSEgressRewrite: a steered query leaves egress as a steered
// SYN does: destination MAC rewritten to the interface's own, the reinject
// mark set, redirected to the same interface's ingress, the rest untouched.
func TestCaptureDNSEgressRewrite(t *testing.T) {
	needRoot(t)
	objs := loadDNSCapture(t)
	pkt := ip4(pod4, peer4, pUDP, 0, query(53))
	inNewNetNS(t, func() {
		ctxOut := make([]byte, 256) // all of struct __sk_buff
		opts := &ebpf.RunOptions{Data: pkt, DataOut: make([]byte, len(pkt)+64), Context: skbCtx{}, ContextOut: ctxOut}
		got, err := objs.RdPodEgress.Run(opts)
		if err != nil {
			t.Errorf("run: %v", err)
			return
		}
		if got != actRedirect {
			t.Errorf("verdict %d, want redirect", int32(got))
		}
		want := append([]byte(nil), pkt...)
		copy(want[0:6], pkt[6:12])
		if string(opts.DataOut) != string(want) {
			t.Errorf("frame\n %x\nwant\n %x", opts.DataOut, want)
		}
		if mark := binary.NativeEndian.Uint32(ctxOut[8:]); mark != reinject {
			t.Errorf("mark %#x, want %#x", mark, reinject)
		}
	})
}

// dnsSocket opens a UDP socket of the test's namespace on port 15053,
// bound to addr, with mark; closed when the test ends.
func dnsSocket(t *testing.T, addr netip.Addr, mark int) {
	fam := unix.AF_INET6
	var sa unix.Sockaddr = &unix.SockaddrInet6{Port: 15053, Addr: addr.As16()}
	if addr.Is4() {
		fam = unix.AF_INET
		sa = &unix.SockaddrInet4{Port: 15053, Addr: addr.As4()}
	}
	fd, err := unix.Socket(fam, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Errorf("socket: %v", err)
		return
	}
	t.Cleanup(func() { unix.Close(fd) })
	if fam == unix.AF_INET6 {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0); err != nil {
			t.Errorf("dual-stack: %v", err)
		}
	}
	for _, o := range [][3]int{{unix.SOL_SOCKET, unix.SO_MARK, mark}, {unix.SOL_SOCKET, unix.SO_REUSEADDR, 1}, {unix.SOL_IP, unix.IP_FREEBIND, 1}} {
		if err := unix.SetsockoptInt(fd, o[0], o[1], o[2]); err != nil {
			t.Errorf("setsockopt %d: %v", o[1], err)
		}
	}
	if err := unix.Bind(fd, sa); err != nil {
		t.Errorf("bind %s: %v", addr, err)
	}
}

// TestCaptureDNSIngress: a re-injected query of a pod with DNS capture is
// assigned to the tunnel's DNS socket ([::]:15053, tunnel mark), found
// with the query's own tuple and port 15053; with no such socket, or a
// socket that is not the tunnel's (a process in the pod bound the port,
// on the wildcard or on the resolver's address, the more specific match),
// it is dropped: the query never reaches the resolver uncaptured. What is
// not such a query passes as before. BPF_PROG_TEST_RUN's packet is not at
// tc ingress, so bpf_sk_assign itself refuses there (drop_assign_failed:
// the socket was found and was the tunnel's); TestDNSCaptureEndToEnd in
// pkg/loader proves the assignment in a real namespace.
func TestCaptureDNSIngress(t *testing.T) {
	needRoot(t)
	objs := loadDNSCapture(t)
	q := query(53)
	v4q, v6q := ip4(pod4, peer4, pUDP, 0, q), ip6(pod6, peer6, nil, pUDP, q)

	// No socket on 15053.
	runTable(t, objs.RdPodIngress, objs.RdReasons, []progCase{
		{"v4 query, no socket", reinject, v4q, actShot, CaptureVerdictReasonREASON_DROP_NO_DNS_SOCKET},
		{"v6 query, no socket", reinject, v6q, actShot, CaptureVerdictReasonREASON_DROP_NO_DNS_SOCKET},
		{"v4 query, reinject mark with other bits", 0xf111, v4q, actShot, CaptureVerdictReasonREASON_DROP_NO_DNS_SOCKET},
		{"v4 query from the wire", 0, v4q, actUnspec, noReason},
		{"v4 query, pod without DNS capture", reinject, ip4(plain4, peer4, pUDP, 0, q), actUnspec, noReason},
		{"v6 udp to 5353", reinject, ip6(pod6, peer6, nil, pUDP, query(5353)), actUnspec, noReason},
		{"v4 query with ip options", reinject, ip4(pod4, peer4, pUDP, 0, q, 1, 1, 1, 0), actShot, CaptureVerdictReasonREASON_DROP_IP_OPTIONS},
		{"v6 first fragment of a query", reinject, ip6(pod6, peer6, []ext{frag(0, true)}, pUDP, q), actShot, CaptureVerdictReasonREASON_DROP_FRAGMENT},
	})
	// A socket that is not the tunnel's on [::]:15053.
	runTableIn(t, objs.RdPodIngress, objs.RdReasons, func(uint32) { dnsSocket(t, netip.IPv6Unspecified(), 0) }, []progCase{
		{"v4 query, foreign socket", reinject, v4q, actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_DNS_SOCKET},
		{"v6 query, foreign socket", reinject, v6q, actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_DNS_SOCKET},
	})
	// The tunnel's socket, and a foreign one bound to one resolver's
	// address (the more specific match for queries to it).
	both := func(uint32) {
		dnsSocket(t, netip.IPv6Unspecified(), tunnelMark)
		dnsSocket(t, peer4, 0)
	}
	failed := CaptureVerdictReasonREASON_DROP_ASSIGN_FAILED
	runTableIn(t, objs.RdPodIngress, objs.RdReasons, both, []progCase{
		{"v4 query, tunnel socket", reinject, ip4(pod4, other4, pUDP, 0, q), actShot, failed},
		{"v6 query, tunnel socket", reinject, v6q, actShot, failed},
		{"v4 query to the foreign socket's address", reinject, v4q, actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_DNS_SOCKET},
		{"v4 udp to 5353, tunnel socket", reinject, ip4(pod4, other4, pUDP, 0, query(5353)), actUnspec, noReason},
	})
}

// TestCaptureEgressForeignSource: on pod 1's interface, a SYN, a SYN-ACK or
// a DNS query from an enrolled address of pod 3 (an app bound it with
// IPV6_FREEBIND) is dropped and counted for pod 1 (drop_foreign_src).
// Before, it was judged by pod 3's settings: the query, pod 3 having no DNS
// capture, passed uncaptured, the SYN-ACK (pod 3's inbound not captured
// here) passed, and the SYN was steered as pod 3's. The tunnel's own
// packets (tunnel mark: its dials keep the client's address), other
// segments and pod 1's own packets keep their verdicts, and so does a query
// when pod 1 has no DNS capture, or off an enrolled pod's interface.
func TestCaptureEgressForeignSource(t *testing.T) {
	needRoot(t)
	objs := loadDNSCapture(t)
	q := query(53)
	tcpSyn, synAck := syn(8080), tcpHdr(8080, 40000, fSYN|fACK)
	foreign := CaptureVerdictReasonREASON_DROP_FOREIGN_SRC
	own := ownNetNS(t, objs, pod6, 1, dnsFlags)
	// pod 3 with its inbound not captured: its own SYN-ACK would pass
	inboundOff := func(ino uint32) {
		own(ino)
		for _, a := range []netip.Addr{plain4, plain6} {
			k := CapturePodAddr{Addr: a.As16()}
			if err := objs.RdPods.Put(&k, &CapturePodSettings{Flags: uint32(CapturePodFlagPOD_CAPTURE_OUTBOUND), PodId: 3}); err != nil {
				t.Errorf("enroll %s: %v", a, err)
			}
		}
	}
	runTableIn(t, objs.RdPodEgress, objs.RdReasons, inboundOff, []progCase{
		{"v6 syn from pod 3", 0, ip6(plain6, peer6, nil, pTCP, tcpSyn), actShot, foreign},
		{"v4 syn from pod 3", 0, ip4(plain4, peer4, pTCP, 0, tcpSyn), actShot, foreign},
		{"v6 syn from pod 3 behind destination options", 0, ip6(plain6, peer6, []ext{opts(pDst, 0)}, pTCP, tcpSyn), actShot, foreign},
		{"v6 syn from pod 3 to the probe address", 0, ip6(plain6, snat6, nil, pTCP, tcpSyn), actShot, foreign},
		{"v6 syn-ack from pod 3", 0, ip6(plain6, peer6, nil, pTCP, synAck), actShot, foreign},
		{"v6 query from pod 3", 0, ip6(plain6, peer6, nil, pUDP, q), actShot, foreign},
		{"v4 query from pod 3", 0, ip4(plain4, peer4, pUDP, 0, q), actShot, foreign},
		{"v6 syn of the tunnel from pod 3's address", tunnelMark, ip6(plain6, peer6, nil, pTCP, tcpSyn), actUnspec, CaptureVerdictReasonREASON_OUT_PASS_TUNNEL_MARK},
		{"v6 query of the tunnel from pod 3's address", tunnelMark, ip6(plain6, peer6, nil, pUDP, q), actUnspec, noReason},
		{"v6 ack from pod 3", 0, ip6(plain6, peer6, nil, pTCP, tcpHdr(40000, 8080, fACK)), actUnspec, noReason},
		{"v6 udp to 5353 from pod 3", 0, ip6(plain6, peer6, nil, pUDP, query(5353)), actUnspec, noReason},
		{"v6 syn from pod 1", 0, ip6(pod6, peer6, nil, pTCP, tcpSyn), actRedirect, CaptureVerdictReasonREASON_OUT_SYN_STEERED},
		{"v6 query from pod 1", 0, ip6(pod6, peer6, nil, pUDP, q), actRedirect, CaptureVerdictReasonREASON_OUT_DNS_STEERED},
	})
	runTableIn(t, objs.RdPodEgress, objs.RdReasons, ownNetNS(t, objs, pod6, 1, bothWays), []progCase{
		{"v6 query from pod 3, pod 1 without DNS capture", 0, ip6(plain6, peer6, nil, pUDP, q), actUnspec, noReason},
		{"v6 syn from pod 3, pod 1 without DNS capture", 0, ip6(plain6, peer6, nil, pTCP, tcpSyn), actShot, foreign},
	})
	runTable(t, objs.RdPodEgress, objs.RdReasons, []progCase{
		{"v6 syn from pod 3, namespace unknown", 0, ip6(plain6, peer6, nil, pTCP, tcpSyn), actRedirect, CaptureVerdictReasonREASON_OUT_SYN_STEERED},
	})
}
