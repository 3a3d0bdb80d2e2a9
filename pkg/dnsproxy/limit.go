package dnsproxy

import (
	"container/list"
	"sync"
)

// limiter admits work against a node-wide and a per-pod bound: whatever a
// pod makes the proxy hold (a query in flight, which may hold an upstream
// socket; a TCP connection, which holds a goroutine) is taken here and
// given back with release, in one place.
//
// The node's bound is shared: with the defaults 16 pods at their own bound
// fill it, and a pod can hold its share cheaply (queries for names whose
// servers never answer, each held for the upstream timeout; TCP
// connections sending a query just within each idle timeout). So a full
// node does not refuse a pod holding fewer than the others: the oldest
// hold of the pod holding the most is ended (its cancel runs) and its
// place goes to the new one, when that pod holds at least two more than
// the pod asking, as pkg/tunnel's limiter shares the node's connections.
// Pods converge on equal shares, and a few pods' floods never stop the
// others.
type limiter struct {
	perNode, perPod int

	mu    sync.Mutex
	total int
	seq   uint64
	pods  map[string]*list.List // of *hold, oldest first; only pods holding something: bounded by perNode
}

// hold is one admitted unit of work.
type hold struct {
	l   *limiter
	pod string
	seq uint64 // admission order
	// Guarded by l.mu.
	elem    *list.Element // in l.pods[pod] while counted
	evicted bool
	cancel  func() // ends the work when it is evicted
}

func newLimiter(perNode, perPod int) *limiter {
	return &limiter{perNode: perNode, perPod: perPod, pods: map[string]*list.List{}}
}

// take admits one more for pod, whose work cancel ends, or returns the
// bound that refuses it: "node" or "pod". evicted says another pod's
// oldest hold was ended to make room (its cancel has run).
func (l *limiter) take(pod string, cancel func()) (h *hold, refusedBy string, evicted bool) {
	l.mu.Lock()
	own := l.pods[pod]
	n := 0
	if own != nil {
		n = own.Len()
	}
	if n >= l.perPod {
		l.mu.Unlock()
		return nil, "pod", false
	}
	var victim *hold
	if l.total >= l.perNode {
		if victim = l.victimLocked(pod, n); victim == nil {
			l.mu.Unlock()
			return nil, "node", false
		}
		victim.evicted = true
		l.dropLocked(victim)
	}
	if own == nil {
		own = list.New()
		l.pods[pod] = own
	}
	l.seq++
	h = &hold{l: l, pod: pod, seq: l.seq, cancel: cancel}
	h.elem = own.PushBack(h)
	l.total++
	l.mu.Unlock()
	if victim != nil && victim.cancel != nil {
		victim.cancel()
	}
	return h, "", victim != nil
}

// victimLocked returns the oldest hold of the pod holding the most (of two
// holding as many, the one whose oldest is older), if it holds at least
// two more than pod, which holds n; nil if none does.
func (l *limiter) victimLocked(pod string, n int) *hold {
	if n+2 > l.perPod {
		return nil // no pod holds that many: spare the scan
	}
	var best *hold
	bestN := 0
	for q, holds := range l.pods {
		m := holds.Len()
		if q == pod || m < n+2 {
			continue
		}
		oldest := holds.Front().Value.(*hold)
		if best == nil || m > bestN || (m == bestN && oldest.seq < best.seq) {
			best, bestN = oldest, m
		}
	}
	return best
}

// dropLocked uncounts h, once.
func (l *limiter) dropLocked(h *hold) {
	if h.elem == nil {
		return
	}
	holds := l.pods[h.pod]
	holds.Remove(h.elem)
	h.elem = nil
	if holds.Len() == 0 {
		delete(l.pods, h.pod)
	}
	l.total--
}

// release gives back what take admitted; only the first call, or an
// eviction before it, counts.
func (h *hold) release() {
	h.l.mu.Lock()
	defer h.l.mu.Unlock()
	h.l.dropLocked(h)
}

// wasEvicted says whether h was ended to make room for another pod.
func (h *hold) wasEvicted() bool {
	h.l.mu.Lock()
	defer h.l.mu.Unlock()
	return h.evicted
}
