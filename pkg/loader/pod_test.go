package loader_test

import (
	"context"
	"net/netip"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestReattachKeepsNewOwnersCounters: a pod attached again without an
// address that another pod has taken meanwhile (a reused address) leaves
// that pod's entry and counters alone. Before, the re-attach deleted the
// counters of the address whatever pod owned it.
func TestReattachKeepsNewOwnersCounters(t *testing.T) {
	topo := netnstest.New(t, 1)
	p, q := topo.Nodes[0].AddPod("p"), topo.Nodes[0].AddPod("q")
	topo.AddAddr(q, p.IPv4.String()+"/32", "eth0") // q takes p's address
	ctx := context.Background()
	l := loadertest.Load(t, loadertest.TempBPFFS(t))
	defer l.Close()
	old := loadertest.PodOf(p, true)
	if _, err := l.AttachPod(ctx, old); err != nil {
		t.Fatal(err)
	}
	reused := loadertest.PodOf(q, true)
	reused.Addrs = []netip.Addr{p.IPv4}
	st, err := l.AttachPod(ctx, reused)
	if err != nil {
		t.Fatal(err)
	}
	old.Addrs = []netip.Addr{p.IPv6}
	if _, err := l.AttachPod(ctx, old); err != nil {
		t.Fatal(err)
	}
	if s, ok, err := l.Maps().Pod(p.IPv4); err != nil || !ok || s.PodID != st.ID {
		t.Errorf("entry of %s: %+v %v %v, want q's (id %d)", p.IPv4, s, ok, err, st.ID)
	}
	if _, ok, err := l.Maps().Counters(p.IPv4); err != nil || !ok {
		t.Errorf("counters of %s, q's address, after p was attached again without it: %v %v", p.IPv4, ok, err)
	}
}
