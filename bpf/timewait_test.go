package bpf

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// timeWaitPair leaves a TIME_WAIT socket on the server side of a loopback
// connection to port (the server closes first, as the tunnel does towards an
// app) and returns the client's address: the 4-tuple a new SYN from that
// address would reuse.
func timeWaitPair(network, laddr, daddr, caddr string) (netip.AddrPort, error) {
	l, err := net.Listen(network, laddr)
	if err != nil {
		return netip.AddrPort{}, err
	}
	defer l.Close()
	d := net.Dialer{}
	if caddr != "" {
		d.LocalAddr, err = net.ResolveTCPAddr(network, caddr)
		if err != nil {
			return netip.AddrPort{}, err
		}
	}
	c, err := d.Dial(network, daddr)
	if err != nil {
		return netip.AddrPort{}, err
	}
	s, err := l.Accept()
	if err != nil {
		c.Close()
		return netip.AddrPort{}, err
	}
	s.Close() // the server's FIN first: its socket ends in TIME_WAIT
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		c.Close()
		return netip.AddrPort{}, fmt.Errorf("wait for the server's FIN: %w", err)
	}
	c.Close()
	time.Sleep(50 * time.Millisecond) // the last ACK reaches the server socket
	return netip.MustParseAddrPort(c.LocalAddr().String()), nil
}

// TestCaptureSYNMeetsTimeWait: a re-injected SYN whose 4-tuple has a
// TIME_WAIT socket (the tunnel's app-facing socket of the previous
// connection on that source port) is turned into the RST that ends that
// socket, a clone of it is queued again, and it is counted as
// in_syn_timewait. Before the fix such SYNs were assigned to the listener,
// whose request collided with the TIME_WAIT entry and was dropped silently
// (issue 15).
func TestCaptureSYNMeetsTimeWait(t *testing.T) {
	needRoot(t)
	objs := loadCapture(t)
	inNewNetNS(t, func() {
		lo, err := netlink.LinkByName("lo")
		if err == nil {
			err = netlink.LinkSetUp(lo)
		}
		if err != nil {
			t.Errorf("loopback up: %v", err)
			return
		}
		for _, fam := range []struct {
			name, network, laddr, daddr, caddr string
			mark                               uint32 // 0x111: re-injected by the egress program
			want                               uint32
		}{
			{"re-injected, ipv4 socket", "tcp4", "127.0.0.1:8080", "127.0.0.1:8080", "", 0x111, actOK},
			{"re-injected, ipv4-mapped on an ipv6 socket", "tcp", "[::]:8081", "127.0.0.1:8081", "", 0x111, actOK},
			{"re-injected, ipv6", "tcp6", "[::1]:8082", "[::1]:8082", "", 0x111, actOK},
			// From the wire to the pod: before the fix this SYN was left
			// to the kernel, whose TIME_WAIT handling gives it to a
			// listener of the original port, the app's.
			{"from the wire, ipv4", "tcp4", "127.0.0.1:8083", "127.0.0.1:8083", "127.0.0.2:0", 0, actUnspec},
		} {
			client, err := timeWaitPair(fam.network, fam.laddr, fam.daddr, fam.caddr)
			if err != nil {
				t.Errorf("%s: %v", fam.name, err)
				continue
			}
			server := netip.MustParseAddrPort(fam.daddr)
			src, dst := client.Addr().Unmap(), server.Addr()
			if fam.mark != 0 {
				enroll(t, objs.RdPods, 1, src) // the pod's own outbound SYN
			} else {
				enroll(t, objs.RdPods, 2, dst) // a SYN to the pod from elsewhere
			}
			var pkt []byte
			seg := tcpHdr(client.Port(), server.Port(), fSYN, synOpts...)
			if src.Is4() {
				pkt = ip4(src, dst, pTCP, 0x4000, seg)
			} else {
				pkt = ip6(src, dst, nil, pTCP, seg)
			}
			before := reasonCounts(t, objs.RdReasons)
			got, err := objs.RdPodIngress.Run(&ebpf.RunOptions{Data: pkt, Context: skbCtx{Mark: fam.mark}})
			if err != nil {
				t.Errorf("%s: run: %v", fam.name, err)
				continue
			}
			after := reasonCounts(t, objs.RdReasons)
			n := after[CaptureVerdictReasonREASON_IN_SYN_TIMEWAIT] - before[CaptureVerdictReasonREASON_IN_SYN_TIMEWAIT]
			if got != fam.want || n != 1 {
				t.Errorf("%s: verdict %d, in_syn_timewait counted %d times; want %d and once", fam.name, int32(got), n, int32(fam.want))
			}
		}
	})
}

