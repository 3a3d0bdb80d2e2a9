package nodeagent

import "github.com/prometheus/client_golang/prometheus"

var (
	linkRepinsDesc = prometheus.NewDesc("redirector_link_pins_restored_total",
		"Link pins that were removed underneath the agent and pinned again.",
		nil, nil)
	netnsMovedDesc = prometheus.NewDesc("redirector_pod_netns_moved_total",
		"Namespaces the link check found at an attached pod's network namespace path, other than the one the pod was attached in (a sandbox re-created at the same path), for which it queued the pod: once per namespace found.",
		nil, nil)
	sealedDesc = prometheus.NewDesc("redirector_pods_sealed",
		"Pods gone from the source while their network namespace lives, held captured with their connections refused until the namespace goes.",
		nil, nil)
	netnsKnownDesc = prometheus.NewDesc("redirector_netns_index_namespaces",
		"Network namespaces the address-to-namespace index remembers (bounded by the namespaces on the node).",
		nil, nil)
)

type collector struct {
	r   *Reconciler
	idx interface{ Len() int }
}

// NewCollector exports what the link repair did, how many pods are sealed and, when the reconciler's
// namespace finder has a Len (netns.Index), how many namespaces it knows.
func NewCollector(r *Reconciler) prometheus.Collector {
	c := collector{r: r}
	if idx, ok := r.finder.(interface{ Len() int }); ok {
		c.idx = idx
	}
	return c
}

// Describe implements prometheus.Collector.
func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- linkRepinsDesc
	ch <- netnsMovedDesc
	ch <- sealedDesc
	if c.idx != nil {
		ch <- netnsKnownDesc
	}
}

// Collect implements prometheus.Collector.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	st := c.r.Stats()
	ch <- prometheus.MustNewConstMetric(linkRepinsDesc, prometheus.CounterValue, float64(st.LinkRepins))
	ch <- prometheus.MustNewConstMetric(netnsMovedDesc, prometheus.CounterValue, float64(st.NetNSMoved))
	ch <- prometheus.MustNewConstMetric(sealedDesc, prometheus.GaugeValue, float64(st.Sealed))
	if c.idx != nil {
		ch <- prometheus.MustNewConstMetric(netnsKnownDesc, prometheus.GaugeValue, float64(c.idx.Len()))
	}
}
