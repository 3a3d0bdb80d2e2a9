package loader

import "github.com/prometheus/client_golang/prometheus"

var (
	heldLinksDesc = prometheus.NewDesc("redirector_held_links",
		"tcx links of enrolled pods the agent holds open (two per pod attached with tcx, so at most twice the 4096 pod slots), so that a removed pin never detaches a pod.",
		nil, nil)
	linkRepinsDesc = prometheus.NewDesc("redirector_link_pins_restored_total",
		"Link pins that were removed underneath the agent and pinned again.",
		nil, nil)
	netnsKnownDesc = prometheus.NewDesc("redirector_netns_index_namespaces",
		"Network namespaces the address-to-namespace index remembers (bounded by the namespaces on the node).",
		nil, nil)
)

type collector struct {
	l   *Loader
	r   *Reconciler
	idx interface{ Len() int }
}

// NewCollector exports what the loader holds and what the link repair did.
// idx, when it has a Len (netns.Index), is reported too.
func NewCollector(l *Loader, r *Reconciler) prometheus.Collector {
	c := collector{l: l, r: r}
	if idx, ok := r.finder.(interface{ Len() int }); ok {
		c.idx = idx
	}
	return c
}

// Describe implements prometheus.Collector.
func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- heldLinksDesc
	ch <- linkRepinsDesc
	if c.idx != nil {
		ch <- netnsKnownDesc
	}
}

// Collect implements prometheus.Collector.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(heldLinksDesc, prometheus.GaugeValue, float64(c.l.HeldLinks()))
	ch <- prometheus.MustNewConstMetric(linkRepinsDesc, prometheus.CounterValue, float64(c.r.Stats().LinkRepins))
	if c.idx != nil {
		ch <- prometheus.MustNewConstMetric(netnsKnownDesc, prometheus.GaugeValue, float64(c.idx.Len()))
	}
}
