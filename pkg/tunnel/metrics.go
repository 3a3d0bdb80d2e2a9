package tunnel

import (
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Metrics are the tunnel's Prometheus metrics: Istio's TCP metrics with
// Istio's labels, reported by both ends, plus the tunnel's own. Labels are
// bounded by workloads and services, never by connection.
type Metrics struct {
	connsOpened   *prometheus.CounterVec
	connsClosed   *prometheus.CounterVec
	sentBytes     *prometheus.CounterVec
	receivedBytes *prometheus.CounterVec
	policyDenials *prometheus.CounterVec
	failClosed    *prometheus.CounterVec
	servedPods    prometheus.Gauge
	openConns     *prometheus.GaugeVec
	limitRefused  *prometheus.CounterVec
	acceptErrors  *prometheus.CounterVec
	policyClosed  *prometheus.CounterVec

	series *seriesGC
}

// istioLabels are the labels Istio puts on its TCP metrics.
var istioLabels = []string{
	"reporter",
	"source_workload", "source_workload_namespace", "source_principal", "source_app",
	"destination_workload", "destination_workload_namespace", "destination_principal", "destination_app",
	"destination_service", "destination_service_name", "destination_service_namespace",
	"request_protocol", "response_flags", "connection_security_policy",
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered, for tests and tools).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		connsOpened: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_tcp_connections_opened_total", Help: "TCP connections opened, as Istio reports them."}, istioLabels),
		connsClosed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_tcp_connections_closed_total", Help: "TCP connections closed, as Istio reports them."}, istioLabels),
		sentBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_tcp_sent_bytes_total", Help: "Bytes sent in responses (server to client)."}, istioLabels),
		receivedBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_tcp_received_bytes_total", Help: "Bytes received in requests (client to server)."}, istioLabels),
		policyDenials: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_policy_denials_total", Help: "Inbound connections refused, by reason."}, []string{"reason"}),
		failClosed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_fail_closed_total", Help: "Connections dropped by the tunnel rather than sent insecurely, by reason."}, []string{"reason"}),
		servedPods: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "redirector_tunnel_pods", Help: "Pods whose tunnel listeners are open."}),
		openConns: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "redirector_tunnel_open_connections",
			Help: "Connections the capture listeners hold open on this node, by listener (outbound 15001, inbound plaintext 15006)."}, []string{"listener"}),
		limitRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_tunnel_refused_connections_total",
			Help: "Connections reset at accept because a connection limit (node, pod or source address) was reached, by listener and limit."}, []string{"listener", "limit"}),
		acceptErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_tunnel_accept_errors_total",
			Help: "Failed accepts on the capture listeners (EMFILE, ENFILE, ENOBUFS, ...), each retried after a backoff, by listener."}, []string{"listener"}),
		policyClosed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_policy_closed_connections_total",
			Help: "Open inbound connections closed because a policy or workload change no longer allows them, by reason."}, []string{"reason"}),
	}
	for _, l := range []string{"outbound", "inbound"} {
		m.openConns.WithLabelValues(l)
	}
	m.series = newSeriesGC(time.Now, []*prometheus.CounterVec{m.connsOpened, m.connsClosed, m.sentBytes, m.receivedBytes})
	if reg != nil {
		reg.MustRegister(m.series.collector(), m.policyDenials, m.failClosed, m.servedPods, m.openConns, m.limitRefused, m.acceptErrors, m.policyClosed)
	}
	return m
}

// connInfo describes one proxied connection for the metric labels.
type connInfo struct {
	reporter     string // "source" (outbound side) or "destination"
	src, dst     *workload.Workload
	srcID, dstID identity.ID
	service      *workload.Service
	secure       bool
	flags        string // Istio response flags: "-" or e.g. "UF" (upstream failure)
}

func (c connInfo) labels() prometheus.Labels {
	l := prometheus.Labels{"reporter": c.reporter, "request_protocol": "tcp"}
	workloadLabels(l, "source", c.src, c.srcID)
	workloadLabels(l, "destination", c.dst, c.dstID)
	l["destination_service"], l["destination_service_name"], l["destination_service_namespace"] = "unknown", "unknown", "unknown"
	if c.service != nil {
		l["destination_service"] = c.service.Hostname("")
		l["destination_service_name"] = c.service.Name
		l["destination_service_namespace"] = c.service.Namespace
	}
	l["response_flags"] = "-"
	if c.flags != "" {
		l["response_flags"] = c.flags
	}
	l["connection_security_policy"] = "none"
	if c.secure {
		l["connection_security_policy"] = "mutual_tls"
	}
	return l
}

func workloadLabels(l prometheus.Labels, side string, w *workload.Workload, id identity.ID) {
	l[side+"_workload"], l[side+"_workload_namespace"], l[side+"_app"] = "unknown", "unknown", "unknown"
	l[side+"_principal"] = "unknown"
	if !id.IsZero() {
		l[side+"_principal"] = id.String()
	}
	if w == nil {
		return
	}
	l[side+"_workload"] = workloadName(w)
	l[side+"_workload_namespace"] = w.Namespace
	if app := w.Labels["app"]; app != "" {
		l[side+"_app"] = app
	} else if app := w.Labels["app.kubernetes.io/name"]; app != "" {
		l[side+"_app"] = app
	}
}

// workloadName is the pod's workload as Istio names it: the canonical name
// label, else app, else the pod name without a ReplicaSet's hash suffixes.
func workloadName(w *workload.Workload) string {
	for _, k := range []string{"service.istio.io/canonical-name", "app.kubernetes.io/name", "app"} {
		if v := w.Labels[k]; v != "" {
			return v
		}
	}
	if h := w.Labels["pod-template-hash"]; h != "" {
		if i := strings.Index(w.Name, "-"+h+"-"); i > 0 {
			return w.Name[:i]
		}
	}
	return w.Name
}

// open counts c as opened and returns what counts it closed with its bytes.
// The labelled counters are resolved once, not again at close.
// The series stays (see seriesGC) until the connection is closed.
func (m *Metrics) open(c connInfo) (closed func(requestBytes, responseBytes int64)) {
	l := c.labels()
	end := m.series.begin(l)
	m.connsOpened.With(l).Inc()
	done, received, sent := m.connsClosed.With(l), m.receivedBytes.With(l), m.sentBytes.With(l)
	return func(requestBytes, responseBytes int64) {
		done.Inc()
		received.Add(float64(requestBytes))
		sent.Add(float64(responseBytes))
		end()
	}
}

// failed counts a connection that could not reach its upstream (Istio's
// response flag UF): opened and closed with no bytes.
func (m *Metrics) failed(c connInfo) {
	c.flags = "UF"
	m.open(c)(0, 0)
}

func (m *Metrics) denied(reason string) { m.policyDenials.WithLabelValues(reason).Inc() }
