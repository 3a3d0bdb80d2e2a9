package tunnel

import (
	"cmp"
	"context"
	"log/slog"
	"net/netip"
	"strconv"
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
	socketsOpen   *prometheus.GaugeVec // ztunnel's istio_tcp_sockets_open{reporter}
	limitRefused  *prometheus.CounterVec
	// limitEvicted counts connections closed to give their slot of a full
	// node budget to a pod holding fewer (limiter.take).
	limitEvicted *prometheus.CounterVec
	acceptErrors *prometheus.CounterVec
	policyClosed *prometheus.CounterVec
	// sourceMismatch counts HBONE clients whose identity is not the
	// one of the workload at their address (sourceWorkload).
	sourceMismatch prometheus.Counter
	// derivedRefused counts connections whose baggage names were
	// dropped at a bound of admitDerived, by limit.
	derivedRefused *prometheus.CounterVec
	// handover counts pods whose listeners passed between agents
	// (handover.go), by result.
	handover *prometheus.CounterVec
	// dnsDropped counts datagrams the pods' DNS sockets read and did not
	// answer (dns.go), by reason.
	dnsDropped *prometheus.CounterVec

	series *seriesGC
	// cluster is the cluster ID for the agent's own workloads.
	cluster string
	access  *accessLog
}

// istioLabels are ztunnel's CommonTrafficLabels (src/proxy/metrics.rs),
// in its order, with its locality labels: the label set Istio's dashboards
// and Kiali's graph group istio_tcp_* by. A value the agent does not know
// is "unknown", as ztunnel writes it.
//
// The values are bounded by the cluster's workloads and services, never by
// connection, address or port: per reporter, at most (source workloads x
// destination workloads x destination services x 3 response flags x 2
// security policies) series, of which only pairs that actually talked
// exist, and those of workloads (or revisions of them) that left, or of
// clients named by their identity alone, are deleted (see seriesGC).
// Names a peer announces in baggage count only within maxDerivedSeries.
var istioLabels = []string{
	"reporter",
	"source_workload", "source_canonical_service", "source_canonical_revision", "source_workload_namespace",
	"source_principal", "source_app", "source_version", "source_cluster",
	"destination_service", "destination_service_namespace", "destination_service_name",
	"destination_workload", "destination_canonical_service", "destination_canonical_revision", "destination_workload_namespace",
	"destination_principal", "destination_app", "destination_version", "destination_cluster",
	"request_protocol", "response_flags", "connection_security_policy",
	"source_region", "source_zone", "destination_region", "destination_zone",
}

// denialLabels label redirector_policy_denials_total: the reason and the
// workloads on both sides, so a denial shows which client hit which server.
var denialLabels = []string{
	"reason",
	"source_workload", "source_workload_namespace", "source_principal",
	"destination_workload", "destination_workload_namespace",
}

// Response flags, in ztunnel's vocabulary (ResponseFlags in
// src/proxy/metrics.rs).
const (
	flagNone    = "-"
	flagDeny    = "DENY"    // refused by policy (AuthorizationPolicy or STRICT mTLS)
	flagConnect = "CONNECT" // the upstream could not be reached (dial, TLS or CONNECT failed)
)

