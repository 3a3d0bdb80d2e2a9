package admin

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// askSocket sends GET /healthz/ready over the unix socket at path, as
// `redirector ready` does, and returns the status line.
func askSocket(path string, timeout time.Duration) (string, error) {
	c, err := net.DialTimeout("unix", path, timeout)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte("GET /healthz/ready HTTP/1.1\r\nHost: agent\r\n\r\n")); err != nil {
		return "", err
	}
	return bufio.NewReader(c).ReadString('\n')
}

// TestReadinessSocketBoundsConnections: the readiness socket is the startup
// probe's (`redirector ready`). Before, it held every connection it
// accepted, for up to the 5 s header timeout, with no bound and no count: a
// client that opened connections and sent nothing, or half a request, made
// the agent hold as many descriptors and goroutines as it liked, out of
// those it shares with every pod's data path. Now it holds a bounded
// number, counted, and a connection over the bound evicts the oldest one
// (an honest probe sends its request at once and is answered in
// microseconds, so the oldest is a stalled one): the probe is still
// answered while stalled clients keep coming.
func TestReadinessSocketBoundsConnections(t *testing.T) {
	reg := prometheus.NewRegistry()
	sock := filepath.Join(t.TempDir(), "ready.sock")
	start(t, Options{Registry: reg, ReadinessSocket: sock})

	const n = 200
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for i := range n {
		c, err := dialRetry(sock)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		conns = append(conns, c)
		if i%2 == 0 {
			// half a request (slowloris); the others send nothing
			if _, err := c.Write([]byte("GET /healthz/ready HTTP/1.1\r\n")); err != nil {
				t.Fatal(err)
			}
		}
	}
	time.Sleep(300 * time.Millisecond)
	if open := stillOpen(t, conns); open > maxConnsPerSource {
		t.Errorf("%d stalled connections to the readiness socket held open, want at most %d", open, maxConnsPerSource)
	}
	if got := metricValue(t, reg, "redirector_endpoint_open_connections", "readiness_socket"); got < 0 || got > maxConnsPerSource {
		t.Errorf("readiness socket open connections: %v, want a count of at most %d", got, maxConnsPerSource)
	}
	if got := metricValue(t, reg, "redirector_endpoint_evicted_connections_total", "readiness_socket"); got < n-maxConnsPerSource {
		t.Errorf("readiness socket evicted connections: %v, want at least %d", got, n-maxConnsPerSource)
	}
	// The probe is answered with the stalled connections still open.
	line, err := askSocket(sock, 2*time.Second)
	if err != nil || !strings.HasPrefix(line, "HTTP/1.1 200") {
		t.Errorf("probe beside %d stalled connections: %q, %v; want 200", n, line, err)
	}
}

// TestReadinessSocketProbeAmidFlood: stalled clients that keep coming
// (each connection replaced as soon as it is evicted) do not keep the
// probe from its answer.
func TestReadinessSocketProbeAmidFlood(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "ready.sock")
	start(t, Options{ReadinessSocket: sock})
	defer floodSocket(sock, time.Millisecond)()
	time.Sleep(100 * time.Millisecond)
	for i := range 20 {
		line, err := askSocket(sock, 2*time.Second)
		if err != nil || !strings.HasPrefix(line, "HTTP/1.1 200") {
			t.Fatalf("probe %d amid stalled clients: %q, %v; want 200", i, line, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestReadinessSocketProbeAmidFastFlood: one client opening stalled
// connections as fast as it can. With every unix peer one source, each
// new connection evicted the oldest open one, and a probe's connection was
// evicted before it was answered. Each peer process is a source of its own
// now (SO_PEERCRED): over the bound the connection evicted is of the
// process holding the most, so the flooding client only ever evicts its
// own.
func TestReadinessSocketProbeAmidFastFlood(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "ready.sock")
	start(t, Options{ReadinessSocket: sock})
	defer floodSocket(sock, 0)()
	time.Sleep(100 * time.Millisecond)
	const n = 20
	lines, err := askFromChild(sock, n)
	for i, line := range lines {
		if !strings.HasPrefix(line, "HTTP/1.1 200") {
			t.Fatalf("probe %d amid a fast flood of stalled clients: %q; want 200", i, line)
		}
	}
	if err != nil || len(lines) != n {
		t.Fatalf("probe %d amid a fast flood of stalled clients: %v; want 200", len(lines), err)
	}
}

// floodSocket opens stalled connections to the unix socket sock, pausing
// pause after each try (none: as fast as it can), and keeps the last
// 4*maxConnsPerSource of them open (each evicted one replaced at once),
// until the returned stop is called.
func floodSocket(sock string, pause time.Duration) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for ctx.Err() == nil {
			c, err := net.DialTimeout("unix", sock, time.Second)
			if err == nil {
				held = append(held, c)
				if len(held) > 4*maxConnsPerSource {
					held[0].Close()
					held = held[1:]
				}
			}
			time.Sleep(pause)
		}
	}()
	return func() { cancel(); <-done }
}

// askFromChild asks the readiness socket n times from a process of its own
// (this test binary run again, see TestMain), each time as `redirector
// ready` does, and returns the status lines it got. As that one, each ask
// tries the connect again every 10 ms for 2 s while the socket's backlog
// is full (EAGAIN). It was a curl per ask, tried again on its exit 7: a
// process start per try, 0.1 s and more on a CPU the flood keeps busy, so
// 2 s were a dozen tries, not `redirector ready`'s 200, and under -race an
// ask lost that race now and then.
func askFromChild(sock string, n int) ([]string, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d:%s", askChildEnv, n, sock))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(out) == 0 {
		lines = nil
	}
	if err != nil {
		return lines, fmt.Errorf("child: %w: %s", err, stderr.String())
	}
	return lines, nil
}

// askChildEnv tells a run of the test binary by askFromChild to ask a
// socket ("count:path") instead of running the tests.
const askChildEnv = "REDIRECTOR_ADMIN_TEST_ASK_SOCKET"

func TestMain(m *testing.M) {
	if v := os.Getenv(askChildEnv); v != "" {
		os.Exit(askChild(v))
	}
	os.Exit(m.Run())
}

// askChild is the child of askFromChild: it prints the status line of
// each ask, one a line, and fails at the first ask that got none.
func askChild(v string) int {
	count, sock, _ := strings.Cut(v, ":")
	n, err := strconv.Atoi(count)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s=%q: %v\n", askChildEnv, v, err)
		return 2
	}
	for range n {
		line, err := askSocketRetry(sock, 2*time.Second)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println(strings.TrimSpace(line))
	}
	return 0
}

// dialRetry connects to the unix socket at path, trying again for 2 s while
// its listen backlog is full (EAGAIN): connects in a row can come faster
// than the agent accepts them.
func dialRetry(path string) (net.Conn, error) {
	deadline := time.Now().Add(2 * time.Second)
	for {
		c, err := net.DialTimeout("unix", path, time.Second)
		if errors.Is(err, syscall.EAGAIN) && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
			continue
		}
		return c, err
	}
}

// askSocketRetry is askSocket, tried again every 10 ms for d while the
// socket's backlog is full, as `redirector ready` does.
func askSocketRetry(path string, d time.Duration) (string, error) {
	deadline := time.Now().Add(d)
	for {
		line, err := askSocket(path, d)
		if errors.Is(err, syscall.EAGAIN) && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
			continue
		}
		return line, err
	}
}
