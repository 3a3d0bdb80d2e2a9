package hbone

import (
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// TCP-to-TCP relays (plain TCP upstreams, plaintext inbound) move their bytes
// with splice(2) through a pipe, as io.Copy between two *net.TCPConn does,
// but in a loop of their own: Go's reports its count only when it returns,
// at the end of the connection, and a relay's counts must move while it
// lasts (Counts). It is the same system calls as Go's (internal/poll's
// Splice): drain what the source has into the pipe, pump it all into the
// destination, again, waiting in the network poller on EAGAIN.

// maxSplice is the most one splice moves from the source, and the size of
// the pipes (Go's maxSpliceSize).
const maxSplice = 1 << 20

// splicePipe is a non-blocking pipe and the bytes it holds.
type splicePipe struct {
	r, w int
	data int
}

// pipePool keeps emptied pipes for the next relay, as Go's splice does: a
// relay of a short connection would otherwise make and close a pipe per
// direction. A pipe the pool drops is closed by its finalizer.
var pipePool = sync.Pool{New: func() any {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return (*splicePipe)(nil)
	}
	// A smaller pipe (the call may fail) only takes more calls.
	_, _ = unix.FcntlInt(uintptr(fds[0]), unix.F_SETPIPE_SZ, maxSplice)
	p := &splicePipe{r: fds[0], w: fds[1]}
	runtime.SetFinalizer(p, (*splicePipe).close)
	return p
}}

func (p *splicePipe) close() {
	_ = unix.Close(p.r)
	_ = unix.Close(p.w)
}

// putPipe gives p back to the pool if it is empty, and closes it otherwise
// (bytes a failed relay left in it).
func putPipe(p *splicePipe) {
	if p.data != 0 {
		runtime.SetFinalizer(p, nil)
		p.close()
		return
	}
	pipePool.Put(p)
}

// spliceCopy copies src to dst until EOF with splice(2), adding what each
// splice into dst moved to moved. handled is false, with nothing copied,
// when the sockets cannot be spliced (no pipe, or EINVAL at the first
// splice): the caller copies through a buffer instead.
func spliceCopy(dst, src *net.TCPConn, moved *atomic.Int64) (total int64, handled bool, err error) {
	rc, err := src.SyscallConn()
	if err != nil {
		return 0, false, nil
	}
	wc, err := dst.SyscallConn()
	if err != nil {
		return 0, false, nil
	}
	p := pipePool.Get().(*splicePipe)
	if p == nil {
		return 0, false, nil
	}
	defer putPipe(p)
	for {
		var (
			n    int
			serr error
		)
		if err := rc.Read(func(fd uintptr) bool {
			n, serr = splice(p.w, int(fd), maxSplice)
			return serr != unix.EAGAIN
		}); err != nil {
			return total, true, err
		}
		switch {
		case serr == unix.EINVAL && total == 0:
			return 0, false, nil
		case serr != nil:
			return total, true, os.NewSyscallError("splice", serr)
		case n == 0:
			return total, true, nil // EOF
		}
		p.data += n
		var werr error
		if err := wc.Write(func(fd uintptr) bool {
			for p.data > 0 {
				m, e := splice(int(fd), p.r, p.data)
				switch {
				case m > 0:
					p.data -= m
					total += int64(m)
					moved.Add(int64(m))
					continue
				case e == unix.EAGAIN:
					return false
				case e == nil:
					werr = io.ErrShortWrite
				default:
					werr = os.NewSyscallError("splice", e)
				}
				return true
			}
			return true
		}); err != nil {
			return total, true, err
		}
		if werr != nil {
			return total, true, werr
		}
	}
}

// splice moves up to max bytes from in to out, without blocking on either.
func splice(out, in, max int) (int, error) {
	for {
		n, err := unix.Splice(in, nil, out, nil, max, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
		if err != syscall.EINTR {
			return int(n), err
		}
	}
}
