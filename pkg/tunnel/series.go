package tunnel

import (
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// seriesGrace is how long the istio_tcp_* series of a workload (or
// service) that left the directory stay exported after their last
// connection closed. Five minutes is 20 scrapes at Prometheus' common 15 s
// interval and 5 at a slow 60 s one: every scraper sees the final values
// several times, so increase() and rate() over the workload's last
// minutes stay right; deleting at once would lose the last increments.
// Kept forever, the series of pods that come and go grow the agent's heap
// and every scrape without bound.
const seriesGrace = 5 * time.Minute

// seriesGC deletes the per-workload series of workloads that are gone.
// A series is gone when its source or destination workload (by namespace,
// workload name and app, the labels it carries) or its service is in no
// state the tunnel has since installed, and no connection counted in it is
// open. It is deleted seriesGrace later, at the next scrape or Update.
type seriesGC struct {
	now  func() time.Time
	vecs []*prometheus.CounterVec

	mu     sync.Mutex
	live   map[string]bool // liveness keys of the current directory; nil: all live
	series map[string]*seriesEntry
}

type seriesEntry struct {
	labels    prometheus.Labels
	open      int       // connections counted in the series and still open
	goneSince time.Time // zero while live or open
}

func newSeriesGC(now func() time.Time, vecs []*prometheus.CounterVec) *seriesGC {
	return &seriesGC{now: now, vecs: vecs, series: map[string]*seriesEntry{}}
}

func seriesKey(l prometheus.Labels) string {
	var b strings.Builder
	for _, n := range istioLabels {
		b.WriteString(l[n])
		b.WriteByte(0)
	}
	return b.String()
}

func workloadKey(ns, name, app string) string { return "w\x00" + ns + "\x00" + name + "\x00" + app }
func serviceKey(ns, name string) string       { return "s\x00" + ns + "\x00" + name }

// begin records an open connection counted in the series l; end when it
// closes.
func (g *seriesGC) begin(l prometheus.Labels) (end func()) {
	k := seriesKey(l)
	g.mu.Lock()
	e := g.series[k]
	if e == nil {
		e = &seriesEntry{labels: l}
		g.series[k] = e
	}
	e.open++
	e.goneSince = time.Time{}
	g.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			g.mu.Lock()
			defer g.mu.Unlock()
			if e.open--; e.open == 0 && !g.liveLocked(e) {
				e.goneSince = g.now()
			}
		})
	}
}

// setLive installs the directory that says which workloads exist, starts
// the grace of series that just went, and deletes those past it.
func (m *Metrics) setLive(dir *workload.Directory) {
	live := map[string]bool{}
	for _, w := range dir.All() {
		l := prometheus.Labels{}
		workloadLabels(l, "w", w, identity.ID{})
		live[workloadKey(l["w_workload_namespace"], l["w_workload"], l["w_app"])] = true
	}
	for _, s := range dir.Services() {
		live[serviceKey(s.Namespace, s.Name)] = true
	}
	g := m.series
	g.mu.Lock()
	g.live = live
	now := g.now()
	for _, e := range g.series {
		switch {
		case e.open > 0 || g.liveLocked(e):
			e.goneSince = time.Time{}
		case e.goneSince.IsZero():
			e.goneSince = now
		}
	}
	g.mu.Unlock()
	g.sweep()
}

// liveLocked reports whether every workload and service e names exists.
func (g *seriesGC) liveLocked(e *seriesEntry) bool {
	if g.live == nil {
		return true
	}
	for _, side := range []string{"source", "destination"} {
		name := e.labels[side+"_workload"]
		if name == "unknown" {
			continue
		}
		if !g.live[workloadKey(e.labels[side+"_workload_namespace"], name, e.labels[side+"_app"])] {
			return false
		}
	}
	if name := e.labels["destination_service_name"]; name != "unknown" {
		if !g.live[serviceKey(e.labels["destination_service_namespace"], name)] {
			return false
		}
	}
	return true
}

// sweep deletes the series gone for seriesGrace.
func (g *seriesGC) sweep() {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	for k, e := range g.series {
		if e.goneSince.IsZero() || now.Sub(e.goneSince) < seriesGrace {
			continue
		}
		for _, v := range g.vecs {
			v.Delete(e.labels)
		}
		delete(g.series, k)
	}
}

// collector exports the vectors, sweeping first, so that a scrape never
// shows a series past its grace even when no Update came since.
func (g *seriesGC) collector() prometheus.Collector { return sweepingCollector{g} }

type sweepingCollector struct{ g *seriesGC }

func (c sweepingCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, v := range c.g.vecs {
		v.Describe(ch)
	}
}

func (c sweepingCollector) Collect(ch chan<- prometheus.Metric) {
	c.g.sweep()
	for _, v := range c.g.vecs {
		v.Collect(ch)
	}
}
