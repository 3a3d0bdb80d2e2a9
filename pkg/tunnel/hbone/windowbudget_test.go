package hbone

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

func TestWindowBudget(t *testing.T) {
	a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	w := newWindowBudget(100, 60)
	for _, step := range []struct {
		peer       netip.Addr
		want, got  int64
		reserved   int64
		short      uint64
		releaseNow int64 // given back by peer after the step
	}{
		{a, 40, 40, 40, 0, 0},
		{a, 40, 20, 60, 1, 0},  // a's share
		{b, 50, 40, 100, 2, 0}, // the budget
		{b, 10, 0, 100, 3, 40},
		{b, 30, 30, 90, 3, 0},
	} {
		if got := w.reserve(step.peer, step.want); got != step.got {
			t.Fatalf("reserve(%v, %d) = %d, want %d", step.peer, step.want, got, step.got)
		}
		if w.reserved != step.reserved || w.short != step.short {
			t.Fatalf("after reserve(%v, %d): reserved %d short %d, want %d %d", step.peer, step.want, w.reserved, w.short, step.reserved, step.short)
		}
		w.release(step.peer, netip.Addr{}, step.releaseNow)
	}
	w.release(a, netip.Addr{}, 60)
	w.release(b, netip.Addr{}, 30)
	if w.reserved != 0 || len(w.byPeer) != 0 {
		t.Errorf("all released: reserved %d, peers %v", w.reserved, w.byPeer)
	}
}

