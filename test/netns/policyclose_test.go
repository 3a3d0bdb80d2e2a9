package netnstest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// openEcho opens a connection from p to dst (through the mesh when p is
// enrolled) and checks that it echoes.
func openEcho(t *testing.T, p *Pod, dst netip.AddrPort) net.Conn {
	t.Helper()
	var c net.Conn
	Eventually(t, 10*time.Second, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		var err error
		if c, err = netns.Dial(ctx, p.Path(), "tcp", dst.String(), netns.SocketOptions{}); err != nil {
			return err
		}
		if err := echoes(c, "hello"); err != nil {
			c.Close()
			return err
		}
		return nil
	})
	t.Cleanup(func() { c.Close() })
	return c
}

// echoes sends one line on c and expects it back within 3 s.
func echoes(c net.Conn, line string) error {
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, line+"\n"); err != nil {
		return err
	}
	got, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if got != line+"\n" {
		return fmt.Errorf("echoed %q, want %q", got, line)
	}
	return nil
}

// waitClosed waits for the peer to close or reset c; a read that times
// out means the connection is still open.
func waitClosed(c net.Conn, timeout time.Duration) error {
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	buf := make([]byte, 64)
	for {
		_, err := c.Read(buf)
		switch {
		case err == nil:
			continue
		case errors.Is(err, os.ErrDeadlineExceeded):
			return fmt.Errorf("still open after %v", timeout)
		default:
			return nil // EOF or reset: closed
		}
	}
}

