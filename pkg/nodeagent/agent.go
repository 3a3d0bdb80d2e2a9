// Package nodeagent owns enrollment on one node. It takes the mesh model a
// source delivers (source.Snapshot), completes it with what the CNI plugin
// reports, hands the directory and policies to the tunnel, keeps a
// certificate per local identity, and converges each of this node's pods
// on its own through a work queue with retry and backoff (as Istio's node
// agent does), plus a periodic full pass that repairs drift. The loader
// does the kernel work; cmd/redirector only wires the pieces.
package nodeagent

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/client-go/util/workqueue"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/tunnel"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Annotator writes the pod annotation that says whether the node's
// dataplane redirects it (ambient.istio.io/redirection).
type Annotator interface {
	// SetRedirection annotates the pod of that name only if its UID is uid ("": any).
	SetRedirection(ctx context.Context, namespace, name, uid string, enabled bool) error
}

// Claim says whether this agent still holds the node (maps.Claim): a
// newer agent of an upgrade takes it over.
type Claim interface{ Held() bool }

// reclaimer is a Claim that can be taken back once the newer agent gave
// the node up (maps.Claim.Reclaim).
type reclaimer interface {
	Reclaim(ctx context.Context) (bool, error)
}

// Config wires the agent.
type Config struct {
	Node        string
	TrustDomain string
	// Selection's excluded namespaces go into the CNI plugin's hint.
	Selection selection.Config
	// DNSCapture is the node's DNS capture setting; a pod's annotation
	// overrides it (workload.Workload.DNSCapture).
	DNSCapture bool
	// CNISocket is where the CNI plugin reports pods ("" for none); the
	// selection hint is written next to it.
	CNISocket string
	// ProcDir is where the host's /proc is mounted (CNI netns paths).
	ProcDir         string
	ReconcilePeriod time.Duration
	Tunnel          *tunnel.Tunnel
	Loader          *loader.Loader
	Reconciler      *Reconciler
	Certs           *identity.Manager
	// Annotator is nil for sources without an API server (the file).
	Annotator Annotator
	Claim     Claim
	// TakeNode, if set, makes this agent the one holding the node
	// (maps.Claim.Take), once, as the source's first complete snapshot
	// arrives (with SOURCE=xds, one with istiod's answer) and before it is
	// applied; snapshots before it are dropped. An agent that took the
	// node at start and then had nothing to apply (a manifest refused, an
	// API server or istiod not answering) left it unmanaged: the older
	// agent, which had the last good state, yielded, and no pod was
	// enrolled, detached or repaired until the new source answered. Until
	// it returns, the older agent goes on as before; an error ends Run.
	// nil: the node is held already.
	TakeNode func(ctx context.Context) error
	// OnYield runs when a newer agent took the node over (again, after an
	// OnReclaim).
	OnYield func()
	// OnReclaim runs when this agent took the node back from a newer one
	// that gave it up (a rolled back upgrade), before the full pass that
	// follows: it undoes OnYield. The loader reads the pinned state again
	// and relinks the node as the claim is taken back (cmd/redirector's
	// takeBackClaim: loader.Relink under the claim's lock).
	OnReclaim func()
	// Registry, if set, gets the work queue's metrics.
	Registry prometheus.Registerer
	Logger   *slog.Logger
}

