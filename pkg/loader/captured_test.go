package loader_test

import (
	"bytes"
	"context"
	"net"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestCapturedConnectionNeverLeavesAfterTunnelReset: the tunnel resets a
// captured connection (a refused destination, a failed dial) while the app
// is sending. Between the tunnel socket's end and the RST reaching the app
// socket (its lock held by a send in progress, which queues the RST in the
// backlog), the app's segments find no tunnel socket for their tuple. The
// egress program used to pass such a packet as one of a connection from
// before enrollment: out of the pod towards the original destination, in
// plaintext. Here the RST is held back for good (a tc program on the pod's
// loopback drops the tunnel-marked packets), which opens that window as wide
// as it gets: the app's data must still never leave the pod, and is counted
// as drop_tunnel_gone. With local routing (the default), the app's socket
// was routed over lo when its connection was established: its data meets the
// pod's own TCP, which resets it, and nothing reaches the pod's interface.
func TestCapturedConnectionNeverLeavesAfterTunnelReset(t *testing.T) {
	onEachCapturePath(t, testCapturedNeverLeaves)
}

// capturePaths are the two ways the packets of an established captured
// connection reach the tunnel's socket: over lo, the app's socket routed
// there by rd_pod_sockops (local routing, the default), and through the pod
// interface's programs (local routing off, or a socket from before it).
var capturePaths = []capturePath{
	{"local route", true},
	{"packet path", false},
}

type capturePath struct {
	name  string
	local bool // routed over lo
}

// onEachCapturePath runs test once per capture path, as a subtest named for
// the path: a captured connection must hold on both.
func onEachCapturePath(t *testing.T, test func(*testing.T, capturePath)) {
	for _, path := range capturePaths {
		t.Run(path.name, func(t *testing.T) { test(t, path) })
	}
}

// capturingNode is one simulated node with two pods, named first and second,
// and the capture programs loaded for path into a fresh bpffs: where every
// test of a capture path starts. The caller closes the loader.
func capturingNode(t *testing.T, path capturePath, first, second string) (node *netnstest.Node, a, b *netnstest.Pod, l *loader.Loader) {
	t.Helper()
	node = netnstest.New(t, 1).Nodes[0]
	a, b = node.AddPod(first), node.AddPod(second)
	l = loadertest.LoadPacketPath(t, loadertest.TempBPFFS(t), !path.local)
	return node, a, b, l
}

// listenAsTunnel listens in the pod at podPath where the capture delivers
// outbound connections (port 15001, transparent, with the tunnel's mark), as
// the tunnel does; the listener closes when the test ends.
func listenAsTunnel(ctx context.Context, t *testing.T, podPath string) net.Listener {
	t.Helper()
	tunnel, err := netns.Listen(ctx, podPath, "tcp", "[::]:15001", netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tunnel.Close() })
	return tunnel
}

