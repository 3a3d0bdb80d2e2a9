package tunnel

import (
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
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

// maxDerivedSeries bounds the series whose source names come from a peer's
// baggage rather than from the directory: a peer with a valid certificate
// may announce any names, and each new one would otherwise be a new series.
// Past the bound such connections are counted with an unknown source.
const maxDerivedSeries = 1000

// maxDerivedSeriesPerPeer is one verified identity's share of
// maxDerivedSeries, so that one peer (a compromised workload) cannot take
// every slot and leave the other peers' connections, remote clusters' and
// VMs' above all, without their names. An honest source needs one series
// per name it runs under and destination it reaches on this node.
const maxDerivedSeriesPerPeer = 100

// seriesGC deletes the per-workload series of workloads that are gone.
// A series is gone when its source or destination workload (by namespace
// and workload name, the labels it carries) or its service is in no state
// the tunnel has since installed (or it names its source only by a
// verified identity, or by the peer's baggage; see liveLocked), and no
// connection counted in it is open.
// It is deleted seriesGrace later, at the next scrape or Update.
type seriesGC struct {
	now    func() time.Time
	grace  time.Duration // seriesGrace unless SetSeriesGrace changed it
	groups []seriesGroup

	mu   sync.Mutex
	live map[string]bool // liveness keys of the current directory; nil: all live
	// owners are the service accounts the current directory's workloads
	// run as, by workload and by canonical service (workloadKey,
	// canonicalKey); nil before the first directory.
	owners  map[string]map[string]bool
	series  map[string]*seriesEntry
	derived int // entries whose source names a peer announced
	// derivedBy counts those entries by the source_principal that
	// announced them.
	derivedBy map[string]int
	// flows are the open connections' byte flows (begin), a ring through
	// this sentinel: one per open connection, which the tunnel's
	// connection limits bound.
	flows byteFlow
}

// seriesGroup is counter vectors that share one label set.
type seriesGroup struct {
	names []string
	vecs  []*prometheus.CounterVec
	// bytes are the indices in vecs of the request and response byte
	// counters that an open connection's byteFlow adds to, if the group
	// counts bytes.
	bytes []int
}

// byteFlow is an open connection's bytes on their way into its series:
// the relay adds to moved as it copies (one atomic add per write, to this
// connection's own counter), and the series' byte counters are brought up
// to moved at each scrape (foldOpen) and at the close, so a long-lived
// connection's bytes show while it lasts, not all at once at its end.
type byteFlow struct {
	moved hbone.Counts // AToB: request bytes (client to server); BToA: response bytes
	// folded is what the counters have been given of each direction; it
	// only grows, so a byte is added once whoever folds it.
	folded   [2]atomic.Int64
	counters [2]prometheus.Counter // request, response (received, sent)
	// prev and next link the flow in seriesGC.flows while its connection
	// is open; guarded by the seriesGC's mu.
	prev, next *byteFlow
}

// fold brings the counters up to the running counts.
func (f *byteFlow) fold() { f.foldTo(f.moved.AToB.Load(), f.moved.BToA.Load()) }

// foldTo brings the counters up to request and response bytes: each
// counter gets what its direction has beyond what it was given already.
// The relay's final counts equal its running ones, so at the close the
// series hold exactly those, however scrapes and the close interleaved.
func (f *byteFlow) foldTo(request, response int64) {
	for i, n := range [2]int64{request, response} {
		for {
			old := f.folded[i].Load()
			if n <= old {
				break
			}
			if f.folded[i].CompareAndSwap(old, n) {
				f.counters[i].Add(float64(n - old))
				break
			}
		}
	}
}

type seriesEntry struct {
	group  int
	labels prometheus.Labels
	// counters are the group's vectors' counters of labels, in the
	// group's order, resolved once (with the entry) rather than hashed
	// from the labels again on every connection.
	counters  []prometheus.Counter
	open      int       // connections counted in the series and still open
	goneSince time.Time // zero while live or open
	derived   bool      // admitted by admitDerived
}

func newSeriesGC(now func() time.Time, groups ...seriesGroup) *seriesGC {
	g := &seriesGC{now: now, grace: seriesGrace, groups: groups, series: map[string]*seriesEntry{}, derivedBy: map[string]int{}}
	g.flows.prev, g.flows.next = &g.flows, &g.flows
	return g
}

// SetSeriesGrace changes how long the series of gone workloads stay
// exported (default seriesGrace); tests and soaks shorten it. Call it
// before the metrics are used.
func (m *Metrics) SetSeriesGrace(d time.Duration) {
	if d > 0 {
		m.series.grace = d
	}
}

func (g *seriesGC) key(group int, l prometheus.Labels) string {
	names := g.groups[group].names
	size := 1 + len(names)
	for _, n := range names {
		size += len(l[n])
	}
	var b strings.Builder
	b.Grow(size)
	b.WriteByte(byte('0' + group))
	for _, n := range names {
		b.WriteByte(0)
		b.WriteString(l[n])
	}
	return b.String()
}

func workloadKey(ns, name string) string  { return "w\x00" + ns + "\x00" + name }
func serviceKey(ns, name string) string   { return "s\x00" + ns + "\x00" + name }
func canonicalKey(ns, name string) string { return "c\x00" + ns + "\x00" + name }

// revisionKey is a workload's canonical service and revision.
func revisionKey(ns, name, canon, rev string) string {
	return "r\x00" + ns + "\x00" + name + "\x00" + canon + "\x00" + rev
}

// claimable reports whether a peer whose verified identity is id may be
// counted under the names it announced in m. Baggage is the peer's claim,
// checked only for its namespace when parsed; a workload or canonical
// service the directory knows must also run as the peer's service account
// somewhere, or any workload of a namespace could have its traffic counted
// (and logged) as another one's of that namespace. Names the directory
// does not know stay claimable: that is what baggage is for.
func (g *seriesGC) claimable(m *peerMeta, id identity.ID) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, k := range []string{workloadKey(m.namespace, m.workload), canonicalKey(m.namespace, m.service)} {
		if sas, known := g.owners[k]; known && !sas[id.ServiceAccount] {
			return false
		}
	}
	return true
}

