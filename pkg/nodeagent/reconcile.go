package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
)

// PodServer is the tunnel's side of enrollment: it opens and closes a pod's
// listeners. The node agent never imports the tunnel; the binary wires the two.
type PodServer interface {
	// ServePod opens (or keeps) the pod's tunnel listeners inside netnsPath.
	ServePod(ctx context.Context, uid, netnsPath string, addrs []netip.Addr) error
	// StopPod closes the pod's listeners. Unknown uids are fine.
	StopPod(ctx context.Context, uid string) error
	// ServedPods lists the uids that have listeners.
	ServedPods() []string
	// PodReady reports whether the pod uid has its listeners: one lookup,
	// where ServedPods lists every pod.
	PodReady(uid string) bool
}

// NetNSFinder maps addresses to network namespace paths (netns.Finder).
type NetNSFinder interface {
	// ScanFor maps addresses to the paths of the namespaces that hold them.
	// It may stop once every address in want is found, and leave others out.
	ScanFor(want []netip.Addr) (map[netip.Addr]string, error)
}

// Reconciler keeps what is attached (pinned links, enrollment entries,
// listeners) equal to the pods that should be enrolled on this node.
type Reconciler struct {
	loader *loader.Loader
	server PodServer
	finder NetNSFinder
	log    *slog.Logger

	// mu: a full Reconcile or a link repair holds it alone; ReconcilePod
	// calls share it, each holding its pod's lock (podLocks).
	mu       sync.RWMutex
	podMu    sync.Mutex
	podLocks map[string]*podLock

	// nsMu guards ns: the namespace each pod was last attached in, by path
	// and inode, as this process saw it. A pod not in it (first pass after
	// a start) is attached again in place once; after that a pod whose path
	// now names another namespace is attached again.
	nsMu sync.Mutex
	ns   map[string]nsRecord

	statsMu sync.Mutex // separate, so a scrape never waits for a reconcile
	stats   ReconcileStats

	// foreignNetNS, if set, says why a namespace found by a pod's address
	// is not that pod's (SetForeignNetNS), or "".
	foreignNetNS func(key, uid, path string) string

	// listed, if set, says whether the source lists the pod uid on this
	// node (enrolled or not) and whether another pod it lists has one of
	// addrs (SetListed). A pod no longer wanted and not listed was deleted,
	// not opted out, and is sealed while its namespace lives (see seal).
	// Without it every pod no longer wanted is detached.
	listed func(uid string, addrs []netip.Addr) (listed, addrTaken bool)
	// sealed are the pods held sealed (under nsMu), by uid; at most
	// maxSealed after a sweep.
	sealed    map[string]sealRecord
	maxSealed int
	// sweepBatch bounds the sealed pods one link check detaches.
	sweepBatch int

	// requeue, if set, hands a pod to its own reconcile (SetRequeue).
	requeue func(uid string)
}

type sealRecord struct {
	name  string // namespace/name
	since time.Time
}

// MaxSealed bounds the pods held sealed at once: past it the longest held
// is detached (a runtime that leaks namespaces would otherwise fill the
// pod slots, MAX_PODS 4096, one leaked sandbox at a time).
const MaxSealed = 1024

// sealedSweepBatch is how many sealed pods one link check detaches at
// most: a detach takes some 20 ms of kernel work, and the pods' links are
// checked after the sweep, so a hundred sealed pods whose namespaces went
// at once (a namespace's pods force-deleted) held every link's check (and
// repair) for two seconds.
const sealedSweepBatch = 16

// SetListed sets the check that tells a pod deleted from its source from
// one that opted out (the Agent's, which knows every pod the source lists
// on the node). Call it before the first reconcile.
func (r *Reconciler) SetListed(f func(uid string, addrs []netip.Addr) (listed, addrTaken bool)) {
	r.listed = f
}

// SetRequeue sets how the link check hands a pod to its own reconcile
// (the Agent's work queue) when its path names another namespace than the
// one it was attached in (see requeueMoved). Call it before
// RepairLinks.
func (r *Reconciler) SetRequeue(f func(uid string)) { r.requeue = f }

// SetForeignNetNS sets the check a namespace found by a pod's address must
// pass before the pod is attached in it (the Agent's, which knows the CNI
// reports). Call it before the first reconcile.
func (r *Reconciler) SetForeignNetNS(f func(key, uid, path string) string) { r.foreignNetNS = f }

