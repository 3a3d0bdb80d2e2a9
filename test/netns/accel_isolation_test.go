package netnstest

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// TestSockopsAccelerationNamespaceIsolation: a hostile pod on the victim's
// node (enrolled or not; with NET_ADMIN in its own namespace) rebuilds, in
// its own namespace, both ends of the victim's meshed connection with the
// very same addresses and ports: the victim's address and port as the app's
// end, and a listener at the server's address that carries the tunnel mark
// as the tunnel's end. Both of its sockets pair (their addresses are an
// enrolled pod's), so the sockhashes hold two sockets per 4-tuple. Only the
// namespace cookie in the key keeps them apart: without it the hostile
// pod's sends would go into the victim's tunnel under the victim's identity
// (injection), or the victim's into the hostile socket (theft).
func TestSockopsAccelerationNamespaceIsolation(t *testing.T) {
	var victim, server, meshed, plain *Pod
	ms := newMeshWith(t, []string{"--sockops-acceleration=true"}, func(tp *Topology, m *Manifest) {
		victim, meshed, plain = tp.Nodes[0].AddPod("victim"), tp.Nodes[0].AddPod("hostile"), tp.Nodes[0].AddPod("plain")
		server = tp.Nodes[1].AddPod("server")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
			Pod(victim, "mesh", "victim").Pod(meshed, "mesh", "hostile").Pod(server, "mesh", "server").
			Pod(plain, "plain", "default")
	})
	ServeTCP(t, server, 9300, func(c net.Conn) { io.Copy(c, c) })
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const tunnelMark = 0x539 // the agents' default

	for _, hostile := range []*Pod{meshed, plain} {
		t.Run(hostile.Name, func(t *testing.T) {
			c := dialPod(t, ctx, victim, server, 9300)
			time.Sleep(20 * time.Millisecond) // the tunnel's socket pairs at the last ACK
			echoOnly(t, c, []byte("victim before"))
			vport := c.LocalAddr().(*net.TCPAddr).Port

			for _, a := range []netip.Addr{victim.IPv4, server.IPv4} {
				if out, err := Exec(ctx, hostile.Path(), "ip", "addr", "add", a.String()+"/32", "dev", "lo"); err != nil {
					t.Fatalf("%v: %s", err, out)
				}
			}
			l, err := netns.Listen(ctx, hostile.Path(), "tcp4", netip.AddrPortFrom(server.IPv4, 9300).String(), netns.SocketOptions{Mark: tunnelMark})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			stolen := make(chan []byte, 1)
			go func() {
				s, err := l.Accept()
				if err != nil {
					stolen <- nil
					return
				}
				defer s.Close()
				s.SetReadDeadline(time.Now().Add(10 * time.Second))
				b, _ := io.ReadAll(s)
				stolen <- b
			}()
			before := accelTotals(t, ms)
			h, err := netns.Dial(ctx, hostile.Path(), "tcp4", netip.AddrPortFrom(server.IPv4, 9300).String(),
				netns.SocketOptions{Local: &net.TCPAddr{IP: victim.IPv4.AsSlice(), Port: vport}})
			if err != nil {
				t.Fatalf("hostile dial from the victim's address and port: %v", err)
			}
			defer h.Close()
			if got, want := h.LocalAddr().String(), c.LocalAddr().String(); got != want {
				t.Fatalf("hostile socket at %s, want the victim's %s", got, want)
			}
			time.Sleep(20 * time.Millisecond)
			if _, err := h.Write([]byte("INJECTED")); err != nil {
				t.Fatal(err)
			}
			// The victim's connection carries its own bytes only, both ways.
			echoOnly(t, c, []byte("victim after"))
			h.(*net.TCPConn).CloseWrite()
			got := <-stolen
			if !bytes.Equal(got, []byte("INJECTED")) {
				t.Errorf("the hostile pod's own listener read %q, want just %q", got, "INJECTED")
			}
			d := accelTotals(t, ms).Sub(before)
			t.Logf("counters: %+v", d)
			// The case is only worth something if the hostile sockets did
			// pair beside the victim's, under the same 4-tuples.
			if d.Sockets < 2 || d.Redirected == 0 {
				t.Errorf("the hostile pod's two sockets did not pair and redirect (%+v): the collision was not tried", d)
			}
		})
	}
}

// echoOnly writes msg on c and checks that exactly msg comes back.
func echoOnly(t *testing.T, c net.Conn, msg []byte) {
	t.Helper()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write(msg); err != nil {
		t.Fatalf("write: %v", err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatalf("read the echo of %q: %v (got %q)", msg, err, buf)
	}
	if !bytes.Equal(buf, msg) {
		t.Fatalf("echo %q, want %q", buf, msg)
	}
	// Nothing more may follow: an injected byte would.
	c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if n, _ := c.Read(buf[:1]); n > 0 {
		t.Fatalf("after the echo of %q came %q", msg, buf[:n])
	}
}