// admitDerived reports whether the istio_tcp_* series l, whose source
// names come from a peer, may be counted: it exists already, or fewer than
// maxDerivedSeries such series do and fewer than maxDerivedSeriesPerPeer of
// its source_principal. Otherwise it returns the bound that was reached
// ("node" or "peer").
func (g *seriesGC) admitDerived(l prometheus.Labels) (ok bool, limit string) {
	k := g.key(0, l)
	peer := l["source_principal"]
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.series[k]; ok {
		return true, ""
	}
	if g.derived >= maxDerivedSeries {
		return false, "node"
	}
	if g.derivedBy[peer] >= maxDerivedSeriesPerPeer {
		return false, "peer"
	}
	g.derived++
	g.derivedBy[peer]++
	g.series[k] = &seriesEntry{group: 0, labels: l, derived: true}
	return true, ""
}

// begin records an open connection counted in the series l and returns
// the series' counters, one per vector of the group in its order; end when
// the connection closes. The counters stay the series' until then: a
// series with open connections is never deleted. flow, if not nil (a
// group that counts bytes), is given the series' byte counters and folded
// into them at each scrape until end, which does not fold it: fold it to
// its final counts before.
func (g *seriesGC) begin(group int, l prometheus.Labels, flow *byteFlow) (counters []prometheus.Counter, end func()) {
	k := g.key(group, l)
	g.mu.Lock()
	e := g.series[k]
	if e == nil {
		e = &seriesEntry{group: group, labels: l}
		g.series[k] = e
	}
	if e.counters == nil {
		vecs := g.groups[group].vecs
		e.counters = make([]prometheus.Counter, len(vecs))
		for i, v := range vecs {
			e.counters[i] = v.With(e.labels)
		}
	}
	e.open++
	e.goneSince = time.Time{}
	if flow != nil {
		b := g.groups[group].bytes
		flow.counters = [2]prometheus.Counter{e.counters[b[0]], e.counters[b[1]]}
		flow.prev, flow.next = g.flows.prev, &g.flows
		g.flows.prev.next = flow
		g.flows.prev = flow
	}
	g.mu.Unlock()
	var once sync.Once
	return e.counters, func() {
		once.Do(func() {
			g.mu.Lock()
			defer g.mu.Unlock()
			if flow != nil {
				flow.prev.next, flow.next.prev = flow.next, flow.prev
				flow.prev, flow.next = nil, nil
			}
			if e.open--; e.open == 0 && !g.liveLocked(e) {
				e.goneSince = g.now()
			}
		})
	}
}

