package bpf

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// The reference classifier of FuzzCapture: what rd_pod_ingress and
// rd_pod_egress must do with a frame, written from docs/architecture.md
// ("Data path (pod side)") and the verdict lists in capture.c's comments,
// not from the C code's structure. Small on purpose: it knows headers,
// the rig's enrolled pods and the rig's sockets, nothing else.

// refClass is what the reference parser makes of a frame.
type refClass int

const (
	refOther    refClass = iota // not IP, or IP whose payload is neither TCP nor UDP
	refTCP                      // a whole TCP header, its tuple known
	refUnparsed                 // IP that may carry TCP but cannot be classified
	refUDP                      // UDP, or the first fragment of a UDP datagram
)

// refPkt is a parsed frame. Addresses are the maps' keys: IPv4 mapped.
type refPkt struct {
	class        refClass
	reason       CaptureVerdictReason // why, for refUnparsed
	hasAddrs     bool
	v6           bool
	src, dst     [16]byte
	sport, dport uint16
	syn, ack     bool
	rst          bool
	forHost      bool // the frame's destination MAC is the device's (PACKET_HOST)
	// refUDP only: the ports were read (a whole UDP header), and why a DNS
	// query in the packet cannot be steered cleanly (0: it can).
	hasPorts bool
	unclean  CaptureVerdictReason
}

// Protocol numbers that may carry TCP out of sight (docs: "hides its
// payload"), and the IPv6 extension headers the kernel walks.
var (
	refHides = map[byte]bool{50: true, 108: true, 4: true, 41: true, 47: true, 137: true, 115: true, 143: true, 97: true}
	// IPv6 headers not walked that an upper-layer header may follow:
	// mobility, HIP, Shim6, experimental 253 and 254.
	refOpaque6 = map[byte]bool{135: true, 139: true, 140: true, 253: true, 254: true}
	refWalked6 = map[byte]bool{0: true, 43: true, 60: true, 44: true, 51: true}
)

// refMayHoldTCP6 reports whether what follows an IPv6 header of next
// header next may be TCP or hide it.
func refMayHoldTCP6(next byte) bool {
	return next == 6 || refWalked6[next] || refHides[next] || refOpaque6[next]
}

func refIsVLAN(t uint16) bool {
	return t == 0x8100 || t == 0x88a8 || t == 0x9100 || t == 0x9200 || t == 0x9300
}

// refParse classifies an Ethernet frame as the kernel's input would see it.
func refParse(f []byte) refPkt {
	var p refPkt
	if len(f) < 14 {
		return p
	}
	p.forHost = [6]byte(f[0:6]) == [6]byte{} // the test device (lo) has MAC 0
	typ := binary.BigEndian.Uint16(f[12:])
	l3, tags := 14, 0
	for refIsVLAN(typ) {
		// up to four tags are looked through; a fifth, or a tag cut
		// short, is dropped unread
		if tags == 4 || len(f) < l3+4 {
			p.class, p.reason = refUnparsed, CaptureVerdictReasonREASON_DROP_VLAN
			return p
		}
		typ = binary.BigEndian.Uint16(f[l3+2:])
		l3 += 4
		tags++
	}
	switch typ {
	case 0x0800:
		refIPv4(f, l3, &p)
	case 0x86dd:
		refIPv6(f, l3, &p)
	default:
		return p
	}
	if tags > 0 && p.class == refUDP {
		// a tag the kernel may take off after tc, and then route
		// what it carries past the capture
		p.unclean = CaptureVerdictReasonREASON_DROP_VLAN
	} else if tags > 0 && p.class != refOther {
		p.class, p.reason = refUnparsed, CaptureVerdictReasonREASON_DROP_VLAN
	}
	return p
}

func (p refPkt) String() string {
	class := [...]string{"other", "tcp", "unparsed", "udp"}[p.class]
	s := fmt.Sprintf("%s (reason %d), host frame %v", class, p.reason, p.forHost)
	if p.hasAddrs {
		s += fmt.Sprintf(", %s:%d -> %s:%d syn %v ack %v", netip.AddrFrom16(p.src).Unmap(), p.sport,
			netip.AddrFrom16(p.dst).Unmap(), p.dport, p.syn, p.ack)
	}
	if p.class == refUDP {
		s += fmt.Sprintf(", ports read %v, unclean %d", p.hasPorts, p.unclean)
	}
	return s
}