// netnsByAddr is the namespace holding one of p's addresses in scan, or an
// error: none does, or the one that does is not p's (foreignNetNS).
func (r *Reconciler) netnsByAddr(scan map[netip.Addr]string, p loader.Pod) (string, error) {
	path := findNetNS(scan, p.Addrs)
	if path == "" {
		return "", fmt.Errorf("pod %s: no network namespace owns its addresses %v", p, p.Addrs)
	}
	if r.foreignNetNS != nil {
		if why := r.foreignNetNS(p.Namespace+"/"+p.Name, p.UID, path); why != "" {
			return "", fmt.Errorf("pod %s: the network namespace %s holding its addresses %v is not the pod's: %s; waiting for its CNI ADD", p, path, p.Addrs, why)
		}
	}
	return path, nil
}

type nsRecord struct {
	name string // namespace/name, for logs
	path string
	ino  uint64
	// movedTo: the inode of the other namespace requeueMoved last found
	// at the path, and queued the pod for (0: none). Each new one is
	// queued again: the pod's reconcile may have failed for the last
	// (backing off), and a later one be its own sandbox.
	movedTo uint64
}

// ReconcileStats are cumulative counts, exported as metrics.
type ReconcileStats struct {
	Runs, Errors, Repairs, Attached, Detached uint64
	// LinkRepins counts link pins put back by RepairLinks.
	LinkRepins uint64
	// NetNSMoved counts pods queued because their namespace path named
	// another namespace (requeueMoved).
	NetNSMoved uint64
	Enrolled   int
	// Sealed is how many pods are held sealed now (see seal).
	Sealed int
}

// Result says what one reconcile did.
type Result struct {
	Attached, Detached, Repaired, Sealed []string // pod namespace/name
	Errors                               []error  // one per pod that could not converge
}

// NewReconciler wires the loader to a pod server and a namespace finder.
func NewReconciler(l *loader.Loader, s PodServer, f NetNSFinder, log *slog.Logger) *Reconciler {
	if log == nil {
		log = slog.Default()
	}
	return &Reconciler{loader: l, server: s, finder: f, log: log, ns: map[string]nsRecord{}, podLocks: map[string]*podLock{},
		sealed: map[string]sealRecord{}, maxSealed: MaxSealed, sweepBatch: sealedSweepBatch}
}

// Stats returns the cumulative counts.
func (r *Reconciler) Stats() ReconcileStats {
	r.statsMu.Lock()
	st := r.stats
	r.statsMu.Unlock()
	r.nsMu.Lock()
	st.Sealed = len(r.sealed)
	r.nsMu.Unlock()
	return st
}

// Workers bounds how many pods one reconcile attaches or detaches at once:
// each mostly waits (namespace switches, netlink, the kernel's RCU grace
// period per new tcx link), so more than the CPUs, but bounded.
func Workers() int { return min(16, max(4, 4*runtime.GOMAXPROCS(0))) }

// Reconcile converges on want, the pods to enroll on this node. A pod with no
// NetNS gets it from its current attachment (while that path still names the
// namespace the pod was attached in) or from the finder, in one lookup for
// all such pods. Every pod is checked cheaply: its recorded metadata, its
// enrollment entries, its held links (attached and pinned), its namespace's
// inode, and with full set its host-probe pins; only pods that drifted are
// attached again (in place), and after a start each pod once. Up to
// Workers() pods are worked on at a time. Per-pod failures are collected and
// never stop the others.
func (r *Reconciler) Reconcile(ctx context.Context, want []loader.Pod, full bool) Result {
	r.mu.Lock()
	defer r.mu.Unlock()
	res, add := newResult()

	current, err := r.loader.Pods()
	if err != nil {
		res.Errors = append(res.Errors, fmt.Errorf("read attached pods: %w", err))
		r.record(*res, 0)
		return *res
	}
	attached := map[string]loader.PodState{}
	for _, p := range current {
		attached[p.Meta.UID] = p
	}
	r.forgetUnattached(attached)
	served := map[string]bool{}
	for _, uid := range r.server.ServedPods() {
		served[uid] = true
	}
	wanted := map[string]bool{}

	// Pods without a namespace take their attachment's; the others are
	// looked up by address, all in one lookup.
	want = slices.Clone(want)
	var lookup []netip.Addr
	for i := range want {
		p := &want[i]
		if cur, ok := attached[p.UID]; p.NetNS == "" && ok && r.sameNS(p.UID, cur.Meta.NetNS, true) {
			p.NetNS = cur.Meta.NetNS
		}
		if p.NetNS == "" {
			lookup = append(lookup, p.Addrs...)
		}
	}
	var scan map[netip.Addr]string
	if len(lookup) > 0 {
		if scan, err = r.finder.ScanFor(lookup); err != nil {
			r.log.WarnContext(ctx, "network namespace scan incomplete", "error", err)
		}
	}

	// Pods that leave go first: a new pod may have been given a leaving
	// pod's address, and the leaving pod's detach deletes that address's
	// entry.
	for _, p := range want {
		wanted[p.UID] = true
	}
	var jobs []func()
	for uid, cur := range attached {
		if wanted[uid] {
			continue
		}
		delete(served, uid)
		jobs = append(jobs, func() { r.leave(ctx, cur, add) })
	}
	for uid := range served {
		if !wanted[uid] {
			jobs = append(jobs, func() {
				if err := r.server.StopPod(ctx, uid); err != nil {
					add(func(res *Result) { res.Errors = append(res.Errors, err) })
				}
			})
		}
	}
	runBounded(Workers(), jobs)

	jobs = jobs[:0]
	for _, p := range want {
		cur, isAttached := attached[p.UID]
		if p.NetNS == "" {
			if p.NetNS, err = r.netnsByAddr(scan, p); err != nil {
				res.Errors = append(res.Errors, err)
				continue
			}
		}
		// kernelOK: metadata as wanted, entries present, links attached
		// and pinned. Listeners live in this process and are checked
		// separately; verified says this process attached the pod in the
		// namespace the path names now.
		kernelOK := isAttached && cur.Matches(p) && r.loader.KernelOK(cur, full)
		verified := r.sameNS(p.UID, p.NetNS, false)
		if kernelOK && verified && served[p.UID] && !r.isSealed(p.UID) {
			continue
		}
		jobs = append(jobs, func() { r.converge(ctx, p, isAttached, kernelOK && verified, add) })
	}
	runBounded(Workers(), jobs)
	enrolled := 0
	if now, err := r.loader.Pods(); err == nil {
		enrolled = len(now)
	}
	r.record(*res, enrolled)
	return *res
}

