// Package loadertest is what tests of the loader and of its users share: a
// bpffs pin root in a temp dir, a loaded Loader, and the loader.Pod of a
// simulated pod.
package loadertest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TempBPFFS returns a pin root path in a temp dir; the loader mounts a
// bpffs there, and cleanup unmounts it if a test failed before Uninstall.
func TempBPFFS(t testing.TB) string {
	root := filepath.Join(t.TempDir(), "bpf")
	t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	return root
}

// Load loads the programs with the default settings under root.
func Load(t testing.TB, root string) *loader.Loader {
	t.Helper()
	return LoadPacketPath(t, root, false)
}

// LoadPacketPath is Load with local routing off (loader.Config.PacketPathOnly)
// when packetPath is set: every packet of a captured connection then takes
// the pod interface's programs.
func LoadPacketPath(t testing.TB, root string, packetPath bool) *loader.Loader {
	t.Helper()
	l, err := loader.Load(context.Background(), loader.Config{PinRoot: root, Settings: loader.DefaultSettings(), PacketPathOnly: packetPath, Logger: slog.Default()})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// PodOf is the loader.Pod of a simulated pod, in namespace "test".
func PodOf(p *netnstest.Pod, inbound bool) loader.Pod {
	return loader.Pod{UID: "uid-" + p.Name, Namespace: "test", Name: p.Name, NetNS: p.Path(), Addrs: p.Addrs(), CaptureInbound: inbound}
}

// TunnelMark is the tunnel's socket mark: sockets with it are not captured.
const TunnelMark = 0x539

// Serve answers each connection with "<name> <local addr> <peer addr>\n" and
// then echoes one line, so the test sees which socket took the connection
// and that data flows both ways.
func Serve(t testing.TB, l net.Listener, name string) {
	netnstest.ServeConns(t, l, func(c net.Conn) {
		fmt.Fprintf(c, "%s %s %s\n", name, c.LocalAddr(), c.RemoteAddr())
		line, err := bufio.NewReader(c).ReadString('\n')
		if err == nil {
			io.WriteString(c, "echo "+line)
		}
	})
}

// Listen listens on addr inside the namespace at path and Serves as name.
func Listen(t testing.TB, path, addr, name string, opts netns.SocketOptions) {
	t.Helper()
	l, err := netns.Listen(context.Background(), path, "tcp", addr, opts)
	if err != nil {
		t.Fatal(err)
	}
	Serve(t, l, name)
}

// Reply says who answered a Call: the listener's name, its local address
// and the caller's address as it saw them.
type Reply struct{ Name, Local, Peer string }

// Call dials dst from inside path and returns who answered.
func Call(path string, dst netip.AddrPort, opts netns.SocketOptions) (Reply, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := netns.Dial(ctx, path, "tcp", dst.String(), opts)
	if err != nil {
		return Reply{}, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		return Reply{}, fmt.Errorf("read greeting: %w", err)
	}
	f := strings.Fields(line)
	if len(f) != 3 {
		return Reply{}, fmt.Errorf("bad greeting %q", line)
	}
	if _, err := io.WriteString(c, "ping\n"); err != nil {
		return Reply{}, err
	}
	if echo, err := r.ReadString('\n'); err != nil || echo != "echo ping\n" {
		return Reply{}, fmt.Errorf("echo: %q %v", echo, err)
	}
	return Reply{f[0], unmapped(f[1]), unmapped(f[2])}, nil
}

func unmapped(s string) string {
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return s
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String()
}

// TCXPrograms names the tcx programs on eth0 of the namespace at path,
// ingress first.
func TCXPrograms(t *testing.T, path string) []string {
	t.Helper()
	var out []string
	err := netns.Do(path, func() error {
		l, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
			r, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: at})
			if err != nil {
				return err
			}
			for _, p := range r.Programs {
				prog, err := ebpf.NewProgramFromID(p.ID)
				if err != nil {
					return err
				}
				info, _ := prog.Info()
				prog.Close()
				out = append(out, info.Name)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("query programs in %s: %v", path, err)
	}
	return out
}
