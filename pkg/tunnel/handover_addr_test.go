package tunnel

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// TestHandedListenerMustBeWildcard: a pod's listeners are on the wildcard
// address, dual-stack where the namespace has IPv6 (listenWildcard): the
// capture assigns SYNs for any of the pod's addresses, IPv4 and IPv6, to
// them. A handed-over listener bound to one address, or IPv6-only, passed
// every check before (the port, the mark, the namespace) and was served:
// the capture found no listener for the pod's own addresses (or for IPv4)
// and dropped every captured connection, while the pod could not bind the
// wildcard either (the port taken) and counted as served. It is refused
// now, with the address in the error.
func TestHandedListenerMustBeWildcard(t *testing.T) {
	ns := podNS(t)
	h, err := netns.Open(ns)
	if err != nil {
		t.Fatal(err)
	}
	ino, err := h.Inode()
	h.Close()
	if err != nil {
		t.Fatal(err)
	}
	marked := netns.SocketOptions{Mark: testMark}
	for _, c := range []struct {
		name, network, addr, want string
	}{
		{"IPv4 loopback", "tcp", "127.0.0.1:15001", "bound to 127.0.0.1, not the wildcard address"},
		{"IPv6 loopback", "tcp", "[::1]:15001", "bound to ::1, not the wildcard address"},
		{"IPv6 only", "tcp6", "[::]:15001", "IPv6 only"},
	} {
		t.Run(c.name, func(t *testing.T) {
			fd := listenerFDNet(t, ns, c.network, c.addr, marked)
			defer closeFDs([]int{fd})
			err := checkHandedListener(fd, ino, 15001, testMark)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("checkHandedListener of a listener on %s (%s) = %v, want an error with %q", c.addr, c.network, err, c.want)
			}
		})
	}
	// The agent's own kinds pass: dual-stack [::] and IPv4 0.0.0.0.
	for _, c := range []struct{ network, addr string }{{"tcp", "[::]:15001"}, {"tcp4", "0.0.0.0:15001"}} {
		fd := listenerFDNet(t, ns, c.network, c.addr, marked)
		if err := checkHandedListener(fd, ino, 15001, testMark); err != nil {
			t.Errorf("checkHandedListener of the agent's own kind of listener (%s %s): %v", c.network, c.addr, err)
		}
		closeFDs([]int{fd})
	}
}

// TestEndpointHandover: a successor takes the very socket of the
// predecessor's HTTP endpoint (admin.ListenAlone binds it without
// SO_REUSEPORT, so nothing else can bind the port, a successor included):
// checked to be bound to the address asked for, in this namespace.
func TestEndpointHandover(t *testing.T) {
	ctx := context.Background()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	old := handoverTunnel(t, nil, nil)
	old.ShareEndpoints(func(name string) net.Listener {
		if name == "readiness" {
			return l
		}
		return nil
	})
	sock, _ := serveHandover(t, old)
	pred := mustPredecessor(t, sock)
	got, err := pred.TakeEndpoint(ctx, "readiness", l.Addr().String())
	if err != nil || got == nil {
		t.Fatalf("TakeEndpoint = %v, %v; want the predecessor's listener", got, err)
	}
	defer got.Close()
	if got.Addr().String() != l.Addr().String() {
		t.Errorf("taken listener on %s, want %s", got.Addr(), l.Addr())
	}
	// One socket: a connection is accepted by the successor's copy.
	go func() {
		if c, err := net.Dial("tcp", l.Addr().String()); err == nil {
			defer c.Close()
			time.Sleep(100 * time.Millisecond)
		}
	}()
	c, err := got.Accept()
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	// Not served: nothing to take, no error.
	if got, err := pred.TakeEndpoint(ctx, "metrics", "127.0.0.1:15020"); got != nil || err != nil {
		t.Errorf("TakeEndpoint of an endpoint not served = %v, %v; want nothing", got, err)
	}
	// Another address than the one this agent would bind: refused.
	_, port, _ := net.SplitHostPort(l.Addr().String())
	if got, err := pred.TakeEndpoint(ctx, "readiness", "127.0.0.2:"+port); got != nil || err == nil || !strings.Contains(err.Error(), "not the endpoint's address") {
		t.Errorf("TakeEndpoint for another address = %v, %v; want refused", got, err)
	}
}
