package tunnel

import (
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
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

// tunnelKeepAlive is set on every socket the tunnel makes (netns.SocketOptions):
// before a dial connects, and on the listeners, whose accepted sockets
// inherit it from the kernel.
var tunnelKeepAlive = &netns.KeepAlive{Idle: keepaliveIdle, Interval: keepaliveInterval, Count: keepaliveCount, UserTimeout: userTimeout}

// inPodCongestion is the congestion control of the tunnel's sockets to the pod's own apps
// (the outbound capture listener's, so its accepted sockets inherit it, and dials to the
// app). These legs never leave the pod: there is no congestion to control, and a pacing
// algorithm (BBR, the default on some nodes) paces every write the tunnel makes to the app
// with the kernel's timers. It is set before the socket connects or listens: switching an
// established socket away from BBR would leave its pacing on.
const inPodCongestion = "cubic"

// inPodCongestionName is inPodCongestion when this kernel can use it, else "" (the node's
// default stays). Checked once, as HBONE_CONGESTION_CONTROL is: asking for an algorithm the
// kernel lacks makes it try to load the module on every socket.
var inPodCongestionName = sync.OnceValue(func() string {
	if netns.CheckCongestion(inPodCongestion) != nil {
		return ""
	}
	return inPodCongestion
})

// checkCongestion warns, once per process, when an HBONE socket does not use
// the congestion control the operator named (HBONE_CONGESTION_CONTROL): the
// start-up check asked the kernel in the agent's namespace, not the pod's,
// and setting it on a socket is best effort (netns.SocketOptions).
func (t *Tunnel) checkCongestion(s any, what string) {
	want := t.cfg.HBONECongestion
	sc, ok := s.(syscall.Conn)
	if want == "" || !ok {
		return
	}
	got, err := socketCongestion(sc)
	if err == nil && got == want {
		return
	}
	t.congestionWarned.Do(func() {
		t.log.Warn("an HBONE socket does not use the congestion control HBONE_CONGESTION_CONTROL names (logged once)",
			"socket", what, "want", want, "got", got, "error", err)
	})
}

// socketCongestion is the congestion control a TCP socket uses.
func socketCongestion(sc syscall.Conn) (string, error) {
	rc, err := sc.SyscallConn()
	if err != nil {
		return "", err
	}
	var name string
	if cerr := rc.Control(func(fd uintptr) {
		name, err = unix.GetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION)
	}); cerr != nil {
		return "", cerr
	}
	return name, err
}
