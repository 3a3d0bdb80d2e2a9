package loader_test

import (
	"context"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestForeignListenerNeverTakesCapturedConnections: a process in the pod
// (as root, the tunnel's user) binds the inbound port to the pod's own
// address with SO_REUSEPORT, next to the tunnel's wildcard listener. Being
// the more specific match, it was what the capture's lookup found, and it
// was handed every captured inbound connection to that address in
// plaintext, past the agent's policy. Now such a connection is dropped
// (drop_foreign_listener), the other address of the pod still reaches the
// tunnel, and the foreign listener accepts nothing.
func TestForeignListenerNeverTakesCapturedConnections(t *testing.T) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	server, client := node.AddPod("server"), node.AddPod("client")
	root := loadertest.TempBPFFS(t)
	l := loadertest.Load(t, root)
	defer l.Close()
	if _, err := l.AttachPod(context.Background(), loadertest.PodOf(server, true)); err != nil {
		t.Fatal(err)
	}
	loadertest.Listen(t, server.Path(), "[::]:15006", "inbound", netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark, ReusePort: true})
	loadertest.Listen(t, server.Path(), ap(server.IPv4, 15006).String(), "foreign", netns.SocketOptions{ReusePort: true})

	before := reasonCount(t, l.Maps(), "drop_foreign_listener")
	if r, err := loadertest.Call(client.Path(), ap(server.IPv4, 8080), netns.SocketOptions{}); err == nil {
		t.Fatalf("a captured connection to %s reached %q: want it dropped", server.IPv4, r.Name)
	}
	if n := reasonCount(t, l.Maps(), "drop_foreign_listener"); n <= before {
		t.Fatalf("drop_foreign_listener stayed at %d", n)
	}
	r, err := loadertest.Call(client.Path(), ap(server.IPv6, 8080), netns.SocketOptions{})
	if err != nil || r.Name != "inbound" {
		t.Fatalf("a captured connection to %s: %+v, %v; want the tunnel's inbound listener", server.IPv6, r, err)
	}
}
