package netns

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"
)

// TCPSocket is one TCP socket of a namespace as sock_diag reports it, for
// the caller of DestroyTCP to judge.
type TCPSocket struct {
	Local, Remote netip.AddrPort
	State         uint8  // the kernel's TCP state number (TCP_ESTABLISHED is 1)
	Mark          uint32 // SO_MARK
	// Stored says the socket has an entry in the socket-storage map named in
	// DestroyOptions.
	Stored bool
}

// StorageMap names a BPF socket-storage map (BPF_MAP_TYPE_SK_STORAGE) whose
// entries sock_diag reports with each socket: FD is this process's
// descriptor of it, ID its kernel id (what the report names).
type StorageMap struct {
	FD int
	ID uint32
}

// DestroyOptions say which TCP sockets DestroyTCP ends.
type DestroyOptions struct {
	// Storage, when set, has each socket's entry in that map reported
	// (TCPSocket.Stored). Reading socket storage through sock_diag takes
	// CAP_BPF or CAP_SYS_ADMIN; refused, sockets are matched without it
	// (DestroyResult.StorageErr).
	Storage *StorageMap
	// Match picks the sockets to end; nil matches none.
	Match func(TCPSocket) bool
	// Max bounds the sockets ended in one call (0: no bound); matched
	// sockets past it are counted in DestroyResult.Left.
	Max int
}

// DestroyResult says what DestroyTCP did.
type DestroyResult struct {
	Destroyed int // ended: the owner's next call on each fails with ECONNABORTED
	Gone      int // matched, but closed before their turn
	Failed    int // matched, and the kernel refused to end them
	Left      int // matched, not tried: past Max, or the deadline came first
	// StorageErr is why the storage map could not be read: sockets were
	// matched on the rest (Stored false for all).
	StorageErr error
}

// connectedStates are the TCP states DestroyTCP looks at: a socket that
// has had a peer and may still send to it, from ESTABLISHED to LAST_ACK
// (SYN_RECV is a fast-open child). Left out: a connect not answered yet
// (SYN_SENT), listeners, TIME_WAIT and request sockets, and closed ones.
const connectedStates = 1<<1 | 1<<3 | 1<<4 | 1<<5 | 1<<8 | 1<<9 | 1<<11

// sock_diag message types and attributes (linux/sock_diag.h, inet_diag.h,
// bpf.h), as the kernel numbers them.
const (
	sockDiagByFamily     = 20
	sockDestroy          = 21
	inetDiagMsgLen       = 72 // struct inet_diag_msg
	inetDiagMark         = 15 // INET_DIAG_MARK, given to a CAP_NET_ADMIN asker
	inetDiagSkStorages   = 20 // INET_DIAG_SK_BPF_STORAGES
	inetDiagReqStorages  = 2  // INET_DIAG_REQ_SK_BPF_STORAGES
	skDiagStorageReqFD   = 1  // SK_DIAG_BPF_STORAGE_REQ_MAP_FD
	skDiagStorage        = 1  // SK_DIAG_BPF_STORAGE
	skDiagStorageMapID   = 2  // SK_DIAG_BPF_STORAGE_MAP_ID
	nlaTypeMask          = 0x3fff
	nlaFNested           = 0x8000
	destroyPasses        = 3 // dumps of one family when the kernel says one was interrupted
	sockDiagRecvTimeout  = 100 * time.Millisecond
	sockDiagRecvBufBytes = 64 << 10
)

