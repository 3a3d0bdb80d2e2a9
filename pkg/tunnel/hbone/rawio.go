package hbone

import (
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Socket reads and writes without the runtime's system-call bookkeeping.
//
// Every socket this package reads or writes is non-blocking: a read or a
// write returns at once, with EAGAIN when it would wait, and the goroutine
// then parks in the network poller. The runtime still treats each one as a
// call that may block (entersyscall, exitsyscall), and when every P was
// idle, entering one wakes the runtime's monitor thread (sysmon), which then
// polls every 20 µs until the process is idle again. At one request at a
// time (fortio, 1000 qps, one connection) that was a quarter of the server
// agent's CPU samples (perf, 2 December): a wake-up of sysmon and a run of
// short sleeps per request, in each agent. sockRead and sockWrite make the
// call with syscall.RawSyscall instead, which the runtime does not see.
//
// sysmon is also what preempts a goroutine that runs for more than 10 ms and
// polls the network when every P has been busy that long, so it must not
// sleep through a long busy stretch: once the data path has made calls for
// ordinaryEvery without a pause of idleGap, one call in ordinaryEvery is made
// the ordinary way, which wakes sysmon if it sleeps. A pause ends the
// stretch. A load that comes in bursts (fortio's 16 connections at 1000 qps:
// a burst of a millisecond or two every 16 ms) or one request at a time never
// makes a stretch that long, and so never wakes sysmon from the data path:
// with one ordinary call per 10 ms regardless, every burst woke it and paid
// its run of short sleeps, 5 % of the server agent's CPU samples (perf, 3
// December). Race builds make every call the ordinary way: the race detector
// learns of the kernel's reads and writes of the buffers, and of the ordering
// between a write and a read, only through the syscall package's own
// functions.

// ordinaryEvery is how long the data path goes at most without one ordinary
// system call while it is busy: sysmon's own period for preemption.
const ordinaryEvery = 10 * time.Millisecond

// idleGap is the pause between two socket calls that ends a busy stretch.
// sysmon sleeps for good only once every P is idle; a pause this long in the
// data path is most likely one, and a busy stretch has calls microseconds
// apart.
const idleGap = 500 * time.Microsecond

// callTick is how stale lastCall may be: it is written at most this often,
// so that not every socket call writes a shared cache line.
const callTick = 50 * time.Microsecond

var (
	clockStart = time.Now()
	// lastCall is about when (since clockStart, within callTick) the last
	// socket call was made; stretchStart when the busy stretch it belongs to
	// began.
	lastCall, stretchStart atomic.Int64
	// lastOrdinary is when the last ordinary call was made.
	lastOrdinary atomic.Int64
	// ordinaryCalls counts the ordinary calls ordinary chose (tests; a count
	// of every call would be a shared cache line written by every socket call).
	ordinaryCalls atomic.Uint64
)

// monotonic is the time in nanoseconds since clockStart.
func monotonic() int64 { return int64(time.Since(clockStart)) }

// ordinary says whether this call should be an ordinary one.
func ordinary() bool {
	if raceEnabled {
		return true
	}
	now := monotonic()
	last := lastCall.Load()
	if now-last >= int64(callTick) && lastCall.CompareAndSwap(last, now) && now-last > int64(idleGap) {
		stretchStart.Store(now)
	}
	if now-stretchStart.Load() < int64(ordinaryEvery) {
		return false
	}
	prev := lastOrdinary.Load()
	if now-prev < int64(ordinaryEvery) || !lastOrdinary.CompareAndSwap(prev, now) {
		return false
	}
	ordinaryCalls.Add(1)
	return true
}

// sockRead is read(2) on a non-blocking socket.
func sockRead(fd uintptr, p []byte) (int, error) {
	return sockCall(syscall.SYS_READ, syscall.Read, fd, p)
}

// sockWrite is write(2) on a non-blocking socket.
func sockWrite(fd uintptr, p []byte) (int, error) {
	return sockCall(syscall.SYS_WRITE, syscall.Write, fd, p)
}

// sockCall makes the system call trap (read or write) on fd and p: raw,
// unless ordinary asks for ordinaryCall, the syscall package's own.
func sockCall(trap uintptr, ordinaryCall func(int, []byte) (int, error), fd uintptr, p []byte) (int, error) {
	if len(p) == 0 || ordinary() {
		return ordinaryCall(int(fd), p)
	}
	n, _, e := syscall.RawSyscall(trap, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

// maxRawIovecs is the most buffers sockWritev passes without the runtime's
// bookkeeping; more go through an ordinary writev.
const maxRawIovecs = 16

// sockWritev is writev(2) of bufs on a non-blocking socket.
func sockWritev(fd uintptr, bufs [][]byte) (int, error) {
	if len(bufs) > maxRawIovecs || ordinary() {
		return unix.Writev(int(fd), bufs)
	}
	var iov [maxRawIovecs]syscall.Iovec
	k := 0
	for _, b := range bufs {
		if len(b) > 0 {
			iov[k].Base = &b[0]
			iov[k].SetLen(len(b))
			k++
		}
	}
	if k == 0 {
		return 0, nil
	}
	n, _, e := syscall.RawSyscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&iov[0])), uintptr(k))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

// rawSock reads and writes a socket through its RawConn with sockRead
// and sockWrite, as net.TCPConn's Read and Write would: waiting in the
// network poller, under the socket's deadlines.
type rawSock struct {
	rc            syscall.RawConn
	laddr, raddr  net.Addr
	reads, writes rawCall
	now           rawCall // writeNow's: bufs instead of p
	fd            int     // the socket's descriptor (reply poll)
	// idle, if set, is called when a read finds nothing; true: read again.
	idle func(fd uintptr) bool
}

// rawCall is one direction's call in progress: one at a time owns p, n and
// err, which fn (bound once, so a call allocates nothing) works on.
type rawCall struct {
	mu   sync.Mutex
	p    []byte
	bufs [][]byte
	n    int
	err  error // the system call's
	fn   func(fd uintptr) bool
}

// run makes the call for p through rc (a write when write is set) and
// returns what fn did and RawConn's own error (closed, deadline passed).
func (c *rawCall) run(rc syscall.RawConn, write bool, p []byte) (n int, sysErr, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.p, c.n, c.err = p, 0, nil
	if write {
		err = rc.Write(c.fn)
	} else {
		err = rc.Read(c.fn)
	}
	n, sysErr = c.n, c.err
	c.p, c.err = nil, nil
	return n, sysErr, err
}

// newRawSock returns c's rawSock, or nil when c is not a plain TCP socket
// (a wrapper may count or transform what passes through it).
func newRawSock(c net.Conn) *rawSock {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return nil
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	return rawSockOf(rc, tc.LocalAddr(), tc.RemoteAddr())
}

// rawSockOf returns a rawSock for rc; the addresses name the socket in errors.
func rawSockOf(rc syscall.RawConn, laddr, raddr net.Addr) *rawSock {
	r := &rawSock{rc: rc, laddr: laddr, raddr: raddr, fd: -1}
	_ = rc.Control(func(fd uintptr) { r.fd = int(fd) })
	r.reads.fn = r.readOnce
	r.writes.fn = r.writeSome
	r.now.fn = r.writevOnce
	return r
}

// readOnce reads once into reads.p, or asks to wait for the socket.
func (r *rawSock) readOnce(fd uintptr) bool {
	c := &r.reads
	for {
		c.n, c.err = sockRead(fd, c.p)
		switch c.err {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			if r.idle != nil && r.idle(fd) {
				continue
			}
			return false
		}
		return true
	}
}

// Read is net.Conn's Read: n > 0, or an error (io.EOF when the peer closed).
func (r *rawSock) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	n, sysErr, err := r.reads.run(r.rc, false, p)
	switch {
	case err != nil: // closed, or the deadline passed
		return 0, err
	case sysErr != nil:
		return 0, r.opError("read", sysErr)
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// writeSome writes what is left of writes.p until the socket is full.
func (r *rawSock) writeSome(fd uintptr) bool {
	c := &r.writes
	for len(c.p) > 0 {
		n, err := sockWrite(fd, c.p)
		switch err {
		case nil:
			c.n += n
			c.p = c.p[n:]
		case syscall.EINTR:
		case syscall.EAGAIN:
			return false
		default:
			c.err = err
			return true
		}
	}
	return true
}

// Write is net.Conn's Write: all of p, or an error.
func (r *rawSock) Write(p []byte) (int, error) {
	n, sysErr, err := r.writes.run(r.rc, true, p)
	switch {
	case sysErr != nil:
		return n, r.opError("write", sysErr)
	case err != nil:
		return n, err
	}
	return n, nil
}

// writevOnce writes now.bufs with one writev(2); it never asks to wait.
func (r *rawSock) writevOnce(fd uintptr) bool {
	c := &r.now
	for {
		n, err := sockWritev(fd, c.bufs)
		if err == syscall.EINTR {
			continue
		}
		if err == nil {
			c.n = n
		}
		return true
	}
}

// writeNow writes bufs with one writev(2) that does not wait, and returns
// how many bytes the socket took: 0 when it is full or the write failed
// (WriteTo's own write then meets the error and reports it).
func (r *rawSock) writeNow(bufs [][]byte) int {
	c := &r.now
	c.mu.Lock()
	defer c.mu.Unlock()
	c.bufs, c.n = bufs, 0
	_ = r.rc.Write(c.fn)
	c.bufs = nil
	return c.n
}

// opError wraps a system call's error as net.TCPConn (or UnixConn) does.
func (r *rawSock) opError(op string, err error) error {
	network := "tcp"
	if r.laddr != nil {
		network = r.laddr.Network()
	}
	return &net.OpError{Op: op, Net: network, Source: r.laddr, Addr: r.raddr, Err: os.NewSyscallError(op, err)}
}
