package dnsproxy

import (
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Metrics are the DNS proxy's Prometheus metrics: ztunnel's istio_dns_*
// series (src/dns/metrics.rs), with its labels, plus the proxy's own
// counts of what it refused or rejected.
//
// Labels are bounded: the query type comes from a fixed set (queryTypes,
// else "other"), the protocol is udp or tcp, and the canonical service
// and revision are those of the node's pods. The series of a canonical
// service and revision no pod of the directory has any more are deleted
// seriesGrace after they left (sources).
type Metrics struct {
	requests         *prometheus.CounterVec
	upstreamRequests *prometheus.CounterVec
	upstreamFailures *prometheus.CounterVec
	upstreamDuration *prometheus.HistogramVec
	refused          *prometheus.CounterVec
	rejected         *prometheus.CounterVec
	evicted          *prometheus.CounterVec
	inFlight         prometheus.Gauge
	// Per upstream resolver (a label value per configured one):
	upUnanswered *prometheus.CounterVec
	upHedged     *prometheus.CounterVec
	upStruck     *prometheus.CounterVec
	upSRTT       *prometheus.GaugeVec
	sources      *sourceSeries
}

// seriesGrace is how long the istio_dns_* series of a canonical service
// and revision stay exported once no pod of the directory has them (and no
// query of theirs was counted): as pkg/tunnel's seriesGrace for the
// istio_tcp_* series, five minutes is 20 scrapes at a 15 s interval, so
// every scraper sees the final values several times and increase() over the
// source's last minutes stays right. Kept forever, the series of every
// revision ever rolled out grow the agent's heap and every scrape.
const seriesGrace = 5 * time.Minute

// source is the label values of the pods a series counts the queries of.
type source struct{ service, revision string }

// unknownSource is the series of queries from no pod the directory knows:
// always live.
var unknownSource = source{"unknown", "unknown"}

// sourceSeries deletes the istio_dns_* series of sources that left, the
// way pkg/tunnel's seriesGC does the istio_tcp_* ones (that type cannot
// serve here: it judges the tunnel's labels, and the tunnel imports this
// package): at each scrape (a sweeping collector) it judges every source
// counted against the directory, starts the grace of one no workload has
// any more, and deletes its series, every query type and protocol, once
// the grace passed. A query counted meanwhile (a pod of that source came
// back, or the directory lagged) ends the grace. Bounded by the sources
// the directory had: one entry per canonical service and revision.
type sourceSeries struct {
	now   func() time.Time
	grace time.Duration
	vecs  []*prometheus.MetricVec
	// dir is the directory the sources are judged against, from watch;
	// nil: none, every source is live.
	dir atomic.Pointer[func() *workload.Directory]

	mu     sync.Mutex
	seen   map[source]time.Time // goneSince per source counted; zero: live
	judged *workload.Directory  // the directory live was computed from
	live   map[source]bool
}

// dnsLabels are ztunnel's DnsLabels, in its order.
var dnsLabels = []string{"request_query_type", "request_protocol", "source_canonical_service", "source_canonical_revision"}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered, for tests and tools).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_dns_requests_total", Help: "DNS queries answered, from the mesh or forwarded, as ztunnel reports them."}, dnsLabels),
		upstreamRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_dns_upstream_requests_total", Help: "DNS queries forwarded to an upstream resolver."}, dnsLabels),
		upstreamFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_dns_upstream_failures_total", Help: "Forwarded DNS queries no upstream resolver answered (the client got SERVFAIL, or the upstream's failure)."}, dnsLabels),
		upstreamDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "istio_dns_upstream_request_duration_seconds",
			Help:    "Time to get a forwarded DNS query's answer from upstream.",
			Buckets: []float64{0.0005, 0.001, 0.01, 0.1, 1, 5}}, dnsLabels),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_dns_refused_total",
			Help: "DNS queries answered REFUSED, and TCP connections closed at once, because a bound was reached, by limit (node, pod: queries in flight; conns_node, conns_pod: TCP connections)."}, []string{"limit"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_dns_rejected_total",
			Help: "DNS queries not answered because they are malformed or not queries, by reason; short ones are dropped, the others answered FORMERR, NOTIMP or BADVERS."}, []string{"reason"}),
		evicted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_dns_evicted_total",
			Help: "DNS queries answered REFUSED, and TCP connections closed, to make room under a full node bound for a pod holding fewer, by limit (node: queries in flight; conns_node: TCP connections)."}, []string{"limit"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "redirector_dns_queries_in_flight", Help: "DNS queries being answered now, over all pods."}),
		upUnanswered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_dns_upstream_unanswered_total",
			Help: "Exchanges with an upstream resolver that got no answer: timed out, or refused or unreachable (not those ended because another upstream answered first)."}, []string{"upstream"}),
		upHedged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_dns_upstream_hedged_total",
			Help: "Forwarded DNS queries asked of the next upstream resolver too because this one had not answered within its hedge delay."}, []string{"upstream"}),
		upStruck: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_dns_upstream_demotions_total",
			Help: "Failures counted against an upstream resolver (no answer, and none to any other query meanwhile), each ranking it after the others for a while."}, []string{"upstream"}),
		upSRTT: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "redirector_dns_upstream_srtt_seconds",
			Help: "Smoothed round-trip time of an upstream resolver's answers (0: none yet)."}, []string{"upstream"}),
	}
	m.sources = &sourceSeries{now: time.Now, grace: seriesGrace, seen: map[source]time.Time{},
		vecs: []*prometheus.MetricVec{m.requests.MetricVec, m.upstreamRequests.MetricVec, m.upstreamFailures.MetricVec, m.upstreamDuration.MetricVec}}
	if reg != nil {
		reg.MustRegister(sweepingCollector{m.sources, []prometheus.Collector{m.requests, m.upstreamRequests, m.upstreamFailures, m.upstreamDuration}},
			m.refused, m.rejected, m.evicted, m.inFlight, m.upUnanswered, m.upHedged, m.upStruck, m.upSRTT)
	}
	return m
}

