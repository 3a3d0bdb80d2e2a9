package tunnel

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/internal/promtest"
	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// fakeConn is a connection with chosen addresses that records its close.
type fakeConn struct {
	net.Conn
	local, remote net.Addr
	closed        atomic.Bool
}

func newFakeConn(local, remote string) *fakeConn {
	a, b := net.Pipe()
	b.Close()
	return &fakeConn{Conn: a, local: net.TCPAddrFromAddrPort(netip.MustParseAddrPort(local)),
		remote: net.TCPAddrFromAddrPort(netip.MustParseAddrPort(remote))}
}

func (c *fakeConn) LocalAddr() net.Addr  { return c.local }
func (c *fakeConn) RemoteAddr() net.Addr { return c.remote }
func (c *fakeConn) Close() error         { c.closed.Store(true); return c.Conn.Close() }

// fakeListener hands out what the test feeds it: a connection or an error.
type fakeListener struct {
	next   chan any
	closed chan struct{}
	once   sync.Once
}

func newFakeListener() *fakeListener {
	return &fakeListener{next: make(chan any), closed: make(chan struct{})}
}

func (l *fakeListener) Accept() (net.Conn, error) {
	select {
	case v := <-l.next:
		if err, ok := v.(error); ok {
			return nil, err
		}
		return v.(net.Conn), nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

// feed hands v to the next Accept, failing the test if nobody accepts.
func (l *fakeListener) feed(t *testing.T, v any) {
	t.Helper()
	select {
	case l.next <- v:
	case <-time.After(5 * time.Second):
		t.Fatalf("nobody accepted %v: the accept loop is gone", v)
	}
}

func (l *fakeListener) Close() error   { l.once.Do(func() { close(l.closed) }); return nil }
func (l *fakeListener) Addr() net.Addr { return &net.TCPAddr{} }

// inOwnNamespace makes p dial from the test's own network namespace.
func inOwnNamespace(t *testing.T, p *pod) {
	t.Helper()
	ns, err := netns.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	p.netns, p.ns = ns.Path(), ns
}

// testPod registers a pod (no sockets) with tun, as startPod would.
func testPod(tun *Tunnel, uid string, addrs ...netip.Addr) *pod {
	ctx, cancel := context.WithCancel(context.Background())
	p := &pod{t: tun, uid: uid, addrs: addrs, ctx: ctx, cancel: cancel, conns: map[net.Conn]*connRef{}, inbound: map[*inboundConn]struct{}{}, id: uid}
	for i, port := range []uint16{tun.cfg.OutboundPort, tun.cfg.InboundPort, tun.cfg.HBONEPort} {
		p.health[i] = &listenerHealth{port: port}
	}
	tun.mu.Lock()
	tun.pods[uid] = p
	tun.mu.Unlock()
	return p
}

func newTestTunnel(t *testing.T, log *bytes.Buffer) *Tunnel {
	cfg := Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008}
	if log != nil {
		cfg.Logger = slog.New(slog.NewTextHandler(&syncWriter{w: log}, nil))
	}
	return New(cfg)
}

type syncWriter struct {
	mu sync.Mutex
	w  *bytes.Buffer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// An accept that fails with EMFILE (or ENFILE, ENOBUFS, ENOMEM) must not
// end the accept loop: before, the loop returned and the listener stayed
// open with nobody accepting. Readiness names the pod and port meanwhile.
func TestAcceptLoopSurvivesEMFILE(t *testing.T) {
	tun := newTestTunnel(t, nil)
	p := testPod(tun, "uid-1", netip.MustParseAddr("10.1.0.2"))
	l := newFakeListener()
	handled := make(chan net.Conn, 1)
	p.acceptLoop(l, p.health[0], p.admitter(listenerOutbound), func(c net.Conn) { handled <- c })
	defer func() { p.stopping.Store(true); l.Close(); p.cancel(); p.wg.Wait() }()

	for _, errno := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM} {
		l.feed(t, &net.OpError{Op: "accept", Net: "tcp", Err: errno})
	}
	errs := tun.cfg.Metrics.acceptErrors.WithLabelValues("outbound")
	waitfor.Until(t, "four counted accept errors", func() bool { return testutil.ToFloat64(errs) == 4 })
	problems := tun.ListenerProblems()
	if len(problems) != 1 || !strings.Contains(problems[0], "uid-1") || !strings.Contains(problems[0], "port 15001") ||
		!strings.Contains(problems[0], "cannot allocate memory") {
		t.Errorf("ListenerProblems() = %q, want the pod, port 15001 and the last error", problems)
	}

	c := newFakeConn("10.9.9.9:80", "10.1.0.2:40000")
	l.feed(t, c) // waits until the loop, backing off, accepts again
	select {
	case got := <-handled:
		if got != net.Conn(c) {
			t.Errorf("handled %v, want the accepted connection", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the accept loop did not accept after the errors")
	}
	if problems := tun.ListenerProblems(); len(problems) != 0 {
		t.Errorf("ListenerProblems() after a successful accept = %q, want none", problems)
	}
}

// A listener closed while its pod is still served is reported, and the
// backoff doubles from 5 ms up to 1 s.
func TestAcceptLoopClosedListenerAndBackoff(t *testing.T) {
	tun := newTestTunnel(t, nil)
	p := testPod(tun, "uid-2", netip.MustParseAddr("10.1.0.3"))
	l := newFakeListener()
	p.acceptLoop(l, p.health[1], p.admitter(listenerInbound), func(net.Conn) {})
	l.Close()
	waitfor.Until(t, "the closed listener reported", func() bool { return len(tun.ListenerProblems()) == 1 })
	if got := tun.ListenerProblems()[0]; !strings.Contains(got, "port 15006") || !strings.Contains(got, "listener closed") {
		t.Errorf("problem %q, want port 15006 and listener closed", got)
	}
	p.cancel()
	p.wg.Wait()

	var b time.Duration
	var seen []time.Duration
	for range 10 {
		b = min(max(2*b, minAcceptBackoff), maxAcceptBackoff)
		seen = append(seen, b)
	}
	if seen[0] != 5*time.Millisecond || seen[1] != 10*time.Millisecond || seen[9] != time.Second {
		t.Errorf("backoff sequence %v", seen)
	}
}

// Connections over a limit are reset at once and counted; slots come back
// when connections close.
func TestConnectionLimits(t *testing.T) {
	tun := New(Config{OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008, Limits: Limits{PerNode: 3, PerPod: 2, PerSource: 1}})
	a := testPod(tun, "a", netip.MustParseAddr("10.1.0.2"))
	b := testPod(tun, "b", netip.MustParseAddr("10.1.0.3"))
	src1, src2 := netip.MustParseAddr("10.2.0.1"), netip.MustParseAddr("10.2.0.2")
	lim := tun.limits

	r1, by := lim.acquire(listenerInbound, a, src1)
	if by != "" {
		t.Fatalf("first inbound refused by %s", by)
	}
	if _, by := lim.acquire(listenerInbound, b, src1); by != "source" {
		t.Errorf("second connection from one source: refused by %q, want source", by)
	}
	r2, _ := lim.acquire(listenerInbound, a, src2)
	if _, by := lim.acquire(listenerInbound, a, netip.MustParseAddr("10.2.0.3")); by != "pod" {
		t.Errorf("third inbound of pod a: refused by %q, want pod", by)
	}
	r3, _ := lim.acquire(listenerInbound, b, netip.MustParseAddr("10.2.0.3"))
	if _, by := lim.acquire(listenerInbound, b, netip.MustParseAddr("10.2.0.4")); by != "node" {
		t.Errorf("fourth inbound on the node: refused by %q, want node", by)
	}
	// Outbound has its own budget.
	ro, by := lim.acquire(listenerOutbound, a, netip.Addr{})
	if by != "" {
		t.Errorf("outbound refused by %q while only inbound is full", by)
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.openConns.WithLabelValues("inbound")); got != 3 {
		t.Errorf("open inbound gauge %v, want 3", got)
	}
	r1()
	r1() // a second release is a no-op
	if _, by := lim.acquire(listenerInbound, b, netip.MustParseAddr("10.2.0.5")); by != "" {
		t.Errorf("after a release: refused by %q", by)
	}
	r2()
	r3()
	ro()
	if n := len(lim.bySource[listenerInbound]); n != 1 {
		t.Errorf("per-source map keeps %d entries, want only the open one", n)
	}

	// Through the accept loop: the refused connection is closed at once,
	// never handled, and counted.
	l := newFakeListener()
	handled := make(chan net.Conn, 4)
	a.acceptLoop(l, a.health[1], a.admitter(listenerInbound), func(c net.Conn) { handled <- c; <-a.ctx.Done() })
	first := newFakeConn("10.1.0.2:8080", "10.2.0.9:1000")
	second := newFakeConn("10.1.0.2:8080", "10.2.0.9:1001")
	l.feed(t, first)
	<-handled
	l.feed(t, second)
	// The refusal is counted after the close: wait for the count, then look at the close.
	refused := tun.cfg.Metrics.limitRefused.WithLabelValues("inbound", "source")
	waitfor.Until(t, "the over-limit connection refused", func() bool { return testutil.ToFloat64(refused) >= 1 })
	if got := testutil.ToFloat64(refused); got != 1 {
		t.Errorf("refused{inbound,source} = %v, want 1", got)
	}
	if !second.closed.Load() {
		t.Error("the over-limit connection was not closed")
	}
	select {
	case c := <-handled:
		t.Errorf("over-limit connection %v was handled", c.RemoteAddr())
	default:
	}
	a.stopping.Store(true)
	l.Close()
	a.cancel()
	a.stop(context.Background())
	if got := testutil.ToFloat64(tun.cfg.Metrics.openConns.WithLabelValues("inbound")); got != 1 {
		t.Errorf("open inbound gauge after the pod stopped = %v, want 1 (pod b's)", got)
	}
}

// podObj is an enrolled pod of node n1 (as a source translates one in an
// ambient namespace).
func podObj(ns, name, sa, ip string, labels map[string]string) *workload.Workload {
	return &workload.Workload{Namespace: ns, Name: name, UID: "uid-" + name, Node: "n1", ServiceAccount: sa,
		Addrs: []netip.Addr{netip.MustParseAddr(ip)}, Labels: labels, WorkloadName: name, WorkloadType: workload.TypePod,
		CanonicalName: name, CanonicalRevision: "latest", Enrolled: true, Reason: "namespace label istio.io/dataplane-mode=ambient"}
}

func testDir(t *testing.T, pods ...*workload.Workload) *workload.Directory {
	t.Helper()
	dir, errs := workload.NewDirectory(pods, nil)
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	return dir
}

func denyFrom(principal string) policy.AuthorizationPolicy {
	return policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: "mesh", Name: "deny"},
		Spec: policy.AuthorizationPolicySpec{Action: policy.ActionDeny, Rules: []policy.Rule{{From: []policy.From{{Source: &policy.Source{Principals: []string{principal}}}}}}}}
}

// A policy change closes the open inbound connections it no longer allows
// (HBONE by principal, plaintext by STRICT) and leaves the others open.
func TestPolicyChangeClosesOpenConnections(t *testing.T) {
	var logs bytes.Buffer
	tun := newTestTunnel(t, &logs)
	server := netip.MustParseAddr("10.1.0.2")
	dir := testDir(t, podObj("mesh", "server", "server-sa", "10.1.0.2", map[string]string{"app": "server"}))
	tun.Update(&State{Dir: dir})
	p := testPod(tun, "uid-server", server)

	bad := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "bad"}
	good := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "good"}
	dst := netip.AddrPortFrom(server, 8080)
	var closedBad, closedGood, closedPlain atomic.Bool
	icBad := p.track(dst, netip.MustParseAddrPort("10.2.0.1:40000"), bad, true)
	icBad.connected(func() { closedBad.Store(true) })
	icGood := p.track(dst, netip.MustParseAddrPort("10.2.0.2:40000"), good, true)
	icGood.connected(func() { closedGood.Store(true) })
	icPlain := p.track(dst, netip.MustParseAddrPort("10.2.0.3:40000"), identity.ID{}, false)
	icPlain.connected(func() { closedPlain.Store(true) })
	// Registered but not connected yet: revoked now, closed when it connects.
	icPending := p.track(dst, netip.MustParseAddrPort("10.2.0.4:40000"), bad, true)

	tun.Update(&State{Dir: dir, AuthorizationPolicies: []policy.AuthorizationPolicy{denyFrom(bad.Principal())}})
	if !closedBad.Load() || closedGood.Load() || closedPlain.Load() {
		t.Errorf("after DENY of %s: closed bad=%v good=%v plain=%v, want only bad", bad, closedBad.Load(), closedGood.Load(), closedPlain.Load())
	}
	var pendingClosed bool
	if icPending.connected(func() { pendingClosed = true }) || !pendingClosed {
		t.Error("a connection revoked before it connected was let through")
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.policyClosed.WithLabelValues("authorization")); got != 2 {
		t.Errorf("policy_closed{authorization} = %v, want 2", got)
	}

	strict := policy.PeerAuthentication{Meta: policy.Meta{Namespace: "mesh", Name: "strict"},
		Spec: policy.PeerAuthenticationSpec{MTLS: &policy.MTLS{Mode: policy.ModeStrict}}}
	tun.Update(&State{Dir: dir, AuthorizationPolicies: []policy.AuthorizationPolicy{denyFrom(bad.Principal())}, PeerAuthentications: []policy.PeerAuthentication{strict}})
	if !closedPlain.Load() || closedGood.Load() {
		t.Errorf("after STRICT: plaintext closed=%v, mTLS good closed=%v; want true, false", closedPlain.Load(), closedGood.Load())
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.policyClosed.WithLabelValues("strict_plaintext")); got != 1 {
		t.Errorf("policy_closed{strict_plaintext} = %v, want 1", got)
	}
	if !strings.Contains(logs.String(), "no longer allows") {
		t.Errorf("no log of the closed connections:\n%s", logs.String())
	}

	// The destination pod's labels change so that a selector now matches.
	denyGood := denyFrom(good.Principal())
	denyGood.Spec.Selector = &policy.WorkloadSelector{MatchLabels: map[string]string{"locked": "yes"}}
	st := &State{Dir: dir, AuthorizationPolicies: []policy.AuthorizationPolicy{denyGood}}
	tun.Update(st)
	if closedGood.Load() {
		t.Error("a DENY selecting other pods closed the connection")
	}
	relabelled := testDir(t, podObj("mesh", "server", "server-sa", "10.1.0.2", map[string]string{"app": "server", "locked": "yes"}))
	tun.Update(&State{Dir: relabelled, AuthorizationPolicies: st.AuthorizationPolicies})
	if !closedGood.Load() {
		t.Error("relabelling the pod under a DENY selector left the connection open")
	}
	p.untrack(icGood)
	if n := len(p.inbound); n != 3 {
		t.Errorf("registry holds %d connections, want the 3 not untracked", n)
	}
}