// DestroyTCP ends, with sock_diag's SOCK_DESTROY, the TCP sockets of h's
// namespace (IPv4 and IPv6, IPv4-mapped ones included) in a connected
// state that o.Match picks: each is aborted as if reset (its owner's next
// call fails with ECONNABORTED, then EPIPE), and what it still had to send
// is dropped. The kernel sends the peer a reset from it, routed as the
// socket's packets are. It needs CAP_NET_ADMIN and a kernel built with
// CONFIG_INET_DIAG_DESTROY.
//
// Sockets are listed first and ended after, by exact tuple and cookie, so
// a socket closed meanwhile is never confused with a new one of its tuple.
// Only the kernel's answers are read: a process of the namespace with
// CAP_NET_ADMIN there can send the netlink socket datagrams of its own. A
// listing the kernel cut short still has what it listed ended, and its
// failure returned. ctx bounds the whole call: when it ends first, what it
// cut off is counted in Left as far as it was listed, and its error is
// returned. A kernel that refuses every socket (no
// CONFIG_INET_DIAG_DESTROY, EPERM) is asked once: the matched sockets of
// both families are counted in Failed, and its refusal returned.
func (h *Handle) DestroyTCP(ctx context.Context, o DestroyOptions) (DestroyResult, error) {
	var fd int
	err := h.Do(func() error {
		var err error
		// The socket asks about the namespace it is made in, whichever
		// thread uses it after.
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
		return err
	})
	if err != nil {
		return DestroyResult{}, fmt.Errorf("sock_diag socket in %s: %w", h.path, err)
	}
	defer unix.Close(fd)
	tv := unix.NsecToTimeval(sockDiagRecvTimeout.Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return DestroyResult{}, fmt.Errorf("sock_diag socket in %s: %w", h.path, err)
	}
	res, err := destroyTCP(ctx, newSockDiag(netlinkConn(fd)), o)
	if err != nil {
		err = fmt.Errorf("end TCP sockets in %s: %w", h.path, err)
	}
	return res, err
}

// destroyTCP is DestroyTCP over d.
func destroyTCP(ctx context.Context, d *sockDiag, o DestroyOptions) (DestroyResult, error) {
	var res DestroyResult
	storage := o.Storage
	done := map[uint64]bool{} // cookies already dealt with
	var errs []error
	var refused error // the kernel ends no socket: the rest are only counted
	// cut ends the call when ctx did, n listed sockets not tried.
	cut := func(n int) (DestroyResult, error) {
		res.Left += n
		if err := errors.Join(errs...); !errors.Is(err, ctx.Err()) {
			errs = append(errs, ctx.Err())
		}
		return res, errors.Join(errs...)
	}
	for _, family := range []uint8{unix.AF_INET, unix.AF_INET6} {
		for pass := 0; pass < destroyPasses; pass++ {
			socks, left, intr, err := d.list(ctx, family, storage, o, done, &res)
			if err != nil && len(socks) == 0 && storage != nil && res.StorageErr == nil && isStorageRefusal(err) {
				res.StorageErr, storage = err, nil
				socks, left, intr, err = d.list(ctx, family, nil, o, done, &res)
			}
			res.Left += left
			if err != nil {
				// What was listed before the failure is still ended.
				errs = append(errs, fmt.Errorf("list %s TCP sockets: %w", familyName(family), err))
			}
			if ctx.Err() != nil {
				return cut(len(socks))
			}
			if refused != nil {
				res.Failed += len(socks)
				break
			}
			for i, s := range socks {
				if ctx.Err() != nil {
					return cut(len(socks) - i)
				}
				done[s.cookie] = true
				err := d.destroy(ctx, s)
				switch {
				case err == nil:
					res.Destroyed++
				case errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ESTALE):
					res.Gone++
				case errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES):
					// No socket will fare better: the others are
					// counted, not tried.
					refused = fmt.Errorf("end TCP socket %s -> %s: %w", s.local, s.remote, err)
					errs = append(errs, refused)
					res.Failed += len(socks) - i
				case ctx.Err() != nil:
					return cut(len(socks) - i)
				default:
					res.Failed++
				}
				if refused != nil {
					break
				}
			}
			if err != nil || refused != nil || !intr || left > 0 {
				break
			}
		}
	}
	return res, errors.Join(errs...)
}

func familyName(family uint8) string {
	if family == unix.AF_INET {
		return "IPv4"
	}
	return "IPv6"
}

// isStorageRefusal tells a refused storage request (no CAP_BPF, a kernel
// without socket storage in sock_diag, a map that is not socket storage)
// from other failures of a listing.
func isStorageRefusal(err error) bool {
	return errors.Is(err, unix.EPERM) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EBADF)
}