// converge serves p's listeners and, unless kernelOK (its kernel state is
// right and this process attached it in the namespace its path names),
// attaches it (in place when isAttached), adding what it did to the result.
func (r *Reconciler) converge(ctx context.Context, p loader.Pod, isAttached, kernelOK bool, add func(func(*Result))) {
	if err := notPodNetNS(p.NetNS); err != nil {
		add(func(res *Result) { res.Errors = append(res.Errors, fmt.Errorf("pod %s: %w", p, err)) })
		return
	}
	if err := r.server.ServePod(ctx, p.UID, p.NetNS, p.Addrs); err != nil {
		add(func(res *Result) {
			res.Errors = append(res.Errors, fmt.Errorf("pod %s: open tunnel listeners: %w", p, err))
		})
		return
	}
	r.unseal(p.UID)
	if kernelOK {
		return
	}
	// Idempotent: for a pod that is right this rewrites the same state
	// (rules, routes and sysctls included).
	if _, err := r.loader.AttachPod(ctx, p); err != nil {
		add(func(res *Result) { res.Errors = append(res.Errors, err) })
		if !isAttached {
			_ = r.server.StopPod(ctx, p.UID)
		}
		return
	}
	r.recordNS(p.UID, p.Namespace+"/"+p.Name, p.NetNS)
	if isAttached {
		add(func(res *Result) { res.Repaired = append(res.Repaired, p.String()) })
	} else {
		add(func(res *Result) { res.Attached = append(res.Attached, p.String()) })
	}
}

// remove closes the pod uid's listeners and ends its connections, then
// detaches it (name is namespace/name, for the result). The tunnel goes
// first: a captured connection's app socket keeps its tuple when the
// capture goes, and what it sends after the detach (in the stop's grace,
// or from CLOSE_WAIT once the tunnel closed its side) leaves by the pod's
// interface as it is, in plaintext. With the capture still in place it
// reaches the tunnel's sockets, or is dropped, until the stop has reset
// it. An app socket whose relay had ended before (closed with a FIN, in
// CLOSE_WAIT) has no relay for the stop to reset: the detach ends it, and
// every other captured socket of the pod, before the capture goes
// (loader.DetachPod). New connections of the pod meanwhile find no
// listener and are dropped (drop_no_listener); their SYN's retransmission
// goes out once the pod is detached.
func (r *Reconciler) remove(ctx context.Context, uid, name string, add func(func(*Result))) {
	if err := r.server.StopPod(ctx, uid); err != nil {
		add(func(res *Result) {
			res.Errors = append(res.Errors, fmt.Errorf("pod %s: close tunnel listeners: %w", name, err))
		})
		return
	}
	if err := r.loader.DetachPod(ctx, uid); err != nil {
		add(func(res *Result) { res.Errors = append(res.Errors, err) })
		return
	}
	r.forgetNS(uid)
	add(func(res *Result) { res.Detached = append(res.Detached, name) })
}

