package loader

import "github.com/prometheus/client_golang/prometheus"

var heldLinksDesc = prometheus.NewDesc("redirector_held_links",
	"tcx links of enrolled pods the agent holds open (two per pod attached with tcx, so at most twice the 4096 pod slots), so that a removed pin never detaches a pod.",
	nil, nil)

type collector struct{ l *Loader }

// NewCollector exports what the loader holds.
func NewCollector(l *Loader) prometheus.Collector { return collector{l: l} }

// Describe implements prometheus.Collector.
func (c collector) Describe(ch chan<- *prometheus.Desc) { ch <- heldLinksDesc }

// Collect implements prometheus.Collector.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(heldLinksDesc, prometheus.GaugeValue, float64(c.l.HeldLinks()))
}