func (p *refPkt) drop(r CaptureVerdictReason) {
	p.class, p.reason = refUnparsed, r
}

func refIPv4(f []byte, l3 int, p *refPkt) {
	if len(f) < l3+20 {
		p.drop(CaptureVerdictReasonREASON_DROP_TRUNCATED)
		return
	}
	h := f[l3:]
	p.src = netip.AddrFrom4([4]byte(h[12:16])).As16()
	p.dst = netip.AddrFrom4([4]byte(h[16:20])).As16()
	p.hasAddrs = true
	if h[0]>>4 != 4 || h[0]&0xf < 5 {
		p.drop(CaptureVerdictReasonREASON_DROP_MALFORMED)
		return
	}
	off := l3 + int(h[0]&0xf)*4
	if off > len(f) {
		p.drop(CaptureVerdictReasonREASON_DROP_TRUNCATED)
		return
	}
	proto := h[9]
	if binary.BigEndian.Uint16(h[6:])&0x3fff != 0 { // MF or an offset
		if proto == 6 || proto == 51 || refHides[proto] {
			p.drop(CaptureVerdictReasonREASON_DROP_FRAGMENT)
		} else if proto == 17 && binary.BigEndian.Uint16(h[6:])&0x1fff == 0 {
			// the first fragment: the only one with the UDP header
			refUDPHdr(f, off, p, CaptureVerdictReasonREASON_DROP_FRAGMENT)
		}
		return
	}
	if proto == 51 { // AH: 12 bytes at least, its length in 4-byte units minus 2
		if len(f) < off+12 {
			p.drop(CaptureVerdictReasonREASON_DROP_TRUNCATED)
			return
		}
		if f[off+1] < 1 {
			p.drop(CaptureVerdictReasonREASON_DROP_MALFORMED)
			return
		}
		proto = f[off]
		off += (int(f[off+1]) + 2) * 4
		if proto == 51 {
			p.drop(CaptureVerdictReasonREASON_DROP_EXTHDR)
			return
		}
		if proto == 17 {
			refUDPHdr(f, off, p, CaptureVerdictReasonREASON_DROP_EXTHDR)
			return
		}
	}
	if refHides[proto] {
		p.drop(CaptureVerdictReasonREASON_DROP_EXTHDR)
		return
	}
	switch proto {
	case 6:
		refTCPHdr(f, off, p)
	case 17:
		var unclean CaptureVerdictReason
		if h[0]&0xf > 5 {
			unclean = CaptureVerdictReasonREASON_DROP_IP_OPTIONS
		}
		refUDPHdr(f, off, p, unclean)
	}
}

func refIPv6(f []byte, l3 int, p *refPkt) {
	if len(f) < l3+40 {
		p.drop(CaptureVerdictReasonREASON_DROP_TRUNCATED)
		return
	}
	h := f[l3:]
	p.src, p.dst = [16]byte(h[8:24]), [16]byte(h[24:40])
	p.hasAddrs, p.v6 = true, true
	if h[0]>>4 != 6 {
		p.drop(CaptureVerdictReasonREASON_DROP_MALFORMED)
		return
	}
	if netip.AddrFrom16(p.src).Is4In6() || netip.AddrFrom16(p.dst).Is4In6() {
		p.drop(CaptureVerdictReasonREASON_DROP_MALFORMED)
		return
	}
	next, off := h[6], l3+40
	for walked := 0; ; walked++ {
		if next == 6 {
			refTCPHdr(f, off, p)
			return
		}
		if next == 17 {
			var unclean CaptureVerdictReason
			if walked > 0 {
				unclean = CaptureVerdictReasonREASON_DROP_EXTHDR
			}
			refUDPHdr(f, off, p, unclean)
			return
		}
		if !refMayHoldTCP6(next) {
			return // UDP, ICMPv6, no next header, unknown: not TCP
		}
		if !refWalked6[next] || walked == 8 {
			// hidden payload, an opaque header, or a chain longer
			// than eight headers
			p.drop(CaptureVerdictReasonREASON_DROP_EXTHDR)
			return
		}
		need := map[byte]int{0: 2, 60: 2, 51: 2, 43: 4, 44: 8}[next]
		if len(f) < off+need {
			p.drop(CaptureVerdictReasonREASON_DROP_TRUNCATED)
			return
		}
		e := f[off:]
		switch next {
		case 43: // routing: with segments left, the destination is a hop
			if e[3] != 0 {
				if refMayHoldTCP6(e[0]) {
					p.drop(CaptureVerdictReasonREASON_DROP_SOURCE_ROUTE)
				} else if e[0] == 17 {
					refUDPHdr(f, off+(int(e[1])+1)*8, p, CaptureVerdictReasonREASON_DROP_SOURCE_ROUTE)
				}
				return
			}
			off += (int(e[1]) + 1) * 8
		case 0, 60:
			off += (int(e[1]) + 1) * 8
		case 51:
			if e[1] < 1 {
				p.drop(CaptureVerdictReasonREASON_DROP_MALFORMED)
				return
			}
			off += (int(e[1]) + 2) * 4
		case 44: // a fragment, unless atomic (offset 0, no more)
			off += 8
			if fo := binary.BigEndian.Uint16(e[2:]); fo&0xfff9 != 0 {
				if refMayHoldTCP6(e[0]) {
					p.drop(CaptureVerdictReasonREASON_DROP_FRAGMENT)
				} else if e[0] == 17 && fo&0xfff8 == 0 {
					refUDPHdr(f, off, p, CaptureVerdictReasonREASON_DROP_FRAGMENT)
				}
				return
			}
		}
		next = e[0]
		if off > len(f) {
			p.drop(CaptureVerdictReasonREASON_DROP_TRUNCATED)
			return
		}
	}
}

