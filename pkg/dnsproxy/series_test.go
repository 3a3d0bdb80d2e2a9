package dnsproxy

import (
	"context"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// seriesOf counts the istio_dns_* series reg exports per canonical
// service and revision ("service/revision").
func seriesOf(t *testing.T, reg *prometheus.Registry) map[string]int {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for _, mf := range mfs {
		if len(mf.GetName()) < 10 || mf.GetName()[:10] != "istio_dns_" {
			continue
		}
		for _, m := range mf.GetMetric() {
			got[labelOf(m, "source_canonical_service")+"/"+labelOf(m, "source_canonical_revision")]++
		}
	}
	return got
}

func labelOf(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// TestDNSSeriesOfDepartedSourcesDeleted: the istio_dns_* series of a
// canonical service and revision stay exported for seriesGrace after the
// last pod with them left the directory, then are deleted (every query
// type and protocol, forwarded ones' upstream series too); those of
// sources still present, and of unknown clients, stay. A pod of the source
// that comes back within the grace keeps its series. Before, every
// revision ever rolled out on the node kept its series until the agent
// restarted.
func TestDNSSeriesOfDepartedSourcesDeleted(t *testing.T) {
	up := udpUpstream(t, func(q *dns.Msg, _ []byte) [][]byte {
		b, _ := new(dns.Msg).SetReply(q).Pack()
		return [][]byte{b}
	})
	var dir atomic.Pointer[workload.Directory]
	dir.Store(testDirectory(t))
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	var clock atomic.Int64 // unix seconds; the registry collects on goroutines of its own
	clock.Store(1_000_000)
	m.sources.now = func() time.Time { return time.Unix(clock.Load(), 0) }
	advance := func(d time.Duration) { clock.Add(int64(d / time.Second)) }
	p, err := New(Config{Upstreams: []netip.AddrPort{up}}, dir.Load, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	m.watch(dir.Load) // as New would, with the proxy's directory
	ctx := context.Background()
	ask := func(who *workload.Workload) {
		for i, q := range []struct {
			name  string
			qtype uint16
		}{{"reviews.mesh.svc.cluster.local.", dns.TypeA}, {"outside.example.org.", dns.TypeA}, {"outside.example.org.", dns.TypeTXT}} {
			for _, proto := range []string{"udp", "tcp"} {
				if p.Answer(ctx, who, proto, query(t, q.name, q.qtype, uint16(i+1)), dialLoopback) == nil {
					t.Fatalf("no answer to %s", q.name)
				}
			}
		}
	}
	ask(client)
	ask(otherClient)
	ask(nil)
	before := seriesOf(t, reg)
	for _, src := range []string{"app/v1", "web/v2", "unknown/unknown"} {
		if before[src] == 0 {
			t.Fatalf("no series of %s: %v", src, before)
		}
	}

	// web's last pod leaves; app's pod is replaced by one of v2.
	appV2 := &workload.Workload{Namespace: "mesh", Name: "app-2", UID: "uid-app-2", CanonicalName: "app", CanonicalRevision: "v2"}
	setDir := func(ws ...*workload.Workload) {
		d, errs := workload.NewDirectory(ws, testServices())
		if len(errs) > 0 {
			t.Fatal(errs)
		}
		dir.Store(d)
	}
	setDir(appV2)
	ask(appV2)
	advance(time.Minute)
	if got := seriesOf(t, reg); got["web/v2"] != before["web/v2"] || got["app/v1"] != before["app/v1"] {
		t.Fatalf("series deleted within the grace: %v, were %v", got, before)
	}
	advance(seriesGrace)
	got := seriesOf(t, reg)
	if got["web/v2"] != 0 || got["app/v1"] != 0 {
		t.Errorf("series of sources gone for %s still exported: %v", seriesGrace+time.Minute, got)
	}
	if got["app/v2"] != before["app/v1"] || got["unknown/unknown"] != before["unknown/unknown"] {
		t.Errorf("series of present sources deleted: %v, want app/v2 and unknown/unknown as %v", got, before)
	}

	// A source that leaves and comes back within the grace keeps its series.
	setDir()
	seriesOf(t, reg) // the scrape that sees it gone
	advance(seriesGrace / 2)
	setDir(appV2)
	seriesOf(t, reg)
	advance(seriesGrace)
	if got := seriesOf(t, reg); got["app/v2"] != before["app/v1"] {
		t.Errorf("the series of a source back within its grace were deleted: %v", got)
	}
	// And a query counted while its source is gone ends the grace too.
	setDir()
	seriesOf(t, reg)
	advance(seriesGrace - time.Second)
	ask(appV2) // a directory lagging behind the pod
	advance(2 * time.Second)
	if got := seriesOf(t, reg); got["app/v2"] != before["app/v1"] {
		t.Errorf("series deleted a second after a query counted in them: %v", got)
	}
	advance(seriesGrace)
	seriesOf(t, reg)
	if got := seriesOf(t, reg); got["app/v2"] != 0 {
		t.Errorf("series of a source gone for good still exported: %v", got)
	}
}
