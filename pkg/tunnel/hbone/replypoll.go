package hbone

import (
	"fmt"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Reply polling. On a VM a thread that goes idle halts its vCPU, and waking
// it again (an interrupt through the hypervisor) costs tens of microseconds:
// most of a relay's share of a round trip (BENCHMARKS.md). When the reader
// has just written a lone small frame into an app's socket and that app has
// been answering within a few tens of microseconds, the answer is likely to
// come before a wake-up would: so the reader, finding its own socket empty,
// polls both sockets for up to the poll window (ppoll with a zero timeout,
// sched_yield between, so a task woken on this CPU runs first) instead of
// parking at once. When the app's socket becomes readable it parks as
// usual, and this thread, never idle, finds the stream's writer ready in its
// next non-blocking network poll: no wake-up on either side of the answer.
//
// It is bounded three ways: only after a delivery to a stream whose app
// answered its previous delivery within five times the window (so a client that
// sends its next request on a timer, or a server that streams, never makes
// the reader poll), never while the process delivers to several streams
// at once (a burst: the apps want the CPUs), and never beyond a process-wide
// CPU budget (a token bucket refilled at the configured share of one CPU).
// At most one reader of the process polls at a time.

// ReplyPollConfig is the process-wide reply polling setting.
type ReplyPollConfig struct {
	// Window is how long after a delivery the reader may poll; 0 turns
	// reply polling off.
	Window time.Duration
	// CPU is the share of one CPU the process may spend polling, (0, 1].
	CPU float64
}

// maxReplyPollWindow bounds the window: beyond it a wake-up is cheaper.
const maxReplyPollWindow = time.Millisecond

// replyPollMaxFrame is the largest delivered frame a poll may follow: a
// request or an answer, one TLS record's worth, not a stream's bulk.
const replyPollMaxFrame = 16 << 10

// replyPollQuiet is how long the process must have delivered to no other
// stream for the reader to poll: several streams served at once (a client's
// burst of requests) keep the CPUs busy with their apps, where a poll would
// take a CPU from them.
const replyPollQuiet = time.Millisecond

// replyPollBurst is the most CPU time the budget saves up.
const replyPollBurst = int64(5 * time.Millisecond)

var (
	replyPollWindow atomic.Int64 // ns; 0: off
	replyPollRate   atomic.Int64 // ns of polling per second

	pollSpinning atomic.Bool
	// lastArmed is the stream (its address, for identity only) the process
	// last delivered a small frame to, lastArmedAt when.
	lastArmed                atomic.Uintptr
	lastArmedAt              atomic.Int64
	pollTokens, pollRefilled atomic.Int64

	pollCaught, pollTunnel, pollExpired atomic.Uint64
	pollBudget, pollBusy                atomic.Uint64
	pollSpent                           atomic.Int64 // ns
)

// CheckReplyPoll says what is wrong with cfg, if anything.
func CheckReplyPoll(cfg ReplyPollConfig) error {
	if cfg.Window < 0 || cfg.Window > maxReplyPollWindow {
		return fmt.Errorf("reply poll window %v: want 0 (off) to %v", cfg.Window, maxReplyPollWindow)
	}
	if cfg.Window > 0 && !(cfg.CPU > 0 && cfg.CPU <= 1) {
		return fmt.Errorf("reply poll CPU share %v: want more than 0 and at most 1", cfg.CPU)
	}
	return nil
}

// SetReplyPoll sets reply polling for the process; a zero Window turns it off.
func SetReplyPoll(cfg ReplyPollConfig) error {
	if err := CheckReplyPoll(cfg); err != nil {
		return err
	}
	replyPollRate.Store(int64(cfg.CPU * float64(time.Second)))
	replyPollWindow.Store(int64(cfg.Window))
	pollRefilled.Store(0) // the budget starts afresh: a second's worth, at most the burst
	pollTokens.Store(0)
	return nil
}

// ReplyPollStats counts the reader's polls for an app's answer.
type ReplyPollStats struct {
	// Polls by how they ended: the app answered (Caught), the tunnel's
	// socket had something first (Tunnel), or the window passed (Expired).
	Caught, Tunnel, Expired uint64
	// Polls not made: the budget was spent (Budget), another reader was
	// polling (Busy).
	Budget, Busy uint64
	Spent        time.Duration // CPU time spent polling
}

// ReplyPolls returns the process's reply poll counts.
func ReplyPolls() ReplyPollStats {
	return ReplyPollStats{
		Caught:  pollCaught.Load(),
		Tunnel:  pollTunnel.Load(),
		Expired: pollExpired.Load(),
		Budget:  pollBudget.Load(),
		Busy:    pollBusy.Load(),
		Spent:   time.Duration(pollSpent.Load()),
	}
}

// armReplyPoll notes that the reader has just written all of a small frame
// into s's app socket (file descriptor fd). Reader goroutine only.
func (c *conn) armReplyPoll(s *Stream, fd int) {
	c.replyFd = -1
	if replyPollWindow.Load() == 0 || fd < 0 {
		return
	}
	now := monotonic()
	s.deliveredAt.Store(now)
	id := uintptr(unsafe.Pointer(s))
	others := lastArmed.Swap(id) != id && now-lastArmedAt.Load() < int64(replyPollQuiet)
	lastArmedAt.Store(now)
	if others || !s.answersFast.Load() {
		return
	}
	c.replyFd, c.replyAt = int32(fd), now
}

// answerFactor times the window is how soon an app must answer a delivery
// for the reader to poll after the next one. An answer the reader did not
// poll for comes after a wake-up or two, so the bound is well above the
// window; clients that send on a timer or servers that stream stay far
// beyond it.
const answerFactor = 5

// noteAnswer is called by s's writer for every read from its app: whether
// the app answered the reader's last delivery soon enough (answerFactor)
// decides whether the reader polls after the next one.
func (s *Stream) noteAnswer() {
	d := s.deliveredAt.Load()
	if d == 0 {
		return
	}
	s.deliveredAt.Store(0)
	s.answersFast.Store(monotonic()-d < answerFactor*replyPollWindow.Load())
}

var zeroTimespec unix.Timespec

// replyPoll is the HBONE socket's idle hook (rawSock.idle): the reader found
// the socket (fd) empty. If a poll is armed, it polls the socket and the app's
// until one is readable or the window ends, and reports whether the HBONE
// socket is readable (read again) or not (park).
func (c *conn) replyPoll(fd uintptr) bool {
	app := c.replyFd
	if app < 0 {
		return false
	}
	c.replyFd = -1
	start := monotonic()
	deadline := c.replyAt + replyPollWindow.Load()
	if start >= deadline {
		return false
	}
	if !takePollTokens(start) {
		pollBudget.Add(1)
		return false
	}
	if !pollSpinning.CompareAndSwap(false, true) {
		pollBusy.Add(1)
		return false
	}
	defer func() {
		spent := monotonic() - start
		pollSpent.Add(spent)
		pollTokens.Add(-spent)
		pollSpinning.Store(false)
	}()
	fds := [2]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}, {Fd: app, Events: unix.POLLIN}}
	for monotonic() < deadline {
		syscall.RawSyscall(syscall.SYS_SCHED_YIELD, 0, 0, 0)
		fds[0].Revents, fds[1].Revents = 0, 0
		n, _, e := syscall.RawSyscall6(unix.SYS_PPOLL, uintptr(unsafe.Pointer(&fds[0])), uintptr(len(fds)),
			uintptr(unsafe.Pointer(&zeroTimespec)), 0, 0, 0)
		if e != 0 || n == 0 {
			continue
		}
		if fds[0].Revents != 0 {
			pollTunnel.Add(1)
			return true
		}
		pollCaught.Add(1)
		return false
	}
	pollExpired.Add(1)
	return false
}

// takePollTokens refills the budget up to now (at most replyPollBurst
// saved) and reports whether any is left.
func takePollTokens(now int64) bool {
	last := pollRefilled.Load()
	if now > last && pollRefilled.CompareAndSwap(last, now) {
		elapsed := min(now-last, int64(time.Second))
		add := elapsed * replyPollRate.Load() / int64(time.Second)
		if pollTokens.Add(add) > replyPollBurst {
			pollTokens.Store(replyPollBurst)
		}
	}
	return pollTokens.Load() > 0
}
