package bpf

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// synSentSocket leaves a socket bound to src:sport in SYN_SENT towards
// dst:dport: its SYN waits for a neighbour that never answers. mark,
// if not 0, is set with SO_MARK first. The socket is closed at the end of
// the test.
func synSentSocket(t *testing.T, src netip.Addr, sport uint16, dst netip.AddrPort, mark int) error {
	family := unix.AF_INET6
	var local, remote unix.Sockaddr = &unix.SockaddrInet6{Addr: src.As16(), Port: int(sport)}, &unix.SockaddrInet6{Addr: dst.Addr().As16(), Port: int(dst.Port())}
	if src.Is4() {
		family = unix.AF_INET
		local, remote = &unix.SockaddrInet4{Addr: src.As4(), Port: int(sport)}, &unix.SockaddrInet4{Addr: dst.Addr().As4(), Port: int(dst.Port())}
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	t.Cleanup(func() { unix.Close(fd) })
	if mark != 0 {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, mark); err != nil {
			return err
		}
	}
	if err := unix.Bind(fd, local); err != nil {
		return err
	}
	if err := unix.Connect(fd, remote); !errors.Is(err, unix.EINPROGRESS) {
		return err
	}
	return nil
}

// TestCaptureSYNMeetsSynSent: a SYN from the wire whose tuple is an app
// socket in SYN_SENT is dropped and counted as drop_syn_sent. The app's own
// SYN for that tuple was captured (it never left the pod), and while it
// stays unanswered (the tunnel is down: drop_no_listener, and the app
// retries for two minutes) a sender that guesses the source port and sends
// a SYN from the address the app dials would otherwise have it taken by
// the kernel as a simultaneous open: the app's connection made with the
// sender, in plaintext, both ways. Before, such a SYN was left to TCP as
// in_syn_existing. The tunnel's own sockets (tunnel mark) are still left
// to TCP.
func TestCaptureSYNMeetsSynSent(t *testing.T) {
	needRoot(t)
	objs := loadCapture(t)
	const app = 8080
	setup := func(uint32) { synSentSetup(t) }
	synSent := CaptureVerdictReasonREASON_DROP_SYN_SENT
	cases := []progCase{
		{"v4 syn to an app socket in SYN_SENT", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(app, 41001, fSYN)), actShot, synSent},
		{"v4 syn with options to an app socket in SYN_SENT", 0, ip4(peer4, pod4, pTCP, 0x4000, tcpHdr(app, 41001, fSYN, synOpts...)), actShot, synSent},
		{"v6 syn to an app socket in SYN_SENT", 0, ip6(peer6, pod6, nil, pTCP, tcpHdr(app, 41001, fSYN)), actShot, synSent},
		{"v6 syn with destination options to an app socket in SYN_SENT", 0, ip6(peer6, pod6, []ext{opts(pDst, 0)}, pTCP, tcpHdr(app, 41001, fSYN)), actShot, synSent},
		// The answer the app waits for is not a SYN alone: left to TCP.
		{"v4 syn-ack to an app socket in SYN_SENT", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(app, 41001, fSYN|fACK)), actUnspec, noReason},
		{"v4 syn to a tunnel socket in SYN_SENT", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(app, 41002, fSYN)), actUnspec, CaptureVerdictReasonREASON_IN_SYN_EXISTING},
		// Another tuple: assigned as before (no listener here).
		{"v4 syn from another port", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(app+1, 41001, fSYN)), actShot, CaptureVerdictReasonREASON_DROP_NO_LISTENER},
	}
	runTableIn(t, objs.RdPodIngress, objs.RdReasons, setup, cases)

	// With the pod's outbound capture off, the app's SYN did go out: a
	// simultaneous open is TCP's business, as before.
	inboundOnly := func(ino uint32) {
		setup(ino)
		k := CapturePodAddr{Addr: pod4.As16()}
		v := CapturePodSettings{Flags: uint32(CapturePodFlagPOD_CAPTURE_INBOUND), PodId: 1}
		if err := objs.RdPods.Put(&k, &v); err != nil {
			t.Errorf("enroll %s inbound only: %v", pod4, err)
		}
	}
	runTableIn(t, objs.RdPodIngress, objs.RdReasons, inboundOnly, []progCase{
		{"v4 syn to an app socket in SYN_SENT, outbound capture off", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(app, 41001, fSYN)), actUnspec, CaptureVerdictReasonREASON_IN_SYN_EXISTING},
	})
}