// TestCaptureSYNTimeWaitRequeuedOnce: a SYN whose RST does not end the
// TIME_WAIT socket (here the RST never reaches it: BPF_PROG_TEST_RUN runs
// the program on a packet the stack never sees; net.ipv4.tcp_rfc1337=1 does
// the same for real, TestCaptureSYNTimeWaitKeptByRFC1337) is queued again
// once and then dropped as drop_syn_timewait. Before, the loop
// guard was skb->priority, which the kernel zeroes on every redirect to
// ingress (____dev_forward_skb): the clone came back unmarked, made another
// clone and another RST, and so on until the TIME_WAIT expired, 60 s of a
// CPU busy in softirq for one SYN that any client could send to a pod whose
// tunnel socket had closed first (the tunnel closes first under STRICT).
func TestCaptureSYNTimeWaitRequeuedOnce(t *testing.T) {
	needRoot(t)
	objs := loadCapture(t)
	inNewNetNS(t, func() {
		lo, err := netlink.LinkByName("lo")
		if err == nil {
			err = netlink.LinkSetUp(lo)
		}
		if err != nil {
			t.Errorf("loopback up: %v", err)
			return
		}
		// The program on the interface the clone is queued to, as on a
		// pod's eth0.
		lk, err := link.AttachTCX(link.TCXOptions{Interface: lo.Attrs().Index, Program: objs.RdPodIngress, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			t.Errorf("attach to lo: %v", err)
			return
		}
		defer lk.Close()

		var tsval uint32
		client, err := timeWaitPairTS("tcp4", "127.0.0.1:8090", "127.0.0.1:8090", "127.0.0.2:0", &tsval)
		if err != nil {
			t.Errorf("time-wait pair: %v", err)
			return
		}
		server := netip.MustParseAddrPort("127.0.0.1:8090")
		enroll(t, objs.RdPods, 2, server.Addr())
		opts := append([]byte(nil), synOpts...)
		binary.BigEndian.PutUint32(opts[8:], tsval-1_000_000) // older than the socket's ts_recent
		pkt := ip4(client.Addr().Unmap(), server.Addr(), pTCP, 0x4000, tcpHdr(client.Port(), server.Port(), fSYN, opts...))

		before := reasonCounts(t, objs.RdReasons)
		if _, err := objs.RdPodIngress.Run(&ebpf.RunOptions{Data: pkt, Context: skbCtx{}}); err != nil {
			t.Errorf("run: %v", err)
			return
		}
		time.Sleep(300 * time.Millisecond) // the clone's trip through the backlog, and any loop
		after := reasonCounts(t, objs.RdReasons)
		requeued := after[CaptureVerdictReasonREASON_IN_SYN_TIMEWAIT] - before[CaptureVerdictReasonREASON_IN_SYN_TIMEWAIT]
		dropped := after[CaptureVerdictReasonREASON_DROP_SYN_TIMEWAIT] - before[CaptureVerdictReasonREASON_DROP_SYN_TIMEWAIT]
		if requeued != 1 || dropped != 1 {
			t.Errorf("in_syn_timewait counted %d times, drop_syn_timewait %d; want once each", requeued, dropped)
		}
	})
}

// timeWaitPairTS is timeWaitPair that also gives the client's TCP
// timestamp clock (TCP_TIMESTAMP) just before it closes: about the last
// TSval the TIME_WAIT socket saw.
func timeWaitPairTS(network, laddr, daddr, caddr string, tsval *uint32) (netip.AddrPort, error) {
	l, err := net.Listen(network, laddr)
	if err != nil {
		return netip.AddrPort{}, err
	}
	defer l.Close()
	d := net.Dialer{}
	if d.LocalAddr, err = net.ResolveTCPAddr(network, caddr); err != nil {
		return netip.AddrPort{}, err
	}
	c, err := d.Dial(network, daddr)
	if err != nil {
		return netip.AddrPort{}, err
	}
	defer c.Close()
	s, err := l.Accept()
	if err != nil {
		return netip.AddrPort{}, err
	}
	s.Close()
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		return netip.AddrPort{}, fmt.Errorf("wait for the server's FIN: %w", err)
	}
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		var v int
		v, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_TIMESTAMP)
		*tsval = uint32(v)
	}); err != nil {
		return netip.AddrPort{}, err
	}
	if serr != nil {
		return netip.AddrPort{}, fmt.Errorf("read TCP_TIMESTAMP: %w", serr)
	}
	c.Close()
	time.Sleep(50 * time.Millisecond)
	return netip.MustParseAddrPort(c.LocalAddr().String()), nil
}

