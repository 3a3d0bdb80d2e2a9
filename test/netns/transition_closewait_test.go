package netnstest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestUnenrollEndsClosedRelaySockets: a meshed connection whose relay ended
// before its pod was unenrolled. The peer's app reset its side, the relay
// ended, and the tunnel closed the pod's app socket with a FIN, as any
// relay end does: the app keeps that socket in CLOSE_WAIT, where it may
// still write. Then the pod opts out of the mesh (its dataplane-mode label
// set to none) and is detached; the tunnel's stop finds no relay of that
// connection to reset. Before the fix, the app's next write left the pod
// by its interface, unmeshed, in plaintext, towards the peer's address
// (which resets it). Now the detach ends every captured socket of the pod
// first (sock_diag SOCK_DESTROY, while the capture is still in place): the
// write fails with ECONNABORTED and nothing crosses the network. Both ends:
// the client pod unenrolled (its outbound connection) and the server pod
// unenrolled (the app socket the tunnel dialled for an inbound one), each
// over IPv4 and IPv6.
func TestUnenrollEndsClosedRelaySockets(t *testing.T) {
	for _, side := range []string{"client", "server"} {
		t.Run(side, func(t *testing.T) {
			ms, client, server, plain := meshed(t)
			const marker = "closewait-plaintext-marker-3e8d"
			payload := bytes.Repeat([]byte(marker), 8)
			serverApp := heldServerApp(t, server, 9201)
			var apps, srvs []net.Conn
			for _, dst := range []netip.Addr{server.IPv4, server.IPv6} {
				app, srv := dialHeld(t, client, netip.AddrPortFrom(dst, 9201), serverApp)
				if peer := srv.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap(); peer != client.IPv4 && peer != client.IPv6 {
					t.Fatalf("server app's peer %s, want the client's address (relayed by the tunnel)", srv.RemoteAddr())
				}
				// Data flows both ways through the mesh.
				sendOver(t, app, srv, "hello")
				sendOver(t, srv, app, "hello back")
				apps, srvs = append(apps, app), append(srvs, srv)
			}
			// The writer is the app of the pod that leaves; its peer's app
			// resets the connection, and the relay ends.
			writers, peers, node, agent := apps, srvs, client.Node, ms.agents[0]
			if side == "server" {
				writers, peers, node, agent = srvs, apps, server.Node, ms.agents[1]
			}
			for _, p := range peers {
				if err := p.(*net.TCPConn).SetLinger(0); err != nil {
					t.Fatal(err)
				}
				p.Close()
			}
			for i, w := range writers {
				_ = w.SetReadDeadline(time.Now().Add(5 * time.Second))
				if n, err := w.Read(make([]byte, 1)); n != 0 || err != io.EOF {
					t.Fatalf("connection %d: the %s app's read once the relay ended: %d %v, want EOF (a FIN)", i, side, n, err)
				}
			}
			// The app's ACK of that FIN is delayed (up to 200 ms); a socket
			// that sat in CLOSE_WAIT sent it long ago.
			time.Sleep(300 * time.Millisecond)

			stopCapture := Capture(t, node.Path(), "uplink")
			ms.optOut(t, agent, side, client, server, plain)
			for i, w := range writers {
				_ = w.SetWriteDeadline(time.Now().Add(2 * time.Second))
				_, err := w.Write(payload)
				if !errors.Is(err, syscall.ECONNABORTED) {
					t.Errorf("connection %d: the %s app's write on its closed relay's socket after the unenrollment: %v, want ECONNABORTED", i, side, err)
				}
			}
			time.Sleep(300 * time.Millisecond) // a retransmission, had the first one left
			if seen := stopCapture(); bytes.Contains(seen, []byte(marker)) {
				t.Fatalf("the %s app's bytes on a connection whose relay had ended left the node in plaintext once its pod was unenrolled", side)
			}
			if want := fmt.Sprintf("sockets=%d", len(writers)); !strings.Contains(agent.Log(), want) {
				t.Errorf("the agent did not log ending the pod's %d captured sockets:\n%s", len(writers), agent.Log())
			}
		})
	}
}

// sendOver writes msg on from and reads it whole on to.
func sendOver(t *testing.T, from, to net.Conn, msg string) {
	t.Helper()
	if _, err := io.WriteString(from, msg); err != nil {
		t.Fatal(err)
	}
	_ = to.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(to, buf); err != nil || string(buf) != msg {
		t.Fatalf("read %q, %v; want %q", buf, err, msg)
	}
	_ = to.SetReadDeadline(time.Time{})
}
