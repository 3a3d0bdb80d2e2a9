package tunnel

import (
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// TCP keepalive and TCP_USER_TIMEOUT on every socket the tunnel holds: the
// app-facing ones (accepted on 15001/15006, dialled to the pod's apps), the
// upstream ones (plain TCP passthrough, HBONE client connections) and the
// HBONE server's accepted ones.
//
// ztunnel probes after 180 s idle, every 180 s, 9 times (30 min to find a
// dead peer) and leaves TCP_USER_TIMEOUT off by default. The idle time is
// kept at 180 s: keepalives are not hop by hop, so the tunnel's own must
// keep idle flows alive through middleboxes with idle timeouts of 350 s
// (AWS NLB) or 10 min (Google LB) without probing busy nodes often. The
// probes are 20 s apart, 6 of them, so an idle connection whose peer is
// gone is released after 180+6×20 = 300 s instead of 30 min: every such
// connection holds fds, buffers and a limit slot.
//
// Keepalive never fires while sent data waits for an ACK; then the kernel
// retransmits for about 15 min (tcp_retries2). TCP_USER_TIMEOUT bounds that
// to the same 300 s. It is set equal to the keepalive budget because it
// also overrides the probe count (RFC 5482, Linux tcp_keepalive_timer): a
// smaller value would cut idle connections before their last probe. A peer
// that is alive but reads nothing (zero window) still ACKs the window
// probes and is not cut (Linux 5.1+).
const (
	keepaliveIdle     = 180 * time.Second
	keepaliveInterval = 20 * time.Second
	keepaliveCount    = 6
	userTimeout       = keepaliveIdle + keepaliveCount*keepaliveInterval
)

// tuneSocket sets keepalive and TCP_USER_TIMEOUT on c when it is a TCP
// socket; anything else (a test pipe) is left alone. A failure only means
// a slower release of a dead peer, so it is not an error.
func tuneSocket(c net.Conn) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return
	}
	_ = tc.SetKeepAliveConfig(net.KeepAliveConfig{Enable: true, Idle: keepaliveIdle, Interval: keepaliveInterval, Count: keepaliveCount})
	rc, err := tc.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Control(func(fd uintptr) {
		_ = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(userTimeout/time.Millisecond))
	})
}

// keepaliveListener tunes every connection it accepts.
type keepaliveListener struct{ net.Listener }

func (l keepaliveListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		tuneSocket(c)
	}
	return c, err
}

// inPodCongestion is the congestion control of the tunnel's sockets to the pod's own apps
// (captured outbound connections, dials to the app). These legs never leave the pod: there is
// no congestion to control, and a pacing algorithm (BBR, the default on some nodes) only adds
// pacing timers and deferred sends to every write the tunnel makes to the app. cubic paces
// nothing without the fq qdisc.
const inPodCongestion = "cubic"

// tuneInPodSocket sets inPodCongestion on a socket to a pod's app. A kernel without cubic
// keeps its default: only speed is at stake.
func tuneInPodSocket(c net.Conn) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Control(func(fd uintptr) {
		_ = unix.SetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION, inPodCongestion)
	})
}