// TestCaptureSYNOlderTimestampEndsTimeWait: a SYN from the wire whose
// timestamp is older than the last one its tuple's TIME_WAIT socket saw (a
// client behind the same NAT address as the previous one, as kube-proxy's
// SNAT of NodePort traffic makes them) still ends the TIME_WAIT and is
// assigned to the inbound listener. Before, the RST made of it carried its
// timestamp, PAWS discarded it, and the SYN was dropped as
// drop_syn_timewait, each retransmission alike, until the TIME_WAIT expired
// (60 s); without the mesh the kernel costs such a client one 1 s
// retransmission. The SYN is delivered for real (a raw socket on lo, where
// the program is attached), so the RST reaches the socket.
func TestCaptureSYNOlderTimestampEndsTimeWait(t *testing.T) {
	needRoot(t)
	objs := loadCapture(t)
	inNewNetNS(t, func() {
		if err := olderTimestampSYN(t, objs, false); err != nil {
			t.Error(err)
		}
	})
}

// TestCaptureSYNTimeWaitKeptByRFC1337: with net.ipv4.tcp_rfc1337=1 in the
// pod a TIME_WAIT socket ignores RSTs; the SYN's clone still finds it, and
// is dropped once as drop_syn_timewait, never looped.
func TestCaptureSYNTimeWaitKeptByRFC1337(t *testing.T) {
	needRoot(t)
	objs := loadCapture(t)
	inNewNetNS(t, func() {
		if err := os.WriteFile("/proc/sys/net/ipv4/tcp_rfc1337", []byte("1"), 0o644); err != nil {
			t.Errorf("set tcp_rfc1337 in the test's namespace: %v", err)
			return
		}
		if err := olderTimestampSYN(t, objs, true); err != nil {
			t.Error(err)
		}
	})
}

