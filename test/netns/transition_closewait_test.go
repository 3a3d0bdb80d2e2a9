package netnstest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
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
			stopServer := make(chan struct{})
			defer close(stopServer)
			serverApp := make(chan net.Conn, 4)
			ServeTCP(t, server, 9201, func(c net.Conn) {
				serverApp <- c
				<-stopServer
			})
			var apps, srvs []net.Conn
			for _, dst := range []netip.Addr{server.IPv4, server.IPv6} {
				var app net.Conn
				Eventually(t, 10*time.Second, func() error {
					ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
					defer cancel()
					var err error
					app, err = netns.Dial(ctx, client.Path(), "tcp", netip.AddrPortFrom(dst, 9201).String(), netns.SocketOptions{})
					return err
				})
				defer app.Close()
				var srv net.Conn
				select {
				case srv = <-serverApp:
				case <-time.After(5 * time.Second):
					t.Fatal("the server app accepted no connection")
				}
				defer srv.Close()
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
			unenrolled := strings.Count(agent.Log(), "pod unenrolled")
			clientLabels, serverLabels := []string{"app=client"}, []string{"app=server"}
			if side == "client" {
				clientLabels = append(clientLabels, "istio.io/dataplane-mode=none")
			} else {
				serverLabels = append(serverLabels, "istio.io/dataplane-mode=none")
			}
			m := &Manifest{}
			m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
				Pod(client, "mesh", "client-sa", clientLabels...).
				Pod(server, "mesh", "server-sa", serverLabels...).
				Pod(plain, "plain", "default")
			if err := m.Write(ms.manifest); err != nil {
				t.Fatal(err)
			}
			Eventually(t, 15*time.Second, func() error {
				if strings.Count(agent.Log(), "pod unenrolled") == unenrolled {
					return fmt.Errorf("the %s pod is not reported unenrolled", side)
				}
				return nil
			})
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
