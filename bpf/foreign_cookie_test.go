package bpf

import (
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

// TestCaptureForeignDestinationCookieACK: an ACK from the wire (no SYN, no
// RST), for this host, to an enrolled address of another pod than the one
// whose interface it arrives on, whose tuple a listener would take, is
// dropped as drop_foreign_dst, as a SYN is. Before, cookie_ack assigned it
// to this pod's transparent inbound listener (with the reinject mark, so the
// pod's fwmark rule delivered it although the address is not the pod's),
// where the kernel drops it as not local: with the listener sending SYN
// cookies (the secret is the host's, not the namespace's), this pod's tunnel
// was handed a connection to another pod's address. The pod's own address
// keeps its verdict, and so does a frame the bridge flooded.
func TestCaptureForeignDestinationCookieACK(t *testing.T) {
	needRoot(t)
	objs := loadCapture(t)
	ack := tcpHdr(40000, 8080, fACK)
	foreign := CaptureVerdictReasonREASON_DROP_FOREIGN_DST
	var fds []int
	t.Cleanup(func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	})
	podTwo := func(ino uint32) {
		enroll(t, objs.RdPods, 2, other4)
		v := CapturePodNetns{Addr: CapturePodAddr{Addr: other4.As16()}, PodId: 2}
		if err := objs.RdPodNetns.Put(ino, &v); err != nil {
			t.Errorf("record netns: %v", err)
		}
		// the app's listener on every address, and the tunnel's
		// inbound listener (tunnel mark, transparent)
		for _, l := range []struct {
			port uint16
			mark int
		}{{8080, 0}, {15006, 0x539}} {
			fd, err := markedListener(netip.AddrPortFrom(netip.IPv4Unspecified(), l.port), l.mark)
			if err != nil {
				t.Errorf("listen on %d: %v", l.port, err)
				return
			}
			fds = append(fds, fd)
		}
	}
	runTableIn(t, objs.RdPodIngress, objs.RdReasons, podTwo, []progCase{
		{"v4 ack to pod 1 on pod 2's interface", 0, forHost(ip4(peer4, pod4, pTCP, 0, ack)), actShot, foreign},
		{"v4 ack with data and fin to pod 1 on pod 2's interface", 0, forHost(ip4(peer4, pod4, pTCP, 0, tcpHdr(40000, 8080, fACK|0x09))), actShot, foreign},
		// BPF_PROG_TEST_RUN's packet is not at tc ingress, so
		// bpf_sk_assign fails: reaching it is what the case shows
		{"v4 ack to pod 2's own address", 0, forHost(ip4(peer4, other4, pTCP, 0, ack)), actShot, CaptureVerdictReasonREASON_DROP_ASSIGN_FAILED},
		{"v4 ack to pod 1, frame for another host", 0, ip4(peer4, pod4, pTCP, 0, ack), actShot, CaptureVerdictReasonREASON_DROP_ASSIGN_FAILED},
		{"v4 rst to pod 1, left to the kernel", 0, forHost(ip4(peer4, pod4, pTCP, 0, tcpHdr(40000, 8080, fACK|fRST))), actUnspec, noReason},
	})
}
