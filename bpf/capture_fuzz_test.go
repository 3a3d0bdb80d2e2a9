package bpf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// FuzzCapture feeds mutated frames to rd_pod_ingress and rd_pod_egress
// (BPF_PROG_TEST_RUN, as root) and checks what must hold whatever the
// bytes are:
//   - the verdict and the reason counted are one the reference classifier
//     (capture_ref_test.go, written from docs/architecture.md) allows: a
//     frame reaches the pod's app or leaves the pod (TC_ACT_OK, a
//     redirect, TC_ACT_UNSPEC) only where the design lets it, and what
//     the programs cannot classify is dropped for enrolled pods;
//   - only TC_ACT_UNSPEC, TC_ACT_OK (ingress), TC_ACT_SHOT and a redirect
//     (egress) are returned;
//   - at most one reason is counted, a drop always under one, and it is
//     counted for the pod address the design names, in the pod counter
//     that reason documents;
//   - the frame comes back unchanged, except the destination MAC of a
//     steered (redirected) frame, which becomes the source MAC.
//
// The first byte of the input picks the setting:
//
//	bit 0     egress (1) or ingress (0)
//	bits 1-2  pod 1's capture flags (outbound 1, inbound 2); the loader
//	          always sets outbound, inbound is off for
//	          bypass-inbound-capture pods. PeerAuthentication's STRICT or
//	          PERMISSIVE is the tunnel's to apply: the programs capture
//	          alike under both, so these flags are what varies for them.
//	bits 3-4  skb mark: none, the tunnel's (0x539), the re-inject mark
//	          (0x111), the tunnel's with bits outside the mask
//	bits 5-6  the namespace's rd_pod_netns entry: none, pod 1's, pod 2's,
//	          or a stale one (pod 1's id on an address pod 2 holds now)
//	bit 7     pod 1's DNS capture (POD_CAPTURE_DNS)
//
// The rig's namespace has the tunnel's three listeners (tunnel mark,
// dual-stack), an app's listener on the inbound port bound to pod 1's
// second IPv4 address (no mark), and one connected pair per family whose
// tuple stands for a tunnel-owned connection. On the DNS port 15053 it has
// the tunnel's UDP socket on [::] for IPv6 only (so an IPv4 query finds
// none) and sockets of an app (no mark) bound to peer4 and peer6 (the more
// specific match for queries to them).
func FuzzCapture(f *testing.F) {
	for _, s := range fuzzSeeds() {
		f.Add(s.mode, s.pkt)
	}
	if os.Geteuid() != 0 {
		f.Skip("BPF_PROG_TEST_RUN needs root; CI runs this as root")
	}
	rig := newFuzzRig(f)
	f.Fuzz(func(t *testing.T, mode byte, pkt []byte) {
		// BPF_PROG_TEST_RUN takes an Ethernet header and at most a
		// page; an MTU's worth is plenty.
		// (returned from, not skipped: CI fails on a skipped test)
		if len(pkt) < 14 || len(pkt) > 1514 {
			return
		}
		rig.check(t, mode, pkt)
	})
}

type fuzzSeed struct {
	mode byte
	pkt  []byte
}

// The rig's addresses, besides capture_test.go's pod4, pod6, peer4, peer6.
var (
	pod4b = netip.MustParseAddr("10.9.0.3")    // pod 1's, with an app listener on 15006
	nb4   = netip.MustParseAddr("10.9.3.2")    // pod 2's
	nb6   = netip.MustParseAddr("fd00:9:3::2") // pod 2's
)

const (
	rigAppPort     = 80    // the connected pairs' peer port
	rigLocalPort   = 40001 // the connected pairs' pod port
	rigSynSentPort = 41001 // the SYN_SENT sockets' pod port
)

// gone4 and gone6 answer nothing (see serve): the rig's sockets
// connecting there stay in SYN_SENT.
var (
	gone4 = netip.MustParseAddr("10.9.4.2")
	gone6 = netip.MustParseAddr("fd00:9:4::2")
)

// fuzzRig is the loaded programs, its maps, and a thread whose network
// namespace the programs run in (socket lookups see the rig's sockets).
type fuzzRig struct {
	objs     *CaptureObjects
	ino      uint32
	runs     chan fuzzRun
	world    refWorld
	lastMode int // the mode the maps hold, -1 none yet
	podAddrs []netip.Addr
}

type fuzzRun struct {
	prog *ebpf.Program
	opts *ebpf.RunOptions
	done chan fuzzResult
}

type fuzzResult struct {
	verdict uint32
	err     error
}