func refTCPHdr(f []byte, off int, p *refPkt) {
	if len(f) < off+20 {
		p.drop(CaptureVerdictReasonREASON_DROP_TRUNCATED)
		return
	}
	t := f[off:]
	doff := int(t[12] >> 4)
	if doff < 5 {
		p.drop(CaptureVerdictReasonREASON_DROP_MALFORMED)
		return
	}
	if len(f) < off+doff*4 { // the options must be there too
		p.drop(CaptureVerdictReasonREASON_DROP_TRUNCATED)
		return
	}
	p.class = refTCP
	p.sport, p.dport = binary.BigEndian.Uint16(t[0:]), binary.BigEndian.Uint16(t[2:])
	p.syn, p.ack, p.rst = t[13]&0x02 != 0, t[13]&0x10 != 0, t[13]&0x04 != 0
}

// refUDPHdr reads the UDP header at off: unclean is why a DNS query in it
// could not be steered, and a header cut short (its ports unknown, so it may
// be a query) makes it drop_truncated.
func refUDPHdr(f []byte, off int, p *refPkt, unclean CaptureVerdictReason) {
	p.class, p.unclean = refUDP, unclean
	if len(f) < off+8 {
		p.unclean = CaptureVerdictReasonREASON_DROP_TRUNCATED
		return
	}
	p.hasPorts = true
	p.sport, p.dport = binary.BigEndian.Uint16(f[off:]), binary.BigEndian.Uint16(f[off+2:])
}

// refPod is an enrolled pod of the rig.
type refPod struct {
	id, flags uint32
}

// refSock is a socket of the rig's namespace: a listener, a connected
// socket, or one in SYN_SENT; marked says it carries the tunnel mark.
type refSock struct {
	local, remote netip.AddrPort
	listen        bool
	synSent       bool
	marked        bool
	dualStack     bool // a [::] listener taking IPv4 too
}

// refWorld is what the programs can see besides the frame: enrollment,
// the namespace's rd_pod_netns entry, and the namespace's sockets.
type refWorld struct {
	pods    map[[16]byte]refPod
	nsOwner *[16]byte // the address rd_pod_netns names for this namespace
	nsPodID uint32
	socks   []refSock
	// udpSocks are the namespace's bound UDP sockets (local and marked,
	// dualStack: [::] not IPV6_V6ONLY).
	udpSocks []refSock
}

// lookupUDP is bpf_sk_lookup_udp for a packet to dst:port: the socket
// bound to dst itself, else one bound to the wildcard address of dst's
// family (or a dual-stack [::]).
func (w *refWorld) lookupUDP(dst [16]byte, port uint16) sockKind {
	return bestBound(w.udpSocks, netip.AddrPortFrom(netip.AddrFrom16(dst).Unmap(), port))
}

