// Package tunnel is the userspace half of the data path. For every enrolled
// pod it opens three listeners inside the pod's network namespace: outbound
// (15001) takes the connections the BPF programs captured from the pod,
// inbound plaintext (15006) takes new plaintext connections to the pod, and
// HBONE (15008) takes mutual-TLS HTTP/2 CONNECT streams from other pods'
// tunnels. Outbound goes to a meshed destination over HBONE with the source
// pod's SPIFFE identity, or as plain TCP to anything else; inbound is checked
// against PeerAuthentication and AuthorizationPolicy and delivered to the app
// from the client's own address.
package tunnel

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redirector-mesh/redirector/pkg/dnsproxy"
	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Config wires the tunnel to identity, ports and metrics.
type Config struct {
	TrustDomain   string
	RootNamespace string // PeerAuthentication/AuthorizationPolicy root, default istio-system
	OutboundPort  uint16
	InboundPort   uint16
	HBONEPort     uint16
	// DNS, when set, answers the pods' captured DNS queries (dns.go): each
	// pod gets a UDP socket on DNSPort, and its TCP connections to port 53
	// go to DNS when DNSCapture, or the pod's own choice, says so.
	DNS        *dnsproxy.Proxy
	DNSPort    uint16
	DNSCapture bool
	// TunnelMark is the SO_MARK of every socket the tunnel opens in a pod;
	// the BPF programs never capture packets that carry it.
	TunnelMark uint32
	// HBONECongestion is the TCP congestion control of the HBONE sockets
	// (dialled and accepted); empty keeps the pod namespace's default.
	// netns.CheckCongestion validates it.
	HBONECongestion string
	// Predecessor, when set, is the agent this one replaces on the node:
	// each pod's listeners are taken from it while it serves the pod
	// (handover.go).
	Predecessor *Predecessor
	// WrapPodSocket, if set, wraps each socket the tunnel accepts on a pod's
	// capture listeners or dials to the pod's apps, before any use (the
	// sockops acceleration's accel.Accelerator.Wrap).
	WrapPodSocket func(net.Conn) net.Conn
	// Limits bound the capture listeners' open connections; zero fields
	// take DefaultLimits' values.
	Limits  Limits
	Certs   *identity.Manager
	Pool    *hbone.Pool
	Metrics *Metrics
	Logger  *slog.Logger
	// NoAccessLog turns off the per-connection access logs (see
	// accessLog), which otherwise go to AccessLogger, or Logger if nil.
	NoAccessLog  bool
	AccessLogger *slog.Logger
}

// State is what the tunnel decides with: the workload directory and the
// mesh policies of one source snapshot. It is replaced whole, never edited.
type State struct {
	Dir                   *workload.Directory
	PeerAuthentications   []policy.PeerAuthentication
	AuthorizationPolicies []policy.AuthorizationPolicy
	// Compiled, when set, decides inbound connections instead of the two
	// lists above (istiod's compiled authorization, STRICT included).
	Compiled *policy.CompiledSet

	// policies indexes the policies above, once per state (Update), so a
	// connection's decision walks only the policies that can apply to it.
	policies *policy.Index
}

// index returns s's policy index, made by Update; a State that did not
// pass through it is indexed on the spot.
func (s *State) index(root string) *policy.Index {
	if s.policies != nil {
		return s.policies
	}
	return policy.NewIndex(s.Compiled, s.AuthorizationPolicies, s.PeerAuthentications, root)
}

// Tunnel serves the enrolled pods of one node.
type Tunnel struct {
	cfg   Config
	log   *slog.Logger
	state atomic.Pointer[State]
	lb    *balancer
	// waypoints finds the services waypoints name by host name.
	waypoints waypointIndex
	// limits counts the capture listeners' open connections.
	limits *limiter
	// refusals (INFO) and failures (WARN) rate-limit the logs of refused
	// and failed connections.
	refusals, failures *refusalLog
	// congestionWarned makes checkCongestion's warning once per process.
	congestionWarned sync.Once
	// updateMu orders Updates, so that open connections are re-decided
	// against each state in the order the states were installed.
	updateMu sync.Mutex
	// meshSynced is closed by the first state whose control plane has
	// answered (or that has none: State.Compiled nil), syncOnce closes it:
	// an outbound connection to an address the directory does not have
	// waits for it (see meshUnknown).
	meshSynced chan struct{}
	syncOnce   sync.Once

	// handoverIdle is how long a connection to the hand-over socket may
	// wait before its request (handoverTimeout; shorter in tests).
	handoverIdle time.Duration
	// endpoints gives the listener of the agent's HTTP endpoint of a name
	// (metrics, readiness, admin) to hand over (ShareEndpoints); nil: none.
	endpoints atomic.Pointer[func(name string) net.Listener]

	// hboneLimits bounds the open connections and TLS handshakes of every
	// pod's HBONE server together, so the bounds hold per node.
	hboneLimits *hbone.ConnLimiter

	mu   sync.Mutex
	pods map[string]*pod // by pod uid
	// draining is set once Drain began: no pod is served any more.
	draining bool
	retired  hbone.ServerStats // HBONE counts of pods no longer served
	// retiredDrops are the socket drop counts of pods no longer served.
	retiredDrops ListenerDrops
}