func newFuzzRig(f *testing.F) *fuzzRig {
	spec, err := LoadCapture()
	if err != nil {
		f.Fatal(err)
	}
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinNone
	}
	var objs CaptureObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		f.Fatalf("load capture programs: %v", err)
	}
	f.Cleanup(func() { objs.Close() })
	r := &fuzzRig{objs: &objs, runs: make(chan fuzzRun), lastMode: -1,
		podAddrs: []netip.Addr{pod4, pod4b, pod6, nb4, nb6}}
	for _, a := range r.podAddrs {
		if err := objs.RdPodStats.Put(CapturePodAddr{Addr: a.As16()}, make([]CapturePodCounters, ebpf.MustPossibleCPU())); err != nil {
			f.Fatalf("stats entry %s: %v", a, err)
		}
	}
	for _, a := range []netip.Addr{nb4, nb6} {
		if err := objs.RdPods.Put(CapturePodAddr{Addr: a.As16()}, CapturePodSettings{Flags: bothWays, PodId: 2}); err != nil {
			f.Fatalf("enroll %s: %v", a, err)
		}
	}

	listen := func(a netip.Addr, port uint16, marked, dual bool) refSock {
		return refSock{local: netip.AddrPortFrom(a, port), listen: true, marked: marked, dualStack: dual}
	}
	conn := func(l, rm netip.Addr, lp, rp uint16) refSock {
		return refSock{local: netip.AddrPortFrom(l, lp), remote: netip.AddrPortFrom(rm, rp)}
	}
	synSent := func(l netip.Addr, lp uint16, rm netip.Addr, marked bool) refSock {
		return refSock{local: netip.AddrPortFrom(l, lp), remote: netip.AddrPortFrom(rm, rigAppPort), synSent: true, marked: marked}
	}
	r.world.socks = []refSock{
		listen(netip.IPv6Unspecified(), 15001, true, true),
		listen(netip.IPv6Unspecified(), 15006, true, true),
		listen(netip.IPv6Unspecified(), 15008, true, true),
		listen(pod4b, 15006, false, false),
		listen(peer4, rigAppPort, false, false),
		listen(peer6, rigAppPort, false, false),
		conn(pod4, peer4, rigLocalPort, rigAppPort), conn(peer4, pod4, rigAppPort, rigLocalPort),
		conn(pod6, peer6, rigLocalPort, rigAppPort), conn(peer6, pod6, rigAppPort, rigLocalPort),
		synSent(pod4, rigSynSentPort, gone4, false), synSent(pod6, rigSynSentPort, gone6, false),
		synSent(pod4, rigSynSentPort+1, gone4, true), synSent(pod4, 15008, gone4, false),
	}
	r.world.udpSocks = []refSock{
		{local: netip.AddrPortFrom(netip.IPv6Unspecified(), 15053), marked: true},
		{local: netip.AddrPortFrom(peer4, 15053)},
		{local: netip.AddrPortFrom(peer6, 15053)},
	}
	ready := make(chan error)
	stop := make(chan struct{})
	go r.serve(ready, stop)
	if err := <-ready; err != nil {
		f.Fatalf("rig namespace: %v", err)
	}
	f.Cleanup(func() { close(stop) })
	return r
}

