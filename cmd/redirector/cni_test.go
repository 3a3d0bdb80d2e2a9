package main

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/cni"
)

// TestServeCNIRefusesUnservableSocket: a CNI_SOCKET the agent cannot serve
// stops it at start, naming the setting. Before, the server's error was
// logged once and the agent went on, ready, while every ADD of an ambient
// pod failed as if the agent were down (and a surge upgrade retired the
// old agent, which still served the socket).
func TestServeCNIRefusesUnservableSocket(t *testing.T) {
	noAnswer := func(context.Context, cni.PodEvent) (cni.Response, error) { return cni.Response{}, nil }
	log := slog.New(slog.DiscardHandler)

	open := filepath.Join(t.TempDir(), "open")
	if err := os.Mkdir(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	notSocket := filepath.Join(t.TempDir(), "cni.sock")
	if err := os.WriteFile(notSocket, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{filepath.Join(open, "cni.sock"), notSocket} {
		ctx, cancel := context.WithCancel(context.Background())
		_, err := serveCNI(ctx, cni.NewServer(path, noAnswer, log), log)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "--cni-socket (CNI_SOCKET): ") || !strings.Contains(err.Error(), path[:len(path)-len("/cni.sock")]) {
			t.Errorf("serveCNI(%s) = %v, want an error naming --cni-socket (CNI_SOCKET) and the path", path, err)
		}
	}

	// A socket it can serve: ready while it serves.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := cni.NewServer(filepath.Join(t.TempDir(), "cni.sock"), noAnswer, log)
	ready, err := serveCNI(ctx, srv, log)
	if err != nil {
		t.Fatal(err)
	}
	<-srv.Ready()
	if ok, reason := ready(); !ok {
		t.Errorf("ready() = false, %q while serving", reason)
	}
}
