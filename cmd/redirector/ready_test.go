package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/admin"
)

// `redirector ready` answers for the agent serving its socket: exit 0 with
// "ready" while the agent is, an error naming the reason while it is not,
// and an error naming the socket when nothing serves it.
func TestReadyAsksTheReadinessSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "ready.sock")
	var ready atomic.Bool
	s, err := admin.Start(context.Background(), admin.Options{
		ReadinessSocket: sock,
		Ready: func() (bool, string) {
			if ready.Load() {
				return true, ""
			}
			return false, "first reconcile not done"
		},
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if err := runReady(ctx, []string{"--socket", sock}); err == nil || !strings.Contains(err.Error(), "not ready: first reconcile not done") {
		t.Errorf("not ready: %v, want the reason", err)
	}
	ready.Store(true)
	if err := runReady(ctx, []string{"--socket", sock}); err != nil {
		t.Errorf("ready: %v", err)
	}
	s.Close()
	if err := runReady(ctx, []string{"--socket", sock, "--timeout", "1s"}); err == nil || !strings.Contains(err.Error(), sock) {
		t.Errorf("nothing serving the socket: %v, want an error naming it", err)
	}
	if err := runReady(ctx, nil); err == nil || !strings.Contains(err.Error(), "--socket") {
		t.Errorf("no socket given: %v, want an error naming --socket", err)
	}
}

// TestReadyRetriesFullBacklog: a unix socket whose listen backlog is full
// refuses a connect at once (EAGAIN) rather than queueing it, and clients
// that open connections faster than the agent accepts them fill it for
// moments. `redirector ready` failed the startup probe at the first such
// moment; it now tries again until its timeout.
func TestReadyRetriesFullBacklog(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "ready.sock")
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: sock}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 1); err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "listener")
	l, err := net.FileListener(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	// Fill the backlog: connects until one is refused.
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for {
		c, err := net.Dial("unix", sock)
		if err != nil {
			if !errors.Is(err, syscall.EAGAIN) {
				t.Fatalf("filling the backlog: %v, want EAGAIN once full", err)
			}
			break
		}
		held = append(held, c)
	}
	// The agent catches up a moment later.
	go func() {
		time.Sleep(300 * time.Millisecond)
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ready") }),
			ReadHeaderTimeout: 100 * time.Millisecond}
		_ = srv.Serve(l)
	}()
	if err := runReady(context.Background(), []string{"--socket", sock, "--timeout", "3s"}); err != nil {
		t.Errorf("ready with the backlog full for a moment: %v, want ready", err)
	}
}