// serve runs on a thread of its own in a new network namespace, sets up the
// rig's sockets there, and runs the programs until stop. The thread is
// never unlocked: it dies with its namespace, and the sockets are closed
// first.
func (r *fuzzRig) serve(ready chan<- error, stop <-chan struct{}) {
	runtime.LockOSThread()
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		ready <- fmt.Errorf("unshare: %w", err)
		return
	}
	var fds []int
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	err := func() error {
		var st unix.Stat_t
		if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
			return err
		}
		r.ino = uint32(st.Ino)
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(lo); err != nil {
			return fmt.Errorf("lo up: %w", err)
		}
		for _, a := range []netip.Addr{pod4, pod4b, peer4, pod6, peer6} {
			ipn, _ := netlink.ParseIPNet(netip.PrefixFrom(a, a.BitLen()).String())
			if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: ipn, Flags: unix.IFA_F_NODAD}); err != nil {
				return fmt.Errorf("address %s: %w", a, err)
			}
		}
		// gone4 and gone6 are neighbours on a veth with permanent
		// entries whose MAC no device has: the other end drops their
		// frames as another host's, no ICMP error, no neighbour probe.
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "rdg0"}, PeerName: "rdg1"}
		if err := netlink.LinkAdd(veth); err != nil {
			return fmt.Errorf("add veth: %w", err)
		}
		peer, err := netlink.LinkByName("rdg1")
		if err != nil {
			return err
		}
		for _, l := range []netlink.Link{veth, peer} {
			if err := netlink.LinkSetUp(l); err != nil {
				return fmt.Errorf("veth up: %w", err)
			}
		}
		for _, a := range []netip.Addr{gone4, gone6} {
			ipn, _ := netlink.ParseIPNet(netip.PrefixFrom(a, a.BitLen()).String())
			if err := netlink.RouteAdd(&netlink.Route{LinkIndex: veth.Attrs().Index, Dst: ipn}); err != nil {
				return fmt.Errorf("route %s: %w", a, err)
			}
			fam := netlink.FAMILY_V4
			if a.Is6() {
				fam = netlink.FAMILY_V6
			}
			n := &netlink.Neigh{LinkIndex: veth.Attrs().Index, Family: fam, State: netlink.NUD_PERMANENT,
				IP: a.AsSlice(), HardwareAddr: []byte{2, 0, 0, 0, 0, 0x99}}
			if err := netlink.NeighAdd(n); err != nil {
				return fmt.Errorf("neighbour %s: %w", a, err)
			}
		}
		sock := func(typ int, a netip.AddrPort, mark int, v6only bool) (int, error) {
			fam := unix.AF_INET6
			var sa unix.Sockaddr = &unix.SockaddrInet6{Port: int(a.Port()), Addr: a.Addr().As16()}
			if a.Addr().Is4() {
				fam = unix.AF_INET
				sa = &unix.SockaddrInet4{Port: int(a.Port()), Addr: a.Addr().As4()}
			}
			fd, err := unix.Socket(fam, typ|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return -1, err
			}
			fds = append(fds, fd)
			if fam == unix.AF_INET6 {
				only := 0
				if v6only {
					only = 1
				}
				if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, only); err != nil {
					return -1, err
				}
			}
			for _, o := range [][2]int{{unix.SO_REUSEADDR, 1}, {unix.SO_REUSEPORT, 1}, {unix.SO_MARK, mark}} {
				if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, o[0], o[1]); err != nil {
					return -1, err
				}
			}
			return fd, unix.Bind(fd, sa)
		}
		for _, k := range r.world.udpSocks {
			mark := 0
			if k.marked {
				mark = tunnelMarkRef
			}
			if _, err := sock(unix.SOCK_DGRAM, k.local, mark, !k.dualStack); err != nil {
				return fmt.Errorf("udp socket %s: %w", k.local, err)
			}
		}
		// The sockets the reference's world lists: listeners first,
		// then each pair's client end connects (from the pod's port)
		// and its server end is accepted.
		listeners := map[netip.AddrPort]int{}
		for _, k := range r.world.socks {
			if !k.listen {
				continue
			}
			mark := 0
			if k.marked {
				mark = tunnelMarkRef
			}
			fd, err := sock(unix.SOCK_STREAM, k.local, mark, !k.dualStack)
			if err != nil {
				return fmt.Errorf("listener %s: %w", k.local, err)
			}
			if err := unix.Listen(fd, 16); err != nil {
				return fmt.Errorf("listen %s: %w", k.local, err)
			}
			listeners[k.local] = fd
		}
		for _, k := range r.world.socks {
			if !k.synSent {
				continue
			}
			mark := 0
			if k.marked {
				mark = tunnelMarkRef
			}
			fd, err := sock(unix.SOCK_STREAM, k.local, mark, true)
			if err != nil {
				return fmt.Errorf("client %s: %w", k.local, err)
			}
			// retransmitted for hours, not two minutes
			if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_SYNCNT, 127); err != nil {
				return fmt.Errorf("syn count: %w", err)
			}
			if err := unix.SetNonblock(fd, true); err != nil {
				return err
			}
			var sa unix.Sockaddr = &unix.SockaddrInet6{Port: int(k.remote.Port()), Addr: k.remote.Addr().As16()}
			if k.remote.Addr().Is4() {
				sa = &unix.SockaddrInet4{Port: int(k.remote.Port()), Addr: k.remote.Addr().As4()}
			}
			if err := unix.Connect(fd, sa); !errors.Is(err, unix.EINPROGRESS) {
				return fmt.Errorf("connect %s from %s: %v, want it in progress", k.remote, k.local, err)
			}
		}
		for _, k := range r.world.socks {
			if k.listen || k.synSent || k.local.Port() != rigLocalPort {
				continue
			}
			fd, err := sock(unix.SOCK_STREAM, k.local, 0, true)
			if err != nil {
				return fmt.Errorf("client %s: %w", k.local, err)
			}
			var sa unix.Sockaddr = &unix.SockaddrInet6{Port: int(k.remote.Port()), Addr: k.remote.Addr().As16()}
			if k.remote.Addr().Is4() {
				sa = &unix.SockaddrInet4{Port: int(k.remote.Port()), Addr: k.remote.Addr().As4()}
			}
			// an IPv6 address's local route comes with addrconf's
			// work item, a moment after the address (up to 5 s on a
			// loaded machine)
			err = unix.Connect(fd, sa)
			for i := 0; i < 500 && errors.Is(err, unix.ENETUNREACH); i++ {
				time.Sleep(10 * time.Millisecond)
				err = unix.Connect(fd, sa)
			}
			if err != nil {
				return fmt.Errorf("connect %s: %w", k.remote, err)
			}
			lfd, ok := listeners[k.remote]
			if !ok {
				return fmt.Errorf("no listener for %s", k.remote)
			}
			nfd, _, err := unix.Accept4(lfd, unix.SOCK_CLOEXEC)
			if err != nil {
				return fmt.Errorf("accept on %s: %w", k.remote, err)
			}
			fds = append(fds, nfd)
		}
		return nil
	}()
	ready <- err
	if err != nil {
		return
	}
	for {
		select {
		case <-stop:
			return
		case run := <-r.runs:
			v, err := run.prog.Run(run.opts)
			run.done <- fuzzResult{v, err}
		}
	}
}

