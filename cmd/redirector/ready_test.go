package main

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

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
