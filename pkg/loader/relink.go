package loader

import (
	"context"
	"fmt"

	"github.com/cilium/ebpf/link"

	"github.com/redirector-mesh/redirector/pkg/maps"
)

// Relinked is what one Relink did.
type Relinked struct {
	// Updated counts the pinned links now running this agent's programs.
	Updated int
	// Failed names each link left on the program it had, by pod and pin,
	// with why: its pod counts as not converged (KernelOK) until an attach
	// replaces the link, which the next pass makes.
	Failed []error
}

// Relink points every pinned link of the node at this agent's programs,
// the path a start takes in Load: each tcx-attached pod's two links (held
// from then on), the host-probe links (the veth map rebuilt from them) and
// the local-routing sock_ops link. It also lets go of held links whose pin
// no longer holds them (another agent detached or replaced their pod), and
// has the pod index read again. Pods attached with legacy tc are left to
// the next full pass, whose check compares their filters' program ids.
//
// It runs under the pin root's exclusive lock: when the agent claims the
// node (maps.ClaimNodeThen: a take-back's Relink between this agent's Load
// and its claim would have left the pods on the older agent's programs),
// and when it takes the node back from a newer agent that gave it up
// (maps.Claim.ReclaimThen). Until 7 December a take-back left every pod on
// the newer agent's programs, so a rollback made for a program bug kept the
// bug until the older agent restarted. It takes no Guard (it would wait for
// the lock its caller holds).
func (l *Loader) Relink(ctx context.Context) Relinked {
	l.mu.Lock()
	l.indexed = false
	l.mu.Unlock()
	l.dropForeignHeld()
	res, err := l.relinkPods(ctx)
	if err != nil {
		res.Failed = append(res.Failed, err)
		l.log.ErrorContext(ctx, "pinned pod links not pointed at this agent's programs", "error", err)
	}
	if l.probes != nil {
		h := l.probes.Relink(ctx)
		res.Updated += h.Updated
		for id, err := range h.Failed {
			l.markStale(id)
			err = fmt.Errorf("host-probe links of pod id %d: %w", id, err)
			l.log.WarnContext(ctx, "pinned host-probe link keeps its program until the pod is attached again", "pod_id", id, "error", err)
			res.Failed = append(res.Failed, err)
		}
		if h.Err != nil {
			res.Failed = append(res.Failed, h.Err)
			l.log.ErrorContext(ctx, "host-probe veth map not rebuilt", "error", h.Err)
		}
	}
	l.attachLocalRoute(ctx)
	l.relinkUpdated.Add(uint64(res.Updated))
	l.relinkFailed.Add(uint64(len(res.Failed)))
	l.log.InfoContext(ctx, "pinned links pointed at this agent's programs", "updated", res.Updated, "failed", len(res.Failed))
	return res
}

// relinkPods points every tcx-attached pod's pinned links at this loader's
// programs and holds them. A link it cannot update stays held as it was
// (its pin may be all that is left to repair from), and its pod is marked
// stale (markStale): KernelOK fails it, and the attach that follows
// replaces the link (pin.AttachTCXHeld attaches the new link before the
// old one goes).
func (l *Loader) relinkPods(ctx context.Context) (Relinked, error) {
	var res Relinked
	metas, err := l.maps.ListMeta()
	if err != nil {
		return res, fmt.Errorf("relink pinned pod links: %w", err)
	}
	for id, m := range metas {
		if m.AttachMode != maps.AttachTCX {
			continue
		}
		lks := l.heldLinks(id)
		for i, dir := range []direction{ingress, egress} {
			lk, err := l.updatePinnedLink(id, dir)
			if err != nil {
				err = fmt.Errorf("%s link of pod %s/%s (%s): %w", dir, m.Namespace, m.Name, l.linkPin(id, dir), err)
				l.log.WarnContext(ctx, "pinned link keeps its program until the pod is attached again", "pod", m.Namespace+"/"+m.Name, "direction", dir, "error", err)
				res.Failed = append(res.Failed, err)
				l.markStale(id)
				continue
			}
			lks[i] = lk
			res.Updated++
		}
		l.holdLinks(id, lks)
	}
	return res, nil
}

// heldLinks are the links held for pod id (nil where none).
func (l *Loader) heldLinks(id uint32) [2]link.Link {
	l.linksMu.Lock()
	defer l.linksMu.Unlock()
	return l.links[id]
}

// markStale records that pod id has a pinned link this loader could not
// point at its programs: it may run another agent's. KernelOK fails such a
// pod until an attach succeeds (clearStale).
func (l *Loader) markStale(id uint32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stale == nil {
		l.stale = map[uint32]bool{}
	}
	l.stale[id] = true
}

func (l *Loader) clearStale(id uint32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.stale, id)
}

func (l *Loader) isStale(id uint32) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.stale[id]
}
