package netnstest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// TestUnenrollNoPlaintext: a pod unenrolled (its label flipped to
// dataplane-mode=none) while meshed connections of it are open, its app
// writing on one and leaving the other idle until after the unenrollment. Its capture goes (entries, rules, links),
// and whatever the app's socket sends after that leaves by its interface
// as it is: before the fix the detach came first and the tunnel's stop
// second, giving the relays a second on top, and closed the app's side
// with a FIN, so the app's writes of that second and after (a socket in
// CLOSE_WAIT still sends) crossed the network in plaintext, towards the
// meshed peer's address. Now the tunnel ends the pod's connections (with
// a reset, which leaves the app's socket nothing to send) while the
// capture is still in place, and only then is the pod detached. Both
// ends: the client pod unenrolled (its outbound), and the server pod
// unenrolled (its inbound, the app answering a meshed client).
func TestUnenrollNoPlaintext(t *testing.T) {
	for _, side := range []string{"client", "server"} {
		t.Run(side, func(t *testing.T) {
			ms, client, server, plain := meshed(t)
			const marker = "unenroll-plaintext-marker-5d2c"
			payload := bytes.Repeat([]byte(marker), 8)
			serverApp := heldServerApp(t, server, 9200)
			dst := netip.AddrPortFrom(server.IPv4, 9200)
			// Two connections: one the app writes to all along, one it
			// leaves idle until the pod is unenrolled (a pooled
			// keep-alive connection, say), then writes to.
			var apps, srvs [2]net.Conn
			for i := range apps {
				apps[i], srvs[i] = dialHeld(t, client, dst, serverApp)
				// The server app reads (and drops) whatever the client
				// sends; the socket stays open until the test ends,
				// whatever happens to it.
				go func(c net.Conn) {
					buf := make([]byte, 4096)
					for {
						if _, err := c.Read(buf); err != nil {
							return
						}
					}
				}(srvs[i])
				if !strings.HasPrefix(srvs[i].RemoteAddr().String(), client.IPv4.String()+":") {
					t.Fatalf("server app's peer %s, want the client's address (relayed by the tunnel)", srvs[i].RemoteAddr())
				}
			}
			// The writer: the unenrolled pod's app.
			writers, node, agent := apps, client.Node, ms.agents[0]
			if side == "server" {
				writers, node, agent = srvs, server.Node, ms.agents[1]
			}
			writer, idle := writers[0], writers[1]
			for _, w := range writers {
				if _, err := w.Write([]byte("hello")); err != nil {
					t.Fatal(err)
				}
			}
			stopCapture := Capture(t, node.Path(), "uplink")

			done := make(chan error, 1)
			go func() {
				// Write until the connection fails, or for 4 s.
				for end := time.Now().Add(4 * time.Second); time.Now().Before(end); {
					_ = writer.SetWriteDeadline(time.Now().Add(time.Second))
					if _, err := writer.Write(payload); err != nil {
						done <- err
						return
					}
					time.Sleep(20 * time.Millisecond)
				}
				done <- errors.New("writes never failed")
			}()

			ms.optOut(t, agent, side, client, server, plain)
			err := <-done
			t.Logf("the app's writes ended: %v", err)
			// What the app sends after the end, on the connection it left
			// idle and on the one that failed.
			_, err = idle.Write(payload)
			t.Logf("the idle connection's write after the unenrollment: %v", err)
			_, _ = writer.Write(payload)
			time.Sleep(300 * time.Millisecond)
			if seen := stopCapture(); bytes.Contains(seen, []byte(marker)) {
				t.Fatalf("the %s app's bytes on its meshed connection left the node in plaintext once its pod was unenrolled", side)
			}
		})
	}
}

// heldServerApp serves port on server and hands every connection it
// accepts to the test, which owns it from then on: the handler holds it
// open until the test ends, so the server app's socket outlives whatever
// happens to the relay, as an app's would.
func heldServerApp(t *testing.T, server *Pod, port int) <-chan net.Conn {
	stop := make(chan struct{})
	accepted := make(chan net.Conn, 4)
	ServeTCP(t, server, port, func(c net.Conn) {
		accepted <- c
		<-stop
	})
	t.Cleanup(func() { close(stop) })
	return accepted
}

// dialHeld connects client's app to dst through the mesh (retrying until
// the capture is in place) and returns both app sockets: the client's and
// the one the server app accepted from serverApp. Both are closed when the
// test ends.
func dialHeld(t *testing.T, client *Pod, dst netip.AddrPort, serverApp <-chan net.Conn) (app, srv net.Conn) {
	t.Helper()
	app = dialApp(t, client, dst)
	select {
	case srv = <-serverApp:
	case <-time.After(5 * time.Second):
		t.Fatal("the server app accepted no connection")
	}
	t.Cleanup(func() { srv.Close() })
	return app, srv
}

// dialApp connects client's app to dst over TCP, retrying for 10 s (3 s
// a try) until the pod's capture is in place, and closes the connection
// when the test ends.
func dialApp(t *testing.T, client *Pod, dst netip.AddrPort) net.Conn {
	t.Helper()
	var app net.Conn
	Eventually(t, 10*time.Second, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		var err error
		app, err = netns.Dial(ctx, client.Path(), "tcp", dst.String(), netns.SocketOptions{})
		return err
	})
	t.Cleanup(func() { app.Close() })
	return app
}

// optOut sets the dataplane-mode of the side ("client" or "server") pod of
// a meshed() setup to none in the cluster file and waits until agent
// reports a pod unenrolled: the unenrollment the transition tests act
// around.
func (ms *mesh) optOut(t *testing.T, agent *Agent, side string, client, server, plain *Pod) {
	t.Helper()
	unenrolled := strings.Count(agent.Log(), "pod unenrolled")
	clientLabels, serverLabels := []string{"app=client"}, []string{"app=server"}
	if side == "client" {
		clientLabels = append(clientLabels, "istio.io/dataplane-mode=none")
	} else {
		serverLabels = append(serverLabels, "istio.io/dataplane-mode=none")
	}
	m := meshedObjects(&Manifest{}, client, server, plain, clientLabels, serverLabels)
	if err := m.Write(ms.manifest); err != nil {
		t.Fatal(err)
	}
	Eventually(t, 15*time.Second, func() error {
		if strings.Count(agent.Log(), "pod unenrolled") == unenrolled {
			return fmt.Errorf("the %s pod is not reported unenrolled", side)
		}
		return nil
	})
}