// TestReceiveWindowBoundedPerPeer: connections from one client address
// together get at most maxPeerWindow of receive window beyond HTTP/2's
// initial 64 KiB (the preface's connection-level WINDOW_UPDATE), and the
// window is enforced: DATA beyond it is a connection error. Another address
// still gets a full window, and a closed connection's window goes back.
// Before, every connection got 16 MiB, so one client with 1024 connections
// could make the agent hold 16 GiB for applications that do not read.
func TestReceiveWindowBoundedPerPeer(t *testing.T) {
	srv, err := NewServer(ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	// granted is the connection window a new client at src was given.
	granted := func(src netip.Addr) (*rawClient, int64) {
		rc, extra := windowGranted(t, srv, src)
		return rc, defaultWindow + extra
	}
	attacker := netip.MustParseAddr("10.9.0.1")
	const full = connWindow
	var total int64
	var conns []*rawClient
	for range 12 {
		rc, w := granted(attacker)
		total += w - defaultWindow
		conns = append(conns, rc)
	}
	t.Logf("12 connections from one address: %d bytes of window beyond the initial ones (%d per peer allowed)", total, int64(maxPeerWindow))
	if total > maxPeerWindow {
		t.Errorf("one address got %d bytes of window, want at most %d", total, int64(maxPeerWindow))
	}
	if _, w := granted(netip.MustParseAddr("10.9.0.2")); w != full {
		t.Errorf("another address got a %d-byte window, want %d", w, full)
	}
	// The last connection got the initial window only: more is refused.
	last := conns[len(conns)-1]
	if err := last.connect(1, "127.0.0.1:9"); err != nil {
		t.Fatal(err)
	}
	if err := last.fr.WriteData(1, false, make([]byte, defaultWindow+1)); err != nil {
		t.Fatal(err)
	}
	if code := last.goAwayCode(); code != http2.ErrCodeFlowControl {
		t.Errorf("DATA beyond a 64 KiB connection window: GOAWAY %v, want FLOW_CONTROL_ERROR", code)
	}
	// A closed connection gives its window back.
	_ = conns[0].nc.Close()
	var w int64
	for range 100 {
		if _, w = granted(attacker); w == full {
			break
		}
	}
	if w != full {
		t.Errorf("after a connection closed, a new one from its address got %d bytes of window, want %d", w, full)
	}
}

// TestWindowReservedOnlyByLiveConns: a connection closed before it started
// (its idle timer runs from newConn: a preface write that takes longer
// than the idle timeout), or whose preface write fails, holds no receive
// window afterwards. Before the fix start reserved the window after the
// close had given back nothing, and nothing gave it back later.
func TestWindowReservedOnlyByLiveConns(t *testing.T) {
	peer := netip.MustParseAddr("10.77.0.1")
	held := func() int64 {
		windows.mu.Lock()
		defer windows.mu.Unlock()
		return windows.byPeer[peer]
	}
	newPipeConn := func() (*conn, net.Conn) {
		local, remote := net.Pipe()
		go func() { _, _ = io.Copy(io.Discard, remote) }()
		t.Cleanup(func() { local.Close(); remote.Close() })
		nc := addrConn{local, net.TCPAddrFromAddrPort(netip.AddrPortFrom(peer, 15008))}
		return newConn(context.Background(), nc, connConfig{log: slog.New(slog.DiscardHandler)}), remote
	}

	c, _ := newPipeConn()
	c.close(http2.ErrCodeNo, errors.New("idle before it started"), true)
	_ = c.start() // the pipe is still open: the preface goes out
	if n := held(); n != 0 {
		t.Errorf("a connection closed before it started holds %d bytes of window", n)
	}

	c, remote := newPipeConn()
	remote.Close()
	if err := c.start(); err == nil {
		t.Fatal("start wrote its preface to a closed pipe")
	}
	c.close(http2.ErrCodeNo, errors.New("start failed"), false)
	if n := held(); n != 0 {
		t.Errorf("a connection whose start failed holds %d bytes of window", n)
	}

	c, _ = newPipeConn()
	if err := c.start(); err != nil {
		t.Fatal(err)
	}
	if n := held(); n != connWindow-defaultWindow {
		t.Errorf("a started connection holds %d bytes of window, want %d", n, connWindow-defaultWindow)
	}
	c.close(http2.ErrCodeNo, errors.New("done"), false)
	c.close(http2.ErrCodeNo, errors.New("closed twice"), false)
	if n := held(); n != 0 {
		t.Errorf("a closed connection holds %d bytes of window", n)
	}
}

// TestStreamWindowFollowsConnWindow: a connection the budget gave less than
// a full window advertises a quarter of what it got as each stream's
// window (never below HTTP/2's initial 64 KiB), so one stream whose
// application does not read cannot hold the whole connection window and
// stop its other streams.
func TestStreamWindowFollowsConnWindow(t *testing.T) {
	peer := netip.MustParseAddr("10.77.0.2")
	for _, tc := range []struct {
		name   string
		left   int64 // of the peer's share when the connection starts
		stream uint32
	}{
		{"full window", maxPeerWindow, streamWindow},
		{"1 MiB left", 1 << 20, (defaultWindow + 1<<20) / 4},
		{"nothing left", 0, defaultWindow},
	} {
		t.Run(tc.name, func(t *testing.T) {
			taken := windows.reserve(peer, maxPeerWindow-tc.left)
			defer windows.release(peer, netip.Addr{}, taken)
			local, remote := net.Pipe()
			t.Cleanup(func() { local.Close(); remote.Close() })
			c := newConn(context.Background(), addrConn{local, net.TCPAddrFromAddrPort(netip.AddrPortFrom(peer, 15008))},
				connConfig{log: slog.New(slog.DiscardHandler)})
			defer c.close(http2.ErrCodeNo, errors.New("done"), false)
			errc := make(chan error, 1)
			go func() { errc <- c.start() }()
			f, err := http2.NewFramer(nil, remote).ReadFrame()
			if err != nil {
				t.Fatal(err)
			}
			go func() { _, _ = io.Copy(io.Discard, remote) }()
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			sf, ok := f.(*http2.SettingsFrame)
			if !ok {
				t.Fatalf("first frame %v, want SETTINGS", f)
			}
			got, _ := sf.Value(http2.SettingInitialWindowSize)
			if got != tc.stream {
				t.Errorf("stream window %d on a connection window of %d, want %d", got, c.recvTarget, tc.stream)
			}
		})
	}
}

// TestWindowOwnerIsWhoOpened: a connection's window is charged to the
// address that opened it: the client's on both ends (on the client, its own
// local address), so pods of a node that all talk to one destination do not
// share one share.
func TestWindowOwnerIsWhoOpened(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	cli, err := d.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	srv, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	want := netip.MustParseAddr("127.0.0.2")
	if got := windowOwnerOf(cli, true); got != want {
		t.Errorf("client side: owner %v, want its local %v", got, want)
	}
	if got := windowOwnerOf(srv, false); got != want {
		t.Errorf("server side: owner %v, want the client's %v", got, want)
	}
}

// TestWindowReclaimedFromIdleConns: when idle connections of a few
// addresses hold the whole node's window budget, a new connection from
// another address takes the window of an idle connection of the address
// holding the most, which is drained with GOAWAY(NO_ERROR); a connection
// carrying a stream is never drained for it. Before, eight addresses' idle
// connections (renewed before the idle timeout) left every later
// connection of the node at HTTP/2's initial 64 KiB window.
func TestWindowReclaimedFromIdleConns(t *testing.T) {
	const full = connWindow - defaultWindow
	saved := windows
	windows = newWindowBudget(2*full, 2*full)
	t.Cleanup(func() { windows = saved })
	srv, err := NewServer(ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	granted := func(src netip.Addr) (*rawClient, int64) { return windowGranted(t, srv, src) }
	busy := netip.MustParseAddr("10.8.0.1")
	upstream, _ := countingUpstream(t)
	var busyConns []*rawClient
	for range 2 {
		rc, w := granted(busy)
		if w != full {
			t.Fatalf("a connection of an empty budget got %d bytes of window, want %d", w, full)
		}
		if err := rc.connect(1, upstream.String()); err != nil {
			t.Fatal(err)
		}
		rc.waitFor("200", func(f rawFrame) bool { return f.typ == http2.FrameHeaders && f.status == 200 })
		busyConns = append(busyConns, rc)
	}
	// The budget is spent by connections with streams: nothing to reclaim.
	if _, w := granted(netip.MustParseAddr("10.8.0.2")); w != 0 {
		t.Fatalf("budget held by busy connections: a new connection got %d bytes of window beyond the initial ones, want 0", w)
	}
	for _, rc := range busyConns {
		_ = rc.nc.Close()
	}
	waitWindows := func(want int64) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			windows.mu.Lock()
			reserved := windows.reserved
			windows.mu.Unlock()
			if reserved == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("reserved window %d, want %d", reserved, want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitWindows(0)

	hoarder := netip.MustParseAddr("10.8.0.3")
	var idle []*rawClient
	for range 2 {
		rc, w := granted(hoarder)
		if w != full {
			t.Fatalf("hoarder's connection got %d bytes of window, want %d", w, full)
		}
		idle = append(idle, rc)
	}
	if _, w := granted(netip.MustParseAddr("10.8.0.4")); w != full {
		t.Errorf("budget held by one address's idle connections: a new connection from another got %d bytes of window, want %d", w, full)
	}
	drained := 0
	for _, rc := range idle {
		timeout := time.After(time.Second)
	frames:
		for {
			select {
			case f, ok := <-rc.frames:
				if !ok {
					t.Error("a hoarder's connection ended without GOAWAY")
					break frames
				}
				if f.typ == http2.FrameGoAway {
					if f.code != http2.ErrCodeNo {
						t.Errorf("reclaimed connection: GOAWAY %v, want NO_ERROR", f.code)
					}
					drained++
					break frames
				}
			case <-timeout:
				break frames
			}
		}
	}
	if drained != 1 {
		t.Errorf("%d of the hoarder's idle connections drained, want 1", drained)
	}
	if s := Windows(); s.Reclaimed != 1 {
		t.Errorf("Windows().Reclaimed = %d, want 1", s.Reclaimed)
	}
	// Shares are now equal: the hoarder's second connection is kept.
	if _, w := granted(netip.MustParseAddr("10.8.0.4")); w != 0 {
		t.Errorf("equal shares: a second connection got %d bytes of window, want 0 (no draining each other)", w)
	}
}

// windowGranted opens a raw client connection from src and returns it with
// the connection window it was given beyond HTTP/2's initial one (the
// preface's WINDOW_UPDATEs, all in before the answer to a PING).
func windowGranted(t *testing.T, srv *Server, src netip.Addr) (*rawClient, int64) {
	t.Helper()
	rc := newRawClientFrom(t, srv, src)
	mark := [8]byte{'w', 'i', 'n', 'd', 'o', 'w'}
	if err := rc.fr.WritePing(false, mark); err != nil {
		t.Fatal(err)
	}
	var window int64
	rc.waitFor("PING ack", func(f rawFrame) bool {
		if f.typ == http2.FrameWindowUpdate && f.stream == 0 {
			window += int64(f.inc)
		}
		return f.typ == http2.FramePing && f.ack && f.ping == mark
	})
	return rc, window
}