// setMode puts the mode's enrollment and rd_pod_netns entry in the maps.
func (r *fuzzRig) setMode(t *testing.T, mode byte) {
	flags := uint32(mode>>1) & 3
	if mode&0x80 != 0 {
		flags |= uint32(CapturePodFlagPOD_CAPTURE_DNS)
	}
	ns := int(mode>>5) & 3
	r.world.pods = map[[16]byte]refPod{
		addrKey(pod4): {1, flags}, addrKey(pod4b): {1, flags}, addrKey(pod6): {1, flags},
		addrKey(nb4): {2, bothWays}, addrKey(nb6): {2, bothWays},
	}
	owners := []struct {
		addr netip.Addr
		id   uint32
	}{{}, {pod4, 1}, {nb4, 2}, {nb4, 1}}
	r.world.nsOwner, r.world.nsPodID = nil, 0
	if ns != 0 {
		k := addrKey(owners[ns].addr)
		r.world.nsOwner, r.world.nsPodID = &k, owners[ns].id
	}
	key := int(flags) | ns<<3
	if key == r.lastMode {
		return
	}
	for _, a := range []netip.Addr{pod4, pod4b, pod6} {
		if err := r.objs.RdPods.Put(CapturePodAddr{Addr: a.As16()}, CapturePodSettings{Flags: flags, PodId: 1}); err != nil {
			t.Fatalf("enroll %s: %v", a, err)
		}
	}
	if ns == 0 {
		if err := r.objs.RdPodNetns.Delete(r.ino); err != nil && !isNotExist(err) {
			t.Fatalf("delete netns entry: %v", err)
		}
	} else if err := r.objs.RdPodNetns.Put(r.ino, CapturePodNetns{Addr: CapturePodAddr{Addr: owners[ns].addr.As16()}, PodId: owners[ns].id}); err != nil {
		t.Fatalf("netns entry: %v", err)
	}
	r.lastMode = key
}

func isNotExist(err error) bool { return err != nil && errors.Is(err, ebpf.ErrKeyNotExist) }

// counters are the sums over CPUs of rd_reasons and of each enrolled
// address's rd_pod_stats.
type counters struct {
	reasons []uint64
	pods    map[[16]byte][5]uint64
}

func (r *fuzzRig) read(t *testing.T) counters {
	c := counters{reasons: make([]uint64, CaptureVerdictReasonREASON_MAX), pods: map[[16]byte][5]uint64{}}
	keys := make([]uint32, 64)
	vals := make([]uint64, len(keys)*ebpf.MustPossibleCPU())
	var cursor ebpf.MapBatchCursor
	n, err := r.objs.RdReasons.BatchLookup(&cursor, keys, vals, nil)
	if err != nil && !isNotExist(err) {
		t.Fatalf("read rd_reasons: %v", err)
	}
	ncpu := len(vals) / len(keys)
	for i := 0; i < n; i++ {
		if keys[i] < uint32(len(c.reasons)) {
			for cpu := 0; cpu < ncpu; cpu++ {
				c.reasons[keys[i]] += vals[i*ncpu+cpu]
			}
		}
	}
	for _, a := range r.podAddrs {
		var per []CapturePodCounters
		if err := r.objs.RdPodStats.Lookup(CapturePodAddr{Addr: a.As16()}, &per); err != nil {
			t.Fatalf("read stats of %s: %v", a, err)
		}
		var s [5]uint64
		for _, v := range per {
			s[0] += v.OutboundConns
			s[1] += v.InboundConns
			s[2] += v.SteeredPackets
			s[3] += v.DroppedPackets
			s[4] += v.BypassedPackets
		}
		c.pods[addrKey(a)] = s
	}
	return c
}

var fuzzMarks = [4]uint32{0, 0x539, 0x111, 0xf539}

