package netnstest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
)

// upgradeLoad is the traffic an upgrade test runs from one pod to another:
// a loop of short connections (each does one HTTP request and closes) and
// long-lived echo streams that send continuously.
type upgradeLoad struct {
	client, server *Pod

	mu      sync.Mutex
	samples []connSample

	streamErrs  atomic.Int64
	streamLines atomic.Int64
	stop        chan struct{}
	endStreams  chan struct{}
	wg          sync.WaitGroup
}

type connSample struct {
	at      time.Time
	connect time.Duration // the TCP handshake (with the local agent)
	total   time.Duration // connect, request and answer through the mesh
	err     error
}

const echoPort = 9000

// startUpgradeLoad starts the short-connection loop (about rate per second)
// and streams long-lived echo connections.
func startUpgradeLoad(t *testing.T, client, server *Pod, rate, streams int) *upgradeLoad {
	t.Helper()
	ServeTCP(t, server, echoPort, func(c net.Conn) { _, _ = io.Copy(c, c) })
	l := &upgradeLoad{client: client, server: server, stop: make(chan struct{}), endStreams: make(chan struct{})}
	url := netip.AddrPortFrom(server.IPv4, 8080).String()
	want := "server peer=" + client.IPv4.String()
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		tick := time.NewTicker(time.Second / time.Duration(rate))
		defer tick.Stop()
		var inflight sync.WaitGroup
		defer inflight.Wait()
		for {
			select {
			case <-l.stop:
				return
			case <-tick.C:
			}
			inflight.Add(1)
			go func() {
				defer inflight.Done()
				s := l.request(url, want)
				l.mu.Lock()
				l.samples = append(l.samples, s)
				l.mu.Unlock()
			}()
		}
	}()
	echo := netip.AddrPortFrom(server.IPv4, echoPort).String()
	for i := range streams {
		c, err := netns.Dial(context.Background(), client.Path(), "tcp", echo, netns.SocketOptions{})
		if err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			defer c.Close()
			r := bufio.NewReader(c)
			for n := 0; ; n++ {
				select {
				case <-l.endStreams:
					return
				default:
				}
				line := fmt.Sprintf("stream %d line %d\n", i, n)
				c.SetDeadline(time.Now().Add(5 * time.Second))
				if _, err := io.WriteString(c, line); err != nil {
					l.streamErrs.Add(1)
					t.Logf("stream %d write: %v", i, err)
					return
				}
				got, err := r.ReadString('\n')
				if err != nil || got != line {
					l.streamErrs.Add(1)
					t.Logf("stream %d read: %q, %v", i, got, err)
					return
				}
				l.streamLines.Add(1)
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	return l
}

func (l *upgradeLoad) request(url, want string) connSample {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s := connSample{at: time.Now()}
	c, err := netns.Dial(ctx, l.client.Path(), "tcp", url, netns.SocketOptions{})
	s.connect = time.Since(s.at)
	if err != nil {
		s.err = fmt.Errorf("connect: %w", err)
		return s
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: server\r\n\r\n"); err != nil {
		s.err = fmt.Errorf("request: %w", err)
		return s
	}
	b, err := io.ReadAll(c)
	s.total = time.Since(s.at)
	if err != nil {
		s.err = fmt.Errorf("answer: %w", err)
	} else if !bytes.Contains(b, []byte(want)) {
		s.err = fmt.Errorf("unexpected answer %q", b)
	}
	return s
}

// synRetrans reads TcpExt TCPSynRetrans of the namespace at path: SYNs the
// pods' kernels sent again because the first met no answer.
func synRetrans(t *testing.T, path string) int64 {
	t.Helper()
	var v int64 = -1
	err := netns.Do(path, func() error {
		// /proc/net is the thread group leader's namespace's, not this
		// thread's: thread-self is the one netns.Do entered.
		b, err := os.ReadFile("/proc/thread-self/net/netstat")
		if err != nil {
			return err
		}
		lines := strings.Split(string(b), "\n")
		for i := 0; i+1 < len(lines); i += 2 {
			names, vals := strings.Fields(lines[i]), strings.Fields(lines[i+1])
			if len(names) == 0 || names[0] != "TcpExt:" {
				continue
			}
			for j, n := range names {
				if n == "TCPSynRetrans" && j < len(vals) {
					v, err = strconv.ParseInt(vals[j], 10, 64)
					return err
				}
			}
		}
		return fmt.Errorf("no TcpExt TCPSynRetrans")
	})
	if err != nil {
		t.Fatalf("netstat of %s: %v", path, err)
	}
	return v
}

var openedRe = regexp.MustCompile(`(?m)^istio_tcp_connections_opened_total\{[^}]*\} ([0-9.e+]+)$`)

// openedTotal sums istio_tcp_connections_opened_total of the agent whose
// metrics endpoint is at addr in node n's namespace.
func openedTotal(t *testing.T, n *Node, addr string) (float64, error) {
	t.Helper()
	out, err := CurlFrom(n.Path(), "http://"+addr+"/metrics")
	if err != nil {
		return 0, err
	}
	var sum float64
	for _, m := range openedRe.FindAllStringSubmatch(out, -1) {
		v, _ := strconv.ParseFloat(m[1], 64)
		sum += v
	}
	return sum, nil
}

func droppedOf(t *testing.T, root string, a netip.Addr) uint64 {
	t.Helper()
	m, err := maps.OpenPinned(root)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	c, _, err := m.Counters(a)
	if err != nil {
		t.Fatal(err)
	}
	return c.DroppedPackets
}

// TestUpgradeHitlessClientNode and TestUpgradeHitlessServerNode upgrade one
// node's agent under load the way the chart's surge rollout does: the new
// agent starts on the same pin root while the old one runs, becomes ready,
// then the old one gets SIGTERM. No short connection may fail, no SYN may
// be dropped or sent again, no long-lived stream may break; the streams
// stay with the old agent until they end, new connections land on the new
// one.
func TestUpgradeHitlessClientNode(t *testing.T) { testUpgradeHitless(t, 0) }

func TestUpgradeHitlessServerNode(t *testing.T) { testUpgradeHitless(t, 1) }

func testUpgradeHitless(t *testing.T, node int) {
	ms, client, server, _ := meshed(t, strictMesh)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[node]
	n := old.Node
	retrans0 := synRetrans(t, client.Path())
	dropped0 := droppedOf(t, old.BPFRoot, client.IPv4) + droppedOf(t, old.BPFRoot, server.IPv4)

	load := startUpgradeLoad(t, client, server, 200, 20)
	iperf := startIperf(t, client, server, 7*time.Second)
	time.Sleep(time.Second)

	upgradeStart := time.Now()
	next := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot,
		Args: []string{"--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}})
	Eventually(t, 20*time.Second, func() error {
		_, err := curlOK(n.Path(), "http://127.0.0.1:25021/healthz/ready")
		return err
	})
	readyAt := time.Now()
	// Both agents serve; the old one stops changing the enrollment.
	old.WaitLog(t, "a newer agent holds the node", 10*time.Second)
	newAtReady, err := openedTotal(t, n, "127.0.0.1:25020")
	if err != nil {
		t.Fatal(err)
	}
	// The new agent took the old one's listeners instead of opening its own.
	next.WaitLog(t, "pod listeners taken over from the predecessor", time.Second)
	time.Sleep(time.Second) // both serve, accepting from the same sockets
	newBefore, err := openedTotal(t, n, "127.0.0.1:25020")
	if err != nil {
		t.Fatal(err)
	}
	oldBefore, err := openedTotal(t, n, "127.0.0.1:15020")
	if err != nil {
		t.Fatal(err)
	}
	termAt := time.Now()
	stopped := make(chan error, 1)
	go func() { stopped <- old.Stop(30 * time.Second) }()
	time.Sleep(2 * time.Second) // the streams run on the draining agent
	linesAtEnd := load.streamLines.Load()
	close(load.endStreams)
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	exitAt := time.Now()
	time.Sleep(time.Second) // the new agent alone
	iperfOut, iperfErr := iperf()
	close(load.stop)
	load.wg.Wait()
	samples := load.samples
	newAfter, err := openedTotal(t, n, "127.0.0.1:25020")
	if err != nil {
		t.Fatal(err)
	}

	// The old agent closes its listeners as it starts draining; on a busy
	// machine that can be some milliseconds after the signal was sent.
	closedAt := logTimeOf(t, old.Log(), "shutting down: draining connections", termAt)
	// Connections begun within handoffGrace of it may still be the old agent's, and rightly:
	// the log line comes just before the listeners close (and its time is cut to the
	// millisecond), and on the server node a stream the client's agent opened on its pooled
	// HBONE connection before the old agent's GOAWAY reached it is served there, as HTTP/2's
	// graceful shutdown intends. Every connection begun after that must be the new agent's.
	const handoffGrace = 250 * time.Millisecond
	var failed, afterTerm, inGrace int
	var maxConnect, maxTotal time.Duration
	var firstErr error
	for _, s := range samples {
		if s.err != nil {
			failed++
			if firstErr == nil {
				firstErr = s.err
			}
			continue
		}
		switch {
		case !s.at.Before(closedAt.Add(handoffGrace)):
			afterTerm++
		case !s.at.Before(closedAt):
			inGrace++
		}
		maxConnect, maxTotal = max(maxConnect, s.connect), max(maxTotal, s.total)
	}
	retrans := synRetrans(t, client.Path()) - retrans0
	dropped := droppedOf(t, old.BPFRoot, client.IPv4) + droppedOf(t, old.BPFRoot, server.IPv4) - dropped0
	elapsed := samples[len(samples)-1].at.Sub(samples[0].at)
	t.Logf("upgrade of node %d: %d connections in %s (%.0f/s), %d failed (first: %v), connect max %s, request max %s, "+
		"SYN retransmissions %d, captured packets dropped %d; new agent ready %s after start; old agent exited %s after SIGTERM; "+
		"stream lines %d (%d by SIGTERM+2s), stream errors %d; connections opened on the new agent after SIGTERM %.0f, of them %d begun after the hand-off's grace (%d within it), on the old before SIGTERM %.0f",
		node, len(samples), elapsed.Round(time.Millisecond), float64(len(samples))/elapsed.Seconds(), failed, firstErr,
		maxConnect.Round(time.Microsecond), maxTotal.Round(time.Microsecond), retrans, dropped,
		readyAt.Sub(upgradeStart).Round(time.Millisecond), exitAt.Sub(termAt).Round(time.Millisecond),
		load.streamLines.Load(), linesAtEnd, load.streamErrs.Load(), newAfter-newBefore, afterTerm, inGrace, oldBefore)
	t.Logf("while both agents served (1 s), the new one opened %.0f connections", newBefore-newAtReady)
	t.Logf("iperf3 flow through the upgrade: %s", iperfOut)
	if iperfErr != nil {
		t.Errorf("the iperf3 flow broke during the upgrade: %v", iperfErr)
	}
	t.Logf("over time (250 ms buckets from the first connection; R new agent ready, T SIGTERM, X old agent exited):\n%s",
		timeline(samples, map[string]time.Time{"R": readyAt, "T": termAt, "X": exitAt}))
	if failed > 0 {
		t.Errorf("%d of %d connections failed during the upgrade (first: %v)", failed, len(samples), firstErr)
	}
	if retrans != 0 || dropped != 0 {
		t.Errorf("%d SYN retransmissions, %d captured packets dropped: a SYN met no listener during the upgrade", retrans, dropped)
	}
	if e := load.streamErrs.Load(); e != 0 {
		t.Errorf("%d long-lived streams broke during the upgrade", e)
	}
	// Every connection begun after the hand-off's grace was served by the new agent (the old
	// one's listeners closed at once, its queue moved over); on the server node the new agent
	// counts it at the inbound side.
	if newAfter-newBefore < float64(afterTerm) {
		t.Errorf("new agent opened %.0f connections after SIGTERM, want at least the %d begun after the hand-off's grace", newAfter-newBefore, afterTerm)
	}
	if !strings.Contains(old.Log(), "closed_at_timeout=0") {
		t.Errorf("the old agent closed connections at the drain timeout; its log:\n%s", lastLines(old.Log(), 20))
	}
	_ = next
}

// logTimeOf is the time of the first line of an agent's log that holds
// msg, or def when there is none.
func logTimeOf(t *testing.T, log, msg string, def time.Time) time.Time {
	t.Helper()
	for line := range strings.Lines(log) {
		if !strings.Contains(line, msg) {
			continue
		}
		if _, rest, ok := strings.Cut(line, "time="); ok {
			stamp, _, _ := strings.Cut(rest, " ")
			if at, err := time.Parse(time.RFC3339Nano, stamp); err == nil {
				return at
			}
		}
		t.Errorf("no time in the log line %q", line)
	}
	return def
}

// curlOK fetches url from the namespace at path and fails unless the
// status is 200.
func curlOK(path, url string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	out, err := Exec(ctx, path, "curl", "-sS", "-f", "--max-time", "3", url)
	return string(out), err
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// TestUpgradeRefusesOtherLayout runs two builds: an agent built with the
// next pinned-map layout version, started (as an upgrade would) on a node
// whose maps the current agent pinned, refuses with the documented message
// and exits; the running agent keeps serving and no pod loses its
// redirection.
func TestUpgradeRefusesOtherLayout(t *testing.T) {
	ms, client, server, _ := meshed(t, strictMesh)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[0]
	before := mustEnrolledNames(t, old.BPFRoot)

	next := filepath.Join(t.TempDir(), "redirector-layout2")
	build := exec.Command("go", "build", "-o", next, "-ldflags",
		"-X github.com/redirector-mesh/redirector/pkg/maps.layoutVersion=2", "github.com/redirector-mesh/redirector/cmd/redirector")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the layout-2 agent: %v: %s", err, out)
	}
	a := StartAgent(t, old.Node, AgentOptions{Binary: next, Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot,
		Args: []string{"--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}})
	select {
	case <-a.done:
	case <-time.After(20 * time.Second):
		t.Fatalf("the layout-2 agent did not exit:\n%s", a.Log())
	}
	for _, want := range []string{"incompatible pinned map layout", "layout version 1", "this agent reads layout 2", "redirector uninstall --bpf-root " + old.BPFRoot} {
		if !strings.Contains(a.Log(), want) {
			t.Errorf("the layout-2 agent's error lacks %q:\n%s", want, lastLines(a.Log(), 10))
		}
	}
	after := mustEnrolledNames(t, old.BPFRoot)
	if len(after) != len(before) {
		t.Errorf("enrolled pods %v after the refused upgrade, want %v", after, before)
	}
	// The running agent serves on, through the mesh (STRICT).
	for range 5 {
		if out, err := Curl(client, URL(server.IPv4, 8080)); err != nil || !strings.Contains(out, "server peer="+client.IPv4.String()) {
			t.Fatalf("after the refused upgrade: %q, %v", out, err)
		}
	}
}

// TestKillUnderLoadFailsClosed kills the client node's agent with SIGKILL
// under the connection loop: nothing goes over the wire in plaintext while
// no agent runs (connections fail or wait instead), and connections succeed
// again once a new agent started on the same pins. The recovery time is
// logged (BENCHMARKS.md), not asserted.
func TestKillUnderLoadFailsClosed(t *testing.T) {
	ms, client, server, _ := meshed(t)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[0]
	wire := Capture(t, client.Node.Path(), "uplink")
	load := startUpgradeLoad(t, client, server, 200, 0)
	time.Sleep(time.Second)
	killAt := time.Now()
	old.Kill()
	time.Sleep(2 * time.Second)
	startAt := time.Now()
	StartAgent(t, old.Node, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot})
	// Run until connections started after the restart succeed for 2 s.
	var firstOK time.Time
	Eventually(t, 20*time.Second, func() error {
		load.mu.Lock()
		defer load.mu.Unlock()
		for _, s := range load.samples {
			if s.err == nil && s.at.After(startAt) && firstOK.IsZero() {
				firstOK = s.at.Add(s.total)
			}
		}
		if firstOK.IsZero() || time.Since(firstOK) < 2*time.Second {
			return fmt.Errorf("no connection served since the restart yet")
		}
		return nil
	})
	close(load.endStreams)
	close(load.stop)
	load.wg.Wait()
	b := wire()

	var down, downOK, after, afterFailed int
	var firstStartedOK time.Time
	for _, s := range load.samples {
		switch {
		case s.at.After(killAt) && s.at.Before(startAt):
			down++
			if s.err == nil {
				downOK++
			}
		case !s.at.Before(firstOK):
			after++
			if s.err != nil {
				afterFailed++
			}
		}
		if s.err == nil && s.at.After(startAt) && (firstStartedOK.IsZero() || s.at.Before(firstStartedOK)) {
			firstStartedOK = s.at
		}
	}
	t.Logf("kill -9: %d connections attempted while no agent ran (%d completed later through the new agent after SYN retransmission), "+
		"first answer %s after the restart began, first connection begun after the restart and served: begun %s after it; "+
		"%d of %d connections since failed",
		down, downOK, firstOK.Sub(startAt).Round(time.Millisecond), firstStartedOK.Sub(startAt).Round(time.Millisecond), afterFailed, after)
	if len(b) == 0 {
		t.Fatal("the capture saw nothing")
	}
	if bytes.Contains(b, []byte("GET / HTTP")) || bytes.Contains(b, []byte("server peer=")) {
		t.Fatal("plaintext request or answer on the wire between the nodes")
	}
	if afterFailed > 0 {
		t.Errorf("%d of %d connections failed after the agent was back", afterFailed, after)
	}
}

// timeline prints one line per 250 ms bucket of samples: connections begun,
// failed, and the slowest connect and request, with marks at the events.
func timeline(samples []connSample, marks map[string]time.Time) string {
	if len(samples) == 0 {
		return ""
	}
	const step = 250 * time.Millisecond
	t0 := samples[0].at
	type bucket struct {
		n, failed        int
		connect, request time.Duration
	}
	var bs []bucket
	for _, s := range samples {
		i := int(s.at.Sub(t0) / step)
		for len(bs) <= i {
			bs = append(bs, bucket{})
		}
		b := &bs[i]
		b.n++
		if s.err != nil {
			b.failed++
			continue
		}
		b.connect, b.request = max(b.connect, s.connect), max(b.request, s.total)
	}
	var out strings.Builder
	for i, b := range bs {
		var ev []string
		for k, at := range marks {
			if j := int(at.Sub(t0) / step); j == i {
				ev = append(ev, k)
			}
		}
		slices.Sort(ev)
		fmt.Fprintf(&out, "  %5.2fs %3d conns %d failed connect-max %6.2fms request-max %6.2fms %s %s\n",
			(time.Duration(i) * step).Seconds(), b.n, b.failed, float64(b.connect.Microseconds())/1000,
			float64(b.request.Microseconds())/1000, strings.Repeat("#", int(b.request.Milliseconds())), strings.Join(ev, ""))
	}
	return out.String()
}

// TestUpgradeNewAgentKilled: kill -9 of the new agent half-way through an
// upgrade (both run, the old one yielded the node) under load. The old
// agent's listeners never closed, so new connections go on through it (the
// killed agent's queued requests migrate to them); only connections the
// killed process held can fail. A restarted new agent claims the node again
// and the upgrade completes with nothing failing.
func TestUpgradeNewAgentKilled(t *testing.T) {
	ms, client, server, _ := meshed(t)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[0]
	n := old.Node
	wire := Capture(t, n.Path(), "uplink")
	load := startUpgradeLoad(t, client, server, 200, 0)
	args := []string{"--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}
	next := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot, Args: args})
	Eventually(t, 20*time.Second, func() error { _, err := curlOK(n.Path(), "http://127.0.0.1:25021/healthz/ready"); return err })
	old.WaitLog(t, "a newer agent holds the node", 10*time.Second)
	time.Sleep(500 * time.Millisecond)
	killAt := time.Now()
	next.Kill()
	time.Sleep(2 * time.Second) // the old agent alone, not enrolling
	restartAt := time.Now()
	StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot, Args: args})
	Eventually(t, 20*time.Second, func() error { _, err := curlOK(n.Path(), "http://127.0.0.1:25021/healthz/ready"); return err })
	if err := old.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	termDone := time.Now()
	time.Sleep(time.Second)
	close(load.endStreams)
	close(load.stop)
	load.wg.Wait()
	b := wire()

	var aroundKill, killFailed, later, laterFailed int
	var firstErr error
	for _, s := range load.samples {
		switch {
		case s.at.After(killAt.Add(-500*time.Millisecond)) && s.at.Before(restartAt):
			aroundKill++
			if s.err != nil {
				killFailed++
				if firstErr == nil {
					firstErr = s.err
				}
			}
		case s.at.After(restartAt):
			later++
			if s.err != nil {
				laterFailed++
			}
		}
	}
	t.Logf("kill -9 of the new agent: %d of %d connections begun from 500 ms before the kill until the restart failed (first: %v); "+
		"%d of %d since the restart failed; upgrade completed %s after the restart",
		killFailed, aroundKill, firstErr, laterFailed, later, termDone.Sub(restartAt).Round(time.Millisecond))
	if bytes.Contains(b, []byte("GET / HTTP")) || bytes.Contains(b, []byte("server peer=")) {
		t.Fatal("plaintext request or answer on the wire between the nodes")
	}
	if laterFailed > 0 {
		t.Errorf("%d of %d connections failed after the new agent was restarted", laterFailed, later)
	}
}

// TestDrainTimeoutClosesCounted: connections still open when DRAIN_TIMEOUT
// runs out are closed, and the agent says how many (log and
// redirector_drain_closed_connections_total, read while it drains).
func TestDrainTimeoutClosesCounted(t *testing.T) {
	var client, server *Pod
	ms := newMeshWith(t, []string{"--drain-timeout", "2s"}, func(tp *Topology, m *Manifest) {
		client = tp.Nodes[0].AddPod("client")
		server = tp.Nodes[1].AddPod("server")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").
			Pod(client, "mesh", "client-sa", "app=client").
			Pod(server, "mesh", "server-sa", "app=server")
	})
	HTTPApp(t, server, 8080, "server")
	ms.agents[0].WaitLog(t, "pod enrolled", 10*time.Second)
	ms.agents[1].WaitLog(t, "pod enrolled", 10*time.Second)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	load := startUpgradeLoad(t, client, server, 1, 3)
	time.Sleep(500 * time.Millisecond)
	old := ms.agents[0]
	drainingSeen := make(chan bool, 1)
	go func() {
		// While it drains, the gauge shows the three streams.
		deadline := time.Now().Add(1500 * time.Millisecond)
		for time.Now().Before(deadline) {
			out, _ := CurlFrom(old.Node.Path(), "http://127.0.0.1:15020/metrics")
			if strings.Contains(out, "redirector_drain_open_connections 3") {
				drainingSeen <- true
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		drainingSeen <- false
	}()
	if err := old.Stop(15 * time.Second); err != nil {
		t.Fatal(err)
	}
	// Each stream notices on its next line (20 ms apart).
	Eventually(t, 5*time.Second, func() error {
		if e := load.streamErrs.Load(); e != 3 {
			return fmt.Errorf("%d streams ended with an error, want the 3 closed at the drain timeout", e)
		}
		return nil
	})
	close(load.endStreams)
	close(load.stop)
	load.wg.Wait()
	if !strings.Contains(old.Log(), "open_connections=3") || !strings.Contains(old.Log(), "closed_at_timeout=3") {
		t.Errorf("drain log: want 3 open, 3 closed at the timeout:\n%s", lastLines(old.Log(), 5))
	}
	if !<-drainingSeen {
		t.Error("redirector_drain_open_connections never showed the 3 streams while draining")
	}
}

// startIperf runs one iperf3 flow from client to server for d; wait returns
// its summary (received rate) or why it failed.
func startIperf(t *testing.T, client, server *Pod, d time.Duration) (wait func() (string, error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d+30*time.Second)
	t.Cleanup(cancel)
	srv := Command(ctx, server.Path(), "iperf3", "-s", "-1", "-p", "5201")
	var srvOut bytes.Buffer // read only once the server has exited
	srv.Stdout, srv.Stderr = &srvOut, &srvOut
	if err := srv.Start(); err != nil {
		t.Fatalf("iperf3 server: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- srv.Wait() }()
	t.Cleanup(func() { _ = srv.Process.Kill(); <-exited })
	// The mesh accepts the client's connection before the server's side is
	// dialled, so a server not yet listening shows as a reset: wait for it,
	// under the test's load, and say why if it gave up.
	start := time.Now()
	Eventually(t, 15*time.Second, func() error {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("iperf3 server exited before listening (%v): %s", err, srvOut.String())
		default:
		}
		out, err := Exec(ctx, server.Path(), "ss", "-Hltn", "sport = :5201")
		if err == nil && len(bytes.TrimSpace(out)) == 0 {
			err = fmt.Errorf("iperf3 server not listening yet")
		}
		return err
	})
	if wait := time.Since(start); wait > 2*time.Second {
		t.Logf("the iperf3 server took %s to listen", wait.Round(time.Millisecond))
	}
	type result struct {
		out string
		err error
	}
	done := make(chan result, 1)
	go func() {
		out, err := Exec(ctx, client.Path(), "iperf3", "-c", server.IPv4.String(), "-p", "5201",
			"-t", strconv.Itoa(int(d.Seconds())), "-J")
		var rep struct {
			End struct {
				SumReceived struct {
					Bytes         float64 `json:"bytes"`
					BitsPerSecond float64 `json:"bits_per_second"`
				} `json:"sum_received"`
			} `json:"end"`
			Error string `json:"error"`
		}
		if jerr := json.Unmarshal(out, &rep); jerr == nil && rep.Error != "" {
			err = fmt.Errorf("%v: %s", err, rep.Error)
		}
		done <- result{fmt.Sprintf("%.0f MB in %s, %.0f Mbit/s received", rep.End.SumReceived.Bytes/1e6, d,
			rep.End.SumReceived.BitsPerSecond/1e6), err}
	}()
	return func() (string, error) {
		r := <-done
		return r.out, r.err
	}
}

// TestTakeoverWithoutHandover: an upgrade from a release without listener
// hand-over (every release before it: their listeners sit in SO_REUSEPORT
// groups, which the new agent's sockets, without it, cannot join), or with
// no hand-over socket set. The old agent's listeners (here: plain ones the
// test holds on the pod's tunnel ports) make the new agent's binds fail
// with EADDRINUSE; the new agent still becomes ready (a
// surge rollout would otherwise wait forever) and takes the ports the
// moment they are released, then serves the pod through the mesh.
func TestTakeoverWithoutHandover(t *testing.T) {
	var held []net.Listener
	var client, server *Pod
	ms := newMeshWith(t, nil, func(tp *Topology, m *Manifest) {
		client = tp.Nodes[0].AddPod("client")
		server = tp.Nodes[1].AddPod("server")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").
			Pod(client, "mesh", "client-sa", "app=client").
			Pod(server, "mesh", "server-sa", "app=server").
			Raw(strictMesh)
		for _, port := range []int{15001, 15006, 15008} {
			l, err := netns.Listen(context.Background(), client.Path(), "tcp", fmt.Sprintf("[::]:%d", port), netns.SocketOptions{})
			if err != nil {
				t.Fatal(err)
			}
			held = append(held, l)
		}
	})
	HTTPApp(t, server, 8080, "server")
	a := ms.agents[0]
	a.WaitLog(t, "pod ports held by another process", 10*time.Second)
	Eventually(t, 10*time.Second, func() error { _, err := curlOK(a.Node.Path(), "http://127.0.0.1:15021/healthz/ready"); return err })
	if _, err := Curl(client, URL(server.IPv4, 8080)); err == nil {
		t.Fatal("a request went through while the agent did not hold the client's ports (not through the mesh?)")
	}
	for _, l := range held {
		l.Close()
	}
	a.WaitLog(t, "serving pod (ports taken over)", 5*time.Second)
	out, err := Curl(client, URL(server.IPv4, 8080))
	if err != nil || !strings.Contains(out, "server peer="+client.IPv4.String()) {
		t.Fatalf("after the take-over: %q, %v", out, err)
	}
}