// Agent is the node's enrollment owner. Create it with New, feed it with
// Run, and let the CNI server call HandleCNI.
type Agent struct {
	cfg   Config
	log   *slog.Logger
	queue workqueue.TypedRateLimitingInterface[string]
	// workers are the goroutines converging queued pods.
	workers sync.WaitGroup
	// claimMu serialises checkClaim's hand-overs: a yield (OnYield, made
	// by whichever worker or loop saw the claim first) and a take-back
	// (OnReclaim, by the main loop) one after the other, never interleaved.
	claimMu sync.Mutex
	// waiting is set while this agent waits for a complete snapshot to
	// take the node with (Config.TakeNode): another agent's claim is not a
	// successor's then.
	waiting atomic.Bool

	// mu guards everything below. The main loop and CNI events both apply
	// the latest snapshot; workers read the desired state.
	mu sync.Mutex
	// yielded is set once a newer agent claimed the node, until it gives
	// the node back (checkClaim): snapshots then update only the tunnel's
	// state and certificates, never the enrollment or annotations.
	yielded bool
	last    *source.Snapshot
	cniPods map[string]cniPod // namespace/name -> what the CNI plugin reported
	// reportedNetNS is cniPods' namespaces by inode, published on every
	// change (publishReportsLocked) for readers that cannot take mu.
	reportedNetNS atomic.Pointer[map[uint64][]reportedNS]
	// desired is, by pod uid, how each pod to enroll should be attached,
	// with its workload (for its annotation).
	desired map[string]desiredPod
	// refused are, by pod uid, the local pods the rules select but that
	// cannot be enrolled: their address is another local pod's (claimAddrs).
	refused  map[string]error
	lastHint string
	// newSnapshot is closed (and replaced) when the source hands over a
	// new snapshot, waking CNI ADDs that wait for their pod to show up.
	// Only the source signals: waiters applying on their own must not wake
	// each other. podSynced likewise when a worker converged a pod.
	newSnapshot chan struct{}
	podSynced   chan struct{}
	reconciled  bool

	// annots are written by runAnnotations, never under mu.
	annots *annotations

	// listed is every local pod of the last snapshot applied, enrolled or
	// not, for the reconciler's listedPod (which runs under its locks, so
	// never takes mu).
	listed atomic.Pointer[localPods]
}

// localPods are the pods the source lists on this node, by uid, and their
// addresses.
type localPods struct {
	uids  map[string]bool
	addrs map[netip.Addr]bool
}

type desiredPod struct {
	pod loader.Pod
	w   *workload.Workload
	// ino is the inode of the namespace the CNI plugin reported pod.NetNS
	// as (0 without a report): a new sandbox may be given the path of the
	// pod's old one, and is another namespace all the same.
	ino uint64
}

// Retry backoff of a pod whose reconcile failed: doubling from the first
// to the last, per pod; the periodic full pass retries them all as well.
const (
	retryFirst = 200 * time.Millisecond
	retryMax   = 30 * time.Second
)

// New returns an agent; nothing runs until Run.
func New(cfg Config) *Agent {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	a := &Agent{
		cfg: cfg,
		log: cfg.Logger,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](retryFirst, retryMax),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "pods", MetricsProvider: newQueueMetrics(cfg.Registry)}),
		cniPods:     map[string]cniPod{},
		desired:     map[string]desiredPod{},
		newSnapshot: make(chan struct{}),
		podSynced:   make(chan struct{}),
		annots:      newAnnotations(),
	}
	a.waiting.Store(cfg.TakeNode != nil)
	if cfg.Reconciler != nil {
		cfg.Reconciler.SetForeignNetNS(a.foreignNetNS)
		cfg.Reconciler.SetListed(a.listedPod)
		cfg.Reconciler.SetRequeue(a.requeueMoved)
	}
	return a
}

// requeueMoved queues the pod uid, whose namespace path names a new
// namespace (Reconciler.requeueMoved), with its backoff reset: the path is
// seen as soon as the runtime makes the namespace, before the pod's
// addresses are on it, so the first try may fail; a pod that was failing
// for an earlier namespace at the path would otherwise wait out a long
// backoff (up to retryMax) for its own new sandbox, uncaptured meanwhile.
func (a *Agent) requeueMoved(uid string) {
	a.queue.Forget(uid)
	a.queue.Add(uid)
}

// Close waits for the pod workers to finish what they were doing when Run
// returned.
func (a *Agent) Close() {
	a.queue.ShutDown()
	a.workers.Wait()
}

// Reconciled reports whether the first full pass has finished (readiness).
func (a *Agent) Reconciled() (bool, string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.reconciled, "first full reconcile pending"
}

