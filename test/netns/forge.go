package netnstest

import (
	"bytes"
	"encoding/binary"
	"net"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// Forged packets, as a pod with a packet socket (CAP_NET_RAW, which
// container runtimes grant by default) can send them onto its node's bridge.

// TCPSegment is a TCP segment from src to dst with the given numbers, flags
// and payload, its checksum over the family's pseudo-header.
func TCPSegment(src, dst netip.AddrPort, seq, ack uint32, flags byte, payload []byte) []byte {
	seg := make([]byte, 20+len(payload))
	binary.BigEndian.PutUint16(seg[0:], src.Port())
	binary.BigEndian.PutUint16(seg[2:], dst.Port())
	binary.BigEndian.PutUint32(seg[4:], seq)
	binary.BigEndian.PutUint32(seg[8:], ack)
	seg[12] = 5 << 4
	seg[13] = flags
	binary.BigEndian.PutUint16(seg[14:], 65535)
	copy(seg[20:], payload)
	var pseudo []byte
	if src.Addr().Is4() {
		s, d := src.Addr().As4(), dst.Addr().As4()
		pseudo = append(append(s[:], d[:]...), 0, unix.IPPROTO_TCP, byte(len(seg)>>8), byte(len(seg)))
	} else {
		s, d := src.Addr().As16(), dst.Addr().As16()
		pseudo = append(append(s[:], d[:]...), 0, 0, byte(len(seg)>>8), byte(len(seg)), 0, 0, 0, unix.IPPROTO_TCP)
	}
	binary.BigEndian.PutUint16(seg[16:], inetChecksum(pseudo, seg))
	return seg
}

// IPPacket wraps a TCP segment in an IPv4 (DF set) or IPv6 header.
func IPPacket(src, dst netip.Addr, seg []byte) []byte {
	if src.Is4() {
		h := make([]byte, 20)
		h[0] = 0x45
		binary.BigEndian.PutUint16(h[2:], uint16(20+len(seg)))
		binary.BigEndian.PutUint16(h[6:], 0x4000)
		h[8] = 64
		h[9] = unix.IPPROTO_TCP
		s, d := src.As4(), dst.As4()
		copy(h[12:], s[:])
		copy(h[16:], d[:])
		binary.BigEndian.PutUint16(h[10:], inetChecksum(h))
		return append(h, seg...)
	}
	h := make([]byte, 40)
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:], uint16(len(seg)))
	h[6] = unix.IPPROTO_TCP
	h[7] = 64
	s, d := src.As16(), dst.As16()
	copy(h[8:], s[:])
	copy(h[24:], d[:])
	return append(h, seg...)
}

// InjectFrame sends an IP packet out of from's eth0 to the MAC address of
// to's eth0: the node's bridge forwards it to to's veth without IP input.
func InjectFrame(t TB, from, to *Pod, pkt []byte) {
	t.Helper()
	var mac net.HardwareAddr
	if err := netns.Do(to.Path(), func() error {
		ifi, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		mac = ifi.HardwareAddr
		return nil
	}); err != nil {
		t.Fatalf("MAC address of %s: %v", to.Name, err)
	}
	sendFrame(t, from, mac, pkt)
}

// InjectFrameToNode sends an IP packet out of from's eth0 to its node's
// bridge, as a packet to its gateway: the node's IP input takes it.
func InjectFrameToNode(t TB, from *Pod, pkt []byte) {
	t.Helper()
	sendFrame(t, from, from.Node.BridgeMAC(), pkt)
}

// sendFrame writes pkt in a frame to mac out of from's eth0, whatever its
// source address.
func sendFrame(t TB, from *Pod, mac net.HardwareAddr, pkt []byte) {
	t.Helper()
	proto := uint16(unix.ETH_P_IP)
	if pkt[0]>>4 == 6 {
		proto = unix.ETH_P_IPV6
	}
	err := netns.Do(from.Path(), func() error {
		ifi, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		sa := &unix.SockaddrLinklayer{Protocol: htons(proto), Ifindex: ifi.Index, Halen: 6}
		copy(sa.Addr[:], mac)
		return unix.Sendto(fd, pkt, 0, sa)
	})
	if err != nil {
		t.Fatalf("inject a frame from %s: %v", from.Name, err)
	}
}

// NextSegment calls send, which makes src send payload to pod p, and reads
// p's eth0 until it sees that segment: it returns the sequence and
// acknowledgement numbers src's next segment will carry.
func NextSegment(t TB, p *Pod, src netip.AddrPort, payload []byte, send func() error) (seq, ack uint32) {
	t.Helper()
	var fd int
	err := netns.Do(p.Path(), func() error {
		ifi, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index})
	})
	if err != nil {
		t.Fatalf("watch %s's eth0: %v", p.Name, err)
	}
	defer unix.Close(fd)
	tv := unix.Timeval{Usec: 200000}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if err := send(); err != nil {
		t.Fatalf("send %q from %s: %v", payload, src, err)
	}
	b := make([]byte, 65536)
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); {
		n, _, err := unix.Recvfrom(fd, b, 0)
		if err != nil {
			continue
		}
		from, seg, ok := parseTCP(b[:n])
		if !ok || from != src.Addr() || binary.BigEndian.Uint16(seg[0:]) != src.Port() {
			continue
		}
		off := int(seg[12]>>4) * 4
		if off <= len(seg) && bytes.Equal(seg[off:], payload) {
			return binary.BigEndian.Uint32(seg[4:]) + uint32(len(payload)), binary.BigEndian.Uint32(seg[8:])
		}
	}
	t.Fatalf("no segment with %q from %s seen in pod %s", payload, src, p.Name)
	return 0, 0
}

// parseTCP returns the source address and the TCP segment of an IPv4 or
// IPv6 packet without extension headers.
func parseTCP(p []byte) (netip.Addr, []byte, bool) {
	if len(p) < 20 {
		return netip.Addr{}, nil, false
	}
	switch p[0] >> 4 {
	case 4:
		ihl := int(p[0]&0xf) * 4
		total := int(binary.BigEndian.Uint16(p[2:]))
		if p[9] != unix.IPPROTO_TCP || total > len(p) || total < ihl+20 {
			return netip.Addr{}, nil, false
		}
		return netip.AddrFrom4([4]byte(p[12:16])), p[ihl:total], true
	case 6:
		if len(p) < 60 || p[6] != unix.IPPROTO_TCP {
			return netip.Addr{}, nil, false
		}
		plen := int(binary.BigEndian.Uint16(p[4:]))
		if plen < 20 || 40+plen > len(p) {
			return netip.Addr{}, nil, false
		}
		return netip.AddrFrom16([16]byte(p[8:24])), p[40 : 40+plen], true
	}
	return netip.Addr{}, nil, false
}

// inetChecksum is the Internet checksum over the concatenated parts.
func inetChecksum(parts ...[]byte) uint16 {
	var sum uint32
	for _, b := range parts {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(b[i])<<8 | uint32(b[i+1])
		}
		if len(b)%2 == 1 {
			sum += uint32(b[len(b)-1]) << 8
		}
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}