func (r *fuzzRig) check(t *testing.T, mode byte, pkt []byte) {
	egress := mode&1 != 0
	mark := fuzzMarks[(mode>>3)&3]
	r.setMode(t, mode)
	prog, name := r.objs.RdPodIngress, "ingress"
	if egress {
		prog, name = r.objs.RdPodEgress, "egress"
	}
	in := slices.Clone(pkt)
	opts := &ebpf.RunOptions{Data: in, DataOut: make([]byte, len(in)+256), Context: skbCtx{Mark: mark}}
	before := r.read(t)
	done := make(chan fuzzResult)
	r.runs <- fuzzRun{prog, opts, done}
	res := <-done
	if errors.Is(res.err, unix.EINVAL) && tooShortToRun(pkt) {
		// the kernel refuses to run an IP frame without its IP header
		// (the programs drop those unread, TestCaptureIngressTable)
		return
	}
	if res.err != nil {
		t.Fatalf("run %s: %v", name, res.err)
	}
	got := res.verdict
	after := r.read(t)

	p := refParse(pkt)
	want := r.world.expect(egress, mark, p)
	desc := fmt.Sprintf("%s, mode %#02x (pod 1 flags %d, dns %v, mark %#x, netns %d), ref %v", name, mode, (mode>>1)&3, mode&0x80 != 0, mark, (mode>>5)&3, p)

	// At most one reason counted, once.
	counted := noReason
	for i := range after.reasons {
		switch d := after.reasons[i] - before.reasons[i]; {
		case d == 0:
		case d == 1 && counted == noReason:
			counted = CaptureVerdictReason(i)
		default:
			t.Fatalf("%s: reason %d counted %d more times (and %d before it)", desc, i, d, counted)
		}
	}
	switch got {
	case actUnspec, actShot:
	case actOK:
		if egress {
			t.Fatalf("%s: TC_ACT_OK on egress", desc)
		}
	case actRedirect:
		if !egress {
			t.Fatalf("%s: redirect on ingress", desc)
		}
	default:
		t.Fatalf("%s: verdict %d is none of the programs' own", desc, int32(got))
	}
	if got == actShot && (counted == noReason || refCounterFields(counted)[0] != 3) {
		t.Fatalf("%s: dropped, counted under %d (not a drop reason)", desc, counted)
	}
	if got != actShot && counted != noReason && refCounterFields(counted)[0] == 3 {
		t.Fatalf("%s: verdict %d, counted under drop reason %d", desc, int32(got), counted)
	}

	var match *outcome
	for i := range want {
		if want[i].verdict == got && want[i].reason == counted {
			match = &want[i]
		}
	}
	if match == nil {
		t.Fatalf("%s: verdict %d reason %d; the design allows %s", desc, int32(got), counted, outcomesString(want))
	}

	// The pod counters: the reason's field of the pod it names, and
	// nothing else.
	for _, a := range r.podAddrs {
		k := addrKey(a)
		var wantDelta [5]uint64
		if match.pod != nil && *match.pod == k {
			for _, fi := range refCounterFields(counted) {
				wantDelta[fi] = 1
			}
		}
		for fi := range wantDelta {
			if d := after.pods[k][fi] - before.pods[k][fi]; d != wantDelta[fi] {
				t.Fatalf("%s: counter %d of %s moved by %d, want %d", desc, fi, a, d, wantDelta[fi])
			}
		}
	}

	// The frame comes back as it went, but for the steered frame's
	// destination MAC (steer).
	out := opts.DataOut
	expOut := slices.Clone(pkt)
	if got == actRedirect {
		copy(expOut[0:6], pkt[6:12])
	}
	if !bytes.Equal(out, expOut) {
		t.Fatalf("%s: frame changed:\n in  %x\n out %x\n want %x", desc, pkt, out, expOut)
	}
}

// tooShortToRun reports whether BPF_PROG_TEST_RUN refuses frame f: an
// EtherType of IPv4 or IPv6 without room for that header.
func tooShortToRun(f []byte) bool {
	switch binary.BigEndian.Uint16(f[12:]) {
	case unix.ETH_P_IP:
		return len(f) < 14+20
	case unix.ETH_P_IPV6:
		return len(f) < 14+40
	}
	return false
}

func outcomesString(os []outcome) string {
	s := ""
	for i, o := range os {
		if i > 0 {
			s += " or "
		}
		s += fmt.Sprintf("verdict %d reason %d", int32(o.verdict), o.reason)
		if o.pod != nil {
			s += " for " + netip.AddrFrom16(*o.pod).Unmap().String()
		}
	}
	return s
}

// fuzzMode is the input's first byte (see FuzzCapture).
func fuzzMode(egress bool, flags uint32, markSel, ns int) byte {
	m := byte(flags&3)<<1 | byte(markSel&3)<<3 | byte(ns&3)<<5
	if flags&uint32(CapturePodFlagPOD_CAPTURE_DNS) != 0 {
		m |= 0x80
	}
	if egress {
		m |= 1
	}
	return m
}