// diagConn carries sock_diag requests to a namespace's kernel and its
// answers back: a netlink socket (netlinkConn), or a test's stand-in.
type diagConn interface {
	send(req []byte) error
	// recv reads one datagram into buf. fromKernel is false for one
	// another socket sent (a process of the pod with CAP_NET_ADMIN
	// there may). unix.EAGAIN: none came within sockDiagRecvTimeout.
	recv(buf []byte) (n int, fromKernel bool, err error)
}

// netlinkConn is a NETLINK_SOCK_DIAG socket.
type netlinkConn int

func (c netlinkConn) send(req []byte) error {
	return unix.Sendto(int(c), req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
}

func (c netlinkConn) recv(buf []byte) (int, bool, error) {
	n, from, err := unix.Recvfrom(int(c), buf, 0)
	if err != nil {
		return 0, false, err
	}
	nl, ok := from.(*unix.SockaddrNetlink)
	return n, ok && nl.Pid == 0, nil
}

// sockDiag speaks sock_diag over one conn: one request at a time.
type sockDiag struct {
	conn diagConn
	seq  uint32
	buf  []byte
}

func newSockDiag(c diagConn) *sockDiag {
	return &sockDiag{conn: c, buf: make([]byte, sockDiagRecvBufBytes)}
}

// listedSocket is a socket to end: its identity as the kernel gave it.
type listedSocket struct {
	family        uint8
	id            [48]byte // struct inet_diag_sockid, cookie included
	cookie        uint64
	local, remote netip.AddrPort
}

// noCookie is INET_DIAG_NOCOOKIE: a destroy naming it would end whichever
// socket holds the tuple, so a socket listed with it (never by the kernel,
// which gives every socket a cookie) is not asked for.
const noCookie = ^uint64(0)

// list dumps family's TCP sockets in connected states and returns those
// o.Match picks and done does not hold, at most o.Max less what res holds
// already; left counts the matched ones past that bound, and intr says the
// kernel reported the dump inconsistent (sockets came and went during it).
// With an error, what was listed before it is returned too.
func (d *sockDiag) list(ctx context.Context, family uint8, storage *StorageMap, o DestroyOptions, done map[uint64]bool, res *DestroyResult) (socks []listedSocket, left int, intr bool, err error) {
	if err := ctx.Err(); err != nil {
		return nil, 0, false, err
	}
	d.seq++
	seq := d.seq
	msg := make([]byte, nlmsgHdrLen+inetDiagReqLen, nlmsgHdrLen+inetDiagReqLen+12)
	req := msg[nlmsgHdrLen:]
	req[0] = family
	req[1] = unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(req[4:], connectedStates)
	if storage != nil {
		// INET_DIAG_REQ_SK_BPF_STORAGES { SK_DIAG_BPF_STORAGE_REQ_MAP_FD fd }
		msg = binary.NativeEndian.AppendUint16(msg, 12)
		msg = binary.NativeEndian.AppendUint16(msg, inetDiagReqStorages|nlaFNested)
		msg = binary.NativeEndian.AppendUint16(msg, 8)
		msg = binary.NativeEndian.AppendUint16(msg, skDiagStorageReqFD)
		msg = binary.NativeEndian.AppendUint32(msg, uint32(storage.FD))
	}
	putNlmsghdr(msg, sockDiagByFamily, unix.NLM_F_REQUEST|unix.NLM_F_DUMP, seq)
	if err := d.conn.send(msg); err != nil {
		return nil, 0, false, err
	}
	room := -1
	if o.Max > 0 {
		room = max(0, o.Max-res.Destroyed-res.Gone-res.Failed-res.Left)
	}
	var storageID uint32
	if storage != nil {
		storageID = storage.ID
	}
	for {
		if err := ctx.Err(); err != nil {
			return socks, left, intr, err // a dump keeps coming while it is read
		}
		b, err := d.recv(ctx, 0)
		if err != nil {
			return socks, left, intr, err
		}
		finished, dumpIntr, err := parseDump(b, seq, func(m []byte) {
			s, ok := parseDiagMsg(m, family, storage != nil, storageID)
			if !ok || done[s.cookie] || o.Match == nil || !o.Match(s.TCPSocket) {
				return
			}
			if room == 0 {
				left++
				return
			}
			if room > 0 {
				room--
			}
			socks = append(socks, s.listedSocket)
		})
		intr = intr || dumpIntr
		if err != nil {
			return socks, left, intr, err
		}
		if finished {
			return socks, left, intr, nil
		}
	}
}

// parseDump reads one datagram of the answer to dump request seq, calling
// each with the payload of every socket message of it (struct
// inet_diag_msg and its attributes). finished says it held the end of the
// dump (NLMSG_DONE), intr that the kernel marked a part inconsistent.
// Messages of other requests are skipped; a message that does not fit,
// an error, or an end that carries one, is an error.
func parseDump(b []byte, seq uint32, each func(payload []byte)) (finished, intr bool, err error) {
	for len(b) >= nlmsgHdrLen {
		l := int(binary.NativeEndian.Uint32(b[0:]))
		if l < nlmsgHdrLen || l > len(b) {
			return false, intr, fmt.Errorf("sock_diag: message of %d bytes in %d", l, len(b))
		}
		m := b[:l]
		b = b[min(nlmsgAlign(l), len(b)):]
		if binary.NativeEndian.Uint32(m[8:]) != seq {
			continue // an answer to an earlier request
		}
		if binary.NativeEndian.Uint16(m[6:])&unix.NLM_F_DUMP_INTR != 0 {
			intr = true
		}
		switch binary.NativeEndian.Uint16(m[4:]) {
		case unix.NLMSG_DONE:
			// Its payload is the dump's own end: an error there cut it short.
			if len(m) >= nlmsgHdrLen+4 {
				if code := int32(binary.NativeEndian.Uint32(m[nlmsgHdrLen:])); code < 0 {
					return true, intr, fmt.Errorf("sock_diag: dump ended early: %w", unix.Errno(-code))
				}
			}
			return true, intr, nil
		case unix.NLMSG_ERROR:
			if err := nlError(m); err != nil {
				return false, intr, err
			}
		case sockDiagByFamily:
			each(m[nlmsgHdrLen:])
		}
	}
	return false, intr, nil
}

// recv reads one datagram of answers from the kernel. While none comes it
// waits as long as ctx lasts and, with tries > 0, at most that many read
// timeouts. Datagrams another socket sent are dropped.
func (d *sockDiag) recv(ctx context.Context, tries int) ([]byte, error) {
	for {
		n, kernel, err := d.conn.recv(d.buf)
		switch {
		case errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR):
			// SO_RCVTIMEO: look at ctx again.
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			if tries > 0 {
				if tries--; tries == 0 {
					return nil, errNoAnswer
				}
			}
			continue
		case err != nil:
			return nil, err
		case !kernel:
			continue
		case n < nlmsgHdrLen:
			return nil, fmt.Errorf("sock_diag: short answer of %d bytes", n)
		}
		return d.buf[:n], nil
	}
}

