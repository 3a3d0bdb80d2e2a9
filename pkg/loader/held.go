package loader

import (
	"context"
	"errors"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/redirector-mesh/redirector/pkg/pin"
)

// The loader holds each pod's two tcx links open (two file descriptors per
// pod, so at most 2 × MAX_PODS). A held link stays attached when someone
// removes its pin, so capture has no gap, and CheckLinks pins it again; a
// link detached underneath (bpftool, or its interface gone) shows as
// defunct on its open descriptor, with no path lookup. Close releases them,
// and the pins keep the links for the next process.

// holdLinks records the open links of pod id, closing any it replaces.
func (l *Loader) holdLinks(id uint32, lks [2]link.Link) {
	l.linksMu.Lock()
	old, ok := l.links[id]
	if l.links == nil {
		l.links, l.linkFDs = map[uint32][2]link.Link{}, map[uint32][2]int{}
	}
	l.links[id] = lks
	l.linkFDs[id] = linkFDs(lks)
	l.linksGen++
	l.linksMu.Unlock()
	if ok {
		for i, lk := range old {
			if lk != nil && lk != lks[i] {
				lk.Close()
			}
		}
	}
}

// dropLinks closes pod id's held links; their pins, if any, keep them.
func (l *Loader) dropLinks(id uint32) {
	l.linksMu.Lock()
	old, ok := l.links[id]
	delete(l.links, id)
	delete(l.linkFDs, id)
	l.linksGen++
	l.linksMu.Unlock()
	if ok {
		for _, lk := range old {
			if lk != nil {
				lk.Close()
			}
		}
	}
}

// HeldLinks is how many tcx links the loader holds open (two per pod
// attached with tcx).
func (l *Loader) HeldLinks() int {
	l.linksMu.Lock()
	defer l.linksMu.Unlock()
	n := 0
	for _, lks := range l.links {
		for _, lk := range lks {
			if lk != nil {
				n++
			}
		}
	}
	return n
}

// LinkCheck is what one CheckLinks pass found.
type LinkCheck struct {
	// Repinned counts links whose pin was gone and has been put back.
	Repinned int
	// Broken are pods with a link that is no longer attached: they need
	// attaching again (nodeagent.Reconciler.RepairLinks does it).
	Broken []uint32
	Errors []error
}

// In linkFDs, for a link that is not there, and one without a descriptor.
const (
	noLink = -1
	noFD   = -2
)

// linkFDs are the file descriptors of lks (or noLink, noFD).
func linkFDs(lks [2]link.Link) [2]int {
	fds := [2]int{noLink, noLink}
	for i, lk := range lks {
		if lk == nil {
			continue
		}
		fds[i] = noFD
		if fdr, ok := lk.(interface{ FD() int }); ok {
			fds[i] = fdr.FD()
		}
	}
	return fds
}

// CheckLinks looks at every held link: a link that is no longer attached
// marks its pod broken, and with pins set a missing pin is put back from the
// open link at once (the link never stopped running). It costs one bpf(2)
// call per link, on the descriptor kept in linkFDs (no walk through the
// link objects), and one stat with pins, so it can run several times a
// second.
func (l *Loader) CheckLinks(ctx context.Context, pins bool) LinkCheck {
	var res LinkCheck
	if pins {
		// Putting a pin back changes the pinned state: not once another
		// agent holds the node (it may have unpinned the pod on purpose).
		release, err := l.guard(ctx)
		if err != nil {
			res.Errors = append(res.Errors, err)
			pins = false
		} else {
			defer release()
		}
	}
	// Under the lock, so that no link is closed while it is looked at; the
	// pass is a few microseconds per pod.
	l.linksMu.Lock()
	defer l.linksMu.Unlock()
	for id, fds := range l.linkFDs {
		broken := false
		for i, d := range [2]direction{ingress, egress} {
			if fds[i] == noLink {
				continue
			}
			if fds[i] == noFD {
				broken = true // not a link this check can look at
				continue
			}
			if ok, err := pin.TCXAttachedFD(fds[i]); err != nil || !ok {
				broken = true
				continue
			}
			if !pins {
				continue
			}
			lk := l.links[id][i]
			path := l.linkPin(id, d)
			if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err := pin.Repin(lk, path); err != nil {
				res.Errors = append(res.Errors, err)
				continue
			}
			res.Repinned++
		}
		if broken {
			res.Broken = append(res.Broken, id)
		}
	}
	return res
}

