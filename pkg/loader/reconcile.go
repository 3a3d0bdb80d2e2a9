package loader

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"sync"

	"github.com/redirector-mesh/redirector/pkg/maps"
)

// PodServer is the tunnel's side of enrollment: it opens and closes a pod's
// listeners. The loader never imports the tunnel; the binary wires the two.
type PodServer interface {
	// ServePod opens (or keeps) the pod's tunnel listeners inside netnsPath.
	ServePod(ctx context.Context, uid, netnsPath string, addrs []netip.Addr) error
	// StopPod closes the pod's listeners. Unknown uids are fine.
	StopPod(ctx context.Context, uid string) error
	// ServedPods lists the uids that have listeners.
	ServedPods() []string
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
	loader *Loader
	server PodServer
	finder NetNSFinder
	log    *slog.Logger

	mu sync.Mutex // one reconcile at a time

	statsMu sync.Mutex // separate, so a scrape never waits for a reconcile
	stats   ReconcileStats
}

// ReconcileStats are cumulative counts, exported as metrics.
type ReconcileStats struct {
	Runs, Errors, Repairs, Attached, Detached uint64
	Enrolled                                  int
}

// Result says what one reconcile did.
type Result struct {
	Attached, Detached, Repaired []string // pod namespace/name
	Errors                       []error  // one per pod that could not converge
}

// NewReconciler wires the loader to a pod server and a namespace finder.
func NewReconciler(l *Loader, s PodServer, f NetNSFinder, log *slog.Logger) *Reconciler {
	if log == nil {
		log = slog.Default()
	}
	return &Reconciler{loader: l, server: s, finder: f, log: log}
}

// Stats returns the cumulative counts.
func (r *Reconciler) Stats() ReconcileStats {
	r.statsMu.Lock()
	defer r.statsMu.Unlock()
	return r.stats
}

// Reconcile converges on want, the pods to enroll on this node. A pod with no
// NetNS gets it from its current attachment or from the finder. With full
// set, pods that look right are attached again anyway, which repairs drift
// (a missing link pin or enrollment entry) and is what start-up and the
// periodic pass do. Per-pod failures are collected and never stop the others.
func (r *Reconciler) Reconcile(ctx context.Context, want []Pod, full bool) Result {
	r.mu.Lock()
	defer r.mu.Unlock()
	var res Result

	current, err := r.loader.Pods()
	if err != nil {
		res.Errors = append(res.Errors, fmt.Errorf("read attached pods: %w", err))
		r.record(res, 0)
		return res
	}
	attached := map[string]PodState{}
	for _, p := range current {
		attached[p.Meta.UID] = p
	}
	served := map[string]bool{}
	for _, uid := range r.server.ServedPods() {
		served[uid] = true
	}
	wanted := map[string]bool{}

	// Pods without a namespace take their attachment's; the others are
	// looked up by address, all in one scan that ends once they are found.
	want = slices.Clone(want)
	var lookup []netip.Addr
	for i := range want {
		p := &want[i]
		if cur, ok := attached[p.UID]; p.NetNS == "" && ok && pathExists(cur.Meta.NetNS) {
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

	for _, p := range want {
		wanted[p.UID] = true
		cur, isAttached := attached[p.UID]
		if p.NetNS == "" {
			p.NetNS = findNetNS(scan, p.Addrs)
			if p.NetNS == "" {
				res.Errors = append(res.Errors, fmt.Errorf("pod %s: no network namespace owns its addresses %v", p, p.Addrs))
				continue
			}
		}
		// kernelOK: links pinned and entries present as wanted. Listeners
		// live in this process and are checked separately.
		kernelOK := isAttached && sameAttachment(cur, p) && r.entriesPresent(cur)
		if kernelOK && served[p.UID] && !full {
			continue
		}
		if err := r.server.ServePod(ctx, p.UID, p.NetNS, p.Addrs); err != nil {
			res.Errors = append(res.Errors, fmt.Errorf("pod %s: open tunnel listeners: %w", p, err))
			continue
		}
		if kernelOK && !full {
			continue
		}
		// Idempotent: for a pod that is right this rewrites the same state
		// (full passes also catch drift in rules, routes and sysctls).
		if _, err := r.loader.AttachPod(ctx, p); err != nil {
			res.Errors = append(res.Errors, err)
			if !isAttached {
				_ = r.server.StopPod(ctx, p.UID)
			}
			continue
		}
		switch {
		case !isAttached:
			res.Attached = append(res.Attached, p.String())
		case !kernelOK:
			res.Repaired = append(res.Repaired, p.String())
		}
	}

	for uid, cur := range attached {
		if wanted[uid] {
			continue
		}
		name := cur.Meta.Namespace + "/" + cur.Meta.Name
		if err := r.loader.DetachPod(ctx, uid); err != nil {
			res.Errors = append(res.Errors, err)
			continue
		}
		res.Detached = append(res.Detached, name)
		delete(served, uid)
		if err := r.server.StopPod(ctx, uid); err != nil {
			res.Errors = append(res.Errors, fmt.Errorf("pod %s: close tunnel listeners: %w", name, err))
		}
	}
	for uid := range served {
		if !wanted[uid] {
			if err := r.server.StopPod(ctx, uid); err != nil {
				res.Errors = append(res.Errors, err)
			}
		}
	}
	enrolled := 0
	if now, err := r.loader.Pods(); err == nil {
		enrolled = len(now)
	}
	r.record(res, enrolled)
	return res
}

func (r *Reconciler) record(res Result, enrolled int) {
	r.statsMu.Lock()
	defer r.statsMu.Unlock()
	r.stats.Runs++
	r.stats.Errors += uint64(len(res.Errors))
	r.stats.Repairs += uint64(len(res.Repaired))
	r.stats.Attached += uint64(len(res.Attached))
	r.stats.Detached += uint64(len(res.Detached))
	r.stats.Enrolled = enrolled
}

// entriesPresent reports whether every address of the pod still has its
// enrollment entry and its links are still pinned.
func (r *Reconciler) entriesPresent(p PodState) bool {
	for _, a := range p.Meta.Addrs {
		if s, ok, err := r.loader.maps.Pod(a); err != nil || !ok || s != p.Meta.Settings {
			return false
		}
	}
	if p.Meta.AttachMode != maps.AttachTCX {
		return true
	}
	for _, d := range []direction{ingress, egress} {
		if !pathExists(r.loader.linkPin(p.ID, d)) {
			return false
		}
	}
	return true
}

func sameAttachment(cur PodState, p Pod) bool {
	iface := p.Interface
	if iface == "" {
		iface = "eth0"
	}
	addrs := slices.Clone(p.Addrs)
	for i := range addrs {
		addrs[i] = addrs[i].Unmap()
	}
	return cur.Meta.NetNS == p.NetNS && cur.Meta.Interface == iface &&
		slices.Equal(cur.Meta.Addrs, addrs) && cur.Meta.Settings.CaptureInbound == p.CaptureInbound
}

func findNetNS(scan map[netip.Addr]string, addrs []netip.Addr) string {
	for _, a := range addrs {
		if path, ok := scan[a.Unmap()]; ok {
			return path
		}
	}
	return ""
}

func pathExists(p string) bool {
	_, err := os.Stat(p)
	return !errors.Is(err, os.ErrNotExist)
}