// TestPolicyChangeClosesOpenConnections: an open connection that a new
// AuthorizationPolicy or PeerAuthentication no longer allows is closed by
// the destination's agent; connections still allowed stay open. Before the
// fix, policies applied to new connections only, and the denied
// connections stayed open for their life.
func TestPolicyChangeClosesOpenConnections(t *testing.T) {
	ms, client, server, plain := meshed(t)
	ServeTCP(t, server, 9000, func(c net.Conn) { _, _ = io.Copy(c, c) })
	dst := netip.AddrPortFrom(server.IPv4, 9000)
	meshedConn := openEcho(t, client, dst) // HBONE, as client-sa
	plainConn := openEcho(t, plain, dst)   // plaintext, PERMISSIVE by default

	// DENY client-sa: its open HBONE connection is closed, the plaintext
	// one (no principal) stays.
	deny := clientPrincipalPolicy("deny-client", "DENY")
	ms.rewrite(t, client, server, plain, deny)
	if err := waitClosed(meshedConn, 10*time.Second); err != nil {
		t.Errorf("meshed connection denied by the new policy: %v", err)
	}
	if err := echoes(plainConn, "still here"); err != nil {
		t.Errorf("plaintext connection still allowed was broken: %v", err)
	}
	ms.agents[1].WaitLog(t, "no longer allows", 5*time.Second)
	if log := ms.agents[1].Log(); !strings.Contains(log, "authorization=1") {
		t.Errorf("the server's agent did not count one connection closed by authorization:\n%s", tail(log, 20))
	}

	// STRICT for the namespace: the plaintext connection is closed now,
	// while a new meshed connection from another identity would pass.
	strict := strictMesh
	ms.rewrite(t, client, server, plain, deny, strict)
	if err := waitClosed(plainConn, 10*time.Second); err != nil {
		t.Errorf("plaintext connection under the new STRICT policy: %v", err)
	}
	ms.agents[1].WaitLog(t, "strict_plaintext=1", 5*time.Second)

	// Removing the policies lets the client connect again.
	ms.rewrite(t, client, server, plain)
	again := openEcho(t, client, dst)
	// An unrelated change (a new, non-matching DENY) leaves it open.
	other := strings.ReplaceAll(deny, "client-sa", "someone-else")
	loads := strings.Count(ms.agents[1].Log(), "loaded manifests")
	ms.rewrite(t, client, server, plain, other)
	Eventually(t, 10*time.Second, func() error {
		if strings.Count(ms.agents[1].Log(), "loaded manifests") == loads {
			return errors.New("the server's agent has not loaded the change yet")
		}
		return nil
	})
	time.Sleep(500 * time.Millisecond) // loaded, then applied by the agent's loop
	if err := echoes(again, "after an unrelated change"); err != nil {
		t.Errorf("connection still allowed was closed by an unrelated policy change: %v", err)
	}
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// holdsPerSource checks the connections one client opened to an app,
// twice perSource of them: perSource echo through the app (appConns counts
// what it accepted), the others were refused at agent's listener kind
// listener over the source limit and counted, the open gauge says
// perSource; once they are closed, it returns to 0.
func holdsPerSource(t *testing.T, agent *Agent, listener string, conns []net.Conn, perSource int64, appConns *atomic.Int64) {
	t.Helper()
	ok := int64(0)
	for i, c := range conns {
		if err := echoes(c, fmt.Sprint(listener, " ", i)); err == nil {
			ok++
		}
	}
	if ok != perSource || appConns.Load() != perSource {
		t.Errorf("%s: %d connections echo and the app saw %d, want %d each (the per-source limit)", listener, ok, appConns.Load(), perSource)
	}
	text := scrape(t, agent, "http://127.0.0.1:15020/metrics")
	if got := metricSum(text, "redirector_tunnel_refused_connections_total", `listener="`+listener+`"`, `limit="source"`); got != float64(perSource) {
		t.Errorf("refused{%s,source} = %v, want %d", listener, got, perSource)
	}
	if got := metricSum(text, "redirector_tunnel_open_connections", `listener="`+listener+`"`); got != float64(perSource) {
		t.Errorf("open %s connections = %v, want %d", listener, got, perSource)
	}
	for _, c := range conns {
		c.Close()
	}
	Eventually(t, 5*time.Second, func() error {
		if n := metricSum(scrape(t, agent, "http://127.0.0.1:15020/metrics"), "redirector_tunnel_open_connections", `listener="`+listener+`"`); n != 0 {
			return fmt.Errorf("%v %s connections still open after the client closed them", n, listener)
		}
		return nil
	})
}

// TestPlaintextFloodBoundedAndQuiet: plaintext connections from one
// client address beyond MAX_CONNECTIONS_PER_SOURCE are reset at accept and
// counted, never reach the app; so are a meshed client's HBONE tunnels
// beyond their own per-source budget (refused with 503); a flood of refused connections (STRICT)
// is counted one by one but logged in a line or two, not one per
// connection. Before the fix, the tunnel held every connection and wrote
// one INFO line per refusal.
func TestPlaintextFloodBoundedAndQuiet(t *testing.T) {
	const perSource = 20
	// Both pods enrolled (meshedWith waits for it): a client pod not yet
	// enrolled reaches the server in plaintext, where the per-source limit
	// resets its later connects.
	ms, client, server, plain := meshedWith(t, []string{"--max-connections-per-source", fmt.Sprint(perSource)})
	var appConns atomic.Int64
	ServeTCP(t, server, 9000, func(c net.Conn) { appConns.Add(1); _, _ = io.Copy(c, c) })
	dst := netip.AddrPortFrom(server.IPv4, 9000)
	openEcho(t, plain, dst).Close()
	// "pod enrolled" can be logged before the client's connections are
	// captured: CI once saw its 21st meshed connect reset by the server's
	// plaintext per-source limit. A connection held open shows on the client
	// agent's outbound listener once they are.
	Eventually(t, 10*time.Second, func() error {
		c := openEcho(t, client, dst)
		defer c.Close()
		if n := metricSum(scrape(t, ms.agents[0], "http://127.0.0.1:15020/metrics"), "redirector_tunnel_open_connections", `listener="outbound"`); n == 0 {
			return fmt.Errorf("the client's connection to %s is not captured", dst)
		}
		return nil
	})
	Eventually(t, 5*time.Second, func() error {
		for _, l := range []string{"inbound", "hbone"} {
			if n := metricSum(scrape(t, ms.agents[1], "http://127.0.0.1:15020/metrics"), "redirector_tunnel_open_connections", `listener="`+l+`"`); n != 0 {
				return fmt.Errorf("%v %s connections still open", n, l)
			}
		}
		return nil
	})
	appConns.Store(0)

	// Twice the per-source limit, all held open. A refused connection is
	// reset so soon that its connect may already fail.
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range 2 * perSource {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		c, err := netns.Dial(ctx, plain.Path(), "tcp", dst.String(), netns.SocketOptions{})
		cancel()
		switch {
		case err == nil:
			conns = append(conns, c)
		case !errors.Is(err, syscall.ECONNRESET):
			t.Fatalf("connect: %v", err)
		}
	}
	holdsPerSource(t, ms.agents[1], "inbound", conns, perSource, &appConns)
	conns = nil

	// Meshed: HBONE tunnels from one client pod have a per-source budget of
	// their own (each holds an app socket on the server's node). Over it, the
	// CONNECT is refused with 503 before any dial, so the client's
	// connection ends without reaching the app. As above, the refusal
	// can come so soon (a 503 over the pooled connection, then the
	// client agent's reset) that the app's connect already fails.
	appConns.Store(0)
	for range 2 * perSource {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		c, err := netns.Dial(ctx, client.Path(), "tcp", dst.String(), netns.SocketOptions{})
		cancel()
		switch {
		case err == nil:
			conns = append(conns, c)
		case !errors.Is(err, syscall.ECONNRESET):
			t.Fatalf("meshed connect: %v", err)
		}
	}
	holdsPerSource(t, ms.agents[1], "hbone", conns, perSource, &appConns)
	conns = nil

	// STRICT: a flood of refused plaintext connections.
	strict := strictMesh
	ms.rewrite(t, client, server, plain, strict)
	WaitRefused(t, plain, URL(server.IPv4, 9000), 10*time.Second)
	denials := func() float64 {
		return metricSum(scrape(t, ms.agents[1], "http://127.0.0.1:15020/metrics"), "redirector_policy_denials_total", `reason="strict_plaintext"`)
	}
	before := denials()
	const flood = 300
	refused := 0
	for range flood {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		c, err := netns.Dial(ctx, plain.Path(), "tcp", dst.String(), netns.SocketOptions{})
		cancel()
		switch {
		case err == nil:
			if waitClosed(c, 3*time.Second) == nil {
				refused++
			}
			c.Close()
		case errors.Is(err, syscall.ECONNRESET):
			refused++
		}
	}
	if refused < flood*9/10 {
		t.Errorf("only %d of %d connections were accepted and then refused", refused, flood)
	}
	// A reset connect may also come from elsewhere (a reused source port:
	// issue 15), so the count is checked against most of the flood.
	if got := denials() - before; got < flood*9/10 {
		t.Errorf("strict_plaintext denials grew by %v during a flood of %d refused connections", got, refused)
	}
	if lines := strings.Count(ms.agents[1].Log(), `msg="plaintext connection refused: mTLS is STRICT"`); lines > 3 {
		t.Errorf("%d log lines for %d refused connections, want a few (rate-limited)", lines, refused)
	}
}

// TestAcceptSurvivesFDExhaustion: with the agent's fd limit lowered and
// then exhausted by connections it is holding, the inbound accept
// loop backs off instead of exiting, and once fds are free again new
// connections are served. Before the fix, the first EMFILE ended the loop
// for good: the listener stayed open, the capture kept handing it SYNs,
// and every later connection hung.
func TestAcceptSurvivesFDExhaustion(t *testing.T) {
	ms, _, server, plain := meshed(t)
	ServeTCP(t, server, 9000, func(c net.Conn) { _, _ = io.Copy(c, c) })
	dst := netip.AddrPortFrom(server.IPv4, 9000)
	openEcho(t, plain, dst).Close()

	a := ms.agents[1]
	pid := a.cmd.Process.Pid
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	var old unix.Rlimit
	low := unix.Rlimit{Cur: uint64(len(fds) + 16), Max: 0}
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, nil, &old); err != nil {
		t.Fatal(err)
	}
	low.Max = old.Max
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &low, nil); err != nil {
		t.Fatal(err)
	}
	restored := false
	restore := func() {
		if !restored {
			restored = true
			if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &old, nil); err != nil {
				t.Errorf("restore the agent's fd limit: %v", err)
			}
		}
	}
	defer restore()

	// Fill the agent's spare fds with connections to the pod's HBONE port
	// that never start their TLS handshake: the agent holds each for its
	// handshake timeout (10 s) without opening anything else. Plaintext
	// connections would not do: each served one also needs an fd for the
	// dial to the app, and when that dial fails first the accepted fd is
	// freed again, so the accept itself might never see EMFILE.
	var conns []net.Conn
	dial := func(to netip.AddrPort) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if c, err := netns.Dial(ctx, plain.Path(), "tcp", to.String(), netns.SocketOptions{}); err == nil {
			conns = append(conns, c)
		}
	}
	for range 40 {
		dial(netip.AddrPortFrom(server.IPv4, 15008))
	}
	// Now the inbound plaintext listener's accept has no fd to take, once the
	// HBONE listener has taken the last one: more HBONE connections wait in its
	// backlog than the limit left room for, and its accept loop, backing off
	// for at most a second, takes any fd the agent frees (a transient file,
	// or a plaintext connection whose dial to the app failed for want of an
	// fd). So plaintext connections keep coming until one meets EMFILE at
	// accept, which none can do while a transient fd happens to be free.
	backoff := regexp.MustCompile(`accept failed; retrying with backoff.* port=15006 .*too many open files`)
	Eventually(t, 5*time.Second, func() error {
		dial(dst)
		if !backoff.MatchString(a.Log()) {
			return fmt.Errorf("no EMFILE backoff logged for port 15006:\n%s", tail(a.Log(), 20))
		}
		return nil
	})
	for _, c := range conns {
		c.Close()
	}
	restore()
	// New connections are served, and the agent is ready again.
	openEcho(t, plain, dst).Close()
	a.WaitLog(t, "accepting again", 5*time.Second)
	Eventually(t, 10*time.Second, func() error {
		if out := scrape(t, a, "http://127.0.0.1:15021/healthz/ready"); !strings.Contains(out, "ready") || strings.Contains(out, "not ready") {
			return fmt.Errorf("readiness: %s", out)
		}
		return nil
	})
	if got := metricSum(scrape(t, a, "http://127.0.0.1:15020/metrics"), "redirector_tunnel_accept_errors_total", `listener="inbound"`); got == 0 {
		t.Error("redirector_tunnel_accept_errors_total{listener=inbound} is 0 after EMFILE")
	}
}