// Without a policy change nor a change of the pod's workload, an Update
// decides nothing again.
func TestRecheckOnlyOnChange(t *testing.T) {
	tun := newTestTunnel(t, nil)
	server := netip.MustParseAddr("10.1.0.2")
	deny := denyFrom("cluster.local/ns/mesh/sa/bad")
	dir := testDir(t, podObj("mesh", "server", "server-sa", "10.1.0.2", nil))
	tun.Update(&State{Dir: dir, AuthorizationPolicies: []policy.AuthorizationPolicy{deny}})
	p := testPod(tun, "uid-server", server)
	// A connection the current policy would refuse, registered as if it
	// were admitted under an older state: only a change re-decides it.
	var closed atomic.Bool
	ic := p.track(netip.AddrPortFrom(server, 80), netip.MustParseAddrPort("10.2.0.1:40000"), identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "bad"}, true)
	ic.connected(func() { closed.Store(true) })
	same := testDir(t, podObj("mesh", "server", "server-sa", "10.1.0.2", nil))
	tun.Update(&State{Dir: same, AuthorizationPolicies: []policy.AuthorizationPolicy{denyFrom("cluster.local/ns/mesh/sa/bad")}})
	if closed.Load() {
		t.Error("an Update with equal policies and workload re-decided the connection")
	}
	tun.Update(&State{Dir: same})
	tun.Update(&State{Dir: same, AuthorizationPolicies: []policy.AuthorizationPolicy{deny}})
	if !closed.Load() {
		t.Error("a policy change did not re-decide the connection")
	}
}

