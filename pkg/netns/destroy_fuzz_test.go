package netns

import (
	"bytes"
	"context"
	"encoding/binary"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fuzzKernel answers DestroyTCP's first dump with the fuzzer's bytes, cut
// into datagrams, and every SOCK_DESTROY with success.
type fuzzKernel struct {
	answer [][]byte
	queue  [][]byte
	idle   int
	dumps  int
	asked  [][]byte // the inet_diag_sockid of each SOCK_DESTROY
}

func (k *fuzzKernel) send(req []byte) error {
	switch binary.NativeEndian.Uint16(req[4:]) {
	case sockDiagByFamily:
		if k.dumps++; k.dumps == 1 {
			k.queue = append(k.queue, k.answer...)
		}
	case sockDestroy:
		k.asked = append(k.asked, bytes.Clone(req[nlmsgHdrLen+8:nlmsgHdrLen+56]))
		// Ahead of what is left of the fuzzer's answer, as the kernel
		// answers a request while it handles it.
		k.queue = append([][]byte{errMsg(binary.NativeEndian.Uint32(req[8:]), 0)}, k.queue...)
	}
	return nil
}

func (k *fuzzKernel) recv(buf []byte) (int, bool, error) {
	if len(k.queue) == 0 {
		if k.idle++; k.idle > 3 {
			return 0, false, errFakeDone
		}
		return 0, false, unix.EAGAIN
	}
	k.idle = 0
	b := k.queue[0]
	k.queue = k.queue[1:]
	return copy(buf, b), true, nil
}

// FuzzSockDiagDump gives DestroyTCP arbitrary bytes as the kernel's answer
// to its dump, in datagrams of chunk×4 bytes (0: one datagram): it must
// not panic or loop, every socket it asks the kernel to end must be one
// the answer named (its inet_diag_sockid, cookie included, is in the
// bytes), never one without a cookie, and none twice; its counts must add
// up to what it asked and what Max left. Seeds: well-formed dumps of
// IPv4, IPv6 and IPv4-mapped sockets with marks and socket storage, in one
// datagram or many, with an error inside or at the end.
func FuzzSockDiagDump(f *testing.F) {
	socks := []fakeSock{v4(1, fakeReinject, tcpEstablished), stored(v4(2, 0, tcpCloseWait), fakeMapID), v4(3, fakeTunnel, tcpEstablished),
		v6(1, fakeReinject, tcpCloseWait), mapped(2, 0, tcpFinWait1)}
	var dump []byte
	for _, s := range socks {
		dump = append(dump, diagMsg(1, s, true, []uint32{fakeMapID})...)
	}
	f.Add(append(bytes.Clone(dump), doneMsg(1, 0)...), uint8(0), uint8(0))
	f.Add(append(bytes.Clone(dump), doneMsg(1, 0)...), uint8(len(diagMsg(1, socks[0], true, nil))/4), uint8(2))
	f.Add(append(bytes.Clone(dump), doneMsg(1, unix.ENOBUFS)...), uint8(7), uint8(0))
	f.Add(append(append(bytes.Clone(dump[:len(dump)/2]), errMsg(1, unix.EPERM)...), doneMsg(1, 0)...), uint8(0), uint8(1))
	f.Add(append(diagMsg(2, socks[0], false, nil), doneMsg(1, 0)...), uint8(0), uint8(0))
	f.Fuzz(func(t *testing.T, answer []byte, chunk, maxSocks uint8) {
		k := &fuzzKernel{}
		if chunk == 0 {
			k.answer = [][]byte{answer}
		} else {
			for b := answer; len(b) > 0; {
				n := min(int(chunk)*4, len(b))
				k.answer, b = append(k.answer, b[:n]), b[n:]
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		res, _ := destroyTCP(ctx, newSockDiag(k), DestroyOptions{Storage: fakeStorage, Match: func(TCPSocket) bool { return true }, Max: int(maxSocks)})
		seen := map[string]bool{}
		for _, id := range k.asked {
			if !bytes.Contains(answer, id) {
				t.Fatalf("asked to end %x, which the answer does not name", id)
			}
			if binary.NativeEndian.Uint64(id[40:]) == noCookie {
				t.Fatalf("asked to end %x, without a cookie", id)
			}
			if seen[string(id)] {
				t.Fatalf("asked to end %x twice", id)
			}
			seen[string(id)] = true
		}
		if res.Destroyed != len(k.asked) || res.Gone != 0 || res.Failed != 0 || res.Left < 0 {
			t.Fatalf("%+v after %d asked", res, len(k.asked))
		}
		if maxSocks > 0 && res.Destroyed > int(maxSocks) {
			t.Fatalf("%d ended, past Max %d", res.Destroyed, maxSocks)
		}
	})
}
