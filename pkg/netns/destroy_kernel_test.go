package netns

import (
	"context"
	"encoding/binary"
	"errors"
	"net/netip"
	"slices"
	"sync"

	"golang.org/x/sys/unix"
)

// fakeSock is one socket of fakeKernel's namespace.
type fakeSock struct {
	local, remote netip.AddrPort
	v6            bool // an AF_INET6 socket (local and remote may be IPv4-mapped)
	state         uint8
	cookie        uint64
	mark          uint32
	hasMark       bool
	storedIn      []uint32 // socket-storage map ids with an entry for it
}

func (s fakeSock) family() uint8 {
	if s.v6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

// fakeKernel stands in for a namespace's sock_diag, so the parts of
// DestroyTCP that read the kernel's answers can be tried on answers a
// kernel seldom gives: dumps cut across reads, errors in and at the end of
// a dump, refusals, lost answers, datagrams another socket sent.
type fakeKernel struct {
	mu    sync.Mutex
	socks []fakeSock
	// perRead is how many socket messages one datagram of a dump holds
	// (0: all); the end of the dump always comes in a read of its own.
	perRead int
	// dumpErrAfter, when dumpErr is set, ends a dump with an NLMSG_ERROR
	// after that many socket messages; doneErr puts an error in the
	// NLMSG_DONE.
	dumpErr      unix.Errno
	dumpErrAfter int
	doneErr      unix.Errno
	// storageErr refuses dumps that ask for socket storage.
	storageErr unix.Errno
	// destroyErr answers SOCK_DESTROY; nil ends the socket. lost: no answer.
	destroyErr func(s fakeSock) (err unix.Errno, lost bool)
	// onDestroy runs at each SOCK_DESTROY the kernel answers.
	onDestroy func(n int)
	// before is queued ahead of every dump's answer: stale answers, or
	// datagrams of another sender (foreign).
	before  [][]byte
	foreign map[int]bool // indexes of before sent by another socket

	queue     []fakeDatagram
	idle      int      // reads in a row that found nothing
	destroyed []uint64 // cookies SOCK_DESTROY ended, in order
	asked     []uint64 // cookies SOCK_DESTROY was asked for
	dumps     int
}

type fakeDatagram struct {
	b      []byte
	kernel bool
}

func (k *fakeKernel) send(req []byte) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(req) < nlmsgHdrLen+inetDiagReqLen {
		return unix.EINVAL
	}
	typ := binary.NativeEndian.Uint16(req[4:])
	seq := binary.NativeEndian.Uint32(req[8:])
	r := req[nlmsgHdrLen:]
	switch typ {
	case sockDiagByFamily:
		k.dumps++
		for i, b := range k.before {
			k.queue = append(k.queue, fakeDatagram{b, !k.foreign[i]})
		}
		if k.storageErr != 0 && len(req) > nlmsgHdrLen+inetDiagReqLen {
			k.queue = append(k.queue, fakeDatagram{errMsg(seq, k.storageErr), true})
			return nil
		}
		k.dump(r[0], seq, binary.NativeEndian.Uint32(r[4:]), req[nlmsgHdrLen+inetDiagReqLen:])
	case sockDestroy:
		cookie := uint64(binary.NativeEndian.Uint32(r[48:])) | uint64(binary.NativeEndian.Uint32(r[52:]))<<32
		k.asked = append(k.asked, cookie)
		// By tuple, then the cookie, as the kernel looks a socket up.
		i := slices.IndexFunc(k.socks, func(s fakeSock) bool {
			id := sockID(s)
			return s.family() == r[0] && slices.Equal(id[:40], r[8:48])
		})
		var code unix.Errno
		lost := false
		switch {
		case i < 0:
			code = unix.ENOENT
		case cookie != noCookie && k.socks[i].cookie != cookie:
			code = unix.ESTALE
		case k.destroyErr != nil:
			code, lost = k.destroyErr(k.socks[i])
		}
		if lost {
			return nil
		}
		if code == 0 {
			k.destroyed = append(k.destroyed, cookie)
			k.socks = slices.Delete(k.socks, i, i+1)
		}
		k.queue = append(k.queue, fakeDatagram{errMsg(seq, code), true})
		if k.onDestroy != nil {
			k.onDestroy(len(k.asked))
		}
	default:
		k.queue = append(k.queue, fakeDatagram{errMsg(seq, unix.EINVAL), true})
	}
	return nil
}

