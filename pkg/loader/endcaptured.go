package loader

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
)

// Bounds of ending a leaving pod's captured sockets: a namespace holding a
// great many must not hold its detach (and a reconcile worker) for long.
// What they leave is counted and named in a warning.
const (
	maxEndedSockets   = 1 << 16
	endSocketsTimeout = 2 * time.Second
)

// endedCounts are the sockets endCaptured dealt with, by result, since the
// loader started.
type endedCounts struct {
	ended, failed, left atomic.Uint64
}

// endCaptured aborts (sock_diag SOCK_DESTROY) every TCP socket of the
// leaving pod whose connection was captured, in the namespace h it was
// attached in, while its capture is still in place. Such a socket's
// connection ended at the tunnel (the pod's stop reset the relays it
// found), but a relay that had ended before closed its app socket with a
// FIN, and that socket stays open in CLOSE_WAIT for as long as the app
// likes: once the pod is detached, what the app writes on it leaves by the
// pod's interface as it is, in plaintext, towards the peer's address.
// Aborted, its next write fails with ECONNABORTED instead; the reset the
// kernel sends for it is routed (or dropped) by the capture, which is still
// there.
//
// A socket is captured when the capture's socket storage (rd_captured)
// names it, which the capture programs give every app socket whose
// connection reached the tunnel, or when it carries the reinject mark
// local routing gives those sockets (the storage alone would do; the mark
// still names them where the kernel will not report the storage). Sockets
// carrying the tunnel mark are the tunnel's, and connections the app
// opened before enrollment or is still opening (SYN_SENT: its SYN went out
// unmeshed once the pod is detached, as the pod now is) carry neither and
// are left alone.
//
// Failing does not stop the detach: it is logged and counted. Only a pod
// leaving the mesh is handled so (DetachPod): an upgrade never detaches,
// and a sealed pod keeps its capture.
func (l *Loader) endCaptured(ctx context.Context, h *netns.Handle, meta maps.PodMeta) {
	s := l.cfg.Settings
	reinject, tunnel := s.ReinjectMark&s.MarkMask, s.TunnelMark&s.MarkMask
	opts := netns.DestroyOptions{
		Match: func(sk netns.TCPSocket) bool {
			m := sk.Mark & s.MarkMask
			return m != tunnel && (m == reinject || sk.Stored)
		},
		Max: maxEndedSockets,
	}
	if l.captured != nil && l.capturedID != 0 {
		opts.Storage = &netns.StorageMap{FD: l.captured.FD(), ID: uint32(l.capturedID)}
	}
	ctx, cancel := context.WithTimeout(ctx, endSocketsTimeout)
	defer cancel()
	start := time.Now()
	res, err := h.DestroyTCP(ctx, opts)
	l.endedSockets.ended.Add(uint64(res.Destroyed))
	l.endedSockets.failed.Add(uint64(res.Failed))
	l.endedSockets.left.Add(uint64(res.Left))
	pod := meta.Namespace + "/" + meta.Name
	if res.StorageErr != nil {
		l.log.WarnContext(ctx, "the capture's socket storage cannot be read through sock_diag: only the leaving pod's sockets local routing marked are ended",
			"pod", pod, "error", res.StorageErr)
	}
	if res.Destroyed > 0 {
		l.log.InfoContext(ctx, "captured sockets of the leaving pod ended", "pod", pod, "sockets", res.Destroyed, "took", time.Since(start))
	}
	if err != nil || res.Failed > 0 || res.Left > 0 {
		l.log.WarnContext(ctx, "captured sockets of the leaving pod not ended: what their apps write after the detach leaves unmeshed",
			"pod", pod, "failed", res.Failed, "left", res.Left, "bound", maxEndedSockets, "timeout", endSocketsTimeout, "error", err)
	}
}

// EndedSockets are the captured sockets of leaving pods the loader ended
// since it started, and those it could not end (the kernel refused) or
// left (past the bound or the timeout).
func (l *Loader) EndedSockets() (ended, failed, left uint64) {
	return l.endedSockets.ended.Load(), l.endedSockets.failed.Load(), l.endedSockets.left.Load()
}