// TestCaptureSYNMeetsSynSentInboundOff: the same simultaneous open against
// a pod whose inbound capture is off (ambient.istio.io/bypass-inbound-
// capture) while its outbound capture is on. Its outbound connections are
// meshed all the same, and the app's own SYN was captured, so a SYN from
// the wire for that tuple is dropped as drop_syn_sent. Before, the
// inbound-off branch passed every packet (in_pass_no_capture) before the
// SYN_SENT check, and the kernel connected the app with the sender in
// plaintext. Other SYNs still pass.
func TestCaptureSYNMeetsSynSentInboundOff(t *testing.T) {
	needRoot(t)
	objs := loadCapture(t)
	const app = 8080
	outboundOnly := func(ino uint32) {
		synSentSetup(t)
		for _, a := range []netip.Addr{pod4, pod6} {
			k := CapturePodAddr{Addr: a.As16()}
			v := CapturePodSettings{Flags: uint32(CapturePodFlagPOD_CAPTURE_OUTBOUND), PodId: 1}
			if err := objs.RdPods.Put(&k, &v); err != nil {
				t.Errorf("enroll %s outbound only: %v", a, err)
			}
		}
	}
	noCapture := CaptureVerdictReasonREASON_IN_PASS_NO_CAPTURE
	runTableIn(t, objs.RdPodIngress, objs.RdReasons, outboundOnly, []progCase{
		{"v4 syn to an app socket in SYN_SENT", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(app, 41001, fSYN)), actShot, CaptureVerdictReasonREASON_DROP_SYN_SENT},
		{"v6 syn to an app socket in SYN_SENT", 0, ip6(peer6, pod6, nil, pTCP, tcpHdr(app, 41001, fSYN)), actShot, CaptureVerdictReasonREASON_DROP_SYN_SENT},
		{"v4 syn to a tunnel socket in SYN_SENT", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(app, 41002, fSYN)), actUnspec, noCapture},
		{"v4 syn-ack to an app socket in SYN_SENT", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(app, 41001, fSYN|fACK)), actUnspec, noCapture},
		{"v4 syn from another port", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(app+1, 41001, fSYN)), actUnspec, noCapture},
	})
}

// TestCaptureSYNMeetsSynSentHBONEPort: the same for a SYN to the HBONE
// port, which passes without take_syn: an app that bound the pod's address
// and port 15008 (a root app can, next to the tunnel's reuseport listener)
// and connects from it has its SYN captured all the same. Before, such a
// SYN passed as in_pass_hbone.
func TestCaptureSYNMeetsSynSentHBONEPort(t *testing.T) {
	needRoot(t)
	objs := loadCapture(t)
	setup := func(uint32) { synSentSetup(t) }
	runTableIn(t, objs.RdPodIngress, objs.RdReasons, setup, []progCase{
		{"v4 syn to an app socket in SYN_SENT on the HBONE port", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(8080, 15008, fSYN)), actShot, CaptureVerdictReasonREASON_DROP_SYN_SENT},
		{"v4 syn to the HBONE port from another port", 0, ip4(peer4, pod4, pTCP, 0, tcpHdr(8081, 15008, fSYN)), actUnspec, CaptureVerdictReasonREASON_IN_PASS_HBONE},
		{"v6 syn to the HBONE port", 0, ip6(peer6, pod6, nil, pTCP, tcpHdr(8080, 15008, fSYN)), actUnspec, CaptureVerdictReasonREASON_IN_PASS_HBONE},
	})
}

// synSentSetup gives the test's namespace the pod's addresses on a veth
// pair whose other end owns nothing, and leaves app sockets in SYN_SENT
// from pod4 and pod6 port 41001 and pod4 port 15008, and a tunnel socket
// (tunnel mark) from pod4 port 41002, all towards port 8080 of the peers.
func synSentSetup(t *testing.T) {
	// A veth pair whose other end owns nothing: the SYN waits for a
	// neighbour that never answers.
	dummy := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "rd0"}, PeerName: "rd1"}
	if err := netlink.LinkAdd(dummy); err != nil {
		t.Errorf("add veth: %v", err)
		return
	}
	if peer, err := netlink.LinkByName("rd1"); err != nil || netlink.LinkSetUp(peer) != nil {
		t.Errorf("veth peer up: %v", err)
		return
	}
	for _, a := range []string{pod4.String() + "/16", pod6.String() + "/32"} {
		ipn, err := netlink.ParseIPNet(a)
		if err != nil {
			t.Errorf("parse %s: %v", a, err)
			return
		}
		if err := netlink.AddrAdd(dummy, &netlink.Addr{IPNet: ipn, Flags: unix.IFA_F_NODAD}); err != nil {
			t.Errorf("address %s: %v", a, err)
			return
		}
	}
	if err := netlink.LinkSetUp(dummy); err != nil {
		t.Errorf("veth up: %v", err)
		return
	}
	for _, s := range []struct {
		src   netip.Addr
		sport uint16
		dst   netip.Addr
		mark  int
	}{
		{pod4, 41001, peer4, 0},
		{pod6, 41001, peer6, 0},
		{pod4, 41002, peer4, 0x539},
		{pod4, 15008, peer4, 0}, // an app bound to the HBONE port
	} {
		if err := synSentSocket(t, s.src, s.sport, netip.AddrPortFrom(s.dst, 8080), s.mark); err != nil {
			t.Errorf("socket %s:%d in SYN_SENT: %v", s.src, s.sport, err)
		}
	}
}