// dump queues the answer to a dump of family in the states mask.
func (k *fakeKernel) dump(family uint8, seq, states uint32, attrs []byte) {
	var storage bool
	var mapIDs []uint32
	if len(attrs) >= 12 {
		storage = true
		mapIDs = []uint32{binary.NativeEndian.Uint32(attrs[8:])} // the test's map fds are its ids
	}
	var part []byte
	n := 0
	flush := func() {
		if len(part) > 0 {
			k.queue = append(k.queue, fakeDatagram{part, true})
			part = nil
		}
	}
	for _, s := range k.socks {
		if s.family() != family || states&(1<<s.state) == 0 {
			continue
		}
		if k.dumpErr != 0 && n == k.dumpErrAfter {
			part = append(part, errMsg(seq, k.dumpErr)...)
			flush()
			return
		}
		part = append(part, diagMsg(seq, s, storage, mapIDs)...)
		n++
		if k.perRead > 0 && n%k.perRead == 0 {
			flush()
		}
	}
	if k.dumpErr != 0 && n == k.dumpErrAfter {
		part = append(part, errMsg(seq, k.dumpErr)...)
		flush()
		return
	}
	flush()
	k.queue = append(k.queue, fakeDatagram{doneMsg(seq, k.doneErr), true})
}

func (k *fakeKernel) recv(buf []byte) (int, bool, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.queue) == 0 {
		// A real socket waits sockDiagRecvTimeout each time; this one
		// gives up soon, so that a reader that would wait for ever fails.
		if k.idle++; k.idle > 100 {
			return 0, false, errFakeDone
		}
		return 0, false, unix.EAGAIN
	}
	k.idle = 0
	d := k.queue[0]
	k.queue = k.queue[1:]
	return copy(buf, d.b), d.kernel, nil
}

// destroyWith runs destroyTCP against k.
func (k *fakeKernel) destroyWith(ctx context.Context, o DestroyOptions) (DestroyResult, error) {
	return destroyTCP(ctx, newSockDiag(k), o)
}

func nlmsg(typ, flags uint16, seq uint32, payload []byte) []byte {
	m := make([]byte, nlmsgHdrLen, nlmsgHdrLen+len(payload)+3)
	m = append(m, payload...)
	putNlmsghdr(m, typ, flags, seq)
	for len(m)%4 != 0 {
		m = append(m, 0)
	}
	return m
}

func errMsg(seq uint32, code unix.Errno) []byte {
	p := binary.NativeEndian.AppendUint32(nil, uint32(-int32(code)))
	p = append(p, make([]byte, nlmsgHdrLen)...) // the request's header, as the kernel echoes it
	return nlmsg(unix.NLMSG_ERROR, 0, seq, p)
}

func doneMsg(seq uint32, code unix.Errno) []byte {
	return nlmsg(unix.NLMSG_DONE, unix.NLM_F_MULTI, seq, binary.NativeEndian.AppendUint32(nil, uint32(-int32(code))))
}

func nla(typ uint16, val []byte) []byte {
	a := binary.NativeEndian.AppendUint16(nil, uint16(4+len(val)))
	a = binary.NativeEndian.AppendUint16(a, typ)
	a = append(a, val...)
	for len(a)%4 != 0 {
		a = append(a, 0)
	}
	return a
}

// sockID is s's struct inet_diag_sockid.
func sockID(s fakeSock) [48]byte {
	var id [48]byte
	binary.BigEndian.PutUint16(id[0:], s.local.Port())
	binary.BigEndian.PutUint16(id[2:], s.remote.Port())
	if s.v6 {
		l, r := s.local.Addr().As16(), s.remote.Addr().As16()
		copy(id[4:], l[:])
		copy(id[20:], r[:])
	} else {
		l, r := s.local.Addr().As4(), s.remote.Addr().As4()
		copy(id[4:], l[:])
		copy(id[20:], r[:])
	}
	binary.NativeEndian.PutUint32(id[40:], uint32(s.cookie))
	binary.NativeEndian.PutUint32(id[44:], uint32(s.cookie>>32))
	return id
}

// diagMsg is s as the kernel reports it in a dump: struct inet_diag_msg,
// then its mark and, when asked for, its socket-storage entries.
func diagMsg(seq uint32, s fakeSock, storage bool, mapIDs []uint32) []byte {
	p := make([]byte, inetDiagMsgLen)
	p[0], p[1] = s.family(), s.state
	id := sockID(s)
	copy(p[4:], id[:])
	if s.hasMark {
		p = append(p, nla(inetDiagMark, binary.NativeEndian.AppendUint32(nil, s.mark))...)
	}
	if storage {
		var stgs []byte
		for _, m := range s.storedIn {
			if !slices.Contains(mapIDs, m) {
				continue
			}
			one := nla(skDiagStorageMapID, binary.NativeEndian.AppendUint32(nil, m))
			one = append(one, nla(3, []byte{1})...) // SK_DIAG_BPF_STORAGE_MAP_VALUE
			stgs = append(stgs, nla(skDiagStorage|nlaFNested, one)...)
		}
		if len(stgs) > 0 {
			p = append(p, nla(inetDiagSkStorages|nlaFNested, stgs)...)
		}
	}
	return nlmsg(sockDiagByFamily, unix.NLM_F_MULTI, seq, p)
}

var errFakeDone = errors.New("fake kernel: no more answers")
