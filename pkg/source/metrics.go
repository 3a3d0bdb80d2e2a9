package source

import "github.com/prometheus/client_golang/prometheus"

// Reasons a source refuses what it read, the reason label of
// redirector_source_errors_total.
const (
	// ReasonRead: the manifests could not be read (missing path, permissions).
	ReasonRead = "read"
	// ReasonParse: a document is not valid YAML.
	ReasonParse = "parse"
	// ReasonInvalid: a document parses but is not an object the source accepts
	// (unknown kind or field, no name, a duplicate, a pod address that does
	// not parse), a Kubernetes policy object does not convert to the policy
	// types, or a watched pod's address does not parse (its last good
	// version is kept).
	ReasonInvalid = "invalid"
	// ReasonTruncated: a file was cut short or is still being written.
	ReasonTruncated = "truncated"
	// ReasonTooLarge: the manifests are larger than a load reads.
	ReasonTooLarge = "too_large"
	// ReasonEmpty: no objects where the last good state had some.
	ReasonEmpty = "empty"
	// ReasonListWatch: a list or watch of the Kubernetes API failed.
	ReasonListWatch = "list_watch"
	// ReasonDiscovery: the Kubernetes API did not answer discovery.
	ReasonDiscovery = "discovery"
)

// Metrics counts what sources refused. A source never applies a view it
// could not read in full (it keeps its last good snapshot), so these
// counters are the only trace of a refusal besides the log. A nil *Metrics
// counts nothing.
type Metrics struct {
	errs *prometheus.CounterVec
}

// NewMetrics returns source metrics registered with reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{errs: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "redirector_source_errors_total",
		Help: "Errors that made a source keep its last good snapshot, by source (file, kubernetes) and reason.",
	}, []string{"source", "reason"})}
	if reg != nil {
		reg.MustRegister(m.errs)
	}
	return m
}

// Error counts one error of source for reason.
func (m *Metrics) Error(source, reason string) {
	if m != nil {
		m.errs.WithLabelValues(source, reason).Inc()
	}
}

// Describe and Collect make Metrics a prometheus.Collector (for tests that
// scrape it; NewMetrics registers the counters themselves).
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) { m.errs.Describe(ch) }

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) { m.errs.Collect(ch) }