// leave ends the attached pod cur, no longer wanted: sealed while it is
// gone from its source, holds no address a listed pod has and its
// namespace is still the one it was attached in; detached otherwise.
func (r *Reconciler) leave(ctx context.Context, cur loader.PodState, add func(func(*Result))) {
	if r.holdSealed(cur) {
		r.seal(ctx, cur, add)
		return
	}
	r.remove(ctx, cur.Meta.UID, cur.Meta.Namespace+"/"+cur.Meta.Name, add)
}

func (r *Reconciler) holdSealed(cur loader.PodState) bool {
	if r.listed == nil {
		return false
	}
	listed, taken := r.listed(cur.Meta.UID, cur.Meta.Addrs)
	return !listed && !taken && r.sameNS(cur.Meta.UID, cur.Meta.NetNS, true)
}

// seal ends the pod's connections, as remove does, and keeps its capture.
// A pod leaves its source before its containers stop when it is
// force-deleted (--grace-period=0 --force removes the object at once; the
// kubelet kills the containers after) or dropped from a manifest;
// detached, what it opens meanwhile would leave unmeshed, in plaintext.
// Sealed, it is served again by listeners that refuse everything: the pod
// is no workload of the directory any more, so the tunnel resets what it
// opens (fail_closed unknown_source) and refuses what comes to it
// (unknown_destination), at once, so clients of a stale endpoint move on
// rather than wait out their connect timeout. Istio's node agent likewise
// leaves a deleted pod's rules in its namespace, its traffic failing
// closed at a ztunnel that no longer serves it. A sealed pod is detached
// once its namespace is gone or replaced, a listed pod takes one of its
// addresses, or it is the longest held of more than MaxSealed
// (sweepSealed, every LinkCheckPeriod, and every full pass); it is served
// as itself again if the source lists it again.
func (r *Reconciler) seal(ctx context.Context, cur loader.PodState, add func(func(*Result))) {
	uid, name := cur.Meta.UID, cur.Meta.Namespace+"/"+cur.Meta.Name
	r.nsMu.Lock()
	_, was := r.sealed[uid]
	r.nsMu.Unlock()
	served := r.server.PodReady(uid)
	if was && served {
		return
	}
	if !was {
		// Its connections go with its listeners: what they carried was
		// admitted for a pod that no longer exists.
		if err := r.server.StopPod(ctx, uid); err != nil {
			add(func(res *Result) {
				res.Errors = append(res.Errors, fmt.Errorf("pod %s: close tunnel listeners: %w", name, err))
			})
			return
		}
		r.nsMu.Lock()
		r.sealed[uid] = sealRecord{name: name, since: time.Now()}
		r.nsMu.Unlock()
		add(func(res *Result) { res.Sealed = append(res.Sealed, name) })
	}
	// Without listeners its connections would be dropped, not refused:
	// still closed, only slower for everyone. A failure is retried by the
	// next pass.
	if err := r.server.ServePod(ctx, uid, cur.Meta.NetNS, cur.Meta.Addrs); err != nil {
		add(func(res *Result) {
			res.Errors = append(res.Errors, fmt.Errorf("sealed pod %s: open refusing listeners: %w", name, err))
		})
	}
}

// isSealed reports whether the pod uid is sealed: served, but only by
// listeners that refuse, which a pod wanted again must not be taken for.
func (r *Reconciler) isSealed(uid string) bool {
	r.nsMu.Lock()
	defer r.nsMu.Unlock()
	_, ok := r.sealed[uid]
	return ok
}

func (r *Reconciler) unseal(uid string) {
	r.nsMu.Lock()
	defer r.nsMu.Unlock()
	delete(r.sealed, uid)
}

// sweepSealed detaches the sealed pods that are no longer to be held (see
// seal), the longest held first past the bound (MaxSealed). One the source
// lists again is left to its own reconcile (served again, or detached if it
// opted out), which the agent queues when the pod comes back to its
// listing.
//
// It runs at every link check while any pod is sealed, so it decides
// without the reconcile lock, and detaches each pod as ReconcilePod would:
// beside other pods' reconciles, under the pod's own lock, the decision
// taken again there. Holding the exclusive lock at every check stalled
// every pod's reconcile (a new pod's CNI ADD among them) behind the
// slowest one running, a second's grace of an unenrollment say, at every
// tick for as long as a pod was sealed.
func (r *Reconciler) sweepSealed(ctx context.Context) {
	r.nsMu.Lock()
	if len(r.sealed) == 0 {
		r.nsMu.Unlock()
		return
	}
	uids := make([]string, 0, len(r.sealed))
	for uid := range r.sealed {
		uids = append(uids, uid)
	}
	slices.SortFunc(uids, func(a, b string) int { return r.sealed[a].since.Compare(r.sealed[b].since) })
	r.nsMu.Unlock()

	type leaving struct{ uid, why string }
	var detach []leaving
	for i, uid := range uids {
		if why := r.unsealWhy(uid, i < len(uids)-r.maxSealed); why != "" {
			detach = append(detach, leaving{uid, why})
		}
	}
	if len(detach) == 0 {
		return
	}
	// A detach waits for the kernel (some 20 ms, not shortened by doing
	// several at once), and every pod's links wait for this check: a few
	// per check, the longest sealed first; the full pass detaches the rest
	// as well.
	if len(detach) > r.sweepBatch {
		detach = detach[:r.sweepBatch]
	}
	res, add := newResult()
	for _, d := range detach {
		if !r.detachSealed(ctx, d.uid, d.why, add) {
			break // a newer agent holds the node: it detaches them
		}
	}
	for _, err := range res.Errors {
		r.log.ErrorContext(ctx, "detach sealed pod", "error", err)
	}
	r.record(*res, -1)
}

