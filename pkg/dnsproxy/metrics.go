package dnsproxy

import (
	"strings"
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
// and revision are those of the node's pods.
type Metrics struct {
	requests         *prometheus.CounterVec
	upstreamRequests *prometheus.CounterVec
	upstreamFailures *prometheus.CounterVec
	upstreamDuration *prometheus.HistogramVec
	refused          *prometheus.CounterVec
	rejected         *prometheus.CounterVec
	inFlight         prometheus.Gauge
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
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "redirector_dns_queries_in_flight", Help: "DNS queries being answered now, over all pods."}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.upstreamRequests, m.upstreamFailures, m.upstreamDuration, m.refused, m.rejected, m.inFlight)
	}
	return m
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

func (m *Metrics) request(l []string) { m.requests.WithLabelValues(l...).Inc() }

// upstream records one forwarded query: its duration, and a failure.
func (m *Metrics) upstream(l []string, took time.Duration, failed bool) {
	m.upstreamRequests.WithLabelValues(l...).Inc()
	m.upstreamDuration.WithLabelValues(l...).Observe(took.Seconds())
	if failed {
		m.upstreamFailures.WithLabelValues(l...).Inc()
	}
}

func (m *Metrics) refuse(limit string)  { m.refused.WithLabelValues(limit).Inc() }
func (m *Metrics) reject(reason string) { m.rejected.WithLabelValues(reason).Inc() }
