package nodeagent

import (
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/util/workqueue"
)

// queueMetrics exports the pod work queue as redirector_pod_queue_*: how
// many pods wait (bounded by the node's pods: a pod is queued once however
// often it changes), how long they waited and took, and how many retries
// failures caused. It is a workqueue.MetricsProvider for the one queue.
type queueMetrics struct {
	depth      prometheus.Gauge
	adds       prometheus.Counter
	latency    prometheus.Histogram
	work       prometheus.Histogram
	unfinished prometheus.Gauge
	longest    prometheus.Gauge
	retries    prometheus.Counter
}

// newQueueMetrics registers the metrics in reg (nil: not exported).
func newQueueMetrics(reg prometheus.Registerer) *queueMetrics {
	buckets := []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}
	m := &queueMetrics{
		depth: prometheus.NewGauge(prometheus.GaugeOpts{Name: "redirector_pod_queue_depth",
			Help: "Pods waiting in the node agent's work queue to be converged."}),
		adds: prometheus.NewCounter(prometheus.CounterOpts{Name: "redirector_pod_queue_adds_total",
			Help: "Pods queued to be converged (a change of their wanted state, a retry, a CNI event)."}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "redirector_pod_queue_wait_seconds",
			Help: "How long a queued pod waited before a worker took it.", Buckets: buckets}),
		work: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "redirector_pod_queue_work_seconds",
			Help: "How long converging one pod (attach, detach, listeners) took.", Buckets: buckets}),
		unfinished: prometheus.NewGauge(prometheus.GaugeOpts{Name: "redirector_pod_queue_unfinished_work_seconds",
			Help: "Seconds of work in progress not yet finished: a large value means a stuck pod."}),
		longest: prometheus.NewGauge(prometheus.GaugeOpts{Name: "redirector_pod_queue_longest_running_seconds",
			Help: "How long the longest-running pod convergence has been running."}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{Name: "redirector_pod_queue_retries_total",
			Help: "Pods queued again, with backoff, because converging them failed."}),
	}
	if reg != nil {
		reg.MustRegister(m.depth, m.adds, m.latency, m.work, m.unfinished, m.longest, m.retries)
	}
	return m
}

// The queue has one name; every constructor hands out that queue's metric.
func (m *queueMetrics) NewDepthMetric(string) workqueue.GaugeMetric       { return m.depth }
func (m *queueMetrics) NewAddsMetric(string) workqueue.CounterMetric      { return m.adds }
func (m *queueMetrics) NewLatencyMetric(string) workqueue.HistogramMetric { return m.latency }
func (m *queueMetrics) NewWorkDurationMetric(string) workqueue.HistogramMetric {
	return m.work
}
func (m *queueMetrics) NewUnfinishedWorkSecondsMetric(string) workqueue.SettableGaugeMetric {
	return m.unfinished
}
func (m *queueMetrics) NewLongestRunningProcessorSecondsMetric(string) workqueue.SettableGaugeMetric {
	return m.longest
}
func (m *queueMetrics) NewRetriesMetric(string) workqueue.CounterMetric { return m.retries }