// overBound is the reason given for a sealed pod detached past MaxSealed;
// detachedMeanwhile is a sealed pod no longer attached, only forgotten.
const (
	overBound         = "over the bound"
	detachedMeanwhile = "detached meanwhile"
)

// unsealWhy says why the sealed pod uid is to be detached now, or "": it
// is over the bound (overLimit), a pod the source lists has one of its
// addresses, or its namespace is gone; or detachedMeanwhile.
func (r *Reconciler) unsealWhy(uid string, overLimit bool) string {
	cur, ok, err := r.loader.PodState(uid)
	switch {
	case err != nil:
		return ""
	case !ok:
		return detachedMeanwhile
	}
	listed, taken := r.listed(uid, cur.Meta.Addrs)
	switch {
	case listed:
		// Its own reconcile serves it again, or detaches it: detached
		// here, even past the bound, a pod wanted again would run
		// uncaptured until that reconcile.
		return ""
	case overLimit:
		return overBound
	case taken:
		return "a pod the source lists has its address"
	case !r.sameNS(uid, cur.Meta.NetNS, true):
		return "its network namespace is gone"
	}
	return ""
}

// detachSealed detaches the sealed pod uid, as ReconcilePod would (beside
// other pods, never beside a full pass or the pod's own reconcile), if it
// is still sealed and still to be detached then. It reports false when a
// newer agent holds the node.
func (r *Reconciler) detachSealed(ctx context.Context, uid, why string, add func(func(*Result))) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	unlock := r.lockPod(uid)
	defer unlock()
	if !r.isSealed(uid) {
		return true // served again, or detached, meanwhile
	}
	if why = r.unsealWhy(uid, why == overBound); why == "" {
		return true
	}
	cur, ok, err := r.loader.PodState(uid)
	if err != nil {
		return true
	}
	if !ok {
		r.forgetNS(uid)
		return true
	}
	name := cur.Meta.Namespace + "/" + cur.Meta.Name
	if why == overBound {
		r.log.WarnContext(ctx, "more pods sealed than the bound: the longest sealed is detached and its traffic no longer captured", "pod", name, "bound", r.maxSealed)
	}
	held := true
	res, own := newResult()
	r.remove(ctx, uid, name, own)
	for _, err := range res.Errors {
		if errors.Is(err, maps.ErrNotHeld) {
			held = false
			continue
		}
		add(func(res *Result) { res.Errors = append(res.Errors, err) })
	}
	if len(res.Detached) > 0 {
		r.log.InfoContext(ctx, "sealed pod unenrolled", "pod", name, "reason", why)
		add(func(out *Result) { out.Detached = append(out.Detached, res.Detached...) })
	}
	return held
}

// ReconcilePod converges one pod: want is how it should be attached, or
// nil when it should not be. It is Reconcile for a single pod, for a work
// queue that handles each pod on its own (see nodeagent): pods are
// reconciled concurrently with each other, never with a full Reconcile or
// a link repair, and one pod never twice at once. It never touches another
// pod (enrollment entries are removed only by the pod that owns them).
func (r *Reconciler) ReconcilePod(ctx context.Context, uid string, want *loader.Pod) Result {
	r.mu.RLock()
	defer r.mu.RUnlock()
	unlock := r.lockPod(uid)
	defer unlock()
	res, add := newResult()
	cur, isAttached, err := r.loader.PodState(uid)
	if err != nil {
		res.Errors = append(res.Errors, fmt.Errorf("read attached pods: %w", err))
		r.record(*res, -1)
		return *res
	}
	served := r.server.PodReady(uid)
	switch {
	case want == nil && isAttached:
		r.leave(ctx, cur, add)
	case want == nil:
		if served {
			if err := r.server.StopPod(ctx, uid); err != nil {
				res.Errors = append(res.Errors, err)
			}
		}
		// Nothing of it is attached (a failed attach in a new namespace
		// undoes the pod whole): no namespace record or seal to keep.
		r.forgetNS(uid)
	case want != nil:
		p := *want
		if p.NetNS == "" && isAttached && r.sameNS(p.UID, cur.Meta.NetNS, true) {
			p.NetNS = cur.Meta.NetNS
		}
		if p.NetNS == "" {
			scan, err := r.finder.ScanFor(p.Addrs)
			if err != nil {
				r.log.WarnContext(ctx, "network namespace scan incomplete", "error", err)
			}
			if p.NetNS, err = r.netnsByAddr(scan, p); err != nil {
				res.Errors = append(res.Errors, err)
				break
			}
		}
		kernelOK := isAttached && cur.Matches(p) && r.loader.KernelOK(cur, false) && r.sameNS(p.UID, p.NetNS, false)
		if !(kernelOK && served) || r.isSealed(uid) {
			r.converge(ctx, p, isAttached, kernelOK, add)
		}
	}
	r.record(*res, -1)
	return *res
}

