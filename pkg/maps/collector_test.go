package maps

import (
	"net/netip"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/bpf"
	"github.com/redirector-mesh/redirector/internal/promtest"
)

// TestCollectorDescribe needs no privileges: the collector must describe
// itself without touching the maps, because registration happens before any
// map could be read.
func TestCollectorDescribe(t *testing.T) {
	ch := make(chan *prometheus.Desc, 10)
	NewCollector(&Maps{}).Describe(ch)
	close(ch)
	var descs []string
	for d := range ch {
		descs = append(descs, d.String())
	}
	all := strings.Join(descs, "\n")
	for _, want := range []string{
		`"redirector_bpf_packets_total".*variableLabels: {reason}`,
		`"redirector_bpf_fail_closed_drops_total".*variableLabels: {}`,
		`"redirector_bpf_pod_connections_total".*variableLabels: {namespace,pod,direction}`,
		`"redirector_bpf_pod_packets_total".*variableLabels: {namespace,pod,kind}`,
	} {
		if !regexp.MustCompile(want).MatchString(all) {
			t.Errorf("Describe has nothing matching %s; got\n%s", want, all)
		}
	}
	if err := prometheus.NewPedanticRegistry().Register(NewCollector(&Maps{})); err != nil {
		t.Fatalf("register: %v", err)
	}
}

// newTestMaps creates unpinned maps from the compiled object's specs, so
// tests and benchmarks see the kernel's real per-CPU behaviour without
// touching bpffs.
func newTestMaps(t testing.TB) *Maps {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create BPF maps")
	}
	spec, err := bpf.LoadCapture()
	if err != nil {
		t.Fatal(err)
	}
	m := &Maps{}
	t.Cleanup(func() { m.Close() })
	for _, x := range []struct {
		name string
		dst  **ebpf.Map
	}{{PodsName, &m.Pods}, {PodStatsName, &m.PodStats}, {ReasonsName, &m.Reasons}, {PodMetaName, &m.PodMeta}, {PodNetNSName, &m.PodNetNS}} {
		ms := spec.Maps[x.name].Copy()
		ms.Pinning = ebpf.PinNone
		mp, err := ebpf.NewMap(ms)
		if err != nil {
			t.Fatalf("create map %s: %v", x.name, err)
		}
		*x.dst = mp
	}
	return m
}

// spread divides total over the possible CPUs (the remainder on CPU 0), so
// the collector is checked to sum them rather than read one.
func spread(total uint64) []uint64 {
	out := make([]uint64, ebpf.MustPossibleCPU())
	for i := range out {
		out[i] = total / uint64(len(out))
	}
	out[0] += total % uint64(len(out))
	return out
}