// bestBound is the most specific of socks bound to d's port: one bound to
// d's address, else one bound to the wildcard address of its family (or a
// dual-stack [::]); the tunnel's if it carries the mark. socks are those
// that may take the packet: TCP listeners, or bound UDP sockets.
func bestBound(socks []refSock, d netip.AddrPort) sockKind {
	best, bestSpecific := sockNone, false
	for _, k := range socks {
		if k.local.Port() != d.Port() {
			continue
		}
		specific := k.local.Addr() == d.Addr()
		wild := k.local.Addr().IsUnspecified() && (k.local.Addr().Is6() == d.Addr().Is6() || k.dualStack)
		if !specific && !wild || best != sockNone && bestSpecific && !specific {
			continue
		}
		best, bestSpecific = sockOtherListener, specific
		if k.marked {
			best = sockTunnelListener
		}
	}
	return best
}

// nsPod is netns_pod: the pod whose interface the packet is on, while the
// address the entry names is enrolled with the entry's pod id.
func (w *refWorld) nsPod() (refPod, [16]byte, bool) {
	if w.nsOwner == nil {
		return refPod{}, [16]byte{}, false
	}
	pod, ok := w.pods[*w.nsOwner]
	if !ok || pod.id != w.nsPodID {
		return refPod{}, [16]byte{}, false
	}
	return pod, *w.nsOwner, true
}

// sockKind is what a socket lookup of a tuple finds.
type sockKind int

const (
	sockNone    sockKind = iota
	sockConn             // a socket that is not a listener
	sockSynSent          // an app's socket (no tunnel mark) in SYN_SENT
	sockTunnelListener
	sockOtherListener
)

// lookup is bpf_skc_lookup_tcp on the tuple src:sport -> dst:dport: a
// connected socket whose local end is dst and remote src, else the most
// specific listener on dst:dport.
func (w *refWorld) lookup(src, dst [16]byte, sport, dport uint16) sockKind {
	s := netip.AddrPortFrom(netip.AddrFrom16(src).Unmap(), sport)
	d := netip.AddrPortFrom(netip.AddrFrom16(dst).Unmap(), dport)
	for _, k := range w.socks {
		if !k.listen && k.local == d && k.remote == s {
			if k.synSent && !k.marked {
				return sockSynSent
			}
			return sockConn
		}
	}
	var listeners []refSock
	for _, k := range w.socks {
		if k.listen {
			listeners = append(listeners, k)
		}
	}
	return bestBound(listeners, d)
}

// outcome is one verdict the programs may give, the reason it counts (or
// noReason) and the pod address counted (nil: none).
type outcome struct {
	verdict uint32
	reason  CaptureVerdictReason
	pod     *[16]byte
}

func addrKey(a netip.Addr) [16]byte { return a.As16() }

var (
	refProbe4 = addrKey(snat4)
	refProbe6 = addrKey(snat6)
)

func refIsLoopback(a [16]byte) bool {
	x := netip.AddrFrom16(a)
	return x.Is4In6() && x.Unmap().IsLoopback() || x == netip.IPv6Loopback()
}

func refIsLinkLocal(a [16]byte) bool {
	x := netip.AddrFrom16(a)
	if x.Is4In6() {
		u := x.Unmap().As4()
		return u[0] == 169 && u[1] == 254
	}
	return a[0] == 0xfe && a[1]&0xc0 == 0x80
}

const (
	tunnelMarkRef   = 0x539
	reinjectMarkRef = 0x111
	markMaskRef     = 0xfff
)