// newResult returns an empty result and a function that adds to it,
// which concurrent jobs may call.
func newResult() (*Result, func(func(*Result))) {
	res := &Result{}
	var mu sync.Mutex
	return res, func(f func(*Result)) {
		mu.Lock()
		defer mu.Unlock()
		f(res)
	}
}

// lockPod serialises work on one pod; it returns the unlock.
func (r *Reconciler) lockPod(uid string) func() {
	r.podMu.Lock()
	m, ok := r.podLocks[uid]
	if !ok {
		m = &podLock{}
		r.podLocks[uid] = m
	}
	m.users++
	r.podMu.Unlock()
	m.Lock()
	return func() {
		m.Unlock()
		r.podMu.Lock()
		if m.users--; m.users == 0 {
			delete(r.podLocks, uid)
		}
		r.podMu.Unlock()
	}
}

type podLock struct {
	sync.Mutex
	users int // guarded by Reconciler.podMu
}

// runBounded runs jobs, at most n at a time, and waits for all of them.
func runBounded(n int, jobs []func()) {
	if len(jobs) == 1 {
		jobs[0]()
		return
	}
	sem := make(chan struct{}, n)
	var wg sync.WaitGroup
	for _, job := range jobs {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			job()
		}()
	}
	wg.Wait()
}

// sameNS reports whether path still names the namespace the pod was last
// attached in by this process. With unknownOK, a pod this process has not
// attached yet passes when the path names the namespace the pinned state
// says it was attached in (its first pass verifies the rest), or, with no
// such record, when the path exists: a path can be given to a new sandbox,
// another pod's even, while no agent runs.
func (r *Reconciler) sameNS(uid, path string, unknownOK bool) bool {
	r.nsMu.Lock()
	rec, ok := r.ns[uid]
	r.nsMu.Unlock()
	if !ok {
		return unknownOK && pathExists(path) && r.loader.AttachedAt(uid, path)
	}
	if rec.path != path {
		return false
	}
	ino, err := netns.Inode(path)
	return err == nil && ino == rec.ino
}

func (r *Reconciler) recordNS(uid, name, path string) {
	ino, err := netns.Inode(path)
	r.nsMu.Lock()
	defer r.nsMu.Unlock()
	if err != nil {
		delete(r.ns, uid)
		return
	}
	r.ns[uid] = nsRecord{name: name, path: path, ino: ino}
}

// forgetUnattached drops the namespace records and seals of pods not
// attached: a pod the loader undid on its own (a failed attach in a new
// namespace) left them behind, one per such pod for good, its path statted
// at every link check. Callers hold r.mu.
func (r *Reconciler) forgetUnattached(attached map[string]loader.PodState) {
	r.nsMu.Lock()
	defer r.nsMu.Unlock()
	for uid := range r.ns {
		if _, ok := attached[uid]; !ok {
			delete(r.ns, uid)
		}
	}
	for uid := range r.sealed {
		if _, ok := attached[uid]; !ok {
			delete(r.sealed, uid)
		}
	}
}

func (r *Reconciler) forgetNS(uid string) {
	r.nsMu.Lock()
	defer r.nsMu.Unlock()
	delete(r.ns, uid)
	delete(r.sealed, uid)
}

// LinkCheckPeriod is how often the agent checks that every pod's links are
// attached (RepairLinks): one bpf(2) call per link, a stat of each pod's
// namespace path (requeueMoved) and of each sealed pod's (sweepSealed),
// about 5 µs a pod, 10 with every pod sealed (BenchmarkLinkCheckTick: 200
// pods cost 0.15 to 0.26 % of a CPU at this period), and a
// detached link replaced within a second.
const LinkCheckPeriod = 750 * time.Millisecond

// pinSweep: this often RepairLinks also stats every pin, in case an
// inotify event was lost.
const pinSweep = 10 * time.Second