// watch judges the sources of the series against the directory dir
// returns (the proxy's).
func (m *Metrics) watch(dir func() *workload.Directory) {
	if dir != nil {
		m.sources.dir.Store(&dir)
	}
}

// count notes a query of the source of l (labels' values) counted now.
func (s *sourceSeries) count(l []string) {
	src := source{l[2], l[3]}
	s.mu.Lock()
	s.seen[src] = time.Time{}
	s.mu.Unlock()
}

// sweep starts the grace of the sources no workload of the directory has
// and deletes the series of those past it.
// liveSources are the sources of dir's workloads, and unknownSource.
func liveSources(dir *workload.Directory) map[source]bool {
	live := map[source]bool{unknownSource: true}
	if dir != nil {
		for _, w := range dir.All() {
			live[source{orUnknown(w.CanonicalName), orUnknown(w.CanonicalRevision)}] = true
		}
	}
	return live
}

func (s *sourceSeries) sweep() {
	dirFn := s.dir.Load()
	if dirFn == nil {
		return
	}
	dir := (*dirFn)()
	s.mu.Lock()
	stale := dir != s.judged || s.live == nil
	s.mu.Unlock()
	var live map[source]bool
	if stale {
		// Outside the lock, which every counted query takes: a directory
		// of 100k workloads takes some 20 ms to walk.
		live = liveSources(dir)
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if live != nil {
		s.judged, s.live = dir, live
	}
	for src, goneSince := range s.seen {
		switch {
		case s.live[src]:
			s.seen[src] = time.Time{}
		case goneSince.IsZero():
			s.seen[src] = now
		case now.Sub(goneSince) >= s.grace:
			match := prometheus.Labels{"source_canonical_service": src.service, "source_canonical_revision": src.revision}
			for _, v := range s.vecs {
				v.DeletePartialMatch(match)
			}
			delete(s.seen, src)
		}
	}
}

// sweepingCollector exports the istio_dns_* vectors, sweeping first, so a
// scrape never shows a series past its grace.
type sweepingCollector struct {
	s    *sourceSeries
	vecs []prometheus.Collector
}

func (c sweepingCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, v := range c.vecs {
		v.Describe(ch)
	}
}

func (c sweepingCollector) Collect(ch chan<- prometheus.Metric) {
	c.s.sweep()
	for _, v := range c.vecs {
		v.Collect(ch)
	}
}

// queryTypes are the query types with a label value of their own, in
// ztunnel's spelling (hickory's type name, lowercased); any other is
// "other", so a client cannot mint series.
var queryTypes = map[uint16]string{
	dns.TypeA: "a", dns.TypeAAAA: "aaaa", dns.TypeCNAME: "cname", dns.TypeMX: "mx", dns.TypeTXT: "txt",
	dns.TypeSRV: "srv", dns.TypePTR: "ptr", dns.TypeNS: "ns", dns.TypeSOA: "soa", dns.TypeANY: "any",
	dns.TypeHTTPS: "https", dns.TypeSVCB: "svcb", dns.TypeCAA: "caa", dns.TypeNAPTR: "naptr",
	dns.TypeDS: "ds", dns.TypeDNSKEY: "dnskey",
}

// labels returns the label values of a query of qtype from client over
// proto.
func labels(qtype uint16, proto string, client *workload.Workload) []string {
	t, ok := queryTypes[qtype]
	if !ok {
		t = "other"
	}
	service, revision := "unknown", "unknown"
	if client != nil {
		service = orUnknown(client.CanonicalName)
		revision = orUnknown(client.CanonicalRevision)
	}
	return []string{t, protoLabel(proto), service, revision}
}

// protoLabel bounds the protocol label: tcp, else udp.
func protoLabel(proto string) string {
	if strings.EqualFold(proto, "tcp") {
		return "tcp"
	}
	return "udp"
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

func (m *Metrics) request(l []string) {
	m.sources.count(l)
	m.requests.WithLabelValues(l...).Inc()
}

// upstream records one forwarded query: its duration, and a failure.
func (m *Metrics) upstream(l []string, took time.Duration, failed bool) {
	m.sources.count(l)
	m.upstreamRequests.WithLabelValues(l...).Inc()
	m.upstreamDuration.WithLabelValues(l...).Observe(took.Seconds())
	if failed {
		m.upstreamFailures.WithLabelValues(l...).Inc()
	}
}

func (m *Metrics) refuse(limit string)  { m.refused.WithLabelValues(limit).Inc() }
func (m *Metrics) reject(reason string) { m.rejected.WithLabelValues(reason).Inc() }
func (m *Metrics) evict(limit string)   { m.evicted.WithLabelValues(limit).Inc() }

// upstreamKnown makes the series of the upstream at a, at zero.
func (m *Metrics) upstreamKnown(a netip.AddrPort) {
	l := a.String()
	m.upUnanswered.WithLabelValues(l)
	m.upHedged.WithLabelValues(l)
	m.upStruck.WithLabelValues(l)
	m.upSRTT.WithLabelValues(l)
}

func (m *Metrics) upstreamUnanswered(a netip.AddrPort) {
	m.upUnanswered.WithLabelValues(a.String()).Inc()
}
func (m *Metrics) upstreamHedged(a netip.AddrPort) { m.upHedged.WithLabelValues(a.String()).Inc() }
func (m *Metrics) upstreamStruck(a netip.AddrPort) { m.upStruck.WithLabelValues(a.String()).Inc() }
func (m *Metrics) upstreamRTT(a netip.AddrPort, srtt time.Duration) {
	m.upSRTT.WithLabelValues(a.String()).Set(srtt.Seconds())
}
