package main

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/tunnel"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/unixsock"
)

// handoverServer is the hand-over socket of a tunnel serving no pod, at a
// fresh path.
func handoverServer(t *testing.T) *tunnel.HandoverServer {
	pool := hbone.NewPool(hbone.PoolOptions{})
	t.Cleanup(func() { pool.Close() })
	tun := tunnel.New(tunnel.Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008,
		Pool: pool, Metrics: tunnel.NewMetrics(prometheus.NewRegistry()), Logger: slog.New(slog.DiscardHandler), NoAccessLog: true})
	return tun.HandoverServer(filepath.Join(t.TempDir(), "handover.sock"))
}

// handoverServed reports whether an agent serves the hand-over socket at
// path, as a successor starting finds it (tunnel.DialPredecessor).
func handoverServed(path string) bool {
	pred, err := tunnel.DialPredecessor(context.Background(), path)
	return err == nil && pred != nil
}

func inodeAt(t *testing.T, path string) uint64 {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatalf("hand-over socket: %v", err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

// TestServeHandoverHolderTakesPathBack: while the agent holds the node, a
// hand-over socket another agent renamed over the path, then removed (of
// two new agents racing for the node, the one that yielded installed last
// and stopped), is replaced by the holder's own within a check. Before, the
// path stayed empty: the next agent found no predecessor and bound the
// pods' ports beside the holder, which failed until the holder exited.
func TestServeHandoverHolderTakesPathBack(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	hs := handoverServer(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	serveHandover(ctx, hs, 10*time.Millisecond, nil, nil, func() bool { return true }, log)
	waitfor.Until(t, "served", func() bool { return handoverServed(hs.Path()) })

	l, ino, err := unixsock.Install("stand-in agent's hand-over socket", hs.Path(), "unixpacket")
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	unixsock.RemoveIfOwn(hs.Path(), ino)
	waitfor.Until(t, "the hand-over socket installed again", func() bool { return handoverServed(hs.Path()) && hs.Installed() })
}

// TestServeHandoverOnlyWhileHeld: an agent that yielded the node before it
// installed its hand-over socket (the predecessor gone, taken once) leaves
// the holder's socket at the path, and installs its own once it holds the
// node again and finds the path no longer the holder's. Before, it
// installed as soon as the predecessor was gone, over the holder's socket.
func TestServeHandoverOnlyWhileHeld(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	hs := handoverServer(t)
	holder, ino, err := unixsock.Install("holder's hand-over socket", hs.Path(), "unixpacket")
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	gone, taken := make(chan struct{}), make(chan struct{})
	close(gone)
	close(taken)
	var holds atomic.Bool
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	serveHandover(ctx, hs, 10*time.Millisecond, gone, taken, holds.Load, log)
	time.Sleep(3 * ownPathCheck)
	if got := inodeAt(t, hs.Path()); got != ino {
		t.Fatalf("a yielded agent installed its hand-over socket over the holder's (inode %d, was %d)", got, ino)
	}

	// The holder stops (gives the node up, removes its socket): this
	// agent takes the node back.
	holder.Close()
	unixsock.RemoveIfOwn(hs.Path(), ino)
	holds.Store(true)
	waitfor.Until(t, "the hand-over socket installed once held", func() bool { return handoverServed(hs.Path()) && hs.Installed() })
}

// TestHandoverServerInstalled: Installed follows the path, as the check of
// serveHandover reads it.
func TestHandoverServerInstalled(t *testing.T) {
	hs := handoverServer(t)
	if hs.Installed() {
		t.Fatal("installed before it was served")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- hs.Serve(ctx) }()
	waitfor.Until(t, "installed", hs.Installed)
	other, err := net.Listen("unixpacket", hs.Path()+".other")
	if err != nil {
		t.Fatal(err)
	}
	other.(*net.UnixListener).SetUnlinkOnClose(false)
	defer other.Close()
	if err := os.Rename(hs.Path()+".other", hs.Path()); err != nil {
		t.Fatal(err)
	}
	if hs.Installed() {
		t.Error("installed with another socket at the path")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(hs.Path()); err != nil {
		t.Errorf("the other socket was removed as the server stopped: %v", err)
	}
}
