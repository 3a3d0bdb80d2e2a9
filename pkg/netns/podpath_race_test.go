package netns

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestCheckPodPathWhileThreadsVisitPods: a pod's namespace passes
// CheckPodPath while other goroutines run code in it (Do), as the agent's
// workers do all the time. Seen failing: the check took the agent's own
// namespace from /proc/self/ns/net, which is the main thread's, and the
// Go runtime runs any goroutine on the main thread, Do's too: while one
// was in the pod's namespace, a CNI ADD naming it was refused as "the
// agent's own network namespace" (and while it was in another pod's, the
// host's own namespace was no longer recognised by that check).
func TestCheckPodPathWhileThreadsVisitPods(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	pod := testNS(t, fmt.Sprintf("rdpr%04x", rand.IntN(0xffff)), "10.213.1.2/24")
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				_ = Do(pod, func() error { time.Sleep(100 * time.Microsecond); return nil })
			}
		})
	}
	var refused, selfPassed atomic.Int64
	var last atomic.Value
	deadline := time.Now().Add(2 * time.Second)
	checks := 0
	for time.Now().Before(deadline) {
		checks++
		if _, err := CheckPodPath(pod, ""); err != nil {
			refused.Add(1)
			last.Store(err)
			if !errors.Is(err, ErrNotPodNetNS) {
				t.Fatalf("CheckPodPath(%s): %v", pod, err)
			}
		}
		// /proc/self/ns/net is the main thread's namespace: the pod's
		// while a Do runs there, the agent's a moment later.
		if _, err := CheckPodPath("/proc/self/ns/net", ""); !errors.Is(err, ErrNotPodNetNS) {
			selfPassed.Add(1)
		}
		time.Sleep(50 * time.Microsecond)
	}
	close(stop)
	wg.Wait()
	if n := refused.Load(); n > 0 {
		t.Errorf("CheckPodPath refused a pod's namespace %d times of %d while other threads visited it; last: %v", n, checks, last.Load())
	}
	if n := selfPassed.Load(); n > 0 {
		t.Errorf("CheckPodPath passed /proc/self/ns/net %d times of %d while other threads visited a pod", n, checks)
	}
	// The agent's own namespace is still refused, whatever thread asks.
	for _, path := range []string{"/proc/self/ns/net", "/proc/thread-self/ns/net"} {
		if _, err := CheckPodPath(path, ""); !errors.Is(err, ErrNotPodNetNS) {
			t.Errorf("CheckPodPath(%q) = %v; want ErrNotPodNetNS", path, err)
		}
	}
}
