package tunnel

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// Listener hand-over between two agent processes (an upgrade).
//
// Every pod listener (outbound, inbound, HBONE) is opened with SO_REUSEPORT,
// so a new agent opens its own on the same ports while the old one still
// runs; both sockets form one reuseport group. The capture programs find the
// listener with bpf_skc_lookup_tcp and bpf_sk_assign it; since Linux 6.5 the
// kernel selects again within the reuseport group of an assigned listener,
// so while both run, new connections spread over both (both serve them
// fully). On SIGTERM the old agent closes its listeners first: from then on
// the group holds only the new agent's, and with net.ipv4.tcp_migrate_req=1
// in the pod's namespace the requests still queued on the closed ones
// (SYN_RECV and completed but not yet accepted) move to the new listener
// instead of being reset. No SYN meets an empty port, so none is dropped or
// retransmitted. Established connections stay with the process that
// accepted them and drain (pod.stop).

// enableHandover sets net.ipv4.tcp_migrate_req=1 in the pod's namespace.
// It is left set when the pod leaves: the successor relies on it during a
// hand-over, and it only changes what happens to requests queued on a
// closing reuseport listener (moved, not reset), also for the app's own.
func enableHandover(path, procDir string) error {
	if _, err := netns.EnableMigrateReq(path, procDir); err != nil {
		return fmt.Errorf("listener hand-over: %w", err)
	}
	return nil
}

// DrainMetrics count what a drain (SIGTERM) did with the relayed
// connections: finished on their own within the grace period, or closed at
// its end.
type DrainMetrics struct {
	draining prometheus.Gauge
	finished prometheus.Counter
	closed   prometheus.Counter
}

// NewDrainMetrics registers the drain metrics with reg.
func NewDrainMetrics(reg prometheus.Registerer) *DrainMetrics {
	m := &DrainMetrics{
		draining: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "redirector_drain_open_connections",
			Help: "Relayed connections still open while the agent drains (after SIGTERM), 0 otherwise."}),
		finished: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redirector_drain_finished_connections_total",
			Help: "Relayed connections open when the drain began that ended on their own within the drain timeout."}),
		closed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redirector_drain_closed_connections_total",
			Help: "Relayed connections the agent closed because the drain timeout ran out."}),
	}
	reg.MustRegister(m.draining, m.finished, m.closed)
	return m
}

// DrainResult is what Drain did.
type DrainResult struct {
	Pods     int // pods whose listeners were closed
	Open     int // relayed connections open when the drain began
	Finished int // of those, ended within the grace period
	Closed   int // closed when ctx ended
}

// Drain stops accepting in every pod (closing the listeners hands the
// reuseport groups to a successor agent, with their queued requests), sends
// GOAWAY on every HBONE server connection so peers open new streams to the
// successor, lets the relayed connections run until ctx ends, then closes
// what is left. m may be nil.
func (t *Tunnel) Drain(ctx context.Context, m *DrainMetrics) DrainResult {
	t.mu.Lock()
	t.draining = true
	pods := t.pods
	t.pods = map[string]*pod{}
	for _, p := range pods {
		t.retire(p)
	}
	t.cfg.Metrics.servedPods.Set(0)
	t.mu.Unlock()
	var (
		mu  sync.Mutex
		res = DrainResult{Pods: len(pods)}
		wg  sync.WaitGroup
	)
	for _, p := range pods {
		wg.Add(1)
		go func() {
			defer wg.Done()
			open, forced := p.stop(ctx)
			mu.Lock()
			res.Open += open
			res.Closed += forced
			mu.Unlock()
		}()
	}
	if m != nil {
		// The gauge follows the connections while they drain.
		stop := make(chan struct{})
		go func() {
			tick := time.NewTicker(250 * time.Millisecond)
			defer tick.Stop()
			for {
				m.draining.Set(float64(t.drainingConns(pods)))
				select {
				case <-stop:
					return
				case <-tick.C:
				}
			}
		}()
		defer close(stop)
	}
	wg.Wait()
	res.Finished = max(res.Open-res.Closed, 0)
	if m != nil {
		m.draining.Set(0)
		m.finished.Add(float64(res.Finished))
		m.closed.Add(float64(res.Closed))
	}
	return res
}

// drainingConns counts the relayed connections of pods being drained.
func (t *Tunnel) drainingConns(pods map[string]*pod) int {
	n := 0
	for _, p := range pods {
		p.mu.Lock()
		n += len(p.conns)
		p.mu.Unlock()
	}
	return n
}

// Taking the ports over from a predecessor without SO_REUSEPORT (a release
// from before hand-over): its listeners cannot share a group, so binding
// fails with EADDRINUSE until it closes them on SIGTERM. The pod counts as
// served meanwhile (readiness must pass, or a surge rollout would wait
// forever for this agent while the old one keeps the ports), and binding is
// retried every awaitPortsEvery: the gap after the predecessor closes is at
// most that, and a SYN in it is dropped and retransmitted (about 1 s).
// After awaitPortsReport, readiness names the pod: something else than an
// agent on its way out may hold the port (an app listening on 15001).
const (
	awaitPortsEvery  = 20 * time.Millisecond
	awaitPortsReport = 60 * time.Second
)

// awaitPorts retries listen until it succeeds or the pod stops.
func (p *pod) awaitPorts(ctx context.Context, first error) {
	p.t.log.InfoContext(ctx, "pod ports held by another process (an agent without listener hand-over?); taking them when it lets go",
		"uid", p.uid, "netns", p.netns, "error", first)
	start := time.Now()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		tick := time.NewTicker(awaitPortsEvery)
		defer tick.Stop()
		reported := false
		for {
			select {
			case <-p.ctx.Done():
				return
			case <-tick.C:
			}
			lns, err := p.listen(p.ctx)
			if err != nil {
				if !reported && time.Since(start) > awaitPortsReport {
					reported = true
					for _, h := range p.health {
						h.fail(err, time.Now())
					}
					p.t.log.Error("pod ports still held by another process", "uid", p.uid, "netns", p.netns, "error", err)
				}
				continue
			}
			if !p.serve(lns) {
				return
			}
			for _, h := range p.health {
				h.ok(time.Now())
			}
			p.t.log.Info("serving pod (ports taken over)", "uid", p.uid, "netns", p.netns, "waited", time.Since(start).Round(time.Millisecond))
			return
		}
	}()
}