// fuzzSeeds are the table tests' kinds of frame, each way and in the
// settings that tell them apart: every extension header kind, fragments,
// IP and TCP options, VLAN tags, IPv4-mapped addresses, the probe SNAT
// address, the tunnel's ports, the rig's connected tuples, link-local and
// unenrolled addresses, loopback, hidden payloads, and frames cut short.
func fuzzSeeds() []fuzzSeed {
	const app = 8080
	tcpSyn := syn(app)
	synAck := tcpHdr(app, 40000, fSYN|fACK)
	ack := tcpHdr(40000, app, fACK)
	withOpts := tcpHdr(40000, app, fSYN, synOpts...)
	hdr := func(proto byte) ext { return ext{proto, []byte{0, 0, 0, 0, 0, 0, 0}} }
	final := netip.MustParseAddr("fd00:200::5")
	mapped := func(a netip.Addr) netip.Addr { return netip.AddrFrom16(a.As16()) }

	// frames from src to dst, for either direction
	frames := func(src4, dst4, src6, dst6 netip.Addr) [][]byte {
		inner4 := ip4(src4, dst4, pTCP, 0, tcpSyn)[14:]
		v4ah := append([]byte{pTCP, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1}, tcpSyn...)
		return [][]byte{
			ip4(src4, dst4, pTCP, 0, tcpSyn),
			ip4(src4, dst4, pTCP, 0, withOpts, 1, 1, 1, 0),
			ip4(src4, dst4, pTCP, 0, tcpSyn, make([]byte, 40)...),
			ip4(src4, dst4, pTCP, 0x4000, ack),
			ip4(src4, dst4, pTCP, 0, synAck),
			ip4(src4, dst4, pTCP, 0, tcpHdr(40000, app, fRST)),
			ip4(src4, dst4, pTCP, 0, syn(15001)),
			ip4(src4, dst4, pTCP, 0, syn(15006)),
			ip4(src4, dst4, pTCP, 0, syn(15008)),
			ip4(src4, dst4, pAH, 0, v4ah),
			ip4(src4, dst4, pAH, 0, append([]byte{pAH, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1}, v4ah...)),
			ip4(src4, dst4, pTCP, 0x2000, tcpSyn),
			ip4(src4, dst4, pTCP, 0x2000, tcpSyn[:8]),
			ip4(src4, dst4, pTCP, 1, tcpSyn[8:]),
			ip4(src4, dst4, pTCP, 0x2000|3, make([]byte, 24)),
			ip4(src4, dst4, pAH, 0x2000, v4ah),
			ip4(src4, dst4, pUDP, 0x2000, make([]byte, 8)),
			ip4(src4, dst4, pESP, 0, make([]byte, 32)),
			ip4(src4, dst4, pIPIP, 0, inner4),
			ip4(src4, dst4, pGRE, 0, make([]byte, 24)),
			ip4(src4, dst4, 108, 0, append([]byte{pTCP, 0, 0, 1}, tcpSyn...)),
			ip4(src4, dst4, 137, 0, append([]byte{0, 0x10, 0x01, 0x40}, inner4...)),
			ip4(src4, dst4, 115, 0, append(make([]byte, 8), frame(unix.ETH_P_IP, inner4)...)),
			ip4(src4, dst4, 97, 0, append([]byte{0x30, 0}, frame(unix.ETH_P_IP, inner4)...)),
			ip4(src4, dst4, pUDP, 0, make([]byte, 8)),
			ip4(src4, dst4, 1, 0, make([]byte, 8)),
			ip4(src4, dst4, pTCP, 0, tcpSyn[:10]),
			func() []byte { f := ip4(src4, dst4, pTCP, 0, tcpSyn); f[14] = 0x44; return f }(),
			func() []byte { f := ip4(src4, dst4, pTCP, 0, tcpSyn); f[14] = 0x65; return f }(),
			func() []byte { f := ip4(src4, dst4, pTCP, 0, nil); f[14] = 0x4f; return f }(),
			func() []byte { f := ip4(src4, dst4, pTCP, 0, tcpSyn); f[14+20+12] = 4 << 4; return f }(),
			func() []byte { f := ip4(src4, dst4, pTCP, 0, tcpSyn); f[14+20+12] = 15 << 4; return f }(),
			ip6(src6, dst6, nil, pTCP, tcpSyn),
			ip6(src6, dst6, nil, pTCP, withOpts),
			ip6(src6, dst6, nil, pTCP, ack),
			ip6(src6, dst6, nil, pTCP, synAck),
			ip6(src6, dst6, nil, pTCP, syn(15008)),
			ip6(src6, dst6, []ext{opts(pHop, 0)}, pTCP, tcpSyn),
			ip6(src6, dst6, []ext{opts(pDst, 30)}, pTCP, tcpSyn),
			ip6(src6, dst6, []ext{routing()}, pTCP, tcpSyn),
			ip6(src6, dst6, []ext{frag(0, false)}, pTCP, tcpSyn),
			ip6(src6, dst6, []ext{ah()}, pTCP, tcpSyn),
			ip6(src6, dst6, []ext{opts(pHop, 0), opts(pDst, 1), routing(), ah(), opts(pDst, 0)}, pTCP, tcpSyn),
			ip6(src6, dst6, repeat(opts(pDst, 0), 8), pTCP, tcpSyn),
			ip6(src6, dst6, repeat(opts(pDst, 0), 9), pTCP, tcpSyn),
			ip6(src6, dst6, repeat(opts(pDst, 0), 8), pUDP, make([]byte, 8)),
			ip6(src6, dst6, []ext{frag(0, true)}, pTCP, tcpSyn),
			ip6(src6, dst6, []ext{frag(8, false)}, pTCP, make([]byte, 16)),
			ip6(src6, dst6, []ext{opts(pHop, 0), frag(16, true)}, pTCP, make([]byte, 16)),
			ip6(src6, dst6, []ext{frag(8, true)}, pUDP, make([]byte, 8)),
			ip6(src6, dst6, nil, pESP, make([]byte, 32)),
			ip6(src6, dst6, nil, pIPv6, ip6(src6, dst6, nil, pTCP, tcpSyn)[14:]),
			ip6(src6, dst6, []ext{hdr(135)}, pTCP, tcpSyn),
			ip6(src6, dst6, []ext{hdr(140)}, pTCP, tcpSyn),
			ip6(src6, dst6, []ext{hdr(253)}, pTCP, tcpSyn),
			ip6(src6, dst6, nil, 143, frame(unix.ETH_P_IP, inner4)),
			ip6(src6, dst6, []ext{srh(1, final, dst6)}, pTCP, tcpSyn),
			ip6(src6, dst6, []ext{srh(0, dst6, final)}, pTCP, tcpSyn),
			ip6(src6, dst6, []ext{srh(1, final, dst6)}, pUDP, make([]byte, 8)),
			ip6(src6, dst6, []ext{opts(pDst, 0)}, pNone, nil),
			ip6(src6, dst6, nil, pICMP6, make([]byte, 8)),
			ip6(src6, dst6, []ext{opts(pDst, 0)}, pTCP, nil)[:14+40+4],
			ip6(src6, dst6, []ext{opts(pHop, 0)}, pTCP, tcpSyn[:10]),
			vlan(0x8100, ip4(src4, dst4, pTCP, 0, tcpSyn)),
			vlan(0x88a8, vlan(0x8100, ip6(src6, dst6, nil, pTCP, tcpSyn))),
			vlan(0x8100, vlan(0x8100, vlan(0x8100, vlan(0x8100, vlan(0x8100, ip4(src4, dst4, pTCP, 0, tcpSyn)))))),
			vlan(0x8100, ip4(src4, dst4, pUDP, 0, make([]byte, 8))),
			forHost(ip4(src4, dst4, pTCP, 0, tcpSyn)),
			forHost(ip6(src6, dst6, nil, pTCP, tcpSyn)),
			forHost(ip4(src4, dst4, pUDP, 0, make([]byte, 8))),
			forHost(ip6(src6, dst6, []ext{frag(8, false)}, pTCP, make([]byte, 16))),
		}
	}
	var seeds []fuzzSeed
	add := func(egress bool, pkts ...[]byte) {
		for _, p := range pkts {
			for _, m := range []struct {
				flags       uint32
				markSel, ns int
			}{{bothWays, 0, 0}, {bothWays, 0, 1}, {uint32(CapturePodFlagPOD_CAPTURE_OUTBOUND), 0, 1}, {bothWays, 0, 2}} {
				seeds = append(seeds, fuzzSeed{fuzzMode(egress, m.flags, m.markSel, m.ns), p})
			}
		}
	}
	add(false, frames(peer4, pod4, peer6, pod6)...)
	add(true, frames(pod4, peer4, pod6, peer6)...)
	other := [][]byte{
		// the probe SNAT address, both ways
		ip4(snat4, pod4, pTCP, 0, tcpSyn), ip6(snat6, pod6, nil, pTCP, tcpSyn),
		ip4(pod4, snat4, pTCP, 0, tcpSyn), ip6(pod6, snat6, nil, pTCP, synAck),
		ip6(pod6, snat6, []ext{srh(1, final, snat6)}, pTCP, tcpSyn),
		// the pod's own and other pods' addresses, the app listener's
		ip4(pod4, pod4, pTCP, 0, tcpSyn), ip4(pod4b, pod4, pUDP, 0, make([]byte, 8)),
		ip4(peer4, pod4b, pTCP, 0, tcpSyn), ip4(nb4, pod4, pTCP, 0, tcpSyn), ip6(peer6, nb6, nil, pTCP, tcpSyn),
		// ACKs a listener would take (SYN cookies'), on the pod's own
		// interface and on another pod's (drop_foreign_dst)
		forHost(ip4(peer4, pod4, pTCP, 0, tcpHdr(40000, 15006, fACK))),
		forHost(ip6(peer6, pod6, nil, pTCP, tcpHdr(40000, 15006, fACK|0x08))),
		forHost(ip4(peer4, pod4b, pTCP, 0, tcpHdr(40000, 15006, fACK))),
		// the rig's connected tuples
		ip4(pod4, peer4, pTCP, 0, tcpHdr(rigLocalPort, rigAppPort, fACK)),
		ip4(pod4, peer4, pTCP, 0, tcpHdr(rigLocalPort, rigAppPort, fSYN)),
		ip4(peer4, pod4, pTCP, 0, tcpHdr(rigAppPort, rigLocalPort, fSYN)),
		ip6(pod6, peer6, []ext{opts(pDst, 0)}, pTCP, tcpHdr(rigLocalPort, rigAppPort, fSYN|fACK)),
		ip6(peer6, pod6, nil, pTCP, tcpHdr(rigAppPort, rigLocalPort, fSYN)),
		// the rig's sockets in SYN_SENT: a simultaneous open
		ip4(gone4, pod4, pTCP, 0, tcpHdr(rigAppPort, rigSynSentPort, fSYN)),
		ip6(gone6, pod6, []ext{opts(pDst, 0)}, pTCP, tcpHdr(rigAppPort, rigSynSentPort, fSYN, synOpts...)),
		ip4(gone4, pod4, pTCP, 0, tcpHdr(rigAppPort, rigSynSentPort+1, fSYN)),
		ip4(gone4, pod4, pTCP, 0, tcpHdr(rigAppPort, 15008, fSYN)),
		ip4(pod4, gone4, pTCP, 0, tcpHdr(rigSynSentPort, rigAppPort, fSYN)),
		// addresses that are not enrolled, link-local, loopback, mapped
		ip4(peer4, other4, pTCP, 0, tcpSyn), ip6(other6, peer6, nil, pTCP, tcpSyn),
		forHost(ip6(llPeer, llPod, nil, pTCP, tcpSyn)), ip6(llPod, llPeer, nil, pTCP, tcpSyn),
		forHost(ip4(peer4, ll4Pod, pTCP, 0, tcpSyn)),
		ip4(pod4, netip.MustParseAddr("127.0.0.1"), pTCP, 0, tcpSyn), ip6(pod6, netip.IPv6Loopback(), nil, pTCP, ack),
		ip6(peer6, mapped(pod4), nil, pTCP, tcpSyn), ip6(mapped(pod4), peer6, nil, pTCP, tcpSyn),
		frame(unix.ETH_P_ARP, make([]byte, 28)), []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14},
	}
	for _, p := range dnsFrames() {
		for _, egress := range []bool{false, true} {
			for _, markSel := range []int{0, 1, 2, 3} {
				for _, ns := range []int{0, 1} {
					for _, flags := range []uint32{dnsFlags, bothWays} {
						seeds = append(seeds, fuzzSeed{fuzzMode(egress, flags, markSel, ns), p})
					}
				}
			}
		}
	}
	for _, p := range other {
		for _, egress := range []bool{false, true} {
			for _, markSel := range []int{0, 1, 2, 3} {
				for _, ns := range []int{0, 1, 2, 3} {
					seeds = append(seeds, fuzzSeed{fuzzMode(egress, bothWays, markSel, ns), p})
				}
			}
			for _, flags := range []uint32{0, uint32(CapturePodFlagPOD_CAPTURE_OUTBOUND), uint32(CapturePodFlagPOD_CAPTURE_INBOUND)} {
				seeds = append(seeds, fuzzSeed{fuzzMode(egress, flags, 0, 1), p})
			}
		}
	}
	return seeds
}