// foldOpen brings the byte counters of every open connection's series up
// to what its relay has moved so far. It holds mu, so no series it adds to
// is deleted meanwhile, and a connection's end, which waits for mu, finds
// its series holding exactly its final counts.
func (g *seriesGC) foldOpen() {
	g.mu.Lock()
	defer g.mu.Unlock()
	for f := g.flows.next; f != &g.flows; f = f.next {
		f.fold()
	}
}

// setLive installs the directory that says which workloads exist, starts
// the grace of series that just went, and deletes those past it.
func (m *Metrics) setLive(dir *workload.Directory) {
	live, owners := map[string]bool{}, map[string]map[string]bool{}
	own := func(k, sa string) {
		if owners[k] == nil {
			owners[k] = map[string]bool{}
		}
		owners[k][sa] = true
	}
	for _, w := range dir.All() {
		name, canon, rev := workloadMeta(w)
		live[workloadKey(w.Namespace, name)] = true
		live[revisionKey(w.Namespace, name, canon, rev)] = true
		own(workloadKey(w.Namespace, name), w.ServiceAccount)
		own(canonicalKey(w.Namespace, canon), w.ServiceAccount)
	}
	for _, s := range dir.Services() {
		live[serviceKey(s.Namespace, s.Name)] = true
	}
	g := m.series
	g.mu.Lock()
	g.live, g.owners = live, owners
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
//
// A series whose source names a peer announced is never live: its names
// are the peer's, not the directory's, even when they match a workload
// there, and its slot in the maxDerivedSeries budget must come back a
// grace after its last connection, or a peer could hold the budget for
// ever by naming an existing workload with ever new versions.
//
// Nor is one whose source is only a verified identity (no workload the
// directory has at its address, no baggage taken): no workload of it can
// leave, so it would stay as long as its destination, and every identity
// that ever connected (per-run service accounts, or ones a tenant mints)
// would hold its series for good. It goes a grace after its last
// connection, and comes back, from zero, with the next.
func (g *seriesGC) liveLocked(e *seriesEntry) bool {
	if e.derived {
		return false
	}
	if e.labels["source_workload"] == "unknown" && e.labels["source_principal"] != "unknown" {
		return false
	}
	if g.live == nil {
		return true
	}
	for _, side := range []string{"source", "destination"} {
		name := e.labels[side+"_workload"]
		if name == "unknown" {
			continue
		}
		ns := e.labels[side+"_workload_namespace"]
		if !g.live[workloadKey(ns, name)] {
			return false
		}
		// A workload keeps its name across rollouts, not its revision
		// or service account: the series of one no pod of it runs as
		// any more go too, or every release would add series for as
		// long as the workload lives.
		if canon, ok := e.labels[side+"_canonical_service"]; ok && !g.live[revisionKey(ns, name, canon, e.labels[side+"_canonical_revision"])] {
			return false
		}
		if p, ok := e.labels[side+"_principal"]; ok && p != "unknown" {
			i := strings.LastIndex(p, "/sa/")
			if i < 0 || !g.owners[workloadKey(ns, name)][p[i+len("/sa/"):]] {
				return false
			}
		}
	}
	if name, ok := e.labels["destination_service_name"]; ok && name != "unknown" {
		if !g.live[serviceKey(e.labels["destination_service_namespace"], name)] {
			return false
		}
	}
	return true
}

// sweep deletes the series gone for the grace period.
func (g *seriesGC) sweep() {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	for k, e := range g.series {
		if e.goneSince.IsZero() || now.Sub(e.goneSince) < g.grace {
			continue
		}
		for _, v := range g.groups[e.group].vecs {
			v.Delete(e.labels)
		}
		if e.derived {
			g.derived--
			peer := e.labels["source_principal"]
			if g.derivedBy[peer]--; g.derivedBy[peer] <= 0 {
				delete(g.derivedBy, peer)
			}
		}
		delete(g.series, k)
	}
}

// collector exports the vectors, folding the open connections' bytes in
// and sweeping first, so that a scrape shows the bytes of connections
// still open and never a series past its grace even when no Update came
// since.
func (g *seriesGC) collector() prometheus.Collector { return sweepingCollector{g} }

type sweepingCollector struct{ g *seriesGC }

func (c sweepingCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, gr := range c.g.groups {
		for _, v := range gr.vecs {
			v.Describe(ch)
		}
	}
}

func (c sweepingCollector) Collect(ch chan<- prometheus.Metric) {
	c.g.foldOpen()
	c.g.sweep()
	for _, gr := range c.g.groups {
		for _, v := range gr.vecs {
			v.Collect(ch)
		}
	}
}
