package loader

import "github.com/prometheus/client_golang/prometheus"

var heldLinksDesc = prometheus.NewDesc("redirector_held_links",
	"tcx links of enrolled pods the agent holds open (two per pod attached with tcx, so at most twice the 4096 pod slots), so that a removed pin never detaches a pod.",
	nil, nil)

var relinkedDesc = prometheus.NewDesc("redirector_relinked_links_total",
	"Pinned links (pods' tcx links and host-probe links) pointed at this agent's programs as it claimed the node or took it back from a newer agent that gave it up (result=updated), and those left on the program they had (result=failed: logged naming the pod, which is attached again by the next pass, its link replaced).",
	[]string{"result"}, nil)

var endedSocketsDesc = prometheus.NewDesc("redirector_captured_sockets_ended_total",
	"Captured TCP sockets of pods leaving the mesh, ended (sock_diag SOCK_DESTROY) at their detach so that their apps cannot write on them in plaintext after it (result=ended), those the kernel refused to end (result=failed) and those left past the bound or the timeout of one detach (result=left); failed and left are logged naming the pod.",
	[]string{"result"}, nil)

type collector struct{ l *Loader }

// NewCollector exports what the loader holds.
func NewCollector(l *Loader) prometheus.Collector { return collector{l: l} }

// Describe implements prometheus.Collector.
func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- heldLinksDesc
	ch <- relinkedDesc
	ch <- endedSocketsDesc
}

// Collect implements prometheus.Collector.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(heldLinksDesc, prometheus.GaugeValue, float64(c.l.HeldLinks()))
	ch <- prometheus.MustNewConstMetric(relinkedDesc, prometheus.CounterValue, float64(c.l.relinkUpdated.Load()), "updated")
	ch <- prometheus.MustNewConstMetric(relinkedDesc, prometheus.CounterValue, float64(c.l.relinkFailed.Load()), "failed")
	ended, failed, left := c.l.EndedSockets()
	ch <- prometheus.MustNewConstMetric(endedSocketsDesc, prometheus.CounterValue, float64(ended), "ended")
	ch <- prometheus.MustNewConstMetric(endedSocketsDesc, prometheus.CounterValue, float64(failed), "failed")
	ch <- prometheus.MustNewConstMetric(endedSocketsDesc, prometheus.CounterValue, float64(left), "left")
}