// expect returns the outcomes the design allows for frame p on the egress
// (egress true) or ingress program, with skb mark mark. BPF_PROG_TEST_RUN
// cannot set skb->hash, so no packet carries the host-probe marker, and its
// frames are never PACKET_LOOPBACK.
func (w *refWorld) expect(egress bool, mark uint32, p refPkt) []outcome {
	one := func(v uint32, r CaptureVerdictReason, pod *[16]byte) []outcome {
		return []outcome{{v, r, pod}}
	}
	pass := one(actUnspec, noReason, nil)
	src, dst := p.src, p.dst
	_, srcEnrolled := w.pods[src]
	_, dstEnrolled := w.pods[dst]
	forHost := egress || p.forHost // ingress frames the host would not take are the kernel's to drop
	nsPod, owner, onPod := w.nsPod()

	tunnelMarked := mark&markMaskRef == tunnelMarkRef
	dnsFlag := uint32(CapturePodFlagPOD_CAPTURE_DNS)
	// a query to port 53 as far as the programs can tell: a UDP header
	// cut short may be one
	dnsQuery := p.class == refUDP && (!p.hasPorts || p.dport == 53)
	if dnsQuery && egress {
		// dns_egress: a pod with DNS capture has every query steered
		// to the tunnel's DNS socket, but for the tunnel's own; one it
		// cannot steer cleanly, or to loopback, or from an address of
		// its interface that is not enrolled, never leaves.
		pod, ok := w.pods[src]
		switch {
		case !ok && (tunnelMarked || !onPod || nsPod.flags&dnsFlag == 0):
			return pass
		case !ok && refIsLinkLocal(src):
			return one(actShot, CaptureVerdictReasonREASON_DROP_LINK_LOCAL, &owner)
		case !ok:
			return one(actShot, CaptureVerdictReasonREASON_DROP_UNENROLLED_ADDR, &owner)
		case !tunnelMarked && onPod && pod.id != nsPod.id && nsPod.flags&dnsFlag != 0:
			// another pod's address (IPV6_FREEBIND): never judged
			// by that pod's settings
			return one(actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_SRC, &owner)
		case pod.flags&dnsFlag == 0:
			return pass
		case tunnelMarked:
			return one(actUnspec, CaptureVerdictReasonREASON_OUT_PASS_TUNNEL_MARK, &src)
		case p.unclean != 0:
			return one(actShot, p.unclean, &src)
		case refIsLoopback(dst):
			return one(actShot, CaptureVerdictReasonREASON_DROP_LOOPBACK, &src)
		}
		return one(actRedirect, CaptureVerdictReasonREASON_OUT_DNS_STEERED, &src)
	}
	if dnsQuery && mark&markMaskRef == reinjectMarkRef && srcEnrolled && w.pods[src].flags&dnsFlag != 0 {
		// a query dns_egress steered: to the tunnel's DNS socket on
		// 15053 (bpf_sk_assign may refuse under BPF_PROG_TEST_RUN)
		if p.unclean != 0 {
			return one(actShot, p.unclean, &src)
		}
		switch w.lookupUDP(dst, 15053) {
		case sockTunnelListener:
			return []outcome{{actOK, CaptureVerdictReasonREASON_IN_ASSIGN_DNS, &src}, {actShot, CaptureVerdictReasonREASON_DROP_ASSIGN_FAILED, &src}}
		case sockOtherListener:
			return one(actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_DNS_SOCKET, &src)
		}
		return one(actShot, CaptureVerdictReasonREASON_DROP_NO_DNS_SOCKET, &src)
	}

	switch p.class {
	case refOther, refUDP: // UDP that is no captured query is not the mesh's
		// own_source: IPv4 from the wire from an enrolled address of
		// the pod whose interface it arrives on (accept_local is on).
		if !egress && p.hasAddrs && !p.v6 && srcEnrolled && onPod && w.pods[src].id == nsPod.id {
			return one(actShot, CaptureVerdictReasonREASON_DROP_SPOOFED, &owner)
		}
		return pass
	case refUnparsed:
		// dropped as before, and charged to the pod whose interface
		// it is (its addresses name it only off such an interface)
		switch {
		case !p.hasAddrs && !onPod:
			return one(actShot, p.reason, nil)
		case onPod && (!p.hasAddrs || srcEnrolled || dstEnrolled || forHost):
			return one(actShot, p.reason, &owner)
		case srcEnrolled:
			return one(actShot, p.reason, &src)
		case dstEnrolled:
			return one(actShot, p.reason, &dst)
		}
		return pass
	}

	// unenrolled is unenrolled_local: TCP of the pod's own end that is not
	// enrolled (link-local, SLAAC, secondary) on its interface.
	unenrolled := func(local [16]byte, flag uint32) []outcome {
		if !forHost || !onPod || nsPod.flags&flag == 0 {
			return pass
		}
		if refIsLinkLocal(local) {
			return one(actShot, CaptureVerdictReasonREASON_DROP_LINK_LOCAL, &owner)
		}
		return one(actShot, CaptureVerdictReasonREASON_DROP_UNENROLLED_ADDR, &owner)
	}
	pureSYN := p.syn && !p.ack
	own := w.lookup(src, dst, p.sport, p.dport) // the socket the tuple itself names
	// takeSYN is take_syn: the SYN's own tuple first (an app's socket in
	// SYN_SENT never takes a SYN from the wire while the pod's outbound
	// is captured: its own SYN never left), then the listener on port
	// (bpf_sk_assign may refuse under BPF_PROG_TEST_RUN).
	takeSYN := func(port uint16, pod *[16]byte, assigned CaptureVerdictReason, passV uint32, wire bool) []outcome {
		if own == sockSynSent && wire {
			return one(actShot, CaptureVerdictReasonREASON_DROP_SYN_SENT, pod)
		}
		if own == sockConn || own == sockSynSent {
			return one(passV, CaptureVerdictReasonREASON_IN_SYN_EXISTING, pod)
		}
		switch w.lookup(src, dst, p.sport, port) {
		case sockTunnelListener:
			return []outcome{{actOK, assigned, pod}, {actShot, CaptureVerdictReasonREASON_DROP_ASSIGN_FAILED, pod}}
		case sockOtherListener:
			return one(actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_LISTENER, pod)
		}
		return one(actShot, CaptureVerdictReasonREASON_DROP_NO_LISTENER, pod)
	}

	if egress {
		pod, ok := w.pods[src]
		if !ok {
			if tunnelMarked {
				return pass
			}
			return unenrolled(src, uint32(CapturePodFlagPOD_CAPTURE_OUTBOUND))
		}
		switch {
		case tunnelMarked:
			return one(actUnspec, CaptureVerdictReasonREASON_OUT_PASS_TUNNEL_MARK, &src)
		case refIsLoopback(dst):
			return one(actShot, CaptureVerdictReasonREASON_DROP_LOOPBACK, &src)
		case p.syn && onPod && pod.id != nsPod.id && nsPod.flags&uint32(CapturePodFlagPOD_CAPTURE_OUTBOUND) != 0:
			// a SYN or SYN-ACK from another pod's address, which
			// would be judged by that pod's settings
			return one(actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_SRC, &owner)
		case dst == refProbe4 || dst == refProbe6:
			return one(actUnspec, CaptureVerdictReasonREASON_OUT_PASS_EXCLUDED, &src)
		case pureSYN && pod.flags&uint32(CapturePodFlagPOD_CAPTURE_OUTBOUND) == 0:
			return pass
		case pureSYN:
			return one(actRedirect, CaptureVerdictReasonREASON_OUT_SYN_STEERED, &src)
		case own == sockConn || own == sockSynSent:
			// its tuple is a tunnel socket's (the rig's connected
			// sockets stand for the tunnel's)
			return one(actRedirect, CaptureVerdictReasonREASON_OUT_TUNNEL_SOCKET, &src)
		case p.syn && p.ack && pod.flags&uint32(CapturePodFlagPOD_CAPTURE_INBOUND) != 0:
			return one(actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_LISTENER, &src)
		}
		// a connection from before enrollment (no socket of the
		// test's sender is marked captured)
		return pass
	}

	if mark&markMaskRef == reinjectMarkRef { // re-injected by rd_pod_egress
		if !srcEnrolled {
			return pass
		}
		if !pureSYN {
			return one(actOK, CaptureVerdictReasonREASON_IN_PASS_REINJECTED, &src)
		}
		return takeSYN(15001, &src, CaptureVerdictReasonREASON_IN_ASSIGN_OUTBOUND, actOK, false)
	}
	// From the wire, IPv4 from an enrolled address of the pod whose
	// interface it arrives on is a spoof whatever it is for: the loader
	// turns accept_local on, and the kernel then takes what it refused as
	// a martian before.
	ownSource := !p.v6 && srcEnrolled && onPod && w.pods[src].id == nsPod.id
	pod, ok := w.pods[dst]
	if !ok {
		if ownSource {
			return one(actShot, CaptureVerdictReasonREASON_DROP_SPOOFED, &owner)
		}
		return unenrolled(dst, uint32(CapturePodFlagPOD_CAPTURE_INBOUND))
	}
	if srcEnrolled && w.pods[src].id == pod.id {
		return one(actShot, CaptureVerdictReasonREASON_DROP_SPOOFED, &dst)
	}
	outbound := pod.flags&uint32(CapturePodFlagPOD_CAPTURE_OUTBOUND) != 0
	// a simultaneous open of an app socket the capture took the SYN of
	simultaneous := pureSYN && outbound && own == sockSynSent
	if p.dport == 15008 {
		if simultaneous {
			return one(actShot, CaptureVerdictReasonREASON_DROP_SYN_SENT, &dst)
		}
		return one(actUnspec, CaptureVerdictReasonREASON_IN_PASS_HBONE, &dst)
	}
	if src == refProbe4 || src == refProbe6 {
		return one(actShot, CaptureVerdictReasonREASON_DROP_PROBE_SPOOFED, &dst)
	}
	if pod.flags&uint32(CapturePodFlagPOD_CAPTURE_INBOUND) == 0 {
		if simultaneous {
			return one(actShot, CaptureVerdictReasonREASON_DROP_SYN_SENT, &dst)
		}
		return one(actUnspec, CaptureVerdictReasonREASON_IN_PASS_NO_CAPTURE, &dst)
	}
	if !pureSYN {
		// cookie_ack: an ACK with no connection, which a listener would
		// take (a SYN cookie's), goes to the inbound listener, never to the
		// app's own listener (nor the tunnel's others).
		if p.ack && !p.syn && !p.rst && (own == sockTunnelListener || own == sockOtherListener) {
			// to another pod's address, as its SYN would be
			if p.forHost && onPod && nsPod.id != pod.id {
				return one(actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_DST, &owner)
			}
			switch w.lookup(src, dst, p.sport, 15006) {
			case sockTunnelListener:
				return []outcome{{actOK, CaptureVerdictReasonREASON_IN_ASSIGN_COOKIE_ACK, &dst},
					{actShot, CaptureVerdictReasonREASON_DROP_ASSIGN_FAILED, &dst}}
			case sockOtherListener:
				return one(actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_LISTENER, &dst)
			}
			return one(actShot, CaptureVerdictReasonREASON_DROP_NO_LISTENER, &dst)
		}
		return pass // the kernel's demux finds the connection's socket
	}
	if p.forHost && onPod && nsPod.id != pod.id {
		return one(actShot, CaptureVerdictReasonREASON_DROP_FOREIGN_DST, &owner)
	}
	return takeSYN(15006, &dst, CaptureVerdictReasonREASON_IN_ASSIGN_INBOUND, actUnspec, outbound)
}