// olderTimestampSYN leaves a TIME_WAIT socket on 127.0.0.1:8092 (the
// capture on lo's ingress, a tunnel-marked listener on the inbound port),
// sends a SYN for its tuple with an older timestamp through a raw socket,
// and checks the counts: assigned after in_syn_timewait, or with kept (the
// RST is ignored) dropped as drop_syn_timewait.
func olderTimestampSYN(t *testing.T, objs *CaptureObjects, kept bool) error {
	lo, err := netlink.LinkByName("lo")
	if err == nil {
		err = netlink.LinkSetUp(lo)
	}
	if err != nil {
		return fmt.Errorf("loopback up: %w", err)
	}
	lk, err := link.AttachTCX(link.TCXOptions{Interface: lo.Attrs().Index, Program: objs.RdPodIngress, Attach: ebpf.AttachTCXIngress})
	if err != nil {
		return fmt.Errorf("attach to lo: %w", err)
	}
	defer lk.Close()
	ln, err := markedListener(netip.MustParseAddrPort("127.0.0.1:15006"), 0x539)
	if err != nil {
		return fmt.Errorf("inbound listener: %w", err)
	}
	defer unix.Close(ln)

	var tsval uint32
	client, err := timeWaitPairTS("tcp4", "127.0.0.1:8092", "127.0.0.1:8092", "127.0.0.2:0", &tsval)
	if err != nil {
		return fmt.Errorf("time-wait pair: %w", err)
	}
	server := netip.MustParseAddrPort("127.0.0.1:8092")
	enroll(t, objs.RdPods, 2, server.Addr())
	opts := append([]byte(nil), synOpts...)
	binary.BigEndian.PutUint32(opts[8:], tsval-1_000_000) // older than the socket's ts_recent
	seg := tcpHdr(client.Port(), server.Port(), fSYN, opts...)
	tcpChecksum4(client.Addr().Unmap(), server.Addr(), seg)
	pkt := ip4(client.Addr().Unmap(), server.Addr(), pTCP, 0x4000, seg)[14:]

	before := reasonCounts(t, objs.RdReasons)
	if err := sendRaw4(server.Addr(), pkt); err != nil {
		return err
	}
	time.Sleep(300 * time.Millisecond) // the clone's trip through the backlog, and any loop
	after := reasonCounts(t, objs.RdReasons)
	delta := func(r CaptureVerdictReason) uint64 { return after[r] - before[r] }
	reopened, dropped, assigned := delta(CaptureVerdictReasonREASON_IN_SYN_TIMEWAIT),
		delta(CaptureVerdictReasonREASON_DROP_SYN_TIMEWAIT), delta(CaptureVerdictReasonREASON_IN_ASSIGN_INBOUND)
	want := [3]uint64{1, 0, 1}
	if kept {
		want = [3]uint64{1, 1, 0}
	}
	if got := [3]uint64{reopened, dropped, assigned}; got != want {
		return fmt.Errorf("in_syn_timewait, drop_syn_timewait, in_assign_inbound counted %v; want %v", got, want)
	}
	return nil
}

// markedListener listens on a with SO_MARK mark (a tunnel listener, as the
// capture checks it) and IP_TRANSPARENT.
func markedListener(a netip.AddrPort, mark int) (int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	for _, o := range [][3]int{{unix.SOL_SOCKET, unix.SO_MARK, mark}, {unix.SOL_IP, unix.IP_TRANSPARENT, 1}} {
		if err := unix.SetsockoptInt(fd, o[0], o[1], o[2]); err != nil {
			unix.Close(fd)
			return -1, err
		}
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: a.Addr().As4(), Port: int(a.Port())}); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if err := unix.Listen(fd, 16); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// tcpChecksum4 fills in the checksum of an IPv4 TCP segment: the stack
// checks it when the segment is delivered for real.
func tcpChecksum4(src, dst netip.Addr, seg []byte) {
	s, d := src.As4(), dst.As4()
	pseudo := append(append(append([]byte{}, s[:]...), d[:]...), 0, pTCP, byte(len(seg)>>8), byte(len(seg)))
	seg[16], seg[17] = 0, 0
	var sum uint32
	for _, b := range [][]byte{pseudo, seg} {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
		if len(b)%2 == 1 {
			sum += uint32(b[len(b)-1]) << 8
		}
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(seg[16:], ^uint16(sum))
}

// sendRaw4 sends an IPv4 packet (header included) to dst.
func sendRaw4(dst netip.Addr, pkt []byte) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return fmt.Errorf("raw socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: dst.As4()}); err != nil {
		return fmt.Errorf("send the SYN: %w", err)
	}
	return nil
}
