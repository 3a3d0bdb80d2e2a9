package accel

import "github.com/prometheus/client_golang/prometheus"

var (
	socketsDesc = prometheus.NewDesc("redirector_sockops_sockets_paired_total",
		"Sockets of this node's pods added to the acceleration's maps.", nil, nil)
	messagesDesc = prometheus.NewDesc("redirector_sockops_messages_total",
		"Sends of paired sockets, by the path they took: redirected (socket to socket) or tcp.",
		[]string{"path"}, nil)
	redirectedBytesDesc = prometheus.NewDesc("redirector_sockops_redirected_bytes_total",
		"Bytes moved socket to socket.", nil, nil)
	fallbacksDesc = prometheus.NewDesc("redirector_sockops_fallbacks_total",
		"App connections that took the TCP path for good, by reason: no_peer (no tunnel socket to send to: not paired yet, or closed), "+
			"budget (the tunnel had not read enough), early_data (data was sent before pairing).",
		[]string{"reason"}, nil)
	unpairedDesc = prometheus.NewDesc("redirector_sockops_sockets_unpaired_total",
		"Sockets of this node's pods left unpaired, on the TCP path: a map of the node was full, an app's socket asked for reports of its sends (MSG_ZEROCOPY, transmit time stamps), or the kernel refused the socket.", nil, nil)
)

// collector reads the per-CPU counters when Prometheus scrapes.
type collector struct{ a *Accelerator }

// Collector returns a Prometheus collector of the acceleration's counters.
func (a *Accelerator) Collector() prometheus.Collector { return collector{a} }

// Describe implements prometheus.Collector.
func (c collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{socketsDesc, messagesDesc, redirectedBytesDesc, fallbacksDesc, unpairedDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	n, err := c.a.Counters()
	if err != nil {
		for _, d := range []*prometheus.Desc{socketsDesc, messagesDesc, redirectedBytesDesc, fallbacksDesc, unpairedDesc} {
			ch <- prometheus.NewInvalidMetric(d, err)
		}
		return
	}
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	counter(socketsDesc, n.Sockets)
	counter(messagesDesc, n.Redirected, "redirected")
	counter(messagesDesc, n.Passed, "tcp")
	counter(redirectedBytesDesc, n.RedirectedBytes)
	counter(fallbacksDesc, n.FallbackNoPeer, "no_peer")
	counter(fallbacksDesc, n.FallbackBudget, "budget")
	counter(fallbacksDesc, n.FallbackEarly, "early_data")
	counter(unpairedDesc, n.Unpaired)
}