// Run applies every snapshot src delivers, runs the pod workers and the
// periodic full pass, until ctx is done (nil) or the source fails (its
// error). Call Close after it returned, before the loader closes.
func (a *Agent) Run(ctx context.Context, src source.Source) error {
	a.WriteStartupHint() // again, for an Agent run without a CNI socket served first
	snaps := make(chan source.Snapshot, 1)
	srcErr := make(chan error, 1)
	go func() {
		srcErr <- src.Run(ctx, func(s source.Snapshot) {
			// Latest wins: a reconcile always starts from the newest state.
			select {
			case <-snaps:
			default:
			}
			snaps <- s
		})
	}()
	// The queue stops taking work when Run returns, but Run does not wait
	// for a pod being worked on: a draining agent must close its listeners
	// at once. Close waits.
	defer a.queue.ShutDown()
	for range Workers() {
		a.workers.Go(func() {
			for a.processNext(ctx) {
			}
		})
	}
	if a.cfg.Annotator != nil {
		// Ends when Run returns, a failed source included: Close waits.
		actx, stop := context.WithCancel(ctx)
		defer stop()
		a.workers.Go(func() { a.runAnnotations(actx) })
	}
	ticker := time.NewTicker(a.cfg.ReconcilePeriod)
	defer ticker.Stop()
	for {
		full := false
		select {
		case <-ctx.Done():
			return nil
		case err := <-srcErr:
			return err
		case s := <-snaps:
			if a.waiting.Load() {
				if !complete(s) {
					continue
				}
				if err := a.cfg.TakeNode(ctx); err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return fmt.Errorf("take the node with the first snapshot: %w", err)
				}
				a.waiting.Store(false)
				a.log.Info("first snapshot from the source: this agent holds the node")
			}
			full = a.setSnapshot(s)
		case <-ticker.C:
			full = true
		}
		if a.checkClaim(ctx, true) {
			full = true // converge every pod the other agent changed
		}
		if a.applyLatest(ctx, full) && full {
			a.mu.Lock()
			a.reconciled = true
			a.mu.Unlock()
		}
	}
}

// complete reports whether s is state an agent may take the node over
// with (Config.TakeNode): the xDS source delivers the node's pods before
// istiod's first answer, so that a CNI ADD never waits on istiod, and such
// a snapshot has no policies yet (every connection of the node's pods
// would be refused until istiod answered).
func complete(s source.Snapshot) bool {
	return s.Compiled == nil || s.Compiled.Synced
}

// setSnapshot records the newest snapshot; it reports whether it was the
// first.
func (a *Agent) setSnapshot(s source.Snapshot) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	first := a.last == nil
	a.last = &s
	close(a.newSnapshot)
	a.newSnapshot = make(chan struct{})
	return first
}

// checkClaim yields once a successor holds the node: it enrolls and
// repairs; this agent keeps its policies current and serves the pods it has
// until SIGTERM drains them. It is called before each pass and before each
// queued pod is worked on, so that a pod queued (or backing off) before the
// successor claimed is not attached or detached by both; the loader's claim
// guard refuses any change that starts later still.
//
// A yielded agent takes the node back when the newer agent gave it up as it
// stopped (maps.Claim.Release) and none claimed it since: an upgrade rolled
// back, or a new agent that failed its start after claiming. Before, the
// older agent stayed yielded for as long as it ran: no pod was enrolled,
// detached or repaired on the node, and no CNI event answered. It reports
// whether it took the node back; only the main loop (reclaim set) tries,
// and then runs a full pass.
func (a *Agent) checkClaim(ctx context.Context, reclaim bool) bool {
	if a.cfg.Claim == nil || a.waiting.Load() || a.cfg.Claim.Held() {
		return false
	}
	a.claimMu.Lock()
	defer a.claimMu.Unlock()
	if a.cfg.Claim.Held() {
		return false // taken back while this one waited
	}
	if a.yield() {
		if a.cfg.OnYield != nil {
			a.cfg.OnYield()
		}
		a.log.Info("a newer agent holds the node: no more enrollment changes here, serving open connections until SIGTERM")
		return false
	}
	r, ok := a.cfg.Claim.(reclaimer)
	if !reclaim || !ok {
		return false
	}
	back, err := r.Reclaim(ctx)
	if err != nil {
		a.log.Warn("a newer agent may have given the node up; taking it back failed", "error", err)
		return false
	}
	if !back {
		return false
	}
	if a.cfg.OnReclaim != nil {
		a.cfg.OnReclaim()
	}
	a.mu.Lock()
	a.yielded = false
	a.annots.resume()
	a.mu.Unlock()
	a.log.Warn("the newer agent gave the node up with none after it (an upgrade rolled back?): this agent holds it again, enrolling and repairing its pods")
	return true
}