// New returns a tunnel serving no pod yet.
func New(cfg Config) *Tunnel {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.RootNamespace == "" {
		cfg.RootNamespace = policy.DefaultRootNamespace
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	if !cfg.NoAccessLog {
		cfg.Metrics.SetAccessLog(cmp.Or(cfg.AccessLogger, cfg.Logger))
	}
	def := DefaultLimits()
	if cfg.Limits.PerNode <= 0 {
		cfg.Limits.PerNode = def.PerNode
	}
	if cfg.Limits.PerPod <= 0 {
		cfg.Limits.PerPod = def.PerPod
	}
	if cfg.Limits.PerSource <= 0 {
		cfg.Limits.PerSource = def.PerSource
	}
	t := &Tunnel{cfg: cfg, log: cfg.Logger, pods: map[string]*pod{}, lb: newBalancer(), hboneLimits: hbone.NewConnLimiter(hboneLimitsFor(cfg.Limits)), handoverIdle: handoverTimeout,
		meshSynced: make(chan struct{}),
		refusals:   newRefusalLog(cfg.Logger, slog.LevelInfo), failures: newRefusalLog(cfg.Logger, slog.LevelWarn)}
	t.limits = newLimiter(cfg.Limits, cfg.Metrics, t.refusals)
	t.state.Store(&State{Dir: &workload.Directory{}})
	if cfg.Certs != nil {
		cfg.Certs.OnTrustChange(t.recheckPeers)
		if cfg.Pool != nil {
			// Servers' connections drain when the chain that verified
			// ends, not one a server's presented names suggest.
			certs := cfg.Certs
			cfg.Pool.SetPeerExpiry(func(cs tls.ConnectionState) time.Time {
				return certs.PeerChainEnd(cs, x509.ExtKeyUsageServerAuth)
			})
		}
	}
	return t
}

// Update replaces the directory and policies used for new connections,
// then closes the open inbound connections the new state no longer
// admits (see recheck), and starts the grace period of the metric series
// of workloads that left.
func (t *Tunnel) Update(s *State) {
	c := *s
	if c.Dir == nil {
		c.Dir = &workload.Directory{}
	}
	c.policies = policy.NewIndex(c.Compiled, c.AuthorizationPolicies, c.PeerAuthentications, t.cfg.RootNamespace)
	s = &c
	t.updateMu.Lock()
	defer t.updateMu.Unlock()
	prev := t.state.Swap(s)
	if !meshPending(s) {
		t.syncOnce.Do(func() { close(t.meshSynced) })
	}
	t.waypoints.cur.Store(nil) // holds no directory but the current one
	t.cfg.Metrics.setLive(s.Dir)
	t.lb.prune(s.Dir)
	t.recheck(context.Background(), prev, s)
}

// meshPending reports whether s comes from a control plane that has not
// answered yet: its directory holds only this node's pods.
func meshPending(s *State) bool { return s.Compiled != nil && !s.Compiled.Synced }

// State returns the current directory and policies.
func (t *Tunnel) State() *State { return t.state.Load() }

// ServePod opens the pod's listeners inside netnsPath. Serving a pod that is
// already served from the same namespace (the same path naming the same
// namespace, by inode) is a no-op.
//
// Once Drain has begun it refuses: a draining agent opens no listeners.
// A pod served from another namespace or with other addresses (its sandbox
// was recreated) has its old listeners stopped first, its connections given
// a second, as StopPod does, and outside t.mu, so other pods' calls never
// wait for one pod's connections.
func (t *Tunnel) ServePod(ctx context.Context, uid, netnsPath string, addrs []netip.Addr) error {
	t.mu.Lock()
	if t.draining {
		t.mu.Unlock()
		return errDraining
	}
	old, ok := t.pods[uid]
	if ok && old.netns == netnsPath && slices.Equal(old.addrs, addrs) && !old.pathMoved() {
		t.mu.Unlock()
		return nil
	}
	if ok {
		delete(t.pods, uid)
		t.retire(old)
	}
	t.mu.Unlock()
	if ok {
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		old.stop(sctx)
		t.evict(sctx, old)
		cancel()
	}
	p, err := t.startPod(ctx, uid, netnsPath, addrs)
	if err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, raced := t.pods[uid]; raced || t.draining {
		// Drain began, or another call served the pod meanwhile: this
		// one's listeners are not needed.
		go p.stop(context.Background())
		if t.draining {
			return errDraining
		}
		return nil
	}
	t.pods[uid] = p
	t.cfg.Metrics.servedPods.Set(float64(len(t.pods)))
	return nil
}

// errDraining refuses to serve a pod once Drain began.
var errDraining = errors.New("the agent is draining: no new listeners")

// StopPod closes the pod's listeners and ends its connections.
func (t *Tunnel) StopPod(ctx context.Context, uid string) error {
	t.mu.Lock()
	p, ok := t.pods[uid]
	delete(t.pods, uid)
	if ok {
		t.retire(p)
	}
	t.cfg.Metrics.servedPods.Set(float64(len(t.pods)))
	t.mu.Unlock()
	if ok {
		// The pod's entries are gone already, so its captured connections
		// cannot go on; give them a moment, not a drain.
		ctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		p.stop(ctx)
		t.evict(ctx, p)
	}
	return nil
}

// evict closes the pod's pooled HBONE connections. They live in its
// namespace: nothing else may use them, and a peer may never answer them
// again.
func (t *Tunnel) evict(ctx context.Context, p *pod) {
	if t.cfg.Pool == nil {
		return
	}
	if n := t.cfg.Pool.Evict(func(k hbone.PoolKey) bool { return k.Src == p.id }); n > 0 {
		t.log.DebugContext(ctx, "closed the pod's HBONE connections", "pod", p.uid, "connections", n)
	}
}

// ServedPods lists the uids of pods with open listeners.
func (t *Tunnel) ServedPods() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(t.pods))
	for uid := range t.pods {
		out = append(out, uid)
	}
	return out
}

