// Package cnitest is a fake agent for tests of the CNI plugin and of code
// that talks the pkg/cni protocol: a real cni.Server on a unix socket whose
// handler records every event and answers as the test says.
package cnitest

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/cni"
)

// Agent records events and answers them with Answer.
type Agent struct {
	// Answer decides each response; nil enrolls every ADD and CHECK.
	Answer func(ev cni.PodEvent) (cni.Response, error)

	mu     sync.Mutex
	events []cni.PodEvent
}

// Handle is the agent's cni.Handler.
func (a *Agent) Handle(_ context.Context, ev cni.PodEvent) (cni.Response, error) {
	a.mu.Lock()
	a.events = append(a.events, ev)
	answer := a.Answer
	a.mu.Unlock()
	if answer != nil {
		return answer(ev)
	}
	return cni.Response{Enrolled: ev.Command != cni.CommandDel, Reason: "fake agent enrolls every pod"}, nil
}

// SetAnswer replaces Answer while the server runs.
func (a *Agent) SetAnswer(f func(ev cni.PodEvent) (cni.Response, error)) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.Answer = f
}

// Events returns a copy of the events received so far, in order.
func (a *Agent) Events() []cni.PodEvent {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.events)
}

// Reset forgets the events received so far.
func (a *Agent) Reset() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.events = nil
}

// Serve runs a cni.Server for a on socketPath until the returned stop is
// called or the test ends. It returns once the socket accepts connections.
// stop waits for the server to close and removes the socket; calling it
// again does nothing. Failures are reported on t from the test goroutine.
func Serve(t testing.TB, socketPath string, a *Agent) (stop func()) {
	t.Helper()
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	srv := cni.NewServer(socketPath, a.Handle, log)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-done:
		cancel()
		t.Fatalf("fake agent on %s: %v", socketPath, err)
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatalf("fake agent on %s: not ready after 10s", socketPath)
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("fake agent on %s: %v", socketPath, err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// SocketPath returns a fresh socket path in a short temporary directory:
// t.TempDir() paths can exceed the 108-byte limit of unix socket addresses.
func SocketPath(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "rdcni")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "agent", "cni.sock")
}

// testWriter sends server logs to the test log, so they show with -v or on
// failure only.
type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}