// linksOK reports whether pod id's held links are attached and pinned.
// Pods attached with legacy tc have no links and are always OK here.
func (l *Loader) linksOK(id uint32, tcx bool) bool {
	if !tcx {
		return true
	}
	l.linksMu.Lock()
	defer l.linksMu.Unlock()
	lks, ok := l.links[id]
	if !ok {
		return false
	}
	for i, d := range []direction{ingress, egress} {
		if lks[i] == nil {
			return false
		}
		if ok, err := pin.TCXAttached(lks[i]); err != nil || !ok {
			return false
		}
		if _, err := os.Lstat(l.linkPin(id, d)); err != nil {
			return false
		}
	}
	return true
}

func (l *Loader) closeHeld() {
	l.linksMu.Lock()
	held := l.links
	strays := l.strays
	l.links, l.linkFDs, l.strays = nil, nil, nil
	l.linksMu.Unlock()
	for _, lk := range strays {
		lk.Close()
	}
	for _, lks := range held {
		for _, lk := range lks {
			if lk != nil {
				lk.Close()
			}
		}
	}
}

// HeldDirs returns the pin directories of the pods whose links are held,
// unless the set has not changed since generation gen.
func (l *Loader) HeldDirs(gen uint64) (dirs []string, newGen uint64, changed bool) {
	l.linksMu.Lock()
	defer l.linksMu.Unlock()
	if gen == l.linksGen && gen != 0 {
		return nil, gen, false
	}
	for id := range l.links {
		dirs = append(dirs, l.podDir(id))
	}
	return dirs, l.linksGen, true
}

// keepStray keeps lk, a link displaced from a pod's pin path for why, when
// it is another pod's: attached to another interface (pin.ErrLinkElsewhere)
// and still running. Its only pin was the one replaced, so closing it
// would detach that pod's capture until its own attach: its traffic would
// pass uncaptured meanwhile. It reports whether it kept lk.
func (l *Loader) keepStray(lk link.Link, why error) bool {
	if !errors.Is(why, pin.ErrLinkElsewhere) {
		return false
	}
	if ok, err := pin.TCXAttached(lk); err != nil || !ok {
		return false
	}
	info, err := lk.Info()
	if err != nil {
		return false
	}
	l.linksMu.Lock()
	defer l.linksMu.Unlock()
	if l.strays == nil {
		l.strays = map[link.ID]link.Link{}
	}
	if old := l.strays[info.ID]; old != nil {
		old.Close()
	}
	l.strays[info.ID] = lk
	return true
}

// releaseStrays closes the kept strays attached to interface ifindex of the
// calling thread's network namespace: that pod's own links are in place
// (or it is detached).
func (l *Loader) releaseStrays(ifindex int) {
	l.linksMu.Lock()
	defer l.linksMu.Unlock()
	if len(l.strays) == 0 {
		return
	}
	for _, attach := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
		res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: attach})
		if err != nil {
			continue
		}
		for _, p := range res.Programs {
			id, ok := p.LinkID()
			if lk := l.strays[id]; ok && lk != nil {
				lk.Close()
				delete(l.strays, id)
			}
		}
	}
}

// dropForeignHeld closes the held links whose pin no longer holds them:
// another agent held the node meanwhile and detached the pod (a detach
// unpins its links, and only this process's descriptors kept them
// attached) or attached another pod under its id. Kept, they stayed
// attached for as long as this agent ran, and CheckLinks, finding their
// pin gone, pinned a detached pod's links back under an id the pod
// metadata no longer names.
func (l *Loader) dropForeignHeld() {
	var closing []link.Link
	l.linksMu.Lock()
	for id, lks := range l.links {
		for i, d := range [2]direction{ingress, egress} {
			if lks[i] != nil && !pinnedAt(lks[i], l.linkPin(id, d)) {
				closing = append(closing, lks[i])
				lks[i] = nil
			}
		}
		if lks[0] == nil && lks[1] == nil {
			delete(l.links, id)
			delete(l.linkFDs, id)
		} else {
			l.links[id], l.linkFDs[id] = lks, linkFDs(lks)
		}
	}
	l.linksGen++
	l.linksMu.Unlock()
	for _, lk := range closing {
		lk.Close()
	}
}

// pinnedAt reports whether the link pinned at path is lk.
func pinnedAt(lk link.Link, path string) bool {
	pinned, err := link.LoadPinnedLink(path, &ebpf.LoadPinOptions{}) // links open read-write only
	if err != nil {
		return false
	}
	defer pinned.Close()
	a, errA := lk.Info()
	b, errB := pinned.Info()
	return errA == nil && errB == nil && a.ID == b.ID
}