func testCapturedNeverLeaves(t *testing.T, path capturePath) {
	node, client, other, l := capturingNode(t, path, "client", "other")
	defer l.Close()
	ctx := context.Background()
	if _, err := l.AttachPod(ctx, loadertest.PodOf(client, true)); err != nil {
		t.Fatal(err)
	}
	tunnel := listenAsTunnel(ctx, t, client.Path())
	loadertest.Listen(t, other.Path(), "[::]:8080", "other-app", netns.SocketOptions{})

	for _, dst := range []string{ap(other.IPv4, 8080).String(), ap(other.IPv6, 8080).String()} {
		t.Run(dst, func(t *testing.T) {
			dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			routed := reasonCount(t, l.Maps(), "sock_routed_local")
			app, err := netns.Dial(dctx, client.Path(), "tcp", dst, netns.SocketOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer app.Close()
			tun, err := tunnel.Accept()
			if err != nil {
				t.Fatal(err)
			}
			if tun.LocalAddr().String() != dst {
				t.Fatalf("the app's connection reached the tunnel as %s, want %s", tun.LocalAddr(), dst)
			}
			checkAppMark(t, app, path.local)

			dropper := dropTunnelMarkedOnLoopback(t, client.Path())
			if err := tun.(*net.TCPConn).SetLinger(0); err != nil {
				t.Fatal(err)
			}
			tun.Close() // the RST towards the app goes nowhere

			wire := netnstest.Capture(t, node.Path(), "")
			before := reasonCount(t, l.Maps(), "drop_tunnel_gone")
			secret := []byte("plaintext-after-reset-5be1")
			if _, err := app.Write(secret); err != nil {
				t.Fatalf("app write: %v", err)
			}
			checkTunnelGone(t, l.Maps(), path.local, routed, before)
			if bytes.Contains(wire(), secret) {
				t.Fatal("the app's data left the pod in plaintext after its tunnel socket was reset")
			}
			dropper.Close()
		})
	}
}

// dropTunnelMarkedOnLoopback attaches, in the namespace at path, a tcx
// egress program on lo that drops every packet carrying the test's tunnel
// mark: what the tunnel sends to the app (its replies, its RST) goes
// through the pod's loopback, the app's own packets do not.
func dropTunnelMarkedOnLoopback(t *testing.T, path string) link.Link {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:    ebpf.SchedCLS,
		License: "GPL",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R2, asm.R1, 8, asm.Word), // __sk_buff.mark
			asm.JNE.Imm(asm.R2, loadertest.TunnelMark, "next"),
			asm.Mov.Imm(asm.R0, 2), // TC_ACT_SHOT
			asm.Return(),
			asm.Mov.Imm(asm.R0, -1).WithSymbol("next"), // TCX_NEXT
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("load the dropper: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	var lk link.Link
	if err := netns.Do(path, func() error {
		lo, err := net.InterfaceByName("lo")
		if err != nil {
			return err
		}
		lk, err = link.AttachTCX(link.TCXOptions{Interface: lo.Index, Program: prog, Attach: ebpf.AttachTCXEgress})
		return err
	}); err != nil {
		t.Fatalf("attach the dropper to lo: %v", err)
	}
	t.Cleanup(func() { lk.Close() })
	return lk
}

// checkTunnelGone checks what became of an app's write after the tunnel's
// socket of its connection was gone: on the packet path, egress dropped it
// (drop_tunnel_gone above before); routed locally (sock_routed_local above
// routed when the connection was made), it never reached the pod's
// interface: it went over lo to the pod's own TCP, which has no socket for
// it (it resets IPv6 segments; an IPv4 reset from the tunnel's non-local
// address has no route out, so the app retransmits until the tunnel's own
// RST, held back here, arrives). It returns once a retransmission would have
// left too, so the caller may look at the wire then.
func checkTunnelGone(t *testing.T, m *maps.Maps, local bool, routed, before uint64) {
	t.Helper()
	if !local {
		waitForCount(t, m, "drop_tunnel_gone", before+1)
		time.Sleep(300 * time.Millisecond) // a retransmission, had the first one left
		return
	}
	if n := reasonCount(t, m, "sock_routed_local"); n <= routed {
		t.Fatalf("sock_routed_local stayed at %d: the app's socket was not routed over lo", n)
	}
	time.Sleep(300 * time.Millisecond) // a retransmission, had the first one left
	if n := reasonCount(t, m, "drop_tunnel_gone"); n != before {
		t.Errorf("drop_tunnel_gone went from %d to %d: the routed app socket's data reached the pod's interface", before, n)
	}
}

// checkAppMark checks the SO_MARK of an app's captured socket: the reinject
// mark when local routing gave it one, none on the packet path.
func checkAppMark(t *testing.T, app net.Conn, local bool) {
	t.Helper()
	raw, err := app.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var mark int
	var gerr error
	if err := raw.Control(func(fd uintptr) { mark, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK) }); err != nil || gerr != nil {
		t.Fatalf("read SO_MARK: %v %v", err, gerr)
	}
	want := 0
	if local {
		want = int(loader.DefaultSettings().ReinjectMark)
	}
	if mark != want {
		t.Fatalf("the app socket's SO_MARK is %#x, want %#x", mark, want)
	}
}

func waitForCount(t *testing.T, m *maps.Maps, name string, want uint64) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for reasonCount(t, m, name) < want {
		if time.Now().After(deadline) {
			t.Fatalf("%s stayed at %d, want at least %d", name, reasonCount(t, m, name), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
