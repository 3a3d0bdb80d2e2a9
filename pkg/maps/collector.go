package maps

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metric descriptions of the data path's counters. Pod labels name the pod,
// never an address or a connection, so the series are bounded by the pods
// enrolled on this node.
var (
	packetsDesc = prometheus.NewDesc("redirector_bpf_packets_total",
		"Packets the BPF programs decided on, by verdict reason, summed over CPUs (sock_routed_local counts sockets, not packets).",
		[]string{"reason"}, nil)
	failClosedDesc = prometheus.NewDesc("redirector_bpf_fail_closed_drops_total",
		"Packets the BPF programs dropped rather than let through unprotected (the sum of the drop_* reasons).",
		nil, nil)
	podConnsDesc = prometheus.NewDesc("redirector_bpf_pod_connections_total",
		"Connections of an enrolled pod steered to the tunnel, by direction, summed over the pod's addresses.",
		[]string{"namespace", "pod", "direction"}, nil)
	podPacketsDesc = prometheus.NewDesc("redirector_bpf_pod_packets_total",
		"Packets of an enrolled pod steered, dropped to fail closed, or deliberately bypassed, summed over the pod's addresses.",
		[]string{"namespace", "pod", "kind"}, nil)
)

// collector reads the per-CPU maps when Prometheus scrapes, so the numbers
// are as fresh as the scrape and nothing polls the maps in between.
type collector struct {
	m *Maps
}

// NewCollector returns a Prometheus collector of the data path's counters in
// m. Per-pod series start over when a pod is enrolled again (its counters are
// recreated at zero), which Prometheus treats as a counter reset.
func NewCollector(m *Maps) prometheus.Collector {
	return collector{m: m}
}

// Describe implements prometheus.Collector.
func (c collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{packetsDesc, failClosedDesc, podConnsDesc, podPacketsDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector. A map that cannot be read is
// reported as an invalid metric for its series only; the others still go out.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	c.collectReasons(ch)
	c.collectPods(ch)
}

func (c collector) collectReasons(ch chan<- prometheus.Metric) {
	reasons, err := c.m.ReasonCounts()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(packetsDesc, err)
		ch <- prometheus.NewInvalidMetric(failClosedDesc, err)
		return
	}
	var drops uint64
	for r, n := range reasons {
		ch <- prometheus.MustNewConstMetric(packetsDesc, prometheus.CounterValue, float64(n), ReasonName(r))
		if IsDrop(r) {
			drops += n
		}
	}
	ch <- prometheus.MustNewConstMetric(failClosedDesc, prometheus.CounterValue, float64(drops))
}

// podName identifies a pod in the labels.
type podName struct{ namespace, name string }

func (c collector) collectPods(ch chan<- prometheus.Metric) {
	metas, err := c.m.ListMeta()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(podConnsDesc, err)
		ch <- prometheus.NewInvalidMetric(podPacketsDesc, err)
		return
	}
	// One pass over the stats map rather than a lookup per address.
	counters, err := c.m.AllCounters()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(podConnsDesc, err)
		ch <- prometheus.NewInvalidMetric(podPacketsDesc, err)
		return
	}
	// An address's counters are its owner's (the pod its enrollment entry
	// names; the loader keeps them for that pod alone). A pod's predecessor
	// can still be recorded with the same address while it is detached.
	owners, err := c.m.ListPods()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(podConnsDesc, err)
		ch <- prometheus.NewInvalidMetric(podPacketsDesc, err)
		return
	}
	// Summed by name, not by pod id: while a re-created pod replaces its
	// predecessor both can be recorded for a moment, and two series with the
	// same labels would fail the whole scrape.
	pods := map[podName]PodCounters{}
	for id, meta := range metas {
		sum := pods[podName{meta.Namespace, meta.Name}]
		for _, a := range meta.Addrs {
			if o, ok := owners[a]; !ok || o.PodID == id {
				sum.plus(counters[a])
			}
		}
		pods[podName{meta.Namespace, meta.Name}] = sum
	}
	for p, n := range pods {
		for _, s := range []struct {
			desc  *prometheus.Desc
			value uint64
			label string
		}{
			{podConnsDesc, n.OutboundConns, "outbound"},
			{podConnsDesc, n.InboundConns, "inbound"},
			{podPacketsDesc, n.SteeredPackets, "steered"},
			{podPacketsDesc, n.DroppedPackets, "dropped"},
			{podPacketsDesc, n.BypassedPackets, "bypassed"},
		} {
			ch <- prometheus.MustNewConstMetric(s.desc, prometheus.CounterValue, float64(s.value), p.namespace, p.name, s.label)
		}
	}
}

// plus adds o to c.
func (c *PodCounters) plus(o PodCounters) {
	c.OutboundConns += o.OutboundConns
	c.InboundConns += o.InboundConns
	c.SteeredPackets += o.SteeredPackets
	c.DroppedPackets += o.DroppedPackets
	c.BypassedPackets += o.BypassedPackets
}
