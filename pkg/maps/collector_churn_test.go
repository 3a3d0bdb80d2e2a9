package maps

import (
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
	"github.com/redirector-mesh/redirector/internal/promtest"
)

// A pod re-created with its address (a StatefulSet pod on a CNI that
// keeps its IP), or a new pod given a freed address, is recorded while its
// predecessor is still being detached: both records list the address.
// Its counters are the new owner's alone (the loader keeps them for it, and
// counts them to no one else). Summed under both records, a same-named
// pod's series doubled and then fell back when the old record went: a
// counter going down, which Prometheus takes for a reset and counts the
// whole value again; a differently named predecessor's series kept rising
// with the new pod's traffic.
func TestCollectorCountsAnAddressForItsOwnerOnly(t *testing.T) {
	m := newTestMaps(t)
	addr := netip.MustParseAddr("10.0.0.5")
	for id, p := range map[uint32]PodMeta{
		1: {UID: "u-old", Namespace: "shop", Name: "web-0", Addrs: []netip.Addr{addr}},
		2: {UID: "u-new", Namespace: "shop", Name: "web-0", Addrs: []netip.Addr{addr}},
		3: {UID: "u-other", Namespace: "shop", Name: "db-0", Addrs: []netip.Addr{addr}},
	} {
		if err := m.PutMeta(id, p); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.CreateCounters(addr); err != nil {
		t.Fatal(err)
	}
	if err := m.SetPod(addr, PodSettings{CaptureOutbound: true, PodID: 2}); err != nil {
		t.Fatal(err)
	}
	per := make([]bpf.CapturePodCounters, ebpf.MustPossibleCPU())
	per[0].InboundConns = 7
	k := PodKey(addr)
	if err := m.PodStats.Update(&k, per, ebpf.UpdateExist); err != nil {
		t.Fatal(err)
	}

	got := promtest.Scrape(t, NewCollector(m))
	for series, want := range map[string]float64{
		`redirector_bpf_pod_connections_total{direction="inbound",namespace="shop",pod="web-0"}`: 7,
		`redirector_bpf_pod_connections_total{direction="inbound",namespace="shop",pod="db-0"}`:  0,
	} {
		if got[series] != want {
			t.Errorf("%s = %v, want %v (the address's owner only)", series, got[series], want)
		}
	}
}
