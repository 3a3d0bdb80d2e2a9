package admin

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// scrapeCollector asks its source when scraped: the agent's counters live
// where they are counted (the reconciler, the pool, the servers), and no
// goroutine copies them into gauges in between.
type scrapeCollector struct {
	descs   []*prometheus.Desc
	collect func(ch chan<- prometheus.Metric)
}

func (c scrapeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

func (c scrapeCollector) Collect(ch chan<- prometheus.Metric) { c.collect(ch) }

func counter(d *prometheus.Desc, v uint64, labels ...string) prometheus.Metric {
	return prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
}

func gauge(d *prometheus.Desc, v float64, labels ...string) prometheus.Metric {
	return prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
}

// NewAgentCollector reports enrollment and the reconciler's cumulative
// counts, from stats (nodeagent.Reconciler.Stats in the agent).
func NewAgentCollector(stats func() (runs, errors, repairs uint64, enrolled int)) prometheus.Collector {
	enrolled := prometheus.NewDesc("redirector_enrolled_pods",
		"Pods on this node whose traffic the data path captures.", nil, nil)
	runs := prometheus.NewDesc("redirector_reconcile_runs_total",
		"Enrollment reconciles run, incremental and full.", nil, nil)
	errs := prometheus.NewDesc("redirector_reconcile_errors_total",
		"Pods a reconcile could not converge, counted once per reconcile that failed them.", nil, nil)
	repairs := prometheus.NewDesc("redirector_reconcile_repairs_total",
		"Pods found drifted (a missing pin or enrollment entry) and attached again.", nil, nil)
	return scrapeCollector{
		descs: []*prometheus.Desc{enrolled, runs, errs, repairs},
		collect: func(ch chan<- prometheus.Metric) {
			r, e, p, n := stats()
			ch <- gauge(enrolled, float64(n))
			ch <- counter(runs, r)
			ch <- counter(errs, e)
			ch <- counter(repairs, p)
		},
	}
}

// NewZtunnelCollector reports the series of ztunnel's that Istio's ztunnel
// dashboard reads beside istio_tcp_*: istio_build{component="ztunnel",tag}
// (tag the agent's version) and, from proxies, the pods whose tunnel is
// served (workload_manager_active_proxy_count) and those enrolled but not
// served yet (workload_manager_pending_proxy_count).
func NewZtunnelCollector(tag string, proxies func() (active, pending int)) prometheus.Collector {
	build := prometheus.NewDesc("istio_build", "Istio component build info (as ztunnel's).", nil,
		prometheus.Labels{"component": "ztunnel", "tag": tag})
	active := prometheus.NewDesc("workload_manager_active_proxy_count",
		"Pods on this node whose tunnel is served (ztunnel's active proxies).", nil, nil)
	pending := prometheus.NewDesc("workload_manager_pending_proxy_count",
		"Pods on this node enrolled but whose tunnel is not served yet (ztunnel's pending proxies).", nil, nil)
	return scrapeCollector{
		descs: []*prometheus.Desc{build, active, pending},
		collect: func(ch chan<- prometheus.Metric) {
			a, p := proxies()
			ch <- gauge(build, 1)
			ch <- gauge(active, float64(a))
			ch <- gauge(pending, float64(p))
		},
	}
}

// NewCertCollector reports how long each cached workload certificate has
// left, from the same rows as the config dump's certs section.
func NewCertCollector(certs func() []CertRow) prometheus.Collector {
	return newCertCollector(certs, time.Now)
}

func newCertCollector(certs func() []CertRow, now func() time.Time) prometheus.Collector {
	expiry := prometheus.NewDesc("redirector_certificate_expiry_seconds",
		"Seconds until the cached certificate of a workload identity expires, negative once expired. "+
			"Certificates are renewed in the background at about half their lifetime; a value that keeps falling means renewal fails (see redirector_ca_request_failures_total).",
		[]string{"identity"}, nil)
	return scrapeCollector{
		descs: []*prometheus.Desc{expiry},
		collect: func(ch chan<- prometheus.Metric) {
			t := now()
			// One series per identity, even if the source repeats one:
			// a duplicate would fail the whole scrape. The earliest
			// expiry is the one to alert on.
			soonest := map[string]time.Time{}
			for _, c := range certs() {
				if old, ok := soonest[c.Identity]; !ok || c.NotAfter.Before(old) {
					soonest[c.Identity] = c.NotAfter
				}
			}
			for id, notAfter := range soonest {
				ch <- gauge(expiry, notAfter.Sub(t).Seconds(), id)
			}
		},
	}
}

// PoolStats is the HBONE client pool's state (hbone.PoolStats in the agent).
type PoolStats struct {
	Conns         int    // open pooled connections
	ActiveStreams int    // streams open or being opened
	Dials         uint64 // connections dialled since start
	FloodCloses   uint64 // connections closed because the server flooded them
	// ZeroStreamLimitDrains counts connections drained because the server
	// took no streams (SETTINGS_MAX_CONCURRENT_STREAMS 0).
	ZeroStreamLimitDrains uint64
	// ProtocolErrorCloses counts connections closed because the server
	// broke HTTP/2.
	ProtocolErrorCloses uint64
	// OwnCertificateDrains counts connections given no new stream because
	// of the certificate this node presented on them.
	OwnCertificateDrains uint64
}

// NewPoolCollector reports the HBONE client pool.
func NewPoolCollector(stats func() PoolStats) prometheus.Collector {
	conns := prometheus.NewDesc("redirector_hbone_pool_connections",
		"Pooled HBONE connections open to other nodes' tunnels.", nil, nil)
	streams := prometheus.NewDesc("redirector_hbone_pool_active_streams",
		"HBONE streams open or being opened over pooled connections.", nil, nil)
	dials := prometheus.NewDesc("redirector_hbone_dials_total",
		"HBONE connections dialled; far fewer than streams while pooling works.", nil, nil)
	floods := prometheus.NewDesc("redirector_hbone_pool_flood_closes_total",
		"Pooled HBONE connections closed with GOAWAY ENHANCE_YOUR_CALM because the server flooded them with frames that carry nothing.", nil, nil)
	zeroLimits := prometheus.NewDesc("redirector_hbone_pool_zero_stream_limit_drains_total",
		"Pooled HBONE connections drained because the server set SETTINGS_MAX_CONCURRENT_STREAMS to 0: they can carry no new stream.", nil, nil)
	protocolErrors := prometheus.NewDesc("redirector_hbone_pool_protocol_error_closes_total",
		"Pooled HBONE connections closed because the server broke HTTP/2 (a malformed or truncated response, a push, frames on streams never opened): GOAWAY with the error's code, naming the reason.", nil, nil)
	ownCerts := prometheus.NewDesc("redirector_hbone_pool_own_certificate_drains_total",
		"Pooled HBONE connections given no new stream because of the certificate this node presented on them: its chain ended, it was replaced (renewed, or its root removed), or a trust bundle change refused it. The next stream dials, presenting the current certificate.", nil, nil)
	return scrapeCollector{
		descs: []*prometheus.Desc{conns, streams, dials, floods, zeroLimits, protocolErrors, ownCerts},
		collect: func(ch chan<- prometheus.Metric) {
			s := stats()
			ch <- gauge(conns, float64(s.Conns))
			ch <- gauge(streams, float64(s.ActiveStreams))
			ch <- counter(dials, s.Dials)
			ch <- counter(floods, s.FloodCloses)
			ch <- counter(zeroLimits, s.ZeroStreamLimitDrains)
			ch <- counter(protocolErrors, s.ProtocolErrorCloses)
			ch <- counter(ownCerts, s.OwnCertificateDrains)
		},
	}
}

// BufferStats is the state of the HBONE layer's budgets of large buffers (hbone.Buffers in
// the agent): bulk frame buffers of streams in a burst, and batch buffers of connections
// writing a large frame.
type BufferStats struct {
	Limit                       int
	FramesInUse, BatchesInUse   int
	FramesDenied, BatchesDenied uint64
	// Buffers refused to a peer address that held its share of the budget.
	FramesDeniedShare, BatchesDeniedShare uint64
	// The receive-window budget (hbone.Windows): bytes of window reserved by
	// connections beyond HTTP/2's initial 64 KiB, its limit, and the
	// connections that got less than a full window, and the idle connections
	// drained to give their window to another address's.
	WindowReserved, WindowLimit    int64
	WindowsShort, WindowsReclaimed uint64
}

// NewBufferCollector reports the HBONE layer's large-buffer budgets.
func NewBufferCollector(stats func() BufferStats) prometheus.Collector {
	inUse := prometheus.NewDesc("redirector_hbone_bulk_buffers",
		"Large HBONE buffers in use, by kind: frame (a stream in a burst reads 256 KiB at once) or batch (a connection writes a large frame's TLS records at once).",
		[]string{"kind"}, nil)
	limit := prometheus.NewDesc("redirector_hbone_bulk_buffers_limit",
		"The most large HBONE buffers of each kind in use at once; past it streams and connections use ordinary ones.", nil, nil)
	denied := prometheus.NewDesc("redirector_hbone_bulk_buffers_denied_total",
		"Times a large HBONE buffer was wanted while all were in use, by kind.", []string{"kind"}, nil)
	deniedShare := prometheus.NewDesc("redirector_hbone_bulk_buffers_share_denied_total",
		"Times a large HBONE buffer was refused, by kind, because the connection's peer address held its share (a quarter) of them.", []string{"kind"}, nil)
	window := prometheus.NewDesc("redirector_hbone_receive_window_reserved_bytes",
		"Receive window HBONE connections reserved beyond HTTP/2's initial 64 KiB: what peers may make the agent hold for applications that do not read.", nil, nil)
	windowLimit := prometheus.NewDesc("redirector_hbone_receive_window_limit_bytes",
		"The most receive window all HBONE connections reserve together (a peer address gets at most 1/8 of it).", nil, nil)
	short := prometheus.NewDesc("redirector_hbone_receive_windows_short_total",
		"HBONE connections that got less than a full receive window because the budget or their peer's share was spent.", nil, nil)
	reclaimed := prometheus.NewDesc("redirector_hbone_receive_windows_reclaimed_total",
		"Idle HBONE connections drained (GOAWAY) to give their receive window to a new connection of another address, when the budget was spent.", nil, nil)
	return scrapeCollector{
		descs: []*prometheus.Desc{inUse, limit, denied, deniedShare, window, windowLimit, short, reclaimed},
		collect: func(ch chan<- prometheus.Metric) {
			s := stats()
			ch <- gauge(inUse, float64(s.FramesInUse), "frame")
			ch <- gauge(inUse, float64(s.BatchesInUse), "batch")
			ch <- gauge(limit, float64(s.Limit))
			ch <- counter(denied, s.FramesDenied, "frame")
			ch <- counter(denied, s.BatchesDenied, "batch")
			ch <- counter(deniedShare, s.FramesDeniedShare, "frame")
			ch <- counter(deniedShare, s.BatchesDeniedShare, "batch")
			ch <- gauge(window, float64(s.WindowReserved))
			ch <- gauge(windowLimit, float64(s.WindowLimit))
			ch <- counter(short, s.WindowsShort)
			ch <- counter(reclaimed, s.WindowsReclaimed)
		},
	}
}

// ReplyPollStats counts the HBONE readers' polls for an app's answer (hbone.ReplyPolls).
type ReplyPollStats struct {
	Caught, Tunnel, Expired uint64
	Budget, Busy            uint64
	Seconds                 float64
}

// NewReplyPollCollector reports reply polling.
func NewReplyPollCollector(stats func() ReplyPollStats) prometheus.Collector {
	polls := prometheus.NewDesc("redirector_hbone_reply_polls_total",
		"Times an HBONE reader kept its thread awake after delivering a small frame, polling for the app's answer, by how the poll ended: caught (the app answered), tunnel (the HBONE socket had data first) or expired (the window passed).",
		[]string{"result"}, nil)
	skipped := prometheus.NewDesc("redirector_hbone_reply_polls_skipped_total",
		"Reply polls not made, by reason: budget (the REPLY_POLL_CPU share was spent) or busy (another reader was polling).",
		[]string{"reason"}, nil)
	spent := prometheus.NewDesc("redirector_hbone_reply_poll_seconds_total",
		"CPU time HBONE readers spent polling for apps' answers.", nil, nil)
	return scrapeCollector{
		descs: []*prometheus.Desc{polls, skipped, spent},
		collect: func(ch chan<- prometheus.Metric) {
			s := stats()
			ch <- counter(polls, s.Caught, "caught")
			ch <- counter(polls, s.Tunnel, "tunnel")
			ch <- counter(polls, s.Expired, "expired")
			ch <- counter(skipped, s.Budget, "budget")
			ch <- counter(skipped, s.Busy, "busy")
			ch <- prometheus.MustNewConstMetric(spent, prometheus.CounterValue, s.Seconds)
		},
	}
}

// ServerStats is the HBONE servers' cumulative counts, summed over the
// node's pods (from hbone.ServerStats in the agent). The sums must never go
// down, so counts of servers already stopped have to stay in them.
type ServerStats struct {
	HandshakeFailures   uint64 // TLS handshakes (or ALPN) that failed
	StreamsOK           uint64 // tunnels established (200)
	StreamsBadRequest   uint64 // malformed requests (400, 405, 431)
	StreamsDenied       uint64 // refused by policy
	StreamsRefused      uint64 // REFUSED_STREAM: stream limit or draining
	EarlyResets         uint64 // streams the client reset before their answer
	FloodCloses         uint64 // connections closed with GOAWAY ENHANCE_YOUR_CALM
	ProtocolErrorCloses uint64 // connections closed because the client broke HTTP/2
	AcceptErrors        uint64 // failed accepts (EMFILE, ...), each followed by a backoff
	RefusalsCut         uint64 // refusals reset before their body: the client granted no window
	WriteStallCloses    uint64 // connections closed: a write to the client made no progress for 20 s
	// Streams holding a handler slot (to their relay's end) and waiting for one.
	HandlersHeld, HandlersQueued uint64
	// The node-wide bounds on open connections and TLS handshakes.
	OpenConns, Handshakes           int
	RefusedConns, RefusedHandshakes uint64
	RefusedHandshakeRate            uint64 // a source opened connections too fast
	EvictedHandshakes               uint64 // the oldest closed to admit a new one
	EvictedConns                    uint64 // closed to admit one from a source holding fewer
	SourceResetFloods               uint64 // closed: the source's early resets over all its connections
	SourceHandlerRefusals           uint64 // streams refused: the source held its handlers over all its connections
	// OwnCertificateDrains counts connections drained because of the
	// certificate this node presented on them.
	OwnCertificateDrains uint64
}

// NewServerCollector reports the HBONE servers.
func NewServerCollector(stats func() ServerStats) prometheus.Collector {
	handshakes := prometheus.NewDesc("redirector_hbone_tls_handshake_failures_total",
		"Inbound HBONE TLS handshakes that failed: a peer with an untrusted or expired certificate, no h2 ALPN, plaintext HTTP, or a handshake over 32 KiB.", nil, nil)
	streams := prometheus.NewDesc("redirector_hbone_streams_total",
		"Inbound HBONE CONNECT streams by outcome: ok, bad_request, denied (policy) or refused (stream limit, draining).",
		[]string{"outcome"}, nil)
	earlyResets := prometheus.NewDesc("redirector_hbone_early_resets_total",
		"Inbound HBONE streams the client reset before they were answered (rapid-reset accounting).", nil, nil)
	floods := prometheus.NewDesc("redirector_hbone_flood_closes_total",
		"Inbound HBONE connections closed with GOAWAY ENHANCE_YOUR_CALM: too many early resets, a full handler queue, or a flood of frames that carry nothing.", nil, nil)
	acceptErrors := prometheus.NewDesc("redirector_hbone_accept_errors_total",
		"Failed accepts on the HBONE listeners (EMFILE, ENFILE, ...), each followed by a backoff.", nil, nil)
	refusalsCut := prometheus.NewDesc("redirector_hbone_refusals_cut_total",
		"Inbound HBONE refusals (4xx, 5xx) whose stream was reset before its body went out, because the client granted no flow-control window for it in time.", nil, nil)
	writeStalls := prometheus.NewDesc("redirector_hbone_write_stall_closes_total",
		"Inbound HBONE connections closed because a write to the client made no progress (no byte acknowledged) for 20 s: a client that reads nothing of ours, whose streams' answers and refusals wait behind that write with their handler slots.", nil, nil)
	handlers := prometheus.NewDesc("redirector_hbone_server_handlers",
		"Inbound HBONE streams holding a handler slot (deciding, dialling, refusing or relaying; at most MaxConcurrentStreams per connection) or queued for one (at most 4 times as many), by state: held or queued.",
		[]string{"state"}, nil)
	open := prometheus.NewDesc("redirector_hbone_open_connections",
		"Inbound HBONE connections open now on this node, handshaking or serving.", nil, nil)
	inHandshake := prometheus.NewDesc("redirector_hbone_handshakes_in_progress",
		"Inbound HBONE connections whose TLS handshake and HTTP/2 preface have not finished.", nil, nil)
	refused := prometheus.NewDesc("redirector_hbone_connections_refused_total",
		"Inbound HBONE connections closed at accept because a node-wide or per-source bound was reached, by bound: connections, handshakes (in progress from one source) or handshake_rate (opened by one source per second).",
		[]string{"limit"}, nil)
	evicted := prometheus.NewDesc("redirector_hbone_handshakes_evicted_total",
		"Inbound HBONE connections closed while still handshaking, the oldest first, to admit a new one when the node-wide handshake bound was reached (silent or slow clients).", nil, nil)
	evictedConns := prometheus.NewDesc("redirector_hbone_connections_evicted_total",
		"Inbound HBONE connections closed, the oldest of the source holding the most, to admit one from a source holding fewer when the node-wide connection bound was reached.", nil, nil)
	sourceResetFloods := prometheus.NewDesc("redirector_hbone_source_reset_floods_total",
		"Inbound HBONE connections closed with GOAWAY ENHANCE_YOUR_CALM because their client address reset more streams before their answer, over all its connections, than its budget (1000 per 10 s); also in redirector_hbone_flood_closes_total.", nil, nil)
	sourceHandlers := prometheus.NewDesc("redirector_hbone_source_handler_refusals_total",
		"Inbound HBONE streams refused with REFUSED_STREAM because their client address held its bound (twice MAX_CONNECTIONS_PER_SOURCE, at least 4096) of streams with a handler (deciding, answering, refusing or relaying) over all its connections; also in redirector_hbone_streams_total{outcome=\"refused\"}.", nil, nil)
	protocolErrors := prometheus.NewDesc("redirector_hbone_protocol_error_closes_total",
		"Inbound HBONE connections closed because the client broke HTTP/2 (a malformed frame or header block, DATA beyond the window, frames on closed streams): GOAWAY with the error's code, naming the reason.", nil, nil)
	ownCerts := prometheus.NewDesc("redirector_hbone_own_certificate_drains_total",
		"Inbound HBONE connections drained (GOAWAY, new streams refused with REFUSED_STREAM, open ones run on) because of the certificate this node presented on them: its chain ended, it was replaced (renewed, or its root removed), or a trust bundle change refused it. The client's retry goes on a new connection, presenting the current certificate.", nil, nil)
	return scrapeCollector{
		descs: []*prometheus.Desc{handshakes, streams, earlyResets, floods, protocolErrors, acceptErrors, refusalsCut, writeStalls, handlers, open, inHandshake, refused, evicted, evictedConns, sourceResetFloods, sourceHandlers, ownCerts},
		collect: func(ch chan<- prometheus.Metric) {
			s := stats()
			ch <- counter(earlyResets, s.EarlyResets)
			ch <- counter(floods, s.FloodCloses)
			ch <- counter(protocolErrors, s.ProtocolErrorCloses)
			ch <- counter(acceptErrors, s.AcceptErrors)
			ch <- counter(refusalsCut, s.RefusalsCut)
			ch <- counter(writeStalls, s.WriteStallCloses)
			ch <- gauge(handlers, float64(s.HandlersHeld), "held")
			ch <- gauge(handlers, float64(s.HandlersQueued), "queued")
			ch <- gauge(open, float64(s.OpenConns))
			ch <- gauge(inHandshake, float64(s.Handshakes))
			ch <- counter(refused, s.RefusedConns, "connections")
			ch <- counter(refused, s.RefusedHandshakes, "handshakes")
			ch <- counter(refused, s.RefusedHandshakeRate, "handshake_rate")
			ch <- counter(evicted, s.EvictedHandshakes)
			ch <- counter(evictedConns, s.EvictedConns)
			ch <- counter(sourceResetFloods, s.SourceResetFloods)
			ch <- counter(sourceHandlers, s.SourceHandlerRefusals)
			ch <- counter(ownCerts, s.OwnCertificateDrains)
			ch <- counter(handshakes, s.HandshakeFailures)
			ch <- counter(streams, s.StreamsOK, "ok")
			ch <- counter(streams, s.StreamsBadRequest, "bad_request")
			ch <- counter(streams, s.StreamsDenied, "denied")
			ch <- counter(streams, s.StreamsRefused, "refused")
		},
	}
}
