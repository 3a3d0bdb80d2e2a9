package tunnel

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// fillUntilBlocked writes to c until a write makes no progress for 300 ms:
// every buffer between c and a peer that reads nothing is full.
func fillUntilBlocked(t *testing.T, c net.Conn) {
	t.Helper()
	buf := make([]byte, 64<<10)
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		_ = c.SetWriteDeadline(time.Now().Add(300 * time.Millisecond))
		if _, err := c.Write(buf); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				_ = c.SetWriteDeadline(time.Time{})
				return
			}
			t.Fatalf("fill: %v", err)
		}
	}
	t.Fatal("the writes never blocked")
}

// silentServer accepts connections on addr and neither reads nor writes
// until the test ends; it returns the address and the accepted
// connections.
func silentServer(t *testing.T, addr string) (netip.AddrPort, <-chan net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_ = c.(*net.TCPConn).SetReadBuffer(4 << 10)
			accepted <- c
		}
	}()
	t.Cleanup(func() {
		l.Close()
		for {
			select {
			case c := <-accepted:
				// Reading everything ends a relay stuck on it, so the test
				// leaves no goroutine behind whatever it found.
				go func() { _, _ = io.Copy(io.Discard, c); c.Close() }()
			default:
				return
			}
		}
	})
	return netip.MustParseAddrPort(l.Addr().String()), accepted
}

// A relay whose upstream reads nothing while the app wrote more than the
// buffers hold, and sends nothing, is blocked in a write to the upstream
// and a read from it. Closing the app's socket wakes neither, so a pod's
// stop that closed only the sockets its listeners accepted waited for that
// relay for ever: StopPod (and the reconciler's worker calling it, with the
// reconciler's lock), ServePod of a pod whose sandbox was recreated, and
// Drain never returned, and the pod's sockets, goroutines and limit slots
// stayed. A meshed app needs only a plaintext server of its own that stops
// reading to do that. Stop must close both ends of every relay.
func TestStopEndsRelaysWhoseUpstreamReadsNothing(t *testing.T) {
	tun := newTestTunnel(t, nil)
	tun.Update(&State{Dir: testDir(t, podObj("mesh", "a", "a-sa", "127.0.0.1", nil))})
	p := testPod(tun, "uid-a", netip.MustParseAddr("127.0.0.1"))
	inOwnNamespace(t, p)
	dst, upstreams := silentServer(t, "127.0.0.2:0")

	// The outbound capture listener: what it accepts goes to the server in
	// plain TCP (passthrough), as for any destination outside the mesh.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p.acceptLoop(l, p.health[0], p.admitter(listenerOutbound), func(c net.Conn) {
		src := addrPortOf(c.RemoteAddr())
		srcW, _, err := p.self(src.Addr())
		if err != nil {
			t.Errorf("self: %v", err)
			resetConn(c)
			return
		}
		p.passthrough(p.ctx, c, srcW, nil, src, dst)
	})
	p.mu.Lock()
	p.lns = []net.Listener{l}
	p.mu.Unlock()

	app, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()
	select {
	case up := <-upstreams:
		// Held until the end: a connection no longer referenced is closed
		// by its finalizer, and with unread data that is a reset, which
		// ended the relay under test (CI saw it).
		defer func() { go func() { _, _ = io.Copy(io.Discard, up); up.Close() }() }()
	case <-time.After(5 * time.Second):
		t.Fatal("the tunnel never dialled the server")
	}
	fillUntilBlocked(t, app)

	stopped := make(chan struct{})
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		p.stop(ctx)
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Fatal("stop did not return within 5 s: a relay blocked on an upstream that reads nothing holds it")
	}
	waitfor.Until(t, "the outbound slot released", func() bool {
		tun.limits.mu.Lock()
		defer tun.limits.mu.Unlock()
		return tun.limits.node[listenerOutbound] == 0
	})
}