// errNoAnswer is a request the kernel did not answer: the answer was lost
// (the socket's buffer full), since the kernel answers while it handles
// the send.
var errNoAnswer = errors.New("sock_diag: no answer")

// destroy asks the kernel to end s, and reads its answer.
func (d *sockDiag) destroy(ctx context.Context, s listedSocket) error {
	d.seq++
	seq := d.seq
	msg := make([]byte, nlmsgHdrLen+inetDiagReqLen)
	req := msg[nlmsgHdrLen:]
	req[0] = s.family
	req[1] = unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(req[4:], ^uint32(0))
	copy(req[8:], s.id[:])
	putNlmsghdr(msg, sockDestroy, unix.NLM_F_REQUEST|unix.NLM_F_ACK, seq)
	if err := d.conn.send(msg); err != nil {
		return err
	}
	for {
		b, err := d.recv(ctx, 2)
		if err != nil {
			return err
		}
		for len(b) >= nlmsgHdrLen {
			l := int(binary.NativeEndian.Uint32(b[0:]))
			if l < nlmsgHdrLen || l > len(b) {
				return fmt.Errorf("sock_diag: message of %d bytes in %d", l, len(b))
			}
			m := b[:l]
			b = b[min(nlmsgAlign(l), len(b)):]
			if binary.NativeEndian.Uint32(m[8:]) == seq && binary.NativeEndian.Uint16(m[4:]) == unix.NLMSG_ERROR {
				return nlError(m)
			}
		}
	}
}