// dnsFrames are DNS queries of pod 1 (and look-alikes) as the DNS capture
// sees them: to the resolvers whose port 15053 has the tunnel's socket, an
// app's, or none; to 5353 and from 53; to loopback; from addresses of the
// pod's interface that are not enrolled; and every way of hiding a query
// from a clean parse (IPv4 options and AH, fragments, IPv6 extension
// headers and source routes, VLAN tags, a header cut short).
func dnsFrames() [][]byte {
	q := query(53)
	final := netip.MustParseAddr("fd00:200::5")
	v4ah := append([]byte{pUDP, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1}, q...)
	return [][]byte{
		ip4(pod4, peer4, pUDP, 0, q), ip4(pod4, other4, pUDP, 0, q), ip4(pod4, nb4, pUDP, 0, q),
		ip6(pod6, peer6, nil, pUDP, q), ip6(pod6, other6, nil, pUDP, q),
		ip4(pod4, other4, pUDP, 0, query(5353)), ip6(pod6, other6, nil, pUDP, udpHdr(53, 40000, nil)),
		ip4(pod4, netip.MustParseAddr("127.0.0.53"), pUDP, 0, q), ip6(pod6, netip.IPv6Loopback(), nil, pUDP, q),
		ip6(llPod, llPeer, nil, pUDP, q), ip6(other6, peer6, nil, pUDP, q), ip4(other4, peer4, pUDP, 0, q),
		ip4(pod4, other4, pUDP, 0, q, 1, 1, 1, 0), ip4(pod4, other4, pUDP, 0, query(5353), 1, 1, 1, 0),
		ip4(pod4, other4, pAH, 0, v4ah),
		ip4(pod4, other4, pUDP, 0x2000, q), ip4(pod4, other4, pUDP, 0x2000, q[:4]), ip4(pod4, other4, pUDP, 0x2000|1, q),
		ip4(pod4, other4, pUDP, 0, q[:6]), ip6(pod6, other6, nil, pUDP, q[:2]),
		ip6(pod6, other6, []ext{opts(pHop, 0)}, pUDP, q), ip6(pod6, other6, []ext{opts(pHop, 0)}, pUDP, query(5353)),
		ip6(pod6, other6, []ext{routing()}, pUDP, q), ip6(pod6, other6, []ext{ah()}, pUDP, q),
		ip6(pod6, other6, []ext{frag(0, false)}, pUDP, q), ip6(pod6, other6, []ext{frag(0, true)}, pUDP, q),
		ip6(pod6, other6, []ext{frag(0, true)}, pUDP, nil), ip6(pod6, other6, []ext{frag(8, true)}, pUDP, q),
		ip6(pod6, other6, repeat(opts(pDst, 0), 8), pUDP, q),
		ip6(pod6, other6, []ext{srh(1, final, other6)}, pUDP, q), ip6(pod6, other6, []ext{srh(1, final, other6)}, pUDP, query(5353)),
		vlan(0x8100, ip4(pod4, other4, pUDP, 0, q)), vlan(0x8100, ip6(pod6, other6, nil, pUDP, query(5353))),
		ip4(pod4, peer4, pTCP, 0, syn(53)),
		forHost(ip4(peer4, pod4, pUDP, 0, q)), forHost(ip4(pod4, pod4, pUDP, 0, q)),
	}
}
