package loader_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestDetachLeavesReusedPathAlone: pod a's sandbox goes, its namespace path
// is given to pod b's new sandbox (a reused /proc/<pid>/ns/net, a runtime
// naming namespaces by pod) with the same addresses, b is attached there,
// and only then is a detached (its delete queued behind b's ADD, or an
// agent restarted in between). a's detach must leave b's namespace alone.
// Seen failing: the detach entered whatever namespace a's path named and
// undid a's rules, routes and sysctls there, which were b's: b's captured
// connections were all dropped (no local route for re-injected packets,
// accept_local off) while b counted as enrolled; with legacy tc it deleted
// b's filters, and b's traffic left the pod uncaptured, in plaintext.
func TestDetachLeavesReusedPathAlone(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		name := "tcx"
		if legacy {
			name = "legacy-tc"
		}
		t.Run(name, func(t *testing.T) {
			topo := netnstest.New(t, 1)
			node := topo.Nodes[0]
			p, other := node.AddPod("p"), node.AddPod("o")
			ctx := context.Background()
			l, err := loader.Load(ctx, loader.Config{PinRoot: loadertest.TempBPFFS(t), Settings: loader.DefaultSettings(), ForceLegacyTC: legacy, Logger: slog.Default()})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			a := loadertest.PodOf(p, true)
			a.UID, a.Name = "uid-a", "a"
			if _, err := l.AttachPod(ctx, a); err != nil {
				t.Fatal(err)
			}
			node.RecreatePod(p)
			b := loadertest.PodOf(p, true)
			b.UID, b.Name = "uid-b", "b"
			if _, err := l.AttachPod(ctx, b); err != nil {
				t.Fatal(err)
			}
			loadertest.Listen(t, p.Path(), "[::]:15001", "outbound", netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark})
			loadertest.Listen(t, other.Path(), "[::]:8080", "other-app", netns.SocketOptions{})
			call := func(when string) {
				t.Helper()
				for _, addr := range other.Addrs() {
					r, err := loadertest.Call(p.Path(), ap(addr, 8080), netns.SocketOptions{})
					switch {
					case err != nil:
						t.Errorf("%s: b's connection to %s: %v (lost)", when, addr, err)
					case r.Name != "outbound":
						t.Errorf("%s: b's connection to %s reached %q, not the outbound listener: uncaptured, in plaintext", when, addr, r.Name)
					}
				}
			}
			call("b attached")
			if err := l.DetachPod(ctx, a.UID); err != nil {
				t.Fatal(err)
			}
			call("a detached")
			out, err := netnstest.Exec(ctx, p.Path(), "sysctl", "-n", "net.ipv4.conf.eth0.accept_local")
			if err != nil || strings.TrimSpace(string(out)) != "1" {
				t.Errorf("b's eth0 accept_local after a's detach: %q %v, want 1", out, err)
			}
			if st, ok, err := l.PodState(b.UID); err != nil || !ok || !l.KernelOK(st, true) {
				t.Errorf("b after a's detach: attached %v (%v), kernel state not as attached", ok, err)
			}
		})
	}
}