// refCounterField is the per-pod counter a counted reason adds to
// (struct pod_counters), as an index: outbound_conns, inbound_conns,
// steered_packets, dropped_packets, bypassed_packets; -1 none.
func refCounterFields(r CaptureVerdictReason) []int {
	switch r {
	case CaptureVerdictReasonREASON_OUT_SYN_STEERED:
		return []int{0, 2}
	case CaptureVerdictReasonREASON_IN_ASSIGN_INBOUND:
		return []int{1}
	case CaptureVerdictReasonREASON_OUT_TUNNEL_SOCKET, CaptureVerdictReasonREASON_IN_ASSIGN_OUTBOUND,
		CaptureVerdictReasonREASON_IN_PASS_REINJECTED, CaptureVerdictReasonREASON_IN_SYN_TIMEWAIT,
		CaptureVerdictReasonREASON_IN_ASSIGN_COOKIE_ACK, CaptureVerdictReasonREASON_OUT_DNS_STEERED,
		CaptureVerdictReasonREASON_IN_ASSIGN_DNS:
		return []int{2}
	case CaptureVerdictReasonREASON_OUT_PASS_TUNNEL_MARK, CaptureVerdictReasonREASON_OUT_PASS_EXCLUDED,
		CaptureVerdictReasonREASON_IN_PASS_HBONE, CaptureVerdictReasonREASON_IN_PASS_PROBE,
		CaptureVerdictReasonREASON_IN_PASS_NO_CAPTURE, CaptureVerdictReasonREASON_IN_SYN_EXISTING,
		CaptureVerdictReasonREASON_IN_PASS_EXISTING:
		return []int{4}
	case noReason, CaptureVerdictReasonREASON_SOCK_ROUTED_LOCAL:
		return nil
	}
	return []int{3} // every drop reason
}