// Series of a workload that left are deleted once the grace has passed
// after its last connection closed, not before; live ones stay.
func TestSeriesOfGoneWorkloadsDeleted(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	m := NewMetrics(nil)
	m.series.now = func() time.Time { return now }
	gone := &workload.Workload{Name: "gone", Namespace: "mesh", Labels: map[string]string{"app": "gone"}}
	stays := &workload.Workload{Name: "stays", Namespace: "mesh", Labels: map[string]string{"app": "stays"}}
	dirBoth := testDir(t,
		podObj("mesh", "gone", "sa", "10.1.0.5", map[string]string{"app": "gone"}),
		podObj("mesh", "stays", "sa", "10.1.0.6", map[string]string{"app": "stays"}))
	m.setLive(dirBoth)
	closeGone := m.open(connInfo{reporter: "destination", dst: gone}, "")
	m.open(connInfo{reporter: "destination", dst: stays}, "").close(context.Background(), 10, 20, nil)
	count := func() int { return testutil.CollectAndCount(m.series.collector()) }
	if n := count(); n != 8 {
		t.Fatalf("%d series, want 4 per workload", n)
	}

	dirStays := testDir(t, podObj("mesh", "stays", "sa", "10.1.0.6", map[string]string{"app": "stays"}))
	m.setLive(dirStays)
	now = now.Add(2 * seriesGrace)
	if n := count(); n != 8 {
		t.Errorf("%d series while the gone workload's connection is open, want 8", n)
	}
	closeGone.close(context.Background(), 1, 2, nil)
	now = now.Add(seriesGrace - time.Second)
	if n := count(); n != 8 {
		t.Errorf("%d series before the grace ended, want 8", n)
	}
	now = now.Add(time.Second)
	if n := count(); n != 4 {
		t.Errorf("%d series after the grace, want the live workload's 4", n)
	}
	if len(m.series.series) != 1 {
		t.Errorf("the collector tracks %d series, want 1", len(m.series.series))
	}
	// A workload that comes back before the grace ends keeps its series.
	m.open(connInfo{reporter: "destination", dst: gone}, "").close(context.Background(), 0, 0, nil)
	m.setLive(dirStays)
	now = now.Add(seriesGrace / 2)
	m.setLive(dirBoth)
	now = now.Add(seriesGrace)
	if n := count(); n != 8 {
		t.Errorf("%d series after the workload came back, want 8", n)
	}
}