// DefaultCluster is Istio's default cluster ID, what source_cluster and
// destination_cluster carry for the agent's own cluster.
const DefaultCluster = "Kubernetes"

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
			Name: "redirector_policy_denials_total", Help: "Inbound connections refused, by reason and the workloads on both sides."}, denialLabels),
		failClosed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_fail_closed_total", Help: "Connections dropped by the tunnel rather than sent insecurely, by reason."}, []string{"reason"}),
		servedPods: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "redirector_tunnel_pods", Help: "Pods whose tunnel listeners are open."}),
		openConns: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "redirector_tunnel_open_connections",
			Help: "Connections the agent holds open for this node's pods, by listener (outbound 15001, inbound plaintext 15006, hbone: tunnels to pods' apps)."}, []string{"listener"}),
		socketsOpen: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "istio_tcp_sockets_open",
			Help: "Connections the agent holds open for this node's pods, as ztunnel reports them: reporter source (outbound) or destination (inbound plaintext and HBONE tunnels)."}, []string{"reporter"}),
		limitRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_tunnel_refused_connections_total",
			Help: "Connections refused (reset at accept; HBONE tunnels answered 503) because a connection limit (node, pod or source address) was reached, by listener and limit."}, []string{"listener", "limit"}),
		limitEvicted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_tunnel_evicted_connections_total",
			Help: "Open connections closed (reset) because the node's connection limit was reached and a pod holding at least two fewer of that listener's connections opened one: the oldest of the pod holding the most, by listener."}, []string{"listener"}),
		acceptErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_tunnel_accept_errors_total",
			Help: "Failed accepts on the capture listeners (EMFILE, ENFILE, ENOBUFS, ...), each retried after a backoff, by listener."}, []string{"listener"}),
		policyClosed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_policy_closed_connections_total",
			Help: "Open inbound connections closed because a policy or workload change no longer allows them, by reason."}, []string{"reason"}),
		sourceMismatch: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redirector_hbone_source_identity_mismatch_total",
			Help: "HBONE tunnels whose client proved another identity than the workload the directory has at the client's address (a gateway or NAT between, a reused address, a forged one); counted without that workload's labels."}),
		derivedRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_baggage_series_refused_total",
			Help: "Inbound connections counted in istio_tcp_* without the source names their peer announced in baggage, because such series reached their bound, by limit: peer (100 for one verified identity) or node (1000 in all)."}, []string{"limit"}),
		handover: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_listener_handovers_total",
			Help: "Pods whose listeners, and separately pods whose DNS socket, passed between this agent and another over the hand-over socket, by result: given (to a successor), taken (from the predecessor), not_served (asked for a pod the other agent does not serve), failed (the exchange or a check of a received socket failed; the pod's own listeners are opened instead), refused (a connection or request refused: a peer neither root nor the agent's user, or an undecodable request)."}, []string{"result"}),
		dnsDropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redirector_dns_dropped_total",
			Help: "Datagrams a pod's DNS socket read and dropped unanswered, by reason: not_captured (not a query the capture assigned: its original destination port is not 53, as a datagram sent straight to the socket's port), foreign_source (from an address that is not the pod's, or from port 0), busy (the pod already has " + strconv.Itoa(dnsMaxPendingPerPod) + " queries being answered)."}, []string{"reason"}),
	}
	for _, r := range dnsDropReasons {
		m.dnsDropped.WithLabelValues(r)
	}
	for _, r := range handoverResults {
		m.handover.WithLabelValues(r)
	}
	for _, l := range listenerNames {
		m.openConns.WithLabelValues(l)
	}
	for _, r := range []string{"source", "destination"} {
		m.socketsOpen.WithLabelValues(r)
	}
	for _, l := range []string{"node", "peer"} {
		m.derivedRefused.WithLabelValues(l)
	}
	m.cluster, m.access = DefaultCluster, newAccessLog(nil)
	m.series = newSeriesGC(time.Now,
		seriesGroup{names: istioLabels, vecs: []*prometheus.CounterVec{m.connsOpened, m.connsClosed, m.sentBytes, m.receivedBytes}, bytes: []int{3, 2}},
		seriesGroup{names: denialLabels, vecs: []*prometheus.CounterVec{m.policyDenials}})
	if reg != nil {
		reg.MustRegister(m.series.collector(), m.failClosed, m.servedPods, m.openConns, m.socketsOpen, m.limitRefused, m.limitEvicted, m.acceptErrors, m.policyClosed, m.sourceMismatch, m.derivedRefused, m.handover, m.dnsDropped)
	}
	return m
}

// SetCluster sets the cluster ID the metrics, baggage and access logs give
// the agent's own workloads (default DefaultCluster).
func (m *Metrics) SetCluster(id string) {
	if id != "" {
		m.cluster = id
	}
}

// connInfo describes one proxied connection for the metric labels and the
// access log.
type connInfo struct {
	reporter string // "source" (outbound side) or "destination"
	src, dst *workload.Workload
	// peer is what the client announced in its baggage, used for the
	// source labels when src is not known here.
	peer         *peerMeta
	srcID, dstID identity.ID
	service      *workload.Service
	secure       bool
	flags        string // response flag: "" (none), flagDeny or flagConnect
	// waypoint says dst is the waypoint the connection went through, and
	// service (if any) and hboneAddr what the client addressed.
	waypoint bool

	// For the access log: the client and server addresses the tunnel saw,
	// and the HBONE target (:authority) when the connection was tunnelled.
	srcAddr, dstAddr, hboneAddr netip.AddrPort
}

func (m *Metrics) labels(c connInfo) prometheus.Labels {
	l := make(prometheus.Labels, len(istioLabels))
	for _, n := range istioLabels {
		l[n] = "unknown"
	}
	l["reporter"], l["request_protocol"] = c.reporter, "tcp"
	l["response_flags"] = cmp.Or(c.flags, flagNone)
	if c.secure {
		l["connection_security_policy"] = "mutual_tls"
	}
	switch {
	case c.src != nil:
		m.workloadLabels(l, "source", c.src)
	case c.peer != nil:
		c.peer.labels(l)
	}
	if !c.srcID.IsZero() {
		l["source_principal"] = c.srcID.String()
	}
	if c.dst != nil {
		m.workloadLabels(l, "destination", c.dst)
	}
	if !c.dstID.IsZero() {
		l["destination_principal"] = c.dstID.String()
	}
	if c.service != nil {
		l["destination_service"] = c.service.Hostname
		l["destination_service_name"] = c.service.Name
		l["destination_service_namespace"] = c.service.Namespace
	}
	return l
}

