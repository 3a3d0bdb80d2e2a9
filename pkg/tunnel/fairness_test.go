package tunnel

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// The node's budget of each kind is shared by every pod: with the default
// limits (30,000 per node, 10,000 per pod) three pods that keep 10,000
// connections open, or pending (a blackholed destination holds each for
// the 5 s connect timeout, so 2,000 connects a second), took all of it, and
// every other pod of the node had each new outbound connection reset, for as
// long as they liked. A full node budget now closes the oldest connection
// of the pod holding the most, when it holds at least two more than the
// pod asking: pods converge on equal shares, and a pod that holds little
// always gets a slot.
func TestNodeLimitSharedFairlyAcrossPods(t *testing.T) {
	tun := New(Config{OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008, Limits: Limits{PerNode: 6, PerPod: 4, PerSource: 100}})
	type held struct {
		c   *fakeConn
		pod string
	}
	handled := make(chan held, 32)
	pods := map[string]*pod{}
	feeds := map[string]*fakeListener{}
	for i, name := range []string{"a", "b", "c"} {
		p := testPod(tun, "uid-"+name, netip.AddrFrom4([4]byte{10, 1, 0, byte(2 + i)}))
		l := newFakeListener()
		p.acceptLoop(l, p.health[0], p.admitter(listenerOutbound), func(c net.Conn) {
			handled <- held{c.(*fakeConn), name}
			<-p.ctx.Done()
		})
		pods[name], feeds[name] = p, l
		t.Cleanup(func() { p.stopping.Store(true); l.Close(); p.cancel(); p.stop(context.Background()) })
	}
	port := 40000
	open := func(name string) *fakeConn {
		t.Helper()
		port++
		c := newFakeConn("192.0.2.1:80", fmt.Sprintf("%s:%d", pods[name].addrs[0], port))
		feeds[name].feed(t, c)
		return c
	}
	expectHandled := func(c *fakeConn) {
		t.Helper()
		select {
		case h := <-handled:
			if h.c != c {
				t.Fatalf("handled %v of pod %s, want %v", h.c.RemoteAddr(), h.pod, c.RemoteAddr())
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("connection %v was not handled (closed: %v)", c.RemoteAddr(), c.closed.Load())
		}
	}
	var a, b []*fakeConn
	for range 3 {
		c := open("a")
		expectHandled(c)
		a = append(a, c)
		c = open("b")
		expectHandled(c)
		b = append(b, c)
	}
	// The node is full: pod c's first connection closes pod a's oldest
	// (a and b hold 3 each), its second pod b's oldest; then every pod
	// holds 2 and the node refuses pod c's third.
	c1 := open("c")
	expectHandled(c1)
	waitfor.Until(t, "pod a's oldest connection closed", a[0].closed.Load)
	c2 := open("c")
	expectHandled(c2)
	waitfor.Until(t, "pod b's oldest connection closed", b[0].closed.Load)
	c3 := open("c")
	waitfor.Until(t, "pod c's third connection refused", c3.closed.Load)
	for _, c := range append(append(append([]*fakeConn{}, a[1:]...), b[1:]...), c1, c2) {
		if c.closed.Load() {
			t.Errorf("connection %v closed, want it open", c.RemoteAddr())
		}
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.limitEvicted.WithLabelValues("outbound")); got != 2 {
		t.Errorf("evicted{outbound} = %v, want 2", got)
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.limitRefused.WithLabelValues("outbound", "node")); got != 1 {
		t.Errorf("refused{outbound,node} = %v, want 1", got)
	}
	tun.limits.mu.Lock()
	counts := [3]int{pods["a"].open[listenerOutbound], pods["b"].open[listenerOutbound], pods["c"].open[listenerOutbound]}
	node := tun.limits.node[listenerOutbound]
	tun.limits.mu.Unlock()
	if counts != [3]int{2, 2, 2} || node != 6 {
		t.Errorf("open per pod %v, node %d; want 2 each, 6", counts, node)
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.openConns.WithLabelValues("outbound")); got != 6 {
		t.Errorf("open outbound gauge %v, want 6", got)
	}
}

// silentListener is a listening socket on 127.0.0.2 with a backlog of 0
// that never accepts: once one connection waits in its queue, the SYNs of
// the next are dropped, and their connects stay pending.
func silentListener(t *testing.T) netip.AddrPort {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 2}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 2}), uint16(sa.(*syscall.SockaddrInet4).Port))
	filler, err := net.Dial("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { filler.Close() })
	return addr
}

// An evicted connection's handler stops what it was doing: a dial still
// pending (a destination that never answers) is cancelled with it.
// Otherwise each eviction left a dial outside every count for up to the
// connect timeout, and two pods evicting each other's pending connections
// (each holding at least two more than the other in turn) could keep as
// many as they open in 5 s.
func TestEvictionCancelsPendingDial(t *testing.T) {
	tun := New(Config{OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008, Limits: Limits{PerNode: 2, PerPod: 2, PerSource: 100}})
	tun.Update(&State{Dir: testDir(t, podObj("mesh", "a", "a-sa", "127.0.0.1", nil), podObj("mesh", "b", "b-sa", "127.0.0.3", nil))})
	dst := silentListener(t)
	a := testPod(tun, "uid-a", netip.MustParseAddr("127.0.0.1"))
	b := testPod(tun, "uid-b", netip.MustParseAddr("127.0.0.3"))
	inOwnNamespace(t, a)
	returned := make(chan time.Time, 4)
	la, lb := newFakeListener(), newFakeListener()
	a.acceptLoop(la, a.health[0], a.admitter(listenerOutbound), func(c net.Conn) {
		a.handleOutbound(c)
		returned <- time.Now()
	})
	b.acceptLoop(lb, b.health[0], b.admitter(listenerOutbound), func(net.Conn) { <-b.ctx.Done() })
	for _, p := range []*pod{a, b} {
		t.Cleanup(func() { p.stopping.Store(true); la.Close(); lb.Close(); p.cancel(); p.stop(context.Background()) })
	}
	first := newFakeConn(dst.String(), "127.0.0.1:40001")
	la.feed(t, first)
	la.feed(t, newFakeConn(dst.String(), "127.0.0.1:40002"))
	time.Sleep(200 * time.Millisecond) // both dials pending
	evicted := time.Now()
	lb.feed(t, newFakeConn(dst.String(), "127.0.0.3:40003"))
	waitfor.Until(t, "pod a's oldest connection closed", first.closed.Load)
	select {
	case at := <-returned:
		if d := at.Sub(evicted); d > 2*time.Second {
			t.Errorf("the evicted connection's handler returned %v after the eviction, want its dial cancelled at once", d.Round(time.Millisecond))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the evicted connection's handler never returned")
	}
}