// A flood of refusals writes one line and a summary per interval.
func TestRefusalLogRateLimited(t *testing.T) {
	var buf bytes.Buffer
	now := time.Unix(1_000_000, 0)
	r := newRefusalLog(slog.New(slog.NewTextHandler(&buf, nil)), slog.LevelInfo)
	r.now = func() time.Time { return now }
	var scheduled []func()
	r.after = func(_ time.Duration, f func()) { scheduled = append(scheduled, f) }
	for i := range 10_000 {
		r.note(context.Background(), "plaintext connection refused: mTLS is STRICT", "client", fmt.Sprint("10.0.0.1:", i))
	}
	if lines := strings.Count(buf.String(), "\n"); lines != 1 {
		t.Fatalf("%d lines for 10000 refusals, want 1:\n%s", lines, buf.String())
	}
	if len(scheduled) != 1 {
		t.Fatalf("%d summaries scheduled, want 1", len(scheduled))
	}
	now = now.Add(refusalLogEvery)
	scheduled[0]()
	if !strings.Contains(buf.String(), "count=9999") {
		t.Errorf("summary does not count the 9999 suppressed lines:\n%s", buf.String())
	}
	r.note(context.Background(), "plaintext connection refused: mTLS is STRICT")
	if lines := strings.Count(buf.String(), "\n"); lines != 2 {
		t.Errorf("%d lines, want the first and the summary only (the next interval began at the summary)", lines)
	}
}