func TestCollectorScrapesMaps(t *testing.T) {
	m := newTestMaps(t)

	web4, web6 := netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("fd00::5")
	db := netip.MustParseAddr("10.0.0.9")
	stale := netip.MustParseAddr("10.0.0.77")
	for id, p := range map[uint32]PodMeta{
		1: {UID: "u-web", Namespace: "shop", Name: "web", Addrs: []netip.Addr{web4, web6}},
		2: {UID: "u-db", Namespace: "shop", Name: "db", Addrs: []netip.Addr{db}},
		// The web pod's predecessor, still recorded while it is replaced:
		// it must add to web's series, not collide with them.
		3: {UID: "u-web-old", Namespace: "shop", Name: "web", Addrs: []netip.Addr{stale}},
	} {
		if err := m.PutMeta(id, p); err != nil {
			t.Fatal(err)
		}
		for _, a := range p.Addrs {
			if err := m.CreateCounters(a); err != nil {
				t.Fatal(err)
			}
		}
	}
	// An address with counters but no pod (between detach steps) is not
	// reported per pod.
	if err := m.CreateCounters(netip.MustParseAddr("10.0.0.200")); err != nil {
		t.Fatal(err)
	}

	setCounters := func(a netip.Addr, c PodCounters) {
		t.Helper()
		// Every CPU holds c, so the scrape must show c times the CPU count.
		per := make([]bpf.CapturePodCounters, ebpf.MustPossibleCPU())
		for i := range per {
			per[i] = bpf.CapturePodCounters{OutboundConns: c.OutboundConns, InboundConns: c.InboundConns,
				SteeredPackets: c.SteeredPackets, DroppedPackets: c.DroppedPackets, BypassedPackets: c.BypassedPackets}
		}
		k := PodKey(a)
		if err := m.PodStats.Update(&k, per, ebpf.UpdateExist); err != nil {
			t.Fatal(err)
		}
	}
	setCounters(web4, PodCounters{OutboundConns: 1, InboundConns: 2, SteeredPackets: 3, DroppedPackets: 4, BypassedPackets: 5})
	setCounters(web6, PodCounters{OutboundConns: 10, InboundConns: 20, SteeredPackets: 30, DroppedPackets: 40, BypassedPackets: 50})
	setCounters(stale, PodCounters{OutboundConns: 100})
	setCounters(db, PodCounters{InboundConns: 7, BypassedPackets: 1})

	reasons := map[Reason]uint64{
		bpf.CaptureVerdictReasonREASON_OUT_SYN_STEERED:  41,
		bpf.CaptureVerdictReasonREASON_DROP_NO_LISTENER: 5,
		bpf.CaptureVerdictReasonREASON_DROP_SPOOFED:     3,
	}
	for r, total := range reasons {
		key := uint32(r)
		if err := m.Reasons.Update(&key, spread(total), ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
	}

	cpus := uint64(ebpf.MustPossibleCPU())
	got := promtest.Scrape(t, NewCollector(m))
	want := map[string]uint64{
		`redirector_bpf_pod_connections_total{direction="outbound",namespace="shop",pod="web"}`: 111 * cpus,
		`redirector_bpf_pod_connections_total{direction="inbound",namespace="shop",pod="web"}`:  22 * cpus,
		`redirector_bpf_pod_connections_total{direction="outbound",namespace="shop",pod="db"}`:  0,
		`redirector_bpf_pod_connections_total{direction="inbound",namespace="shop",pod="db"}`:   7 * cpus,
		`redirector_bpf_pod_packets_total{kind="steered",namespace="shop",pod="web"}`:           33 * cpus,
		`redirector_bpf_pod_packets_total{kind="dropped",namespace="shop",pod="web"}`:           44 * cpus,
		`redirector_bpf_pod_packets_total{kind="bypassed",namespace="shop",pod="web"}`:          55 * cpus,
		`redirector_bpf_pod_packets_total{kind="steered",namespace="shop",pod="db"}`:            0,
		`redirector_bpf_pod_packets_total{kind="dropped",namespace="shop",pod="db"}`:            0,
		`redirector_bpf_pod_packets_total{kind="bypassed",namespace="shop",pod="db"}`:           1 * cpus,
		`redirector_bpf_fail_closed_drops_total`:                                                8,
	}
	// Every reason has a series, named as the inspect CLI names it.
	for r := Reason(0); r < bpf.CaptureVerdictReasonREASON_MAX; r++ {
		want[`redirector_bpf_packets_total{reason="`+ReasonName(r)+`"}`] = reasons[r]
	}
	for k, w := range want {
		if v, ok := got[k]; !ok {
			t.Errorf("missing %s", k)
		} else if v != float64(w) {
			t.Errorf("%s = %v, want %d", k, v, w)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("unexpected series %s", k)
		}
	}

	// Nothing is cached: the next scrape reads the maps again.
	setCounters(db, PodCounters{InboundConns: 8})
	dbIn := `redirector_bpf_pod_connections_total{direction="inbound",namespace="shop",pod="db"}`
	if v := promtest.Scrape(t, NewCollector(m))[dbIn]; v != float64(8*cpus) {
		t.Errorf("after an update %s = %v, want %d", dbIn, v, 8*cpus)
	}
}