// yield records that a newer agent holds the node; it reports whether this
// call was the first to.
func (a *Agent) yield() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	first := !a.yielded
	a.yielded = true
	a.annots.handOver() // the newer agent annotates the pods now
	return first
}

// applyLatest applies the newest snapshot, if there is one.
func (a *Agent) applyLatest(ctx context.Context, full bool) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.last == nil {
		return false
	}
	a.apply(ctx, *a.last, full)
	return true
}

// watch returns channels closed when the next snapshot arrives and when a
// worker next converges a pod.
func (a *Agent) watch() (snapshot, pod <-chan struct{}) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.newSnapshot, a.podSynced
}

// applyAndWatch applies the newest snapshot and returns channels closed
// when the next snapshot arrives and when a worker next converges a pod,
// so a caller waiting for a change misses none.
func (a *Agent) applyAndWatch(ctx context.Context) (snapshot, pod <-chan struct{}) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.last != nil {
		a.apply(ctx, *a.last, false)
	}
	return a.newSnapshot, a.podSynced
}

// apply turns one snapshot into the tunnel's state and this node's desired
// enrollment. A full pass converges every pod at once (and repairs drift);
// otherwise the pods whose desired state changed are queued. Callers hold
// a.mu.
func (a *Agent) apply(ctx context.Context, s source.Snapshot, full bool) {
	if !a.yielded {
		a.writeHint(s) // the node's, written by the agent holding it
	}
	a.pruneCNIPods()
	ws, refused := a.claimAddrs(withCNIAddrs(s.Workloads, a.withAttachedPending(s.Workloads)))
	a.refused = refused
	for _, w := range ws {
		if err := refused[w.Key()]; err != nil {
			a.log.Error("pod refused", "error", err)
		}
	}
	ws, errs := a.localAddrsFirst(ws)
	for _, err := range errs {
		a.log.Error("address of a local pod claimed by another node's object", "error", err)
	}
	dir, errs := workload.NewDirectory(ws, workload.NodeLocalServices(s.Services, a.cfg.Node))
	for _, err := range errs {
		a.log.Error("workload skipped", "error", err)
	}
	a.cfg.Tunnel.Update(&tunnel.State{Dir: dir, PeerAuthentications: s.PeerAuthentications, AuthorizationPolicies: s.AuthorizationPolicies, Compiled: s.Compiled})
	local := dir.LocalPods(a.cfg.Node)
	before := a.setListed(local)
	desired := make(map[string]desiredPod, len(local))
	for _, w := range local {
		if w.Enrolled {
			path, ino := a.cniNetNS(w)
			p := loader.Pod{UID: w.Key(), Namespace: w.Namespace, Name: w.Name, NetNS: path, Addrs: w.Addrs,
				CaptureInbound: !w.BypassInbound, CaptureDNS: w.DNSCapture.Or(a.cfg.DNSCapture)}
			desired[p.UID] = desiredPod{pod: p, w: w, ino: ino}
		}
	}
	// Certificates of new identities are requested now, before the CNI ADD
	// is answered; those of identities whose last local pod left are dropped.
	a.cfg.Certs.Sync(enrolledIdentities(a.cfg.TrustDomain, local))
	if a.yielded {
		return
	}
	previous := a.desired
	a.desired = desired
	// Pods whose wanted state changed are queued, on a full pass too: a
	// worker that read the previous state before the pass converges again.
	for uid, d := range desired {
		if old, ok := previous[uid]; !ok || !samePod(old.pod, d.pod) || old.ino != d.ino || old.w.Redirected != d.w.Redirected {
			a.queue.Add(uid)
		}
	}
	for uid := range previous {
		if _, ok := desired[uid]; !ok {
			a.queue.Add(uid)
		}
	}
	a.queueListedAgain(before, desired)
	if full {
		want := make([]loader.Pod, 0, len(desired))
		for _, d := range desired {
			want = append(want, d.pod)
		}
		res := a.cfg.Reconciler.Reconcile(ctx, want, true)
		a.logResult(res)
		if len(res.Errors) > 0 {
			a.requeueUnconverged(desired)
		}
	}
	if a.cfg.Annotator != nil {
		a.syncAnnotations(dir)
	}
}

