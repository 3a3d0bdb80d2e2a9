package main

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/cni"
)

// TestServeCNIUnservableSocketIsNotReady: a CNI socket the agent cannot
// serve makes it not ready, naming CNI_SOCKET and why, and is served once
// put right. Before, the error was logged once and the agent went on
// ready while every ADD of an ambient pod failed as if it were down (and a
// surge upgrade retired the old agent, which still served the socket).
func TestServeCNIUnservableSocketIsNotReady(t *testing.T) {
	noAnswer := func(context.Context, cni.PodEvent) (cni.Response, error) { return cni.Response{}, nil }
	log := slog.New(slog.DiscardHandler)

	open := filepath.Join(t.TempDir(), "open")
	if err := os.Mkdir(open, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	notSocket := filepath.Join(t.TempDir(), "cni.sock")
	if err := os.WriteFile(notSocket, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path, want string
		fix        func() error
	}{
		{filepath.Join(open, "cni.sock"), "--cni-socket (CNI_SOCKET): CNI socket directory " + open + " is writable by group or others",
			func() error { return os.Chmod(open, 0o755) }},
		{notSocket, "--cni-socket (CNI_SOCKET): CNI socket path " + notSocket + " exists and is not a socket",
			func() error { return os.Remove(notSocket) }},
	} {
		ctx, cancel := context.WithCancel(context.Background())
		ready := serveCNI(ctx, cni.NewServer(tc.path, noAnswer, log), 10*time.Millisecond, nil, nil, func() bool { return true }, log)
		waitfor.Until(t, "not ready naming the socket", func() bool {
			ok, reason := ready()
			return !ok && strings.Contains(reason, tc.want)
		})
		if err := tc.fix(); err != nil {
			t.Fatal(err)
		}
		waitfor.Until(t, "ready once the socket can be served", func() bool {
			ok, _ := ready()
			return ok
		})
		if _, err := os.Stat(tc.path); err != nil {
			t.Errorf("socket %s: %v", tc.path, err)
		}
		cancel()
	}
}

// TestServeCNIReinstall: an agent that took the node back from a newer one
// (an upgrade rolled back) installs its CNI socket again over the newer
// agent's, which the rename of that agent's start had put at the path and
// which is dead or gone once it stopped. Before, the path stayed the dead
// agent's: every CNI ADD of an ambient pod on the node failed as if no
// agent ran.
func TestServeCNIReinstall(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	path := filepath.Join(t.TempDir(), "cni.sock")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reinstall := make(chan struct{}, 1)
	var holds atomic.Bool
	holds.Store(true)
	ready := serveCNI(ctx, cni.NewServer(path, func(context.Context, cni.PodEvent) (cni.Response, error) { return cni.Response{}, nil }, log),
		10*time.Millisecond, nil, reinstall, holds.Load, log)
	waitfor.Until(t, "served", func() bool { ok, _ := ready(); return ok })
	// Yielded since: only the take-back's reinstall puts the socket back,
	// not the check of the path.
	holds.Store(false)
	// The newer agent's socket renamed over the path, then the newer agent
	// gone: a stale socket nothing serves.
	newer, err := net.Listen("unix", path+".newer")
	if err != nil {
		t.Fatal(err)
	}
	newer.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := os.Rename(path+".newer", path); err != nil {
		t.Fatal(err)
	}
	newer.Close()
	if _, err := net.Dial("unix", path); err == nil {
		t.Fatal("the stale socket answers")
	}
	holds.Store(true) // taken back
	reinstall <- struct{}{}
	waitfor.Until(t, "the CNI socket installed again", func() bool {
		c, err := net.Dial("unix", path)
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
	if ok, reason := ready(); !ok {
		t.Errorf("not ready after the reinstall: %s", reason)
	}
}

// TestServeCNIHolderTakesPathBack: while the agent holds the node, a socket
// another agent renamed over the path, then removed (a yielded agent that
// installed late and stopped), is replaced by the agent's own within a
// check. Before, the path stayed empty and every CNI ADD failed.
func TestServeCNIHolderTakesPathBack(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	path := filepath.Join(t.TempDir(), "cni.sock")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := serveCNI(ctx, cni.NewServer(path, func(context.Context, cni.PodEvent) (cni.Response, error) { return cni.Response{}, nil }, log),
		10*time.Millisecond, nil, nil, func() bool { return true }, log)
	waitfor.Until(t, "served", func() bool { ok, _ := ready(); return ok })
	other, err := net.Listen("unix", path+".other")
	if err != nil {
		t.Fatal(err)
	}
	other.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := os.Rename(path+".other", path); err != nil {
		t.Fatal(err)
	}
	other.Close()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	waitfor.Until(t, "the CNI socket installed again", func() bool {
		c, err := net.Dial("unix", path)
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
}
