package admin

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/internal/promtest"
)

func expect(t *testing.T, got map[string]float64, want map[string]float64) {
	t.Helper()
	for k, w := range want {
		if v, ok := got[k]; !ok {
			t.Errorf("missing %s", k)
		} else if v != w {
			t.Errorf("%s = %v, want %v", k, v, w)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("unexpected series %s", k)
		}
	}
}

func TestAgentCollector(t *testing.T) {
	runs := uint64(3)
	c := NewAgentCollector(func() (uint64, uint64, uint64, int) { return runs, 2, 1, 4 })
	expect(t, promtest.Scrape(t, c), map[string]float64{
		"redirector_enrolled_pods":           4,
		"redirector_reconcile_runs_total":    3,
		"redirector_reconcile_errors_total":  2,
		"redirector_reconcile_repairs_total": 1,
	})
	runs = 4 // read at scrape time, not at construction
	if v := promtest.Scrape(t, c)["redirector_reconcile_runs_total"]; v != 4 {
		t.Errorf("runs %v after the source changed, want 4", v)
	}
}

func TestCertCollector(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	rows := []CertRow{
		{Identity: "spiffe://cluster.local/ns/shop/sa/web", NotAfter: now.Add(90 * time.Minute)},
		{Identity: "spiffe://cluster.local/ns/shop/sa/db", NotAfter: now.Add(-time.Minute)},
		// A repeated identity must not fail the scrape; the sooner expiry wins.
		{Identity: "spiffe://cluster.local/ns/shop/sa/web", NotAfter: now.Add(time.Hour)},
	}
	c := newCertCollector(func() []CertRow { return rows }, func() time.Time { return now })
	expect(t, promtest.Scrape(t, c), map[string]float64{
		`redirector_certificate_expiry_seconds{identity="spiffe://cluster.local/ns/shop/sa/web"}`: 3600,
		`redirector_certificate_expiry_seconds{identity="spiffe://cluster.local/ns/shop/sa/db"}`:  -60,
	})
}

func TestHBONECollectors(t *testing.T) {
	pool := NewPoolCollector(func() PoolStats {
		return PoolStats{Conns: 2, ActiveStreams: 7, Dials: 5, FloodCloses: 3, ZeroStreamLimitDrains: 4, ProtocolErrorCloses: 10, OwnCertificateDrains: 11}
	})
	expect(t, promtest.Scrape(t, pool), map[string]float64{
		"redirector_hbone_pool_connections":                    2,
		"redirector_hbone_pool_active_streams":                 7,
		"redirector_hbone_dials_total":                         5,
		"redirector_hbone_pool_flood_closes_total":             3,
		"redirector_hbone_pool_zero_stream_limit_drains_total": 4,
		"redirector_hbone_pool_protocol_error_closes_total":    10,
		"redirector_hbone_pool_own_certificate_drains_total":   11,
	})
	buffers := NewBufferCollector(func() BufferStats {
		return BufferStats{Limit: 32, FramesInUse: 3, BatchesInUse: 1, FramesDenied: 4, BatchesDenied: 2, FramesDeniedShare: 7, BatchesDeniedShare: 8,
			WindowReserved: 5 << 20, WindowLimit: 1 << 30, WindowsShort: 6, WindowsReclaimed: 9}
	})
	expect(t, promtest.Scrape(t, buffers), map[string]float64{
		`redirector_hbone_bulk_buffers{kind="frame"}`:                    3,
		`redirector_hbone_bulk_buffers{kind="batch"}`:                    1,
		"redirector_hbone_bulk_buffers_limit":                            32,
		`redirector_hbone_bulk_buffers_denied_total{kind="frame"}`:       4,
		`redirector_hbone_bulk_buffers_denied_total{kind="batch"}`:       2,
		`redirector_hbone_bulk_buffers_share_denied_total{kind="frame"}`: 7,
		`redirector_hbone_bulk_buffers_share_denied_total{kind="batch"}`: 8,
		"redirector_hbone_receive_window_reserved_bytes":                 5 << 20,
		"redirector_hbone_receive_window_limit_bytes":                    1 << 30,
		"redirector_hbone_receive_windows_short_total":                   6,
		"redirector_hbone_receive_windows_reclaimed_total":               9,
	})
	server := NewServerCollector(func() ServerStats {
		return ServerStats{HandshakeFailures: 1, StreamsOK: 10, StreamsBadRequest: 2, StreamsDenied: 3, StreamsRefused: 4,
			EarlyResets: 5, FloodCloses: 6, AcceptErrors: 7, OpenConns: 8, Handshakes: 9, RefusedConns: 11, RefusedHandshakes: 12, EvictedHandshakes: 13, RefusalsCut: 14,
			HandlersHeld: 15, HandlersQueued: 16, EvictedConns: 17, RefusedHandshakeRate: 18, SourceResetFloods: 19, ProtocolErrorCloses: 20, OwnCertificateDrains: 21, WriteStallCloses: 22, SourceHandlerRefusals: 23}
	})
	expect(t, promtest.Scrape(t, server), map[string]float64{
		"redirector_hbone_tls_handshake_failures_total":                      1,
		"redirector_hbone_protocol_error_closes_total":                       20,
		"redirector_hbone_own_certificate_drains_total":                      21,
		`redirector_hbone_streams_total{outcome="ok"}`:                       10,
		`redirector_hbone_streams_total{outcome="bad_request"}`:              2,
		`redirector_hbone_streams_total{outcome="denied"}`:                   3,
		`redirector_hbone_streams_total{outcome="refused"}`:                  4,
		"redirector_hbone_early_resets_total":                                5,
		"redirector_hbone_flood_closes_total":                                6,
		"redirector_hbone_accept_errors_total":                               7,
		"redirector_hbone_open_connections":                                  8,
		"redirector_hbone_handshakes_in_progress":                            9,
		`redirector_hbone_connections_refused_total{limit="connections"}`:    11,
		`redirector_hbone_connections_refused_total{limit="handshakes"}`:     12,
		"redirector_hbone_handshakes_evicted_total":                          13,
		"redirector_hbone_refusals_cut_total":                                14,
		"redirector_hbone_write_stall_closes_total":                          22,
		"redirector_hbone_source_handler_refusals_total":                     23,
		`redirector_hbone_server_handlers{state="held"}`:                     15,
		`redirector_hbone_server_handlers{state="queued"}`:                   16,
		"redirector_hbone_connections_evicted_total":                         17,
		`redirector_hbone_connections_refused_total{limit="handshake_rate"}`: 18,
		"redirector_hbone_source_reset_floods_total":                         19,
	})
}

