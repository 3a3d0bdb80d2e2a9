package bpf

import (
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// TestCaptureUnparsedDropCountsItsPod: a frame the programs cannot classify,
// dropped on an enrolled pod's interface, is counted in that pod's
// dropped_packets, whoever its addresses name. Before, drop_unparsed charged
// the drop to the first enrolled address it found, source first: on
// ingress that is the sender, so a neighbour on the bridge that sent
// fragments "from" another pod of the node raised that pod's drop counter
// while the pod that dropped them showed none; a pod's own egress from an
// address that is not enrolled (its link-local address) to another pod was
// charged to the destination; and a frame whose addresses cannot be read
// (five VLAN tags) to no pod at all, only to the node-wide reason. The
// drops themselves (verdicts and reasons) are unchanged.
func TestCaptureUnparsedDropCountsItsPod(t *testing.T) {
	needRoot(t)
	objs := loadCapture(t)
	enroll(t, objs.RdPods, 2, peer4, peer6) // another pod of the node
	pods := map[netip.Addr]int{pod4: 1, pod6: 1, peer4: 2, peer6: 2}
	for a := range pods {
		if err := objs.RdPodStats.Put(CapturePodAddr{Addr: a.As16()}, make([]CapturePodCounters, ebpf.MustPossibleCPU())); err != nil {
			t.Fatalf("stats entry of %s: %v", a, err)
		}
	}
	dropped := func() map[int]uint64 {
		out := map[int]uint64{}
		for a, id := range pods {
			var per []CapturePodCounters
			if err := objs.RdPodStats.Lookup(CapturePodAddr{Addr: a.As16()}, &per); err != nil {
				t.Fatalf("read stats of %s: %v", a, err)
			}
			for _, c := range per {
				out[id] += c.DroppedPackets
			}
		}
		return out
	}
	tcpSyn := syn(8080)
	fiveTags := func(f []byte) []byte {
		for range 5 {
			f = vlan(0x8100, f)
		}
		return f
	}
	cases := []struct {
		name   string
		prog   *ebpf.Program
		pkt    []byte
		reason CaptureVerdictReason
	}{
		{"ingress v4 fragment from another pod", objs.RdPodIngress, forHost(ip4(peer4, pod4, pTCP, 0x2000, tcpSyn)), CaptureVerdictReasonREASON_DROP_FRAGMENT},
		{"ingress v6 fragment from another pod", objs.RdPodIngress, forHost(ip6(peer6, pod6, []ext{frag(0, true)}, pTCP, tcpSyn)), CaptureVerdictReasonREASON_DROP_FRAGMENT},
		{"ingress v4 ESP from another pod to an address not enrolled", objs.RdPodIngress, forHost(ip4(peer4, other4, pESP, 0, make([]byte, 32))), CaptureVerdictReasonREASON_DROP_EXTHDR},
		{"ingress five VLAN tags", objs.RdPodIngress, forHost(fiveTags(ip4(peer4, pod4, pTCP, 0, tcpSyn))), CaptureVerdictReasonREASON_DROP_VLAN},
		{"egress v6 fragment from the link-local address to another pod", objs.RdPodEgress, ip6(llPod, peer6, []ext{frag(0, true)}, pTCP, tcpSyn), CaptureVerdictReasonREASON_DROP_FRAGMENT},
		{"egress five VLAN tags", objs.RdPodEgress, fiveTags(ip4(pod4, peer4, pTCP, 0, tcpSyn)), CaptureVerdictReasonREASON_DROP_VLAN},
		{"egress v4 fragment", objs.RdPodEgress, ip4(pod4, peer4, pTCP, 0x2000, tcpSyn), CaptureVerdictReasonREASON_DROP_FRAGMENT},
	}
	own := ownNetNS(t, objs, pod4, 1, bothWays)
	inNewNetNS(t, func() {
		var st unix.Stat_t
		if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
			t.Errorf("stat own netns: %v", err)
			return
		}
		own(uint32(st.Ino))
		for _, c := range cases {
			before, reasonsBefore := dropped(), reasonCounts(t, objs.RdReasons)
			got, err := c.prog.Run(&ebpf.RunOptions{Data: c.pkt, Context: skbCtx{}})
			if err != nil {
				t.Errorf("%s: run: %v", c.name, err)
				continue
			}
			if got != actShot {
				t.Errorf("%s: verdict %d, want drop", c.name, int32(got))
			}
			if d := reasonCounts(t, objs.RdReasons)[c.reason] - reasonsBefore[c.reason]; d != 1 {
				t.Errorf("%s: reason %d counted %d times, want 1", c.name, c.reason, d)
			}
			after := dropped()
			if d := after[1] - before[1]; d != 1 {
				t.Errorf("%s: dropped by pod 1's interface, counted %d times in pod 1's dropped_packets, want 1", c.name, d)
			}
			if d := after[2] - before[2]; d != 0 {
				t.Errorf("%s: counted %d times in the dropped_packets of pod 2, which did not drop it", c.name, d)
			}
		}
	})
}
