package identity

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// caMetrics count what the Manager asks of its CA and what handshakes found
// missing; the expiry of kept certificates is exported from Snapshot by the
// agent's certificate collector.
type caMetrics struct {
	requests    prometheus.Counter
	failures    *prometheus.CounterVec
	delayed     prometheus.Counter
	duration    prometheus.Histogram
	unavailable *prometheus.CounterVec
}

func newCAMetrics() *caMetrics {
	return &caMetrics{
		requests: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redirector_ca_requests_total",
			Help: "Certificate requests made to the CA (istiod or the file CA), successful or not.",
		}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_ca_request_failures_total",
			Help: "Certificate requests that failed, by reason: unavailable, timeout, unauthenticated (istiod refused the token or the identity), permission_denied, token, bad_response, wrong_identity, untrusted_chain, short_lifetime (a chain expiring before it could be renewed, kept only while no other certificate outlives it), not_yet_valid (the leaf starts after this node's clock: the clocks disagree), refused, local.",
		}, []string{"reason"}),
		delayed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redirector_ca_requests_delayed_total",
			Help: "Certificate requests held back before being sent by the node-wide bound on CA requests (in flight, and a rate beyond a burst); first certificates go ahead of renewals.",
		}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "redirector_ca_request_duration_seconds",
			Help:    "Latency of certificate requests to the CA, including key generation and checking the answer.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}),
		unavailable: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_certificate_unavailable_total",
			Help: "Handshakes that failed closed because the local identity had no valid certificate, by reason: not_enrolled, pending, ca_failing, expired, not_yet_valid.",
		}, []string{"reason"}),
	}
}

func (c *caMetrics) observe(d time.Duration, err error) {
	c.requests.Inc()
	c.duration.Observe(d.Seconds())
	if err != nil {
		c.failures.WithLabelValues(ReasonOf(err)).Inc()
	}
}

var keptDesc = prometheus.NewDesc("redirector_certificates",
	"Identities of this node's enrolled pods the agent keeps a certificate for, by state: pending, valid, refreshing, failing, expired, not_yet_valid, "+
		"grace (its last local pod left within the grace period, 2m by default: kept for a replacement pod, not served). "+
		"Bounded by the local pods and those that left within the grace period.",
	[]string{"state"}, nil)

// Collector exports the Manager's CA request and fail-closed counters and
// the kept identities by state.
func (m *Manager) Collector() prometheus.Collector { return managerCollector{m} }

type managerCollector struct{ m *Manager }

func (c managerCollector) Describe(ch chan<- *prometheus.Desc) {
	c.m.metrics.Describe(ch)
	ch <- keptDesc
}

func (c managerCollector) Collect(ch chan<- prometheus.Metric) {
	c.m.metrics.Collect(ch)
	counts := map[CertState]int{StatePending: 0, StateValid: 0, StateRefreshing: 0, StateFailing: 0, StateExpired: 0, StateNotYetValid: 0, StateGrace: 0}
	for _, ci := range c.m.Snapshot() {
		counts[ci.State]++
	}
	for state, n := range counts {
		ch <- prometheus.MustNewConstMetric(keptDesc, prometheus.GaugeValue, float64(n), string(state))
	}
}

// Describe implements prometheus.Collector.
func (c *caMetrics) Describe(ch chan<- *prometheus.Desc) {
	c.requests.Describe(ch)
	c.failures.Describe(ch)
	c.delayed.Describe(ch)
	c.duration.Describe(ch)
	c.unavailable.Describe(ch)
}

// Collect implements prometheus.Collector.
func (c *caMetrics) Collect(ch chan<- prometheus.Metric) {
	c.requests.Collect(ch)
	c.failures.Collect(ch)
	c.delayed.Collect(ch)
	c.duration.Collect(ch)
	c.unavailable.Collect(ch)
}