// setListed publishes the local pods the source lists now; it returns the
// previous listing (nil before the first).
func (a *Agent) setListed(local []*workload.Workload) *localPods {
	l := &localPods{uids: make(map[string]bool, len(local)), addrs: map[netip.Addr]bool{}}
	for _, w := range local {
		l.uids[w.Key()] = true
		for _, addr := range w.Addrs {
			l.addrs[addr.Unmap()] = true
		}
	}
	return a.listed.Swap(l)
}

// queueListedAgain queues the attached pods the source lists again (they
// were not in the listing before) while they are not to be enrolled: a
// pod sealed when it left its source (see Reconciler.seal), listed again
// opted out (or not enrollable yet), was not wanted before and is not
// now, so nothing else queues it, and the sealed pods' sweep leaves a
// listed pod to its own reconcile. Held sealed, it is served as itself
// again (the directory knows it), though out of the mesh, until the next
// full pass. Callers hold a.mu.
func (a *Agent) queueListedAgain(before *localPods, desired map[string]desiredPod) {
	now := a.listed.Load()
	if before == nil || now == nil || a.cfg.Loader == nil {
		return // the first pass converges every pod
	}
	for uid := range now.uids {
		if _, wanted := desired[uid]; wanted || before.uids[uid] {
			continue
		}
		if _, attached, err := a.cfg.Loader.PodState(uid); err != nil || attached {
			a.queue.Add(uid)
		}
	}
}

// listedPod reports whether the last snapshot lists the pod uid on this
// node, and whether a pod it lists has one of addrs. Before the first
// snapshot every pod counts as listed: nothing is known to be deleted.
func (a *Agent) listedPod(uid string, addrs []netip.Addr) (listed, addrTaken bool) {
	l := a.listed.Load()
	if l == nil {
		return true, false
	}
	if l.uids[uid] {
		return true, false
	}
	for _, addr := range addrs {
		if l.addrs[addr.Unmap()] {
			return false, true
		}
	}
	return false, false
}

// requeueUnconverged queues, with backoff, the pods a full pass left
// unlike their wanted state: wanted ones not attached as wanted, attached
// ones not wanted. They are retried on their own rather than at the next
// pass.
func (a *Agent) requeueUnconverged(desired map[string]desiredPod) {
	for uid, d := range desired {
		cur, ok, err := a.cfg.Loader.PodState(uid)
		if err != nil || !ok || !matches(cur, d.pod) {
			a.queue.AddRateLimited(uid)
		}
	}
	pods, err := a.cfg.Loader.Pods()
	if err != nil {
		return
	}
	for _, p := range pods {
		if _, ok := desired[p.Meta.UID]; !ok {
			a.queue.AddRateLimited(p.Meta.UID)
		}
	}
}

// matches reports whether cur is attached as want says; a want without a
// namespace path (no CNI report) takes the current one.
func matches(cur loader.PodState, want loader.Pod) bool {
	if want.NetNS == "" {
		want.NetNS = cur.Meta.NetNS
	}
	return cur.Matches(want)
}

func samePod(a, b loader.Pod) bool {
	return a.UID == b.UID && a.Namespace == b.Namespace && a.Name == b.Name && a.NetNS == b.NetNS &&
		a.CaptureInbound == b.CaptureInbound && a.CaptureDNS == b.CaptureDNS && slices.Equal(a.Addrs, b.Addrs)
}

// processNext converges the next queued pod; false once the queue shut
// down.
func (a *Agent) processNext(ctx context.Context) bool {
	uid, quit := a.queue.Get()
	if quit {
		return false
	}
	defer a.queue.Done(uid)
	if ctx.Err() != nil {
		// Shutting down: a draining agent changes no enrollment.
		a.queue.Forget(uid)
		return true
	}
	a.checkClaim(ctx, false)
	a.mu.Lock()
	d, want := a.desired[uid]
	yielded := a.yielded
	a.mu.Unlock()
	if yielded {
		a.queue.Forget(uid)
		return true
	}
	var wp *loader.Pod
	if want {
		p := d.pod
		if d.ino != 0 && !namesInode(p.NetNS, d.ino) {
			// The CNI report named another namespace than the path names
			// now (the sandbox went, and its path was given to another:
			// requeueMoved queues such a pod at once, before any apply
			// drops the report). What is there now is judged as any
			// namespace found by address is (foreignNetNS), never taken
			// on the report's word: it may be another pod's.
			p.NetNS = ""
		}
		wp = &p
	}
	res := a.cfg.Reconciler.ReconcilePod(ctx, uid, wp)
	a.logResult(res)
	if len(res.Errors) > 0 && ctx.Err() == nil {
		a.queue.AddRateLimited(uid)
	} else {
		a.queue.Forget(uid)
	}
	if a.cfg.Annotator != nil {
		a.annotateConverged(uid, d, want, res)
	}
	a.mu.Lock()
	close(a.podSynced)
	a.podSynced = make(chan struct{})
	a.mu.Unlock()
	return true
}

