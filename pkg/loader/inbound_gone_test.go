package loader_test

import (
	"bytes"
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestDialledAppConnectionNeverLeavesAfterTunnelReset is the inbound twin of
// TestCapturedConnectionNeverLeavesAfterTunnelReset. The tunnel serves an
// inbound connection by dialling the app from the client's own address
// (transparent bind), and resets that socket when a policy change revokes
// the connection, when it is revoked before it was registered, or when the
// client gives up. The app's socket came from an accept, so no steered SYN
// ever marked it: its segments sent after the tunnel socket was gone, and
// before the RST reached it, passed as a pre-enrollment connection's, out of
// the pod towards the client's address, in plaintext. Both the app that
// already sent through the tunnel and the one whose first segment comes
// after the reset (a server that speaks first: its greeting) are checked.
// As in the outbound test, the RST is held back for good.
func TestDialledAppConnectionNeverLeavesAfterTunnelReset(t *testing.T) {
	onEachCapturePath(t, testDialledNeverLeaves)
}

func testDialledNeverLeaves(t *testing.T, path capturePath) {
	node, server, client, l := capturingNode(t, path, "server", "client")
	defer l.Close()
	ctx := context.Background()
	if _, err := l.AttachPod(ctx, loadertest.PodOf(server, true)); err != nil {
		t.Fatal(err)
	}
	apps, err := netns.Listen(ctx, server.Path(), "tcp", "[::]:8080", netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer apps.Close()

	for _, c := range []struct {
		name       string
		dst        net.IP
		from       net.IP
		sentBefore bool
	}{
		{"v4 after a steered write", server.IPv4.AsSlice(), client.IPv4.AsSlice(), true},
		{"v6 after a steered write", server.IPv6.AsSlice(), client.IPv6.AsSlice(), true},
		{"v4 first segment", server.IPv4.AsSlice(), client.IPv4.AsSlice(), false},
		{"v6 first segment", server.IPv6.AsSlice(), client.IPv6.AsSlice(), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			dst := (&net.TCPAddr{IP: c.dst, Port: 8080}).String()
			routed := reasonCount(t, l.Maps(), "sock_routed_local")
			tun, err := netns.Dial(dctx, server.Path(), "tcp", dst, netns.SocketOptions{
				Transparent: true, Mark: loadertest.TunnelMark, Local: &net.TCPAddr{IP: c.from},
			})
			if err != nil {
				t.Fatal(err)
			}
			defer tun.Close()
			app, err := apps.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer app.Close()
			checkAppMark(t, app, path.local)
			if c.sentBefore {
				if _, err := app.Write([]byte("hello\n")); err != nil {
					t.Fatal(err)
				}
				got := make([]byte, 6)
				tun.SetReadDeadline(time.Now().Add(2 * time.Second))
				if _, err := io.ReadFull(tun, got); err != nil || string(got) != "hello\n" {
					t.Fatalf("the app's reply did not reach the tunnel socket: %q, %v", got, err)
				}
			}

			dropper := dropTunnelMarkedOnLoopback(t, server.Path())
			if err := tun.(*net.TCPConn).SetLinger(0); err != nil {
				t.Fatal(err)
			}
			tun.Close() // the RST towards the app goes nowhere

			wire := netnstest.Capture(t, node.Path(), "")
			before := reasonCount(t, l.Maps(), "drop_tunnel_gone")
			secret := []byte("plaintext-after-reset-77c3")
			if _, err := app.Write(secret); err != nil {
				t.Fatalf("app write: %v", err)
			}
			checkTunnelGone(t, l.Maps(), path.local, routed, before)
			if bytes.Contains(wire(), secret) {
				t.Fatal("the app's data left the pod in plaintext after the tunnel's socket to it was reset")
			}
			dropper.Close()
		})
	}
}