// RepairLinks keeps every pod's links in place until ctx ends. A removed
// link pin is pinned again as soon as inotify reports it (the loader holds
// the link, so capture never stopped); a link detached underneath (bpftool
// link detach) is seen by a check every period, and its pod is attached
// again from its recorded metadata, as is a pod whose host-probe pin was
// removed (those links are not held: kubelet probes fail, closed, until
// then). Without inotify, every check also stats the pins.
func (r *Reconciler) RepairLinks(ctx context.Context, period time.Duration) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		r.log.WarnContext(ctx, "no inotify for link pins; checking them by stat every period", "error", err)
	}
	var events <-chan fsnotify.Event
	var werrs <-chan error
	if w != nil {
		defer w.Close()
		events, werrs = w.Events, w.Errors
	}
	watched := map[string]bool{}
	var gen uint64
	t := time.NewTicker(period)
	defer t.Stop()
	for tick := 1; ; {
		pins := w == nil
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			if !ev.Has(fsnotify.Remove) && !ev.Has(fsnotify.Rename) {
				continue
			}
			if watched[ev.Name] {
				// A watched directory went: watch it again once it is back.
				delete(watched, ev.Name)
				gen = 0
			}
			pins = true
		case err, ok := <-werrs:
			if !ok {
				werrs = nil
				continue
			}
			r.log.WarnContext(ctx, "inotify on link pins", "error", err)
			pins = true
		case <-t.C:
			tick++
			if w != nil {
				var settled bool
				gen, settled = r.syncWatches(w, watched, gen)
				pins = !settled || tick%max(1, int(pinSweep/period)) == 0
			}
		}
		r.repairLinks(ctx, pins)
	}
}

// syncWatches watches the pods directory and every held pod's pin
// directory, and no others. settled is false when a directory could not be
// watched (it is gone: the pin check recreates it) or has just been: a pin
// removed before its watch existed sent no event, so the caller checks the
// pins then.
func (r *Reconciler) syncWatches(w *fsnotify.Watcher, watched map[string]bool, gen uint64) (newGen uint64, settled bool) {
	dirs, newGen, changed := r.loader.HeldDirs(gen)
	if !changed {
		return gen, true
	}
	want := map[string]bool{filepath.Join(r.loader.PinRoot(), "pods"): true}
	for _, d := range dirs {
		want[d] = true
	}
	settled = true
	complete := true
	for d := range want {
		if watched[d] {
			continue
		}
		settled = false
		if err := w.Add(d); err != nil {
			complete = false
			continue
		}
		watched[d] = true
	}
	for d := range watched {
		if !want[d] {
			_ = w.Remove(d)
			delete(watched, d)
		}
	}
	if !complete {
		newGen = 0 // try again next period
	}
	return newGen, settled
}

func (r *Reconciler) repairLinks(ctx context.Context, pins bool) {
	r.sweepSealed(ctx)
	r.requeueMoved(ctx)
	c := r.loader.CheckLinks(ctx, pins)
	if pins {
		// The host-probe links are not held: a removed pin detached one,
		// and its pod is attached again (which attaches them anew).
		c.Broken = append(c.Broken, r.loader.HostProbeMissing()...)
	}
	for _, err := range c.Errors {
		if errors.Is(err, maps.ErrNotHeld) {
			// A newer agent holds the node and repairs its pods.
			return
		}
		r.log.ErrorContext(ctx, "restore link pin", "error", err)
	}
	if c.Repinned > 0 {
		r.log.WarnContext(ctx, "link pins were removed underneath the agent; pinned again", "links", c.Repinned)
	}
	var repaired, errs uint64
	if len(c.Broken) > 0 {
		// Under the reconcile lock: a pod being detached is not re-attached.
		r.mu.Lock()
		for _, id := range c.Broken {
			meta, ok := r.loader.PodMeta(id)
			if !ok || !pathExists(meta.NetNS) {
				// Detached, or its namespace is gone (the pod is being
				// deleted): the reconciler lets it go.
				continue
			}
			if !r.loader.AttachedAt(meta.UID, meta.NetNS) {
				// Its path names another namespace now (a new sandbox,
				// maybe another pod's): the reconciler finds the pod's
				// own, with the checks that namespace must pass.
				r.log.WarnContext(ctx, "not re-attaching pod: its network namespace path names another namespace than it was attached in", "pod", meta.Namespace+"/"+meta.Name, "netns", meta.NetNS)
				continue
			}
			if err := notPodNetNS(meta.NetNS); err != nil {
				errs++
				r.log.ErrorContext(ctx, "not re-attaching pod", "pod", meta.Namespace+"/"+meta.Name, "error", err)
				continue
			}
			p := loader.Pod{UID: meta.UID, Namespace: meta.Namespace, Name: meta.Name, NetNS: meta.NetNS,
				Interface: meta.Interface, Addrs: meta.Addrs, CaptureInbound: meta.Settings.CaptureInbound, CaptureDNS: meta.Settings.CaptureDNS}
			if _, err := r.loader.AttachPod(ctx, p); err != nil {
				errs++
				r.log.ErrorContext(ctx, "re-attach pod whose link was detached", "pod", p.String(), "error", err)
				continue
			}
			repaired++
			r.log.WarnContext(ctx, "pod repaired: one of its links had been detached (or, for host-probe links, unpinned)", "pod", p.String())
		}
		r.mu.Unlock()
	}
	if c.Repinned > 0 || repaired > 0 || errs > 0 {
		r.statsMu.Lock()
		r.stats.LinkRepins += uint64(c.Repinned)
		r.stats.Repairs += repaired
		r.stats.Errors += errs
		r.statsMu.Unlock()
	}
}

