package cni_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/cni/cnitest"
)

// serve runs a server with the given bounds and handler until the test ends.
func serve(t *testing.T, sock string, h cni.Handler, readTimeout time.Duration, maxConns int) *cni.Server {
	t.Helper()
	srv := cni.NewServer(sock, h, quiet)
	cni.SetLimits(srv, readTimeout, maxConns)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-srv.Ready():
	case err := <-done:
		t.Fatal(err)
	}
	return srv
}

// TestServerRefusesOtherUsers: a process that is not root (nor the agent's
// user) gets no answer and its event never reaches the handler, even when
// the socket's mode would let it connect: the mode is set after bind (a
// connection made in between stays open), and a directory mounted with
// other modes must not widen who may enroll pods (seen failing: the
// event of uid 65534 was handled).
func TestServerRefusesOtherUsers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a client as another user")
	}
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Skip("needs curl")
	}
	sock := cnitest.SocketPath(t)
	var mu sync.Mutex
	var handled []cni.PodEvent
	srv := serve(t, sock, func(_ context.Context, ev cni.PodEvent) (cni.Response, error) {
		mu.Lock()
		defer mu.Unlock()
		handled = append(handled, ev)
		return cni.Response{}, nil
	}, 10*time.Second, 16)
	for d := sock; d != "/tmp"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o777); err != nil {
			t.Fatal(err)
		}
	}
	body, _ := json.Marshal(addEvent())
	cmd := exec.Command(curl, "-sS", "--max-time", "5", "--unix-socket", sock, "-d", string(body), "http://agent"+cni.EventPath)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	t.Logf("curl as uid 65534: %v: %s", err, out)
	mu.Lock()
	if len(handled) > 0 {
		t.Errorf("an event from uid 65534 was handled: %+v", handled)
	}
	mu.Unlock()
	if err == nil {
		t.Errorf("uid 65534 got an answer: %s", out)
	}
	if st := srv.Stats(); st.RefusedPeers != 1 {
		t.Errorf("stats %+v, want 1 refused peer", st)
	}
	// Root still gets through.
	if _, err := cni.Notify(context.Background(), sock, addEvent()); err != nil {
		t.Errorf("root's Notify: %v", err)
	}
}

// TestServerBoundsSlowClients: a client that sends its headers and then
// stalls in the body is cut off after the read timeout (seen failing: only
// the headers had a timeout, so it held its connection and goroutine for
// ever), and at most maxConns connections are served at once; the next
// waits (and is counted) until one ends, then is served.
func TestServerBoundsSlowClients(t *testing.T) {
	sock := cnitest.SocketPath(t)
	release := make(chan struct{})
	var mu sync.Mutex
	inHandler := 0
	srv := serve(t, sock, func(ctx context.Context, ev cni.PodEvent) (cni.Response, error) {
		mu.Lock()
		inHandler++
		mu.Unlock()
		select {
		case <-release:
		case <-ctx.Done():
		}
		return cni.Response{}, nil
	}, 300*time.Millisecond, 2)

	// A stalled body.
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"command\":", cni.EventPath)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	_, _ = io.ReadAll(c)
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("a stalled body held its connection for %s, want it cut after the read timeout", d)
	}

	// Two events held in the handler; a third waits for a slot.
	errs := make(chan error, 3)
	for range 3 {
		go func() {
			_, err := cni.Notify(context.Background(), sock, addEvent())
			errs <- err
		}()
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		mu.Lock()
		n := inHandler
		mu.Unlock()
		if n >= 2 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	mu.Lock()
	n := inHandler
	mu.Unlock()
	if n != 2 {
		t.Errorf("%d events in the handler at once, want the bound 2", n)
	}
	if st := srv.Stats(); st.Open != 2 || st.Waited == 0 {
		t.Errorf("stats %+v, want 2 open and a connection that waited", st)
	}
	close(release)
	for range 3 {
		if err := <-errs; err != nil {
			t.Errorf("Notify: %v", err)
		}
	}
	if !strings.Contains(fmt.Sprint(srv.Stats()), "Open:0") {
		t.Logf("stats after: %+v", srv.Stats())
	}
}