// converged reports whether the pod uid is attached as it is wanted now
// (the namespace the CNI plugin reported included, by inode: the path
// alone may name a new sandbox while the pod is attached in the old one).
func (a *Agent) converged(uid string) bool {
	a.mu.Lock()
	d, ok := a.desired[uid]
	a.mu.Unlock()
	if !ok {
		return false
	}
	cur, attached, err := a.cfg.Loader.PodState(uid)
	if err != nil || !attached || !matches(cur, d.pod) {
		return false
	}
	return d.ino == 0 || a.attachedIno(cur) == d.ino
}

// annotateConverged makes the redirection annotation of the pod a worker
// just converged say what is attached now: set once it is attached, removed
// once it is detached (unless the pod is being deleted).
func (a *Agent) annotateConverged(uid string, d desiredPod, want bool, res Result) {
	if want && len(res.Errors) == 0 && !d.w.Redirected {
		a.annots.set(annotation{d.w.Namespace, d.w.Name, d.w.UID, true})
	}
	dir := a.cfg.Tunnel.State().Dir
	for _, name := range res.Detached {
		ns, n, _ := strings.Cut(name, "/")
		// Only the pod that left: a new pod of the same name (a
		// StatefulSet's) keeps its annotation.
		if w, ok := dir.Pod(ns, n); ok && w.Key() == uid && w.Redirected && !w.Terminating {
			a.annots.set(annotation{ns, n, w.UID, false})
		}
	}
}

func (a *Agent) logResult(res Result) {
	for _, p := range res.Attached {
		a.log.Info("pod enrolled", "pod", p)
	}
	for _, p := range res.Detached {
		a.log.Info("pod unenrolled", "pod", p)
	}
	for _, p := range res.Sealed {
		a.log.Warn("pod sealed: gone from its source while its network namespace lives; its connections are refused until the namespace goes", "pod", p)
	}
	for _, p := range res.Repaired {
		a.log.Warn("pod repaired", "pod", p)
	}
	for _, err := range res.Errors {
		a.log.Error("reconcile", "error", err)
	}
}

// syncAnnotations makes ambient.istio.io/redirection on this node's pods say
// what is attached: "enabled" exactly on the pods the loader redirects.
func (a *Agent) syncAnnotations(dir *workload.Directory) {
	pods, err := a.cfg.Loader.Pods()
	if err != nil {
		a.log.Error("read attached pods", "error", err)
		return
	}
	attached := map[string]bool{}
	for _, p := range pods {
		attached[p.Meta.UID] = true
	}
	var writes []annotation
	for _, w := range dir.LocalPods(a.cfg.Node) {
		want := attached[w.Key()]
		if want == w.Redirected || (!want && w.Terminating) {
			continue
		}
		writes = append(writes, annotation{w.Namespace, w.Name, w.UID, want})
	}
	a.annots.set(writes...)
}

// enrolledIdentities are the identities of the enrolled pods among ws.
func enrolledIdentities(trustDomain string, ws []*workload.Workload) []identity.ID {
	var ids []identity.ID
	for _, w := range ws {
		if w.Enrolled {
			ids = append(ids, identity.ID{TrustDomain: trustDomain, Namespace: w.Namespace, ServiceAccount: w.ServiceAccount})
		}
	}
	return ids
}

// namesInode reports whether path names the namespace with inode ino now.
func namesInode(path string, ino uint64) bool {
	cur, err := netns.Inode(path)
	return err == nil && cur == ino
}
