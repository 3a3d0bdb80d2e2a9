package probe_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/bpf"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/probe"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

const holdPort = 9191 // TCP: records what each client sends, keeps the connection open

// TestProbeNATTranslatesOnlyNodePackets: a pod on the node's bridge that
// sends a segment with the node's address and port of a probe connection
// (a raw packet: any pod with CAP_NET_RAW, which container runtimes grant
// by default) gets it translated to the probe SNAT address and marked as a
// probe, as if the node had sent it: before the fix, rd_host_egress
// translated every later packet of a connection by its NAT entry, whoever
// sent it, and the pod-side capture passes such a packet to the app in
// plaintext, past STRICT mTLS. Here the injected bytes land in the open
// probe connection, read by the app. Now only packets of a socket of the
// node's own namespace are translated; the spoofed one reaches the pod with
// the node's address, where no socket has its tuple.
func TestProbeNATTranslatesOnlyNodePackets(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app, attacker := node.AddPod("app"), node.AddPod("attacker")
	got := holdApp(t, app)
	root := tempBPFFS(t)
	a := load(t, probe.Config{PinRoot: root})
	const id = 5
	enroll(t, root, app, id)
	if err := attachHost(a, app, id); err != nil {
		t.Fatal(err)
	}
	for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		t.Run(f.name, func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod(app), holdPort)
			// A probe in flight: the node's connection, open.
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			c, err := netns.Dial(ctx, node.Path(), "tcp", dst.String(), netns.SocketOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			nodeEnd := netip.MustParseAddrPort(c.LocalAddr().String())
			nodeEnd = netip.AddrPortFrom(nodeEnd.Addr().Unmap(), nodeEnd.Port())
			if nodeEnd.Addr() != f.node {
				t.Fatalf("the node dialled from %s, want its address %s towards the pods", nodeEnd, f.node)
			}
			// Where the connection stands, as the pod sees it: the
			// sequence numbers of the node's next segment.
			seq, ack := nextSegment(t, app, c, f.snat, nodeEnd.Port())
			from := netip.AddrPortFrom(f.snat, nodeEnd.Port())
			if b := got.wait(from, "probe", time.Second); !strings.Contains(b, "probe") {
				t.Fatalf("the app read %q from %s, want the node's probe bytes", b, from)
			}

			// The attacker on the bridge sends the node's next segment.
			before := probeSpoofedDrops(t, root)
			seg := tcpSegment(nodeEnd, dst, seq, ack, 0x18 /* PSH|ACK */, []byte("INJECTED"))
			injectFrame(t, attacker, app, ipPacket(nodeEnd.Addr(), dst.Addr(), seg))
			if b := got.wait(from, "INJECTED", time.Second); strings.Contains(b, "INJECTED") {
				t.Errorf("a segment another pod sent with the node's address was translated as the node's probe: the app read %q from %s", b, from)
			}
			if n := probeSpoofedDrops(t, root) - before; n < 1 {
				t.Errorf("drop_probe_spoofed grew by %d, want >= 1 for the forged segment", n)
			}
			// The node's own packets of the connection still are, and the
			// forged one did not reset it (passed untranslated, it would
			// meet no socket in the pod, whose reset the node takes).
			if _, err := c.Write([]byte("again")); err != nil {
				t.Fatal(err)
			}
			if b := got.wait(from, "again", 2*time.Second); !strings.Contains(b, "again") {
				t.Errorf("the node's own later segment did not reach the app from %s: read %q", from, b)
			}
		})
	}
}