// workloadLabels fills side's labels from w, as ztunnel's with_source and
// with_destination do: app and version repeat the canonical service and
// revision, and the cluster is the workload's own (istiod's cluster_id,
// another cluster's for a remote workload), else this agent's. Locality is
// unknown unless the source gave it.
func (m *Metrics) workloadLabels(l prometheus.Labels, side string, w *workload.Workload) {
	name, canon, rev := workloadMeta(w)
	l[side+"_workload"] = name
	l[side+"_workload_namespace"] = w.Namespace
	l[side+"_canonical_service"], l[side+"_app"] = canon, canon
	l[side+"_canonical_revision"], l[side+"_version"] = rev, rev
	l[side+"_cluster"] = cmp.Or(w.Cluster, m.cluster)
	if w.Region != "" {
		l[side+"_region"] = w.Region
	}
	if w.Zone != "" {
		l[side+"_zone"] = w.Zone
	}
}

// workloadMeta returns w's workload name and canonical service and
// revision, deriving them for a Workload built without them.
func workloadMeta(w *workload.Workload) (name, canon, rev string) {
	name = cmp.Or(w.WorkloadName, w.Name)
	canon, rev = w.CanonicalName, w.CanonicalRevision
	if canon == "" {
		canon, rev = workload.CanonicalService(w.Labels, name)
	}
	return name, canon, rev
}

// open counts c as opened and returns its result, which counts it closed
// with its bytes and writes its access log line. The labelled counters are
// resolved once, not again at close. The series stays (see seriesGC) until
// the connection is closed. The relay adds to the result's running counts
// (connResult.counts) as it copies, which each scrape folds into the byte
// counters while the connection is open (byteFlow).
func (m *Metrics) open(c connInfo, trace string) *connResult {
	if c.peer != nil && c.src == nil && !m.series.claimable(c.peer, c.srcID) {
		// The peer named a workload that runs as another identity.
		c.peer = nil
	}
	l := m.labels(c)
	if c.peer != nil && c.src == nil {
		if ok, limit := m.series.admitDerived(l); !ok {
			// Too many series named by peers, or by this one: count
			// this connection without the names the peer announced.
			m.derivedRefused.WithLabelValues(limit).Inc()
			c.peer = nil
			l = m.labels(c)
		}
	}
	r := &connResult{m: m, c: c, l: l, trace: trace, start: time.Now()}
	counters, end := m.series.begin(0, l, &r.flow)
	opened, done := counters[0], counters[1]
	opened.Inc()
	r.counted = func(requestBytes, responseBytes int64) {
		done.Inc()
		r.flow.foldTo(requestBytes, responseBytes)
		end()
	}
	return r
}

// failed counts a connection that could not reach its upstream (ztunnel's
// CONNECT flag): opened and closed with no bytes.
func (m *Metrics) failed(ctx context.Context, c connInfo, trace string, err error) {
	c.flags = flagConnect
	m.open(c, trace).close(ctx, 0, 0, err)
}

// accessLogged reports whether access logs are on.
func (m *Metrics) accessLogged() bool { return m.access.log != nil }

// SetAccessLog makes the tunnel write access logs to log; nil turns them
// off (the default of a new Metrics).
func (m *Metrics) SetAccessLog(log *slog.Logger) { m.access = newAccessLog(log) }

// deniedConn counts a connection refused by policy: in the denial counter
// with its reason, and as ztunnel does in istio_tcp_* as opened and closed
// with the DENY flag.
func (m *Metrics) deniedConn(ctx context.Context, reason string, c connInfo, trace string, err error) {
	if c.src == nil {
		// Names a refused peer announced get no series of their own: a
		// peer every policy refuses would otherwise still spend the
		// budget of maxDerivedSeries (as denial keeps them out too).
		c.peer = nil
	}
	m.denial(reason, c)
	c.flags = flagDeny
	m.open(c, trace).close(ctx, 0, 0, err)
}

// denied counts a refusal that names no destination workload (a bad
// request, a foreign authority).
func (m *Metrics) denied(reason string) { m.denial(reason, connInfo{}) }

func (m *Metrics) denial(reason string, c connInfo) {
	if c.src == nil {
		c.peer = nil // only names of the directory or verified ones here
	}
	full := m.labels(c)
	l := prometheus.Labels{"reason": reason}
	for _, n := range denialLabels[1:] {
		l[n] = full[n]
	}
	counters, end := m.series.begin(1, l, nil)
	counters[0].Inc()
	end()
}
