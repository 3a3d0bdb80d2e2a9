package main

import (
	"bufio"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"os"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// tapMain records when each TCP segment that carries data passes any
// interface of its namespace (an AF_PACKET tap, the point tcpdump sees), for
// the hop breakdown of the round trip (hops.go). The kernel stamps each packet
// with the real-time clock as it copies it into a TPACKET_V3 ring, in the
// packet's own path (softirq or the sender's transmit), and this process wakes
// only per retired block (every 50 ms or 1 MiB), so the tap adds a copy of the
// headers to each packet and no wake-up to the path it measures.
//
//	meshbench tap -out FILE -app-port 7000 -tunnel-port 15008
//
// It prints "tap ready" once the ring is open, records until its standard
// input closes, then writes one line per segment to FILE:
// "<ns> <leg> <dir> <payload bytes>", leg app or tun (the segment's port is
// -app-port or -tunnel-port; others are left out), dir req (to that port) or
// rep (from it). A segment seen twice (loopback's transmit and receive) is
// written once, at its first sighting.
func tapMain(args []string) error {
	fs := flag.NewFlagSet("tap", flag.ContinueOnError)
	out := fs.String("out", "", "file the segments are written to")
	appPort := fs.Int("app-port", echoPort, "the application's port")
	tunPort := fs.Int("tunnel-port", 0, "the port of the relay-to-relay connection")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *out == "" || *tunPort == 0 {
		return fmt.Errorf("-out and -tunnel-port are required")
	}
	ring, err := openTapRing()
	if err != nil {
		return err
	}
	defer ring.close()
	fmt.Println("tap ready")

	var stop atomic.Bool
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		stop.Store(true)
	}()
	rec := &tapRecorder{appPort: uint16(*appPort), tunPort: uint16(*tunPort), seen: map[segmentKey]bool{}}
	deadline := time.Time{}
	for {
		ring.drain(rec.packet)
		if stop.Load() {
			if deadline.IsZero() {
				// Partly filled blocks are retired by the kernel's timer.
				deadline = time.Now().Add(3 * tapRetire)
			} else if time.Now().After(deadline) {
				break
			}
		}
		_ = ring.wait(int(tapRetire / time.Millisecond))
	}
	ring.drain(rec.packet)
	return rec.write(*out)
}

const (
	tapBlockSize = 1 << 20
	tapBlocks    = 64
	tapRetire    = 50 * time.Millisecond
	tapSnap      = 128 // enough for Ethernet, IPv6 and a TCP header with options
)

// tapRing is a TPACKET_V3 receive ring on an AF_PACKET socket bound to
// every interface of the namespace.
type tapRing struct {
	fd   int
	mem  []byte
	next int // the block to look at next
}

func openTapRing() (*tapRing, error) {
	proto := int(htons(unix.ETH_P_ALL))
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return nil, fmt.Errorf("AF_PACKET socket: %w", err)
	}
	r := &tapRing{fd: fd}
	fail := func(what string, err error) (*tapRing, error) {
		r.close()
		return nil, fmt.Errorf("tap: %s: %w", what, err)
	}
	// Copy only the headers: a filter that accepts every packet, cut short.
	snap := []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: tapSnap}}
	prog := unix.SockFprog{Len: uint16(len(snap)), Filter: &snap[0]}
	if err := unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &prog); err != nil {
		return fail("attach filter", err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_VERSION, unix.TPACKET_V3); err != nil {
		return fail("TPACKET_V3", err)
	}
	req := unix.TpacketReq3{Block_size: tapBlockSize, Block_nr: tapBlocks, Frame_size: 2048,
		Frame_nr: tapBlockSize / 2048 * tapBlocks, Retire_blk_tov: uint32(tapRetire / time.Millisecond)}
	if err := unix.SetsockoptTpacketReq3(fd, unix.SOL_PACKET, unix.PACKET_RX_RING, &req); err != nil {
		return fail("rx ring", err)
	}
	if r.mem, err = unix.Mmap(fd, 0, tapBlockSize*tapBlocks, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
		return fail("mmap ring", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL)}); err != nil {
		return fail("bind", err)
	}
	return r, nil
}

