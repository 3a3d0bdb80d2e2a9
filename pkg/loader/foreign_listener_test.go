package loader_test

import (
	"context"
	"sync"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader"
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
	l, server, client := enrolledServer(t)
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

// TestReusePortMemberNeverAnswersCapturedConnections: a process in the pod
// (as root, the tunnel's user, with no capability) joins the tunnel's own
// inbound reuseport group, on the same wildcard address. Since Linux 6.5 the
// kernel selects again within the group after the capture assigned the
// tunnel's listener, by the tuple's hash and with no mark to check, so the
// process was handed a share of the captured connections into the pod in
// plaintext, past the agent's policy. Now its SYN-ACKs never leave the pod
// (drop_foreign_listener): those calls fail, the others reach the tunnel,
// and the member serves none.
func TestReusePortMemberNeverAnswersCapturedConnections(t *testing.T) {
	l, server, client := enrolledServer(t)
	loadertest.Listen(t, server.Path(), "[::]:15006", "inbound", netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark, ReusePort: true})
	loadertest.Listen(t, server.Path(), "[::]:15006", "member", netns.SocketOptions{ReusePort: true})

	before := reasonCount(t, l.Maps(), "drop_foreign_listener")
	byName := spreadCalls(client, server)
	if byName["member"] > 0 {
		t.Fatalf("%d captured connections reached the pod's own reuseport member in plaintext: %v", byName["member"], byName)
	}
	if byName["inbound"] == 0 || byName["failed"] == 0 {
		t.Fatalf("calls %v: want some on the tunnel's listener and some refused (the group spreads them)", byName)
	}
	if n := reasonCount(t, l.Maps(), "drop_foreign_listener"); n <= before {
		t.Fatalf("drop_foreign_listener stayed at %d", n)
	}
}

// enrolledServer loads the programs and attaches a pod, "server", with its
// inbound captured; "client" is an unenrolled pod of the same node.
func enrolledServer(t *testing.T) (l *loader.Loader, server, client *netnstest.Pod) {
	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	server, client = node.AddPod("server"), node.AddPod("client")
	l = loadertest.Load(t, loadertest.TempBPFFS(t))
	t.Cleanup(func() { l.Close() })
	if _, err := l.AttachPod(context.Background(), loadertest.PodOf(server, true)); err != nil {
		t.Fatal(err)
	}
	return l, server, client
}

// spreadCalls makes concurrent calls from one pod to the other's port 8080,
// over IPv4 and IPv6, from as many source ports (which spreads them over a
// reuseport group), and counts them by who answered ("failed" for none: a
// call nobody answers runs into Call's timeout).
func spreadCalls(from, to *netnstest.Pod) map[string]int {
	const calls = 32
	names := make([]string, calls)
	var wg sync.WaitGroup
	for i := range calls {
		dst := to.IPv4
		if i%2 == 1 {
			dst = to.IPv6
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := loadertest.Call(from.Path(), ap(dst, 8080), netns.SocketOptions{})
			names[i] = r.Name
			if err != nil {
				names[i] = "failed"
			}
		}()
	}
	wg.Wait()
	byName := map[string]int{}
	for _, n := range names {
		byName[n]++
	}
	return byName
}
