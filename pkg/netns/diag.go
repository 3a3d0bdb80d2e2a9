package netns

import (
	"encoding/binary"
	"net/netip"

	"golang.org/x/sys/unix"
)

// tupleProbe asks the namespace it was made in whether a TCP socket holds a
// 4-tuple, with one exact sock_diag lookup (no dump) per question.
type tupleProbe struct {
	fd  int
	buf []byte
}

// newTupleProbe opens the sock_diag socket; it must run on a thread in the
// namespace to be asked about. nil when the kernel offers none: every
// tuple is then taken to be free, as before the probe.
func newTupleProbe() *tupleProbe {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return nil
	}
	return &tupleProbe{fd: fd, buf: make([]byte, 4096)}
}

func (p *tupleProbe) close() {
	if p != nil {
		unix.Close(p.fd)
	}
}

// Sizes of struct nlmsghdr and struct inet_diag_req_v2.
const (
	nlmsgHdrLen    = 16
	inetDiagReqLen = 56
)

// taken reports whether a TCP socket other than a listener (connected,
// closing, TIME_WAIT or a request) has local as its own end and remote as
// its peer. The kernel's exact lookup falls back to a listener of local's
// port, which takes nothing. A failed question answers false.
func (p *tupleProbe) taken(local, remote netip.AddrPort) bool {
	if p == nil || local.Addr().Is4() != remote.Addr().Is4() {
		return false
	}
	msg := make([]byte, nlmsgHdrLen+inetDiagReqLen)
	binary.NativeEndian.PutUint32(msg[0:], uint32(len(msg)))
	binary.NativeEndian.PutUint16(msg[4:], 20) // SOCK_DIAG_BY_FAMILY
	binary.NativeEndian.PutUint16(msg[6:], unix.NLM_F_REQUEST)
	req := msg[nlmsgHdrLen:]
	req[0] = unix.AF_INET6
	if local.Addr().Is4() {
		req[0] = unix.AF_INET
	}
	req[1] = unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(req[4:], ^uint32(0)) // every state
	id := req[8:]
	binary.BigEndian.PutUint16(id[0:], local.Port())
	binary.BigEndian.PutUint16(id[2:], remote.Port())
	la, ra := local.Addr().AsSlice(), remote.Addr().AsSlice()
	copy(id[4:20], la)
	copy(id[20:36], ra)
	binary.NativeEndian.PutUint32(id[40:], ^uint32(0)) // INET_DIAG_NOCOOKIE
	binary.NativeEndian.PutUint32(id[44:], ^uint32(0))
	if err := unix.Sendto(p.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return false
	}
	// The kernel answers an exact lookup while it handles the send.
	n, _, err := unix.Recvfrom(p.fd, p.buf, unix.MSG_DONTWAIT)
	if err != nil || n < nlmsgHdrLen+2 {
		return false
	}
	if binary.NativeEndian.Uint16(p.buf[4:]) != 20 {
		return false // NLMSG_ERROR: ENOENT when no socket, not even a listener
	}
	const tcpListen = 10
	return p.buf[nlmsgHdrLen+1] != tcpListen // struct inet_diag_msg's idiag_state
}