func (r *tapRing) close() {
	if r.mem != nil {
		_ = unix.Munmap(r.mem)
	}
	_ = unix.Close(r.fd)
}

func (r *tapRing) wait(ms int) error {
	_, err := unix.Poll([]unix.PollFd{{Fd: int32(r.fd), Events: unix.POLLIN}}, ms)
	return err
}

// drain hands every packet of the blocks the kernel has retired to f, in
// ring order, and gives the blocks back.
func (r *tapRing) drain(f func(ns int64, net []byte)) {
	for {
		blk := r.mem[r.next*tapBlockSize : (r.next+1)*tapBlockSize]
		status := (*uint32)(unsafe.Pointer(&blk[8]))
		if atomic.LoadUint32(status)&unix.TP_STATUS_USER == 0 {
			return
		}
		n := binary.NativeEndian.Uint32(blk[12:])
		off := binary.NativeEndian.Uint32(blk[16:])
		for range n {
			h := (*unix.Tpacket3Hdr)(unsafe.Pointer(&blk[off]))
			ns := int64(h.Sec)*1e9 + int64(h.Nsec)
			start, end := int(off)+int(h.Net), int(off)+int(h.Mac)+int(h.Snaplen)
			if h.Net >= h.Mac && start < end && end <= len(blk) {
				f(ns, blk[start:end])
			}
			off += h.Next_offset
		}
		atomic.StoreUint32(status, unix.TP_STATUS_KERNEL)
		r.next = (r.next + 1) % tapBlocks
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// segmentKey names one TCP segment, so its second sighting is left out.
type segmentKey struct {
	src, dst   [16]byte
	sport, dpt uint16
	seq        uint32
	payload    uint16
}

type tapEvent struct {
	ns      int64
	leg     string
	dir     string
	payload int
}

type tapRecorder struct {
	appPort, tunPort uint16
	seen             map[segmentKey]bool
	events           []tapEvent
}

// packet records a TCP segment with data on one of the two ports.
func (t *tapRecorder) packet(ns int64, pkt []byte) {
	var k segmentKey
	var l4 []byte
	var total int
	switch {
	case len(pkt) >= 20 && pkt[0]>>4 == 4:
		ihl := int(pkt[0]&0xf) * 4
		if pkt[9] != unix.IPPROTO_TCP || len(pkt) < ihl+20 {
			return
		}
		copy(k.src[:], pkt[12:16])
		copy(k.dst[:], pkt[16:20])
		total = int(binary.BigEndian.Uint16(pkt[2:])) - ihl
		l4 = pkt[ihl:]
	case len(pkt) >= 60 && pkt[0]>>4 == 6:
		if pkt[6] != unix.IPPROTO_TCP { // no extension headers in this suite
			return
		}
		copy(k.src[:], pkt[8:24])
		copy(k.dst[:], pkt[24:40])
		total = int(binary.BigEndian.Uint16(pkt[4:]))
		l4 = pkt[40:]
	default:
		return
	}
	k.sport, k.dpt = binary.BigEndian.Uint16(l4[0:]), binary.BigEndian.Uint16(l4[2:])
	k.seq = binary.BigEndian.Uint32(l4[4:])
	payload := total - int(l4[12]>>4)*4
	if payload <= 0 {
		return
	}
	k.payload = uint16(payload)
	var leg, dir string
	switch {
	case k.dpt == t.appPort:
		leg, dir = "app", "req"
	case k.sport == t.appPort:
		leg, dir = "app", "rep"
	case k.dpt == t.tunPort:
		leg, dir = "tun", "req"
	case k.sport == t.tunPort:
		leg, dir = "tun", "rep"
	default:
		return
	}
	if t.seen[k] {
		return
	}
	t.seen[k] = true
	t.events = append(t.events, tapEvent{ns: ns, leg: leg, dir: dir, payload: payload})
}

func (t *tapRecorder) write(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	for _, e := range t.events {
		fmt.Fprintf(w, "%d %s %s %d\n", e.ns, e.leg, e.dir, e.payload)
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
