package admin

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
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
		c, err := net.DialTimeout("unix", sock, time.Second)
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
	for i := range 20 {
		line, err := askFromChild(t, sock)
		if err != nil || !strings.HasPrefix(line, "HTTP/1.1 200") {
			t.Fatalf("probe %d amid a fast flood of stalled clients: %q, %v; want 200", i, line, err)
		}
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

// askFromChild asks the readiness socket from a process of its own (curl),
// as `redirector ready` does, and returns the status line. As that one, it
// tries again for 2 s while the socket's backlog is full (curl's exit 7:
// the connect refused).
func askFromChild(t *testing.T, sock string) (string, error) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		out, err := exec.Command("curl", "-sS", "-i", "--max-time", "2", "--unix-socket", sock, "http://agent/healthz/ready").CombinedOutput()
		line, _, _ := strings.Cut(string(out), "\n")
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ExitCode() == 7 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if err != nil {
			return line, fmt.Errorf("curl: %w: %s", err, out)
		}
		return line, nil
	}
}
