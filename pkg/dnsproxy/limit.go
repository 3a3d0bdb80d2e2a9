package dnsproxy

import "sync"

// limiter admits work against a node-wide and a per-pod bound: whatever a
// pod makes the proxy hold (a query in flight, which may hold an upstream
// socket; a TCP connection, which holds a goroutine) is taken here and
// given back with release, in one place.
type limiter struct {
	perNode, perPod int

	mu    sync.Mutex
	total int
	pods  map[string]int // only pods holding something: bounded by perNode
}

func newLimiter(perNode, perPod int) *limiter {
	return &limiter{perNode: perNode, perPod: perPod, pods: map[string]int{}}
}

// take admits one more for pod, or returns the bound that refuses it:
// "node" or "pod".
func (l *limiter) take(pod string) (refusedBy string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.total >= l.perNode:
		return "node"
	case l.pods[pod] >= l.perPod:
		return "pod"
	}
	l.total++
	l.pods[pod]++
	return ""
}

// release gives back what take admitted for pod.
func (l *limiter) release(pod string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.total--
	if l.pods[pod]--; l.pods[pod] <= 0 {
		delete(l.pods, pod)
	}
}