// holdApp serves holdPort in pod: it reads from every client and keeps
// what each sent, by the client's address, until the client closes.
func holdApp(t *testing.T, pod *netnstest.Pod) *received {
	t.Helper()
	l, err := netns.Listen(context.Background(), pod.Path(), "tcp", fmt.Sprintf("[::]:%d", holdPort), netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	r := &received{ch: make(chan struct{}, 1), by: map[netip.AddrPort]*bytes.Buffer{}}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				from := netip.MustParseAddrPort(c.RemoteAddr().String())
				from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
				b := make([]byte, 4096)
				for {
					n, err := c.Read(b)
					if n > 0 {
						r.add(from, b[:n])
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return r
}

type received struct {
	mu sync.Mutex
	ch chan struct{} // a nudge for wait on every add
	by map[netip.AddrPort]*bytes.Buffer
}

func (r *received) add(from netip.AddrPort, b []byte) {
	r.mu.Lock()
	buf := r.by[from]
	if buf == nil {
		buf = &bytes.Buffer{}
		r.by[from] = buf
	}
	buf.Write(b)
	r.mu.Unlock()
	select {
	case r.ch <- struct{}{}:
	default:
	}
}

// wait returns what from sent so far, once it holds want or timeout passed.
func (r *received) wait(from netip.AddrPort, want string, timeout time.Duration) string {
	deadline := time.Now().Add(timeout)
	for {
		r.mu.Lock()
		var s string
		if b := r.by[from]; b != nil {
			s = b.String()
		}
		r.mu.Unlock()
		if strings.Contains(s, want) || time.Now().After(deadline) {
			return s
		}
		select {
		case <-r.ch:
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// nextSegment writes "probe" on the node's connection c and reads, on the
// pod's interface, the segment that carried it (from snat:port after the
// translation): it returns the sequence and acknowledgement numbers the
// node's next segment has.
func nextSegment(t *testing.T, pod *netnstest.Pod, c net.Conn, snat netip.Addr, port uint16) (seq, ack uint32) {
	t.Helper()
	var fd int
	err := netns.Do(pod.Path(), func() error {
		ifi, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, int(htons16(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons16(unix.ETH_P_ALL), Ifindex: ifi.Index})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	tv := unix.Timeval{Sec: 0, Usec: 200000}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if _, err := c.Write([]byte("probe")); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Second)
	b := make([]byte, 65536)
	for time.Now().Before(deadline) {
		n, _, err := unix.Recvfrom(fd, b, 0)
		if err != nil {
			continue
		}
		src, tcp, ok := parseIP(b[:n])
		if !ok || src != snat || binary.BigEndian.Uint16(tcp[0:]) != port {
			continue
		}
		off := int(tcp[12]>>4) * 4
		if off > len(tcp) || !bytes.Equal(tcp[off:], []byte("probe")) {
			continue
		}
		return binary.BigEndian.Uint32(tcp[4:]) + 5, binary.BigEndian.Uint32(tcp[8:])
	}
	t.Fatalf("no segment with the probe's bytes from %s:%d seen in pod %s", snat, port, pod.Name)
	return 0, 0
}

// parseIP returns the source address and the TCP segment of an IPv4 or
// IPv6 packet without extension headers.
func parseIP(p []byte) (netip.Addr, []byte, bool) {
	if len(p) < 20 {
		return netip.Addr{}, nil, false
	}
	switch p[0] >> 4 {
	case 4:
		ihl := int(p[0]&0xf) * 4
		if p[9] != unix.IPPROTO_TCP || len(p) < ihl+20 {
			return netip.Addr{}, nil, false
		}
		total := int(binary.BigEndian.Uint16(p[2:]))
		if total > len(p) || total < ihl+20 {
			return netip.Addr{}, nil, false
		}
		return netip.AddrFrom4([4]byte(p[12:16])), p[ihl:total], true
	case 6:
		if len(p) < 60 || p[6] != unix.IPPROTO_TCP {
			return netip.Addr{}, nil, false
		}
		plen := int(binary.BigEndian.Uint16(p[4:]))
		if 40+plen > len(p) {
			return netip.Addr{}, nil, false
		}
		return netip.AddrFrom16([16]byte(p[8:24])), p[40 : 40+plen], true
	}
	return netip.Addr{}, nil, false
}

// tcpSegment is a TCP segment from src to dst with the given numbers,
// flags and payload, its checksum over the family's pseudo-header.
func tcpSegment(src, dst netip.AddrPort, seq, ack uint32, flags byte, payload []byte) []byte {
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

// ipPacket wraps a TCP segment in an IPv4 or IPv6 header.
func ipPacket(src, dst netip.Addr, seg []byte) []byte {
	if src.Is4() {
		h := make([]byte, 20)
		h[0] = 0x45
		binary.BigEndian.PutUint16(h[2:], uint16(20+len(seg)))
		binary.BigEndian.PutUint16(h[6:], 0x4000) // DF
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

// injectFrame sends an IP packet out of from's eth0 to the MAC address of
// to's eth0, as a pod with a packet socket can: the node's bridge forwards
// it to to's veth without IP input.
func injectFrame(t *testing.T, from, to *netnstest.Pod, pkt []byte) {
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
		t.Fatal(err)
	}
	proto := uint16(unix.ETH_P_IP)
	if pkt[0]>>4 == 6 {
		proto = unix.ETH_P_IPV6
	}
	err := netns.Do(from.Path(), func() error {
		ifi, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		sa := &unix.SockaddrLinklayer{Protocol: htons16(proto), Ifindex: ifi.Index, Halen: 6}
		copy(sa.Addr[:], mac)
		return unix.Sendto(fd, pkt, 0, sa)
	})
	if err != nil {
		t.Fatalf("inject from %s: %v", from.Name, err)
	}
}

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

func htons16(v uint16) uint16 { return v<<8 | v>>8 }

// TestProbeNATStaleEntryLeavesTunnelConnection: a NAT entry outlives its
// probe connection (the map is an LRU, nothing deletes on close). A node
// connection the host program must leave alone (the tunnel mark) that
// reuses the tuple of an earlier probe had its SYN left as it was, and
// every later packet translated by the stale entry: the pod's socket,
// which answered the node's address, got the rest from the SNAT address
// and the connection never carried data. A connection is now translated
// from its first packet to its last or not at all.
func TestProbeNATStaleEntryLeavesTunnelConnection(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	app := node.AddPod("app")
	got := holdApp(t, app)
	root := tempBPFFS(t)
	a := load(t, probe.Config{PinRoot: root})
	const id = 6
	enroll(t, root, app, id)
	if err := attachHost(a, app, id); err != nil {
		t.Fatal(err)
	}
	for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
		t.Run(f.name, func(t *testing.T) {
			dst := netip.AddrPortFrom(f.pod(app), holdPort)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			// A probe, closed with a reset so that the node keeps no
			// TIME_WAIT and its port can be taken again at once.
			c, err := netns.Dial(ctx, node.Path(), "tcp", dst.String(), netns.SocketOptions{})
			if err != nil {
				t.Fatal(err)
			}
			local := netip.MustParseAddrPort(c.LocalAddr().String())
			local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
			c.Write([]byte("probe"))
			if b := got.wait(netip.AddrPortFrom(f.snat, local.Port()), "probe", 2*time.Second); b != "probe" {
				t.Fatalf("probe: the app read %q", b)
			}
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
			time.Sleep(100 * time.Millisecond)

			// A tunnel-marked connection from the same address and port.
			m, err := netns.Dial(ctx, node.Path(), "tcp", dst.String(), netns.SocketOptions{Mark: tunnelMark, Local: net.TCPAddrFromAddrPort(local)})
			if err != nil {
				t.Fatalf("tunnel-marked dial from %s, the earlier probe's tuple: %v", local, err)
			}
			defer m.Close()
			if _, err := m.Write([]byte("marked")); err != nil {
				t.Fatal(err)
			}
			if b := got.wait(local, "marked", 2*time.Second); b != "marked" {
				t.Errorf("a tunnel-marked connection on an earlier probe's tuple: the app read %q from the node's %s (and %q from the SNAT address)",
					b, local, got.wait(netip.AddrPortFrom(f.snat, local.Port()), "", 0))
			}
		})
	}
}

// probeSpoofedDrops reads drop_probe_spoofed from the pinned reason counters
// the host programs share with the pod-side ones.
func probeSpoofedDrops(t *testing.T, root string) uint64 {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, bpf.HostProbeMapRdReasons), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var per []uint64
	key := uint32(bpf.CaptureVerdictReasonREASON_DROP_PROBE_SPOOFED)
	if err := m.Lookup(&key, &per); err != nil {
		t.Fatal(err)
	}
	var sum uint64
	for _, v := range per {
		sum += v
	}
	return sum
}