// failing is a collector whose source cannot be read, like a BPF map that
// went away.
type failing struct{ desc *prometheus.Desc }

func (f failing) Describe(ch chan<- *prometheus.Desc) { ch <- f.desc }
func (f failing) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.NewInvalidMetric(f.desc, errors.New("read map: bad file descriptor"))
}

// TestMetricsEndpoint checks the exposition over HTTP, and that one failing
// collector does not take the other metrics down with it.
func TestMetricsEndpoint(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		NewAgentCollector(func() (uint64, uint64, uint64, int) { return 1, 0, 0, 1 }),
		NewServerCollector(func() ServerStats { return ServerStats{StreamsDenied: 3} }),
		NewPoolCollector(func() PoolStats { return PoolStats{} }),
		failing{prometheus.NewDesc("redirector_broken_total", "A source that fails.", nil, nil)},
	)
	s := start(t, Options{Registry: reg})
	get(t, "http://"+s.MetricsAddr()+"/metrics") // the failure is counted in the next scrape
	code, body := get(t, "http://"+s.MetricsAddr()+"/metrics")
	if code != http.StatusOK {
		t.Fatalf("%d %s", code, body)
	}
	for _, line := range []string{
		"# TYPE redirector_enrolled_pods gauge",
		"redirector_enrolled_pods 1",
		"# TYPE redirector_reconcile_runs_total counter",
		`redirector_hbone_streams_total{outcome="denied"} 3`,
		"redirector_hbone_pool_connections 0",
		`promhttp_metric_handler_errors_total{cause="gathering"} 1`,
	} {
		if !strings.Contains(body, line+"\n") {
			t.Errorf("/metrics has no line %q", line)
		}
	}
}

// The series Istio's ztunnel dashboard reads beside istio_tcp_*: the build
// with component ztunnel and the agent's version as tag, and the served
// and pending pods as ztunnel's workload manager counts its proxies.
func TestZtunnelCollector(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(NewZtunnelCollector("v1.2.3", func() (int, int) { return 3, 1 }))
	want := `
# HELP istio_build Istio component build info (as ztunnel's).
# TYPE istio_build gauge
istio_build{component="ztunnel",tag="v1.2.3"} 1
# HELP workload_manager_active_proxy_count Pods on this node whose tunnel is served (ztunnel's active proxies).
# TYPE workload_manager_active_proxy_count gauge
workload_manager_active_proxy_count 3
# HELP workload_manager_pending_proxy_count Pods on this node enrolled but whose tunnel is not served yet (ztunnel's pending proxies).
# TYPE workload_manager_pending_proxy_count gauge
workload_manager_pending_proxy_count 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want)); err != nil {
		t.Error(err)
	}
}
