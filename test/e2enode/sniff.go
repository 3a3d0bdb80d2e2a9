//go:build e2enode && linux

package e2enode

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Sniffer reads every frame on the node's interfaces but loopback with a packet socket in
// the node's network namespace: the host side of each pod's veth, so all pod traffic.
type Sniffer struct {
	fd     int
	marker []byte
	stop   chan struct{}
	done   chan struct{}

	mu        sync.Mutex
	markerHit int            // frames whose TCP payload holds the marker
	byPort    map[uint16]int // TCP frames with a payload, by the lower of the two ports
	// TCP frames with a payload by each of their two endpoints: which connections they were,
	// where byPort mixes in every other pod's (an HBONE pool's keep-alive pings, say).
	byEndpoint map[netip.AddrPort]int
	// TCP frames with a payload by connection, its lower endpoint first: a check of one pair of
	// pods is not misled by a connection of another pod, such as the kernel retransmitting an
	// orphaned socket's data to a pod deleted earlier (flooded by the bridge to every port).
	byFlow map[flow]int
}

// flow is a TCP connection's two endpoints, the lower (by address, then port) first.
type flow [2]netip.AddrPort

func newFlow(a, b netip.AddrPort) flow {
	if b.Compare(a) < 0 {
		a, b = b, a
	}
	return flow{a, b}
}

// Sniff starts capturing; marker is plaintext that must never cross the wire meshed.
func (n *Node) Sniff(marker string) (*Sniffer, error) {
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		if err := enterNetns("/run/netns/" + n.Name); err != nil {
			ch <- result{err: err}
			return
		}
		proto := int(htons(unix.ETH_P_ALL))
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
		if err != nil {
			ch <- result{err: fmt.Errorf("packet socket: %w", err)}
			return
		}
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL)}); err != nil {
			unix.Close(fd)
			ch <- result{err: fmt.Errorf("bind packet socket: %w", err)}
			return
		}
		// A receive timeout, so the reading loop sees Stop: closing the descriptor would not
		// wake a blocked recvfrom.
		tv := unix.Timeval{Usec: 200_000}
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			unix.Close(fd)
			ch <- result{err: err}
			return
		}
		ch <- result{fd: fd}
	}()
	r := <-ch
	if r.err != nil {
		return nil, r.err
	}
	s := &Sniffer{fd: r.fd, marker: []byte(marker), stop: make(chan struct{}), done: make(chan struct{}), byPort: map[uint16]int{}, byEndpoint: map[netip.AddrPort]int{}, byFlow: map[flow]int{}}
	go s.loop()
	return s, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func (s *Sniffer) loop() {
	defer close(s.done)
	buf := make([]byte, 1<<16)
	for {
		select {
		case <-s.stop:
			return
		default:
		}
		nr, from, err := unix.Recvfrom(s.fd, buf, 0)
		if err == unix.EAGAIN || err == unix.EINTR {
			continue
		}
		if err != nil {
			return
		}
		s.received(buf[:nr], from)
	}
}

// drain reads what is still queued on the socket once the loop has ended: on a loaded machine
// the loop can lag behind the wire, and a check made right after a request must count that
// request's frames (the kernel queued them before the request returned).
func (s *Sniffer) drain() {
	buf := make([]byte, 1<<16)
	for range 100_000 { // bounded: traffic goes on while it reads
		nr, from, err := unix.Recvfrom(s.fd, buf, unix.MSG_DONTWAIT)
		if err == unix.EINTR {
			continue
		}
		if err != nil { // EAGAIN: nothing queued any more
			return
		}
		s.received(buf[:nr], from)
	}
}

func (s *Sniffer) received(f []byte, from unix.Sockaddr) {
	if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Hatype == unix.ARPHRD_LOOPBACK {
		return
	}
	s.frame(f)
}

// frame parses Ethernet/IPv4/TCP; other frames are not what the mesh carries here.
func (s *Sniffer) frame(f []byte) {
	if len(f) < 14+20 || binary.BigEndian.Uint16(f[12:14]) != 0x0800 {
		return
	}
	ip := f[14:]
	ihl := int(ip[0]&0x0f) * 4
	total := int(binary.BigEndian.Uint16(ip[2:4]))
	if ip[9] != unix.IPPROTO_TCP || ihl < 20 || total > len(ip) || total < ihl+20 {
		return
	}
	tcp := ip[ihl:total]
	off := int(tcp[12]>>4) * 4
	if off < 20 || off > len(tcp) {
		return
	}
	payload := tcp[off:]
	if len(payload) == 0 {
		return
	}
	sport, dport := binary.BigEndian.Uint16(tcp[0:2]), binary.BigEndian.Uint16(tcp[2:4])
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byPort[min(sport, dport)]++
	src, dst := netip.AddrFrom4([4]byte(ip[12:16])), netip.AddrFrom4([4]byte(ip[16:20]))
	from, to := netip.AddrPortFrom(src, sport), netip.AddrPortFrom(dst, dport)
	s.byEndpoint[from]++
	s.byEndpoint[to]++
	s.byFlow[newFlow(from, to)]++
	if bytes.Contains(payload, s.marker) {
		s.markerHit++
	}
}

// Stop ends the capture, counting the frames already queued, and returns the frames that held
// the marker and the data frames by the lower port of their connection.
func (s *Sniffer) Stop() (markerHits int, byPort map[uint16]int) {
	close(s.stop)
	<-s.done
	s.drain()
	unix.Close(s.fd)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.markerHit, s.byPort
}

// Snapshot returns the counts so far, capture going on.
func (s *Sniffer) Snapshot() (markerHits int, byPort map[uint16]int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := make(map[uint16]int, len(s.byPort))
	for k, v := range s.byPort {
		m[k] = v
	}
	return s.markerHit, m
}

// Frames returns the TCP frames with a payload seen so far (or until Stop) that had addr:port
// as their source or destination; an unparsable addr counts none.
func (s *Sniffer) Frames(addr string, port uint16) int {
	a, err := netip.ParseAddr(addr)
	if err != nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byEndpoint[netip.AddrPortFrom(a, port)]
}

// FramesBetween returns the TCP frames with a payload seen so far (or until Stop) of the
// connections between addresses a and b with port on either side; an unparsable address
// counts none.
func (s *Sniffer) FramesBetween(a, b string, port uint16) int {
	x, errA := netip.ParseAddr(a)
	y, errB := netip.ParseAddr(b)
	if errA != nil || errB != nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for f, c := range s.byFlow {
		lo, hi := f[0], f[1]
		pair := (lo.Addr() == x && hi.Addr() == y) || (lo.Addr() == y && hi.Addr() == x)
		if pair && (lo.Port() == port || hi.Port() == port) {
			n += c
		}
	}
	return n
}

// FlowsOn describes the connections with port on either side and their frames, for a
// failure's report.
func (s *Sniffer) FlowsOn(port uint16) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var lines []string
	for f, c := range s.byFlow {
		if f[0].Port() == port || f[1].Port() == port {
			lines = append(lines, fmt.Sprintf("%s <-> %s: %d frames", f[0], f[1], c))
		}
	}
	slices.Sort(lines)
	if len(lines) == 0 {
		return "none"
	}
	return strings.Join(lines, "; ")
}