// requeueMoved queues every pod this process attached whose namespace
// path names another namespace now: its sandbox was replaced, and a
// runtime that names namespaces by pod (or a reused /proc/<pid>/ns/net)
// gave the new one the old path, with the pod's addresses, so the source
// has nothing to report. Without a CNI ADD saying so, nothing else looks
// before the next full pass, and the new sandbox's apps would run
// uncaptured, in plaintext, meanwhile (the old namespace lives on while the
// tunnel's listeners hold it, so its links look attached). The pod's own
// reconcile attaches it in the new namespace, with the checks a namespace
// must pass. A path that is gone is left to the pod's source and the full
// pass: it goes with every graceful delete, and finding where the pod went
// would mean a namespace scan per check. One stat per pod per check; each
// namespace found at the path is queued once (the queue's backoff retries
// it), and a later one again.
func (r *Reconciler) requeueMoved(ctx context.Context) {
	if r.requeue == nil {
		return
	}
	type entry struct {
		uid string
		rec nsRecord
	}
	r.nsMu.Lock()
	recs := make([]entry, 0, len(r.ns))
	for uid, rec := range r.ns {
		recs = append(recs, entry{uid, rec})
	}
	r.nsMu.Unlock()
	var moved uint64
	for _, e := range recs {
		ino, err := netns.Inode(e.rec.path)
		back := ino == e.rec.ino
		if err != nil || ino == e.rec.movedTo || (back && e.rec.movedTo == 0) {
			continue
		}
		r.nsMu.Lock()
		cur, ok := r.ns[e.uid]
		same := ok && cur == e.rec
		if same {
			cur.movedTo = ino
			if back {
				cur.movedTo = 0 // a later move is news again
			}
			r.ns[e.uid] = cur
		}
		r.nsMu.Unlock()
		if !same || back {
			continue // attached again meanwhile, or detached; or back
		}
		moved++
		r.log.WarnContext(ctx, "pod's network namespace path names another namespace than it was attached in; attaching it there", "pod", e.rec.name, "uid", e.uid, "netns", e.rec.path)
		r.requeue(e.uid)
	}
	if moved > 0 {
		r.statsMu.Lock()
		r.stats.NetNSMoved += moved
		r.statsMu.Unlock()
	}
}

// record adds res to the counts; enrolled is the number of attached pods
// after a full pass, or -1 after one pod's reconcile (not counted as a
// pass).
func (r *Reconciler) record(res Result, enrolled int) {
	pass := enrolled >= 0
	if !pass {
		enrolled = r.loader.PodCount()
	}
	r.statsMu.Lock()
	defer r.statsMu.Unlock()
	if pass {
		r.stats.Runs++
	}
	r.stats.Errors += uint64(len(res.Errors))
	r.stats.Repairs += uint64(len(res.Repaired))
	r.stats.Attached += uint64(len(res.Attached))
	r.stats.Detached += uint64(len(res.Detached))
	r.stats.Enrolled = enrolled
}

func findNetNS(scan map[netip.Addr]string, addrs []netip.Addr) string {
	for _, a := range addrs {
		if path, ok := scan[a.Unmap()]; ok {
			return path
		}
	}
	return ""
}

// notPodNetNS is the reason path cannot be a pod's namespace (the agent's
// own, say: a path that was a pod's may have been replaced), or nil. Other
// errors (a namespace that is gone) are left to the attach, which reports
// them as before.
func notPodNetNS(path string) error {
	if _, err := netns.CheckPodPath(path, ""); errors.Is(err, netns.ErrNotPodNetNS) {
		return err
	}
	return nil
}

func pathExists(p string) bool {
	_, err := os.Stat(p)
	return !errors.Is(err, os.ErrNotExist)
}