// PodReady reports whether the pod has all its listeners open.
func (t *Tunnel) PodReady(uid string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.pods[uid]
	return ok
}

// ListenerProblems names every served pod's listener that does not accept
// now (accepts failing, or the listener closed under a served pod), with
// the pod and port, for readiness. Empty when all accept.
func (t *Tunnel) ListenerProblems() []string {
	t.mu.Lock()
	pods := slices.Collect(maps.Values(t.pods))
	t.mu.Unlock()
	dir := t.State().Dir
	now := time.Now()
	var out []string
	for _, p := range pods {
		name := "pod uid " + p.uid
		if len(p.addrs) > 0 {
			if w, ok := dir.ByAddr(p.addrs[0]); ok {
				name = "pod " + w.String()
			}
		}
		for _, h := range p.health {
			if why := h.problem(now); why != "" {
				out = append(out, name+" "+why)
			}
		}
		if f := p.dnsDown.Load(); f != nil && !p.stopping.Load() {
			out = append(out, name+" "+f.problem(p.t.cfg.DNSPort, now))
		}
		if h := p.health[2]; h.problem(now) == "" && p.hbone != nil && !p.hbone.Accepting() && !p.stopping.Load() {
			out = append(out, fmt.Sprintf("%s port %d: HBONE server not accepting (accept errors, backing off)", name, h.port))
		}
	}
	slices.Sort(out)
	return out
}

// Shutdown stops accepting in every pod and waits, until ctx ends, for open
// connections to finish; then it closes what is left.
func (t *Tunnel) Shutdown(ctx context.Context) error {
	t.mu.Lock()
	pods := t.pods
	t.pods = map[string]*pod{}
	for _, p := range pods {
		t.retire(p)
	}
	t.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range pods {
		wg.Add(1)
		go func() { defer wg.Done(); p.stop(ctx) }()
	}
	wg.Wait()
	return nil
}

// errForeignSource means a connection captured in one pod's namespace
// carries an address that is not that pod's: another local pod's address
// spoofed (a raw socket, IP_TRANSPARENT, an address added to lo), to leave
// with that pod's identity.
var errForeignSource = errors.New("source address is not the capturing pod's")

// self returns p's own workload and identity for a connection from src,
// which must be one of p's addresses in a directory entry that is p itself.
// Identity follows the namespace a connection was captured in (the
// listener's pod), as ztunnel's in-pod mode does, never the address alone.
func (p *pod) self(src netip.Addr) (*workload.Workload, identity.ID, error) {
	src = src.Unmap()
	if !p.owns(src) {
		return nil, identity.ID{}, fmt.Errorf("%w: %s is not an address of pod %s", errForeignSource, src, p.uid)
	}
	w, ok := p.t.State().Dir.ByAddr(src)
	switch {
	case !ok:
		return nil, identity.ID{}, fmt.Errorf("no workload known at %s", src)
	case w.Key() != p.uid:
		return nil, identity.ID{}, fmt.Errorf("%w: %s belongs to %s/%s in the directory, not to pod %s", errForeignSource, src, w.Namespace, w.Name, p.uid)
	}
	return w, p.t.identityOf(w), nil
}

// sourceFailure is the fail-closed reason for an error of self.
func sourceFailure(err error) string {
	if errors.Is(err, errForeignSource) {
		return "foreign_source"
	}
	return "unknown_source"
}

func (t *Tunnel) identityOf(w *workload.Workload) identity.ID {
	return identity.ID{TrustDomain: t.cfg.TrustDomain, Namespace: w.Namespace, ServiceAccount: w.ServiceAccount}
}

// hboneLimitsFor is the HBONE servers' connection limits under l: the
// streams one client address may hold a handler for (relays among them) are
// twice the tunnels relayed for it, at least the package's default, so
// raising PerSource (an ingress's pools) never refuses its tunnels there.
func hboneLimitsFor(l Limits) hbone.ConnLimits {
	return hbone.ConnLimits{MaxHandlersPerSource: max(2*l.PerSource, hbone.DefaultMaxHandlersPerSource)}
}
