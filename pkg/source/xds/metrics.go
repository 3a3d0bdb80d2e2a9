package xds

import "github.com/prometheus/client_golang/prometheus"

// Metrics counts the xDS stream. A nil *Metrics counts nothing.
type Metrics struct {
	connects  *prometheus.CounterVec
	connected prometheus.Gauge
	pushes    *prometheus.CounterVec
	nacks     *prometheus.CounterVec
	rejected  *prometheus.CounterVec
	resources *prometheus.GaugeVec
	// bytes is what the held resources are charged against MaxTypeBytes.
	bytes *prometheus.GaugeVec
	// unresolved counts policies held in no form (see Snapshot.Unresolved).
	unresolved prometheus.Gauge
	// otherNetwork counts workloads on networks other than the agent's.
	otherNetwork prometheus.Gauge
	// addressConflicts counts addresses istiod gives a second owner.
	addressConflicts prometheus.Gauge

	// The series ztunnel exports for its xDS client, under its names and
	// labels, which Istio's ztunnel dashboard reads ("XDS Connections",
	// "XDS Pushes"). Only subscribed type URLs are labels: istiod's text
	// never makes a new series.
	istioMessages     *prometheus.CounterVec
	istioMessageBytes *prometheus.CounterVec
	istioTerminations *prometheus.CounterVec
}

// Reasons a stream ended (the reason label of
// istio_xds_connection_terminations_total), ztunnel's values.
const (
	// endConnectionError: no response came; the stream never opened.
	endConnectionError = "ConnectionError"
	// endReconnect: the transport under an open stream ended (istiod's
	// connection age, a restart); ztunnel counts the same gRPC codes so.
	endReconnect = "Reconnect"
	// endComplete: istiod closed the stream cleanly.
	endComplete = "Complete"
	// endError: any other failure of an open stream.
	endError = "Error"
)

// Reasons a single resource is rejected (the reason label of
// redirector_xds_rejected_resources_total).
const (
	rejectInvalid = "invalid"
	rejectLimit   = "limit"
)

// NewMetrics returns xDS metrics registered with reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		connects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_xds_connects_total",
			Help: "Attempts to open the delta ADS stream to istiod, by result (ok: the first response arrived; error).",
		}, []string{"result"}),
		connected: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "redirector_xds_connected",
			Help: "1 while a delta ADS stream to istiod is open and has delivered a response.",
		}),
		pushes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_xds_pushes_total",
			Help: "Delta xDS responses received, by type (Address, Authorization).",
		}, []string{"type"}),
		nacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_xds_nacks_total",
			Help: "Delta xDS responses answered with a NACK (some resource was rejected), by type.",
		}, []string{"type"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_xds_rejected_resources_total",
			Help: "Resources not applied, by type and reason (invalid: could not be translated; limit: over the per-type bound).",
		}, []string{"type", "reason"}),
		resources: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "redirector_xds_resources",
			Help: "Resources held from istiod, by type.",
		}, []string{"type"}),
		bytes: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "redirector_xds_resource_bytes",
			Help: "What the resources held from istiod are charged against the per-type bound (512 MiB by default): encoded size plus an overhead per resource and per nested message, name and version, by type.",
		}, []string{"type"}),
		unresolved: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "redirector_xds_unresolved_policies",
			Help: "Authorization resources rejected with nothing held in their place (undecodable, unknown scope, over a limit); while above 0 every inbound connection is refused.",
		}),
		otherNetwork: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "redirector_xds_other_network_workloads",
			Help: "Workloads istiod puts on a network other than this agent's (NETWORK): not reachable at their addresses, so left out of the directory and of service endpoints.",
		}),
		addressConflicts: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "redirector_xds_address_conflicts",
			Help: "Addresses istiod gives a second owner, left with the first: a workload's address that is this node's pod's, or a service VIP at the address of a workload that does not serve it (the log names both).",
		}),
		istioMessages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_xds_message_total",
			Help: "Delta xDS responses received, by type URL (ztunnel's series; the same count as redirector_xds_pushes_total).",
		}, []string{"url"}),
		istioMessageBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_xds_message_bytes_total",
			Help: "Bytes of resources received in delta xDS responses, by type URL (ztunnel's series: the encoded resources, not the framing).",
		}, []string{"url"}),
		istioTerminations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_xds_connection_terminations_total",
			Help: "Ended xDS streams to istiod, by reason (ztunnel's series: ConnectionError, no response came; Reconnect, the transport ended under an open stream; Complete, istiod closed it; Error, anything else).",
		}, []string{"reason"}),
	}
	for _, r := range []string{endConnectionError, endReconnect, endComplete, endError} {
		m.istioTerminations.WithLabelValues(r)
	}
	if reg != nil {
		reg.MustRegister(m)
	}
	return m
}

func (m *Metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.connects, m.connected, m.pushes, m.nacks, m.rejected, m.resources, m.bytes, m.unresolved, m.otherNetwork, m.addressConflicts,
		m.istioMessages, m.istioMessageBytes, m.istioTerminations}
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
}

func (m *Metrics) connect(ok bool) {
	if m == nil {
		return
	}
	if ok {
		m.connects.WithLabelValues("ok").Inc()
		m.connected.Set(1)
		return
	}
	m.connects.WithLabelValues("error").Inc()
}

func (m *Metrics) disconnected() {
	if m != nil {
		m.connected.Set(0)
	}
}

func (m *Metrics) push(typ string, nack bool, held, bytes int) {
	if m == nil {
		return
	}
	m.pushes.WithLabelValues(typ).Inc()
	if nack {
		m.nacks.WithLabelValues(typ).Inc()
	}
	m.resources.WithLabelValues(typ).Set(float64(held))
	m.bytes.WithLabelValues(typ).Set(float64(bytes))
}

// received counts one response of a subscribed type at url, carrying
// bytes of resources.
func (m *Metrics) received(url string, bytes int) {
	if m != nil {
		m.istioMessages.WithLabelValues(url).Inc()
		m.istioMessageBytes.WithLabelValues(url).Add(float64(bytes))
	}
}

// ended counts a stream that ended for reason.
func (m *Metrics) ended(reason string) {
	if m != nil {
		m.istioTerminations.WithLabelValues(reason).Inc()
	}
}

func (m *Metrics) reject(typ, reason string) {
	if m != nil {
		m.rejected.WithLabelValues(typ, reason).Inc()
	}
}

func (m *Metrics) setUnresolved(n int) {
	if m != nil {
		m.unresolved.Set(float64(n))
	}
}

func (m *Metrics) setAddressConflicts(n int) {
	if m != nil {
		m.addressConflicts.Set(float64(n))
	}
}

func (m *Metrics) setOtherNetwork(n int) {
	if m != nil {
		m.otherNetwork.Set(float64(n))
	}
}
