package nodeagent_test

import (
	"context"
	"log/slog"
	"net/netip"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/nodeagent"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestFullPassRepairsLegacyFilters: on a kernel without tcx the programs
// are cls_bpf filters, which nothing holds. When they go (a qdisc reset in
// the pod's namespace, or its interface made anew there) the next full
// pass attaches the pod again, as link repair does for a detached tcx
// link. Seen failing: the cheap check looked only at tcx links, so a
// legacy pod counted as attached for good while its traffic left the pod
// uncaptured, in plaintext.
func TestFullPassRepairsLegacyFilters(t *testing.T) {
	topo := netnstest.New(t, 1)
	client, other := topo.Nodes[0].AddPod("client"), topo.Nodes[0].AddPod("other")
	ctx := context.Background()
	l, err := loader.Load(ctx, loader.Config{PinRoot: loadertest.TempBPFFS(t), Settings: loader.DefaultSettings(), ForceLegacyTC: true, Logger: slog.Default()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	loadertest.Listen(t, client.Path(), "[::]:15001", "outbound", netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark})
	loadertest.Listen(t, other.Path(), "[::]:8080", "other-app", netns.SocketOptions{})
	rec := nodeagent.NewReconciler(l, &recordServer{}, netns.DefaultFinder(), nil)
	want := []loader.Pod{loadertest.PodOf(client, true)}
	if res := rec.Reconcile(ctx, want, true); len(res.Errors) > 0 || len(res.Attached) != 1 {
		t.Fatalf("reconcile: %+v", res)
	}
	call := func(when string) string {
		t.Helper()
		r, err := loadertest.Call(client.Path(), netip.AddrPortFrom(other.IPv4, 8080), netns.SocketOptions{})
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		return r.Name
	}
	if got := call("attached"); got != "outbound" {
		t.Fatalf("attached: connection reached %s, want outbound", got)
	}
	if out, err := netnstest.Exec(ctx, client.Path(), "tc", "qdisc", "del", "dev", "eth0", "clsact"); err != nil {
		t.Fatalf("tc qdisc del: %v: %s", err, out)
	}
	if got := call("filters gone"); got != "other-app" {
		t.Fatalf("filters gone: connection reached %s; the test expects the capture off", got)
	}
	res := rec.Reconcile(ctx, want, true)
	t.Logf("full pass: %+v", res)
	if got := call("after a full pass"); got != "outbound" {
		t.Errorf("after a full pass the pod's connection reached %s: its filters are still gone, its traffic uncaptured", got)
	}
	if len(res.Repaired) != 1 {
		t.Errorf("full pass repaired %v, want the pod", res.Repaired)
	}
}