type diagSocket struct {
	TCPSocket
	listedSocket
}

// parseDiagMsg reads a struct inet_diag_msg and its attributes, from a dump
// of family; with storage, whether the socket has an entry in the
// socket-storage map of id storageID.
func parseDiagMsg(b []byte, family uint8, storage bool, storageID uint32) (diagSocket, bool) {
	var s diagSocket
	if len(b) < inetDiagMsgLen || b[0] != family {
		return s, false
	}
	s.family, s.State = b[0], b[1]
	copy(s.id[:], b[4:52])
	id := b[4:52]
	s.cookie = uint64(binary.NativeEndian.Uint32(id[40:])) | uint64(binary.NativeEndian.Uint32(id[44:]))<<32
	if s.cookie == noCookie {
		return s, false
	}
	var local, remote netip.Addr
	switch s.family {
	case unix.AF_INET:
		local, remote = netip.AddrFrom4([4]byte(id[4:8])), netip.AddrFrom4([4]byte(id[20:24]))
	case unix.AF_INET6:
		local, remote = netip.AddrFrom16([16]byte(id[4:20])), netip.AddrFrom16([16]byte(id[20:36]))
	default:
		return s, false
	}
	s.Local = netip.AddrPortFrom(local, binary.BigEndian.Uint16(id[0:]))
	s.Remote = netip.AddrPortFrom(remote, binary.BigEndian.Uint16(id[2:]))
	s.local, s.remote = s.Local, s.Remote
	for a := b[inetDiagMsgLen:]; len(a) >= 4; {
		l := int(binary.NativeEndian.Uint16(a[0:]))
		if l < 4 || l > len(a) {
			break
		}
		typ, val := binary.NativeEndian.Uint16(a[2:])&nlaTypeMask, a[4:l]
		a = a[min(nlaAlign(l), len(a)):]
		switch {
		case typ == inetDiagMark && len(val) >= 4:
			s.Mark = binary.NativeEndian.Uint32(val)
		case typ == inetDiagSkStorages && storage:
			s.Stored = s.Stored || hasStorage(val, storageID)
		}
	}
	return s, true
}

// hasStorage reports whether an INET_DIAG_SK_BPF_STORAGES attribute holds
// an entry of the map id.
func hasStorage(b []byte, id uint32) bool {
	for len(b) >= 4 {
		l := int(binary.NativeEndian.Uint16(b[0:]))
		if l < 4 || l > len(b) {
			return false
		}
		typ, val := binary.NativeEndian.Uint16(b[2:])&nlaTypeMask, b[4:l]
		b = b[min(nlaAlign(l), len(b)):]
		if typ != skDiagStorage {
			continue
		}
		for len(val) >= 4 {
			vl := int(binary.NativeEndian.Uint16(val[0:]))
			if vl < 4 || vl > len(val) {
				break
			}
			vt := binary.NativeEndian.Uint16(val[2:]) & nlaTypeMask
			if vt == skDiagStorageMapID && vl >= 8 && binary.NativeEndian.Uint32(val[4:]) == id {
				return true
			}
			val = val[min(nlaAlign(vl), len(val)):]
		}
	}
	return false
}

func putNlmsghdr(msg []byte, typ, flags uint16, seq uint32) {
	binary.NativeEndian.PutUint32(msg[0:], uint32(len(msg)))
	binary.NativeEndian.PutUint16(msg[4:], typ)
	binary.NativeEndian.PutUint16(msg[6:], flags)
	binary.NativeEndian.PutUint32(msg[8:], seq)
}

// nlError is the error an NLMSG_ERROR message carries, nil for an ack.
func nlError(m []byte) error {
	if len(m) < nlmsgHdrLen+4 {
		return fmt.Errorf("sock_diag: short error message")
	}
	if code := int32(binary.NativeEndian.Uint32(m[nlmsgHdrLen:])); code != 0 {
		return unix.Errno(-code)
	}
	return nil
}

func nlmsgAlign(n int) int { return (n + 3) &^ 3 }
func nlaAlign(n int) int   { return (n + 3) &^ 3 }