// What a remote peer is told about a failed app dial names no local path.
func TestPeerDialErrorHidesPaths(t *testing.T) {
	for _, err := range []error{
		fmt.Errorf("dial 10.1.0.2:8080 from /var/run/netns/cni-1234: %w", &net.OpError{Op: "connect", Err: syscall.ECONNREFUSED}),
		fmt.Errorf("dial 10.1.0.2:8080 from /var/run/netns/cni-1234: %w", context.DeadlineExceeded),
		fmt.Errorf("open /proc/1/ns/net: %w", errors.New("no such file")),
	} {
		got := peerDialError(err)
		if strings.Contains(got, "/") || strings.Contains(got, "netns") {
			t.Errorf("peerDialError(%v) = %q names a local path", err, got)
		}
	}
	if got := peerDialError(fmt.Errorf("x: %w", syscall.ECONNREFUSED)); got != "connection refused" {
		t.Errorf("peerDialError(ECONNREFUSED) = %q", got)
	}
}

// Every socket the tunnel holds gets keepalive and TCP_USER_TIMEOUT: set on
// dialled sockets before they connect, and inherited by accepted ones from
// their listener, with nothing set per accepted connection (the runtime's
// 15 s default included).
func TestTunnelSocketsKeepAlive(t *testing.T) {
	const self = "/proc/self/ns/net"
	ctx := context.Background()
	l, err := netns.Listen(ctx, self, "tcp", "127.0.0.1:0", netns.SocketOptions{KeepAlive: tunnelKeepAlive})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	d, err := netns.Dial(ctx, self, "tcp", l.Addr().String(), netns.SocketOptions{KeepAlive: tunnelKeepAlive})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	a := <-accepted
	defer a.Close()
	for name, c := range map[string]net.Conn{"dialled": d, "accepted": a} {
		rc, err := c.(*net.TCPConn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]int{}
		_ = rc.Control(func(fd uintptr) {
			for opt, v := range map[string][2]int{
				"SO_KEEPALIVE":     {unix.SOL_SOCKET, unix.SO_KEEPALIVE},
				"TCP_KEEPIDLE":     {unix.IPPROTO_TCP, unix.TCP_KEEPIDLE},
				"TCP_KEEPINTVL":    {unix.IPPROTO_TCP, unix.TCP_KEEPINTVL},
				"TCP_KEEPCNT":      {unix.IPPROTO_TCP, unix.TCP_KEEPCNT},
				"TCP_USER_TIMEOUT": {unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT},
			} {
				got[opt], _ = unix.GetsockoptInt(int(fd), v[0], v[1])
			}
		})
		want := map[string]int{"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 180, "TCP_KEEPINTVL": 20, "TCP_KEEPCNT": 6, "TCP_USER_TIMEOUT": 300_000}
		for opt, w := range want {
			if got[opt] != w {
				t.Errorf("%s socket: %s = %d, want %d", name, opt, got[opt], w)
			}
		}
	}
}

// A connection leaves with the identity of the pod whose namespace
// captured it, never that of whichever pod its source address names: a
// pod that spoofs another local pod's address (a raw socket,
// IP_TRANSPARENT, the address added to its lo) is reset and counted before
// any dial, on the direct and the service path, and so is a pod whose own
// address the directory still gives to another pod (an address reused
// before the old pod left the directory). Before, both left as the other pod.
func TestOutboundSourceMustBeTheCapturingPod(t *testing.T) {
	var logs bytes.Buffer
	tun := newTestTunnel(t, &logs)
	tun.Update(&State{Dir: waypointDir(t, nil)})
	client := testPod(tun, "uid-client", netip.MustParseAddr("10.1.0.1"))
	reused := testPod(tun, "uid-newcomer", netip.MustParseAddr("10.1.0.3"))
	for _, tc := range []struct {
		p        *pod
		src, dst string
	}{
		{client, "10.1.0.2:40000", "10.1.0.3:8080"}, // the server's address, to a meshed pod
		{client, "10.1.0.2:40001", "10.96.0.2:80"},  // the same, to a service VIP
		{reused, "10.1.0.3:40002", "10.1.0.2:8080"}, // its own address, still "other" in the directory
		{reused, "10.1.0.3:40003", "10.96.0.2:80"},
	} {
		c := newFakeConn(tc.dst, tc.src)
		tc.p.handleOutbound(c)
		if !c.closed.Load() {
			t.Errorf("pod %s, %s -> %s: connection left open", tc.p.uid, tc.src, tc.dst)
		}
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.failClosed.WithLabelValues("foreign_source")); got != 4 {
		t.Errorf("fail_closed{foreign_source} = %v, want 4", got)
	}
	// The log is rate-limited: the first refusal names its reason.
	if !strings.Contains(logs.String(), "not an address of pod uid-client") {
		t.Errorf("refusal not logged with the reason:\n%s", logs.String())
	}
	if _, _, err := reused.self(netip.MustParseAddr("10.1.0.3")); err == nil || !strings.Contains(err.Error(), "belongs to mesh/other") {
		t.Errorf("self of a reused address: %v, want it to name the directory's pod", err)
	}
}

// A plaintext connection whose original destination is another pod's
// address (a neighbour routed it via this pod's MAC; the transparent
// listener takes any address) is reset and counted, never dialled: served,
// this pod's tunnel would have opened a connection to pod b for the client.
func TestInboundPlaintextToAnotherPodsAddressRefused(t *testing.T) {
	tun := newTestTunnel(t, nil)
	app, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()
	tun.Update(&State{Dir: testDir(t,
		podObj("mesh", "a", "a-sa", "127.0.0.1", nil),
		podObj("mesh", "b", "b-sa", "127.0.0.2", nil))})
	a := testPod(tun, "uid-a", netip.MustParseAddr("127.0.0.1"))
	inOwnNamespace(t, a)
	c := newFakeConn(app.Addr().String(), "127.0.0.3:40000")
	a.handleInboundPlaintext(c)
	if !c.closed.Load() {
		t.Error("the connection to pod b's address was not closed")
	}
	var refused float64
	for k, v := range promtest.Scrape(t, tun.cfg.Metrics.policyDenials) {
		if strings.Contains(k, `reason="foreign_destination"`) {
			refused += v
		}
	}
	if refused != 1 {
		t.Errorf(`redirector_policy_denials_total{reason="foreign_destination"} = %v, want 1`, refused)
	}
	_ = app.(*net.TCPListener).SetDeadline(time.Now().Add(300 * time.Millisecond))
	if got, err := app.Accept(); err == nil {
		got.Close()
		t.Errorf("pod a's tunnel dialled pod b's address for a plaintext client (pod b saw %v)", got.RemoteAddr())
	}
}
