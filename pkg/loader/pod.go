package loader

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/pin"
	"github.com/redirector-mesh/redirector/pkg/probe"
	"github.com/redirector-mesh/redirector/pkg/selection"
)

// Pod is what the loader needs to redirect one pod.
type Pod struct {
	UID, Namespace, Name string
	NetNS                string // path of the pod's network namespace
	Interface            string // the pod's interface; "eth0" when empty
	Addrs                []netip.Addr
	// CaptureInbound is false for pods annotated
	// ambient.istio.io/bypass-inbound-capture: "true".
	CaptureInbound bool
	// CaptureDNS steers the pod's UDP queries to port 53 to the tunnel's
	// DNS socket (POD_CAPTURE_DNS).
	CaptureDNS bool
}

func (p Pod) String() string { return p.Namespace + "/" + p.Name }

// checkProbeAddrs refuses a pod at a host-probe SNAT address. The capture
// never captures that address (a destination on egress, a source marked by
// the host program on ingress), and HOST_PROBE_SNAT_IPV6 only has to be
// unicast: set inside the pod range, the pod given that address would be
// enrolled while its traffic with it passed in plaintext.
func (l *Loader) checkProbeAddrs(p Pod) error {
	for _, a := range p.Addrs {
		for _, probeAddr := range []struct {
			addr netip.Addr
			env  string
		}{{l.cfg.Settings.ProbeSNATv4, probe.EnvSNATv4}, {l.cfg.Settings.ProbeSNATv6, probe.EnvSNATv6}} {
			if a == probeAddr.addr {
				return fmt.Errorf("pod %s: address %s is the host-probe SNAT address (%s), which the capture never captures: "+
					"its traffic would pass in plaintext; set %s to an address no pod has", p, a, probeAddr.env, probeAddr.env)
			}
		}
	}
	return nil
}

func (p *Pod) validate() error {
	if p.UID == "" {
		return fmt.Errorf("pod %s has no uid", p)
	}
	if p.NetNS == "" {
		return fmt.Errorf("pod %s has no network namespace path", p)
	}
	if p.Interface == "" {
		p.Interface = "eth0"
	}
	if len(p.Addrs) == 0 || len(p.Addrs) > maps.MaxMetaAddrs {
		return fmt.Errorf("pod %s has %d addresses, want 1 to %d", p, len(p.Addrs), maps.MaxMetaAddrs)
	}
	// A copy: the caller's slice may be read by others meanwhile.
	addrs := make([]netip.Addr, len(p.Addrs))
	for i, a := range p.Addrs {
		if err := selection.CheckPodAddr(a); err != nil {
			return fmt.Errorf("pod %s: %w", p, err)
		}
		addrs[i] = a.Unmap()
	}
	p.Addrs = addrs
	return nil
}

// AttachPod redirects the pod's traffic: it attaches the programs to the pod's
// interface inside its namespace, adds the fwmark rule and local route, sets
// the interface sysctls re-injection needs, pins the links, attaches the
// host-probe SNAT to the host end of its veth, and writes the enrollment
// entries last. It is idempotent: attaching an attached pod updates it in
// place. On error nothing of the pod is left behind.
//
// A new pod's outbound capture does not wait for the host-probe SNAT: each
// new tcx link costs the kernel an RCU grace period (milliseconds, one at a
// time node-wide), so once the pod's own links are in place its addresses
// that have no entry yet get one with inbound capture off, which changes
// nothing for connections to the pod; inbound capture is switched on only
// after the host programs are attached, as before.
//
// The tunnel's listeners in the pod should exist before this is called: from
// the moment the entries are written, captured SYNs without a listener are
// dropped (fail closed).
func (l *Loader) AttachPod(ctx context.Context, p Pod) (PodState, error) {
	if err := p.validate(); err != nil {
		return PodState{}, err
	}
	if err := l.checkProbeAddrs(p); err != nil {
		return PodState{}, err
	}
	unlock := l.lockPod(p.UID)
	defer unlock()
	release, err := l.guard(ctx)
	if err != nil {
		return PodState{}, fmt.Errorf("attach pod %s: %w", p, err)
	}
	defer release()

	id, old, existed, err := l.reserveID(p.UID)
	if err != nil {
		return PodState{}, err
	}
	// fresh: the pod's interface is new to us, in a new pod or in a new
	// sandbox of an attached one. Then its links are attached, not updated
	// in place: an update would swap the programs on the old sandbox's
	// interface (its pinned links are there) and leave the new one
	// without any, while everything else moved to it.
	fresh, moved := !existed, false
	if existed && l.movedNetNS(id, old.NetNS, p.NetNS) {
		l.log.InfoContext(ctx, "pod moved to a new network namespace: leaving the old one", "pod", p.String(), "old", old.NetNS, "new", p.NetNS)
		if err := l.leaveNetNS(id, old); err != nil {
			l.log.WarnContext(ctx, "leaving the pod's old network namespace", "pod", p.String(), "netns", old.NetNS, "error", err)
		}
		fresh, moved = true, true
	}
	meta := maps.PodMeta{
		UID: p.UID, Namespace: p.Namespace, Name: p.Name,
		NetNS: p.NetNS, Interface: p.Interface, Addrs: p.Addrs,
		Settings:    maps.PodSettings{CaptureOutbound: true, CaptureInbound: p.CaptureInbound, CaptureDNS: p.CaptureDNS, PodID: id},
		AttachMode:  maps.AttachTCX,
		AcceptLocal: -1, RPFilter: -1, RPFilterAll: -1,
	}
	if !fresh {
		meta.AcceptLocal, meta.RPFilter, meta.RPFilterAll = old.AcceptLocal, old.RPFilter, old.RPFilterAll
	}
	if l.cfg.ForceLegacyTC {
		meta.AttachMode = maps.AttachTCLegacy
	}
	// failed undoes a new pod (or one that left its old namespace)
	// entirely; an attached pod keeps what it had.
	failed := func(err error) error {
		if fresh {
			err = errors.Join(err, l.detach(ctx, id, meta, false))
		}
		if moved {
			// detach knows only the new addresses.
			for _, a := range old.Addrs {
				if !containsAddr(p.Addrs, a) {
					err = errors.Join(err, l.deleteEntry(a, id), l.deleteCounters(a, id))
				}
			}
		}
		return err
	}

	// Record first, so that a crash half-way leaves state the reconciler and
	// uninstall can find and remove.
	lks, err := l.attachInNetNS(ctx, id, &meta, !fresh)
	if err != nil {
		return PodState{}, fmt.Errorf("attach pod %s: %w", p, failed(err))
	}
	l.holdLinks(id, lks)
	l.setIndex(id, meta)
	// From its first enrollment entry on, the programs know the pod by its
	// namespace too: its addresses that are not enrolled are dropped.
	if err := l.setPodNetNS(id, meta); err != nil {
		return PodState{}, fmt.Errorf("attach pod %s: %w", p, failed(err))
	}
	// Addresses the pod no longer has lose their entries, and their
	// counters unless another pod owns the address now.
	if existed {
		for _, a := range old.Addrs {
			if !containsAddr(p.Addrs, a) {
				err = errors.Join(err, l.deleteEntry(a, id), l.deleteCounters(a, id))
			}
		}
	}
	// Probe SNAT on the host end comes before inbound capture: from the
	// moment it is on, kubelet's probes must already bypass it. Outbound
	// capture of a new pod starts before (see above).
	if err == nil && fresh {
		err = l.enrollOutbound(p.Addrs, meta.Settings)
	}
	if err == nil {
		var withProbe bool
		withProbe, err = l.attachHostProbe(ctx, id, meta)
		l.setHostProbe(id, withProbe && err == nil)
	}
	for _, a := range p.Addrs {
		if err == nil {
			err = errors.Join(l.maps.CreateCounters(a), l.setEntry(a, meta.Settings))
		}
	}
	if err != nil {
		return PodState{}, fmt.Errorf("enroll pod %s: %w", p, failed(err))
	}
	l.clearStale(id) // every link of the pod attached or updated anew
	return PodState{ID: id, Meta: meta}, nil
}

// lockPod serialises attach and detach of one pod; other pods proceed.
func (l *Loader) lockPod(uid string) (unlock func()) {
	l.mu.Lock()
	for {
		ch, busy := l.busy[uid]
		if !busy {
			break
		}
		l.mu.Unlock()
		<-ch
		l.mu.Lock()
	}
	if l.busy == nil {
		l.busy = map[string]chan struct{}{}
	}
	ch := make(chan struct{})
	l.busy[uid] = ch
	l.mu.Unlock()
	return func() {
		l.mu.Lock()
		delete(l.busy, uid)
		l.mu.Unlock()
		close(ch)
	}
}

// loadIndexLocked reads the metadata map once; from then on the loader
// keeps its index in step with what it writes (it is the map's only writer).
func (l *Loader) loadIndexLocked() error {
	if l.indexed {
		return nil
	}
	metas, err := l.maps.ListMeta()
	if err != nil {
		return err
	}
	l.metas, l.byUID = metas, make(map[string]uint32, len(metas))
	for id, m := range metas {
		l.byUID[m.UID] = id
	}
	l.indexed = true
	return nil
}

// reserveID returns the pod's id and recorded metadata, or a free id
// reserved for it.
func (l *Loader) reserveID(uid string) (id uint32, old maps.PodMeta, existed bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.loadIndexLocked(); err != nil {
		return 0, maps.PodMeta{}, false, err
	}
	if id, ok := l.byUID[uid]; ok {
		return id, l.metas[id], true, nil
	}
	if id, err = freeID(l.metas); err != nil {
		return 0, maps.PodMeta{}, false, err
	}
	// A placeholder until the attach records the real metadata.
	l.metas[id] = maps.PodMeta{UID: uid, AcceptLocal: -1, RPFilter: -1, RPFilterAll: -1}
	l.byUID[uid] = id
	return id, maps.PodMeta{}, false, nil
}

func (l *Loader) setIndex(id uint32, m maps.PodMeta) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.indexed {
		l.metas[id] = m
		l.byUID[m.UID] = id
	}
}

func (l *Loader) unindex(id uint32, uid string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.indexed && l.byUID[uid] == id {
		delete(l.byUID, uid)
		delete(l.metas, id)
	}
	delete(l.hostProbe, id)
	delete(l.stale, id)
}

// enrollOutbound gives each address without an enrollment entry one with
// the pod's settings but inbound capture off. An existing entry is never
// touched: that would turn its inbound capture off, if only briefly.
func (l *Loader) enrollOutbound(addrs []netip.Addr, s maps.PodSettings) error {
	s.CaptureInbound = false
	for _, a := range addrs {
		if _, ok, err := l.maps.Pod(a); err != nil || ok {
			if err != nil {
				return err
			}
			continue
		}
		if err := errors.Join(l.maps.CreateCounters(a), l.setEntry(a, s)); err != nil {
			return err
		}
	}
	return nil
}

func (l *Loader) attachInNetNS(ctx context.Context, id uint32, meta *maps.PodMeta, existed bool) (lks [2]link.Link, err error) {
	err = netns.Do(meta.NetNS, func() error {
		iface, err := netlink.LinkByName(meta.Interface)
		if err != nil {
			return fmt.Errorf("interface %s not found in network namespace %s: %w", meta.Interface, meta.NetNS, err)
		}
		if err := checkEthernet(iface); err != nil {
			return fmt.Errorf("network namespace %s: %w", meta.NetNS, err)
		}
		others, err := checkAddrs(iface, meta.Addrs)
		if err != nil {
			return fmt.Errorf("network namespace %s: %w", meta.NetNS, err)
		}
		if len(others) > 0 {
			l.log.WarnContext(ctx, "pod interface has addresses that are not enrolled: TCP to and from them is dropped",
				"pod", meta.Namespace+"/"+meta.Name, "interface", meta.Interface, "addresses", others)
		}
		if ifaces, err := otherInterfaces(iface); err != nil {
			return fmt.Errorf("network namespace %s: %w", meta.NetNS, err)
		} else if len(ifaces) > 0 {
			l.log.WarnContext(ctx, "pod has other interfaces up: TCP that arrives on them is not captured (the programs are only on the pod interface)",
				"pod", meta.Namespace+"/"+meta.Name, "interface", meta.Interface, "others", ifaces)
		}
		al, rp := sysctlPath(l.cfg.Settings.ProcDir, "ipv4", meta.Interface, "accept_local"), sysctlPath(l.cfg.Settings.ProcDir, "ipv4", meta.Interface, "rp_filter")
		rpAll := sysctlPath(l.cfg.Settings.ProcDir, "ipv4", "all", "rp_filter")
		if !existed {
			// Remember what the pod had, to restore it on detach.
			meta.AcceptLocal, _ = readSysctl(al)
			meta.RPFilter, _ = readSysctl(rp)
			meta.RPFilterAll, _ = readSysctl(rpAll)
		}
		if err := l.maps.PutMeta(id, *meta); err != nil {
			return err
		}
		if hasV4(meta.Addrs) {
			// Re-injected packets carry the pod's own source address.
			if err := writeSysctl(al, 1); err != nil {
				return err
			}
			// The effective rp_filter is the larger of "all" and the interface.
			if err := writeSysctl(rp, 0); err != nil {
				return err
			}
			if v, err := readSysctl(rpAll); err == nil && v != 0 {
				if err := writeSysctl(rpAll, 0); err != nil {
					return err
				}
			}
		}
		if err := l.addRouting(meta.Addrs); err != nil {
			return err
		}
		if meta.AttachMode == maps.AttachTCX {
			// Links found at the pins that are not the pod's for them (a
			// pod's two pins swapped: each holds the other direction's only
			// link) are detached once both new ones run.
			var displaced []link.Link
			defer func() {
				for _, lk := range displaced {
					lk.Close()
				}
			}()
			for i, d := range []direction{ingress, egress} {
				var a pin.Attached
				a, err = l.attachTCX(id, iface.Attrs().Index, d)
				if err != nil {
					break
				}
				lks[i] = a.Link
				if a.Replaced != nil {
					l.log.WarnContext(ctx, "pinned link replaced: it was not the pod's", "pod", meta.Namespace+"/"+meta.Name,
						"pin", l.linkPin(id, d), "reason", a.Replaced)
				}
				if a.Displaced != nil {
					if l.keepStray(a.Displaced, a.Replaced) {
						continue
					}
					displaced = append(displaced, a.Displaced)
				}
			}
			if err == nil {
				// This pod's own links found at other pods' paths are
				// replaced now.
				l.releaseStrays(iface.Attrs().Index)
				return nil
			}
			if !errors.Is(err, ebpf.ErrNotSupported) {
				return err
			}
			// No tcx in this kernel (before 6.6): classic tc instead.
			l.log.InfoContext(ctx, "tcx not supported by the kernel; attaching with clsact + cls_bpf", "pod", meta.Namespace+"/"+meta.Name)
			meta.AttachMode = maps.AttachTCLegacy
			if err := l.maps.PutMeta(id, *meta); err != nil {
				return err
			}
		}
		return l.attachLegacy(iface.Attrs().Index)
	})
	if err != nil {
		for _, lk := range lks {
			if lk != nil {
				lk.Close()
			}
		}
		return [2]link.Link{}, err
	}
	return lks, nil
}

// attachHostProbe puts the probe SNAT programs on the host end of the pod's
// veth, when that end is in this (the node's) network namespace. Pods wired
// otherwise (no veth, or a peer elsewhere) get no SNAT: their probes are
// treated like any plaintext client, which the log says.
func (l *Loader) attachHostProbe(ctx context.Context, id uint32, meta maps.PodMeta) (attached bool, err error) {
	if l.probes == nil {
		return false, nil
	}
	peer, err := probe.HostPeerIndex(meta.NetNS, meta.Interface)
	if err != nil {
		l.log.WarnContext(ctx, "no host-probe SNAT for pod: kubelet probes will be treated as plaintext clients", "pod", meta.Namespace+"/"+meta.Name, "reason", err)
		return false, nil
	}
	if err := l.probes.AttachHost(id, peer); err != nil {
		return false, fmt.Errorf("host-probe SNAT: %w", err)
	}
	return true, nil
}

// hostProbePins are the pins pkg/probe makes in a pod's directory.
var hostProbePins = []string{"host-ingress", "host-egress"}

func (l *Loader) setHostProbe(id uint32, on bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.hostProbe == nil {
		l.hostProbe = map[uint32]bool{}
	}
	if on {
		l.hostProbe[id] = true
	} else {
		delete(l.hostProbe, id)
	}
}

// hostProbeOK reports whether pod id's host-probe links are pinned, if this
// process attached them.
func (l *Loader) hostProbeOK(id uint32) bool {
	l.mu.Lock()
	on := l.hostProbe[id]
	l.mu.Unlock()
	if !on {
		return true
	}
	for _, name := range hostProbePins {
		if _, err := os.Lstat(filepath.Join(l.podDir(id), name)); err != nil {
			return false
		}
	}
	return true
}

// HostProbeMissing lists the pods whose host-probe links this process
// attached and whose pins are gone.
func (l *Loader) HostProbeMissing() []uint32 {
	l.mu.Lock()
	ids := make([]uint32, 0, len(l.hostProbe))
	for id := range l.hostProbe {
		ids = append(ids, id)
	}
	l.mu.Unlock()
	var out []uint32
	for _, id := range ids {
		if !l.hostProbeOK(id) {
			out = append(out, id)
		}
	}
	return out
}

// PodMeta is pod id's metadata as last written.
func (l *Loader) PodMeta(id uint32) (maps.PodMeta, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	m, ok := l.metas[id]
	return m, ok && l.indexed && m.NetNS != ""
}

// DetachPod stops redirecting the pod, which leaves the mesh: its captured
// sockets are ended first (endCaptured), then the enrollment entries go
// (the kill switch), then links, rules, routes and sysctls. Detaching a pod
// that is not attached is not an error.
func (l *Loader) DetachPod(ctx context.Context, uid string) error {
	unlock := l.lockPod(uid)
	defer unlock()
	release, err := l.guard(ctx)
	if err != nil {
		return fmt.Errorf("detach pod %s: %w", uid, err)
	}
	defer release()
	l.mu.Lock()
	err = l.loadIndexLocked()
	id, ok := l.byUID[uid]
	meta := l.metas[id]
	l.mu.Unlock()
	if err != nil {
		return err
	}
	if !ok {
		return nil
	}
	if err := l.detach(ctx, id, meta, true); err != nil {
		return fmt.Errorf("detach pod %s/%s: %w", meta.Namespace, meta.Name, err)
	}
	return nil
}

// setEntry writes addr's enrollment entry. Entries are written and removed
// under l.entries, so a pod's detach never removes the entry a new pod with
// the reused address just wrote (pods are attached and detached
// concurrently, in any order).
func (l *Loader) setEntry(a netip.Addr, s maps.PodSettings) error {
	l.entries.Lock()
	defer l.entries.Unlock()
	return l.maps.SetPod(a, s)
}

// deleteEntry removes addr's enrollment entry if pod id still owns it.
func (l *Loader) deleteEntry(a netip.Addr, id uint32) error {
	l.entries.Lock()
	defer l.entries.Unlock()
	cur, ok, err := l.maps.Pod(a)
	if err != nil || !ok || cur.PodID != id {
		return err
	}
	return l.maps.DeletePod(a)
}

// deleteCounters removes addr's counters unless another pod now owns the
// address (its counters are its own).
func (l *Loader) deleteCounters(a netip.Addr, id uint32) error {
	l.entries.Lock()
	defer l.entries.Unlock()
	if cur, ok, err := l.maps.Pod(a); err != nil || (ok && cur.PodID != id) {
		return err
	}
	return l.maps.DeleteCounters(a)
}

// movedNetNS reports whether the attached pod id, recorded in the
// namespace at oldPath, is now to be attached in the one at newPath: a
// different namespace, by inode (two paths may name one namespace: a
// /proc/<pid>/ns/net and a runtime's bind mount). The inode recorded for
// the pod in rd_pod_netns is the old namespace's, whatever its path leads
// to now; without a record, the old path's own inode. When neither is
// known (a restarted agent, the old path gone) it is no move: the links
// are updated in place as before, and a defunct one is attached anew.
func (l *Loader) movedNetNS(id uint32, oldPath, newPath string) bool {
	newIno, err := netnsIno(newPath)
	if err != nil {
		return false // the attach reports it
	}
	if oldIno, ok := l.recordedNetNS(id); ok {
		return oldIno != newIno
	}
	oldIno, err := netnsIno(oldPath)
	return err == nil && oldIno != newIno
}

// recordedNetNS is the inode of the namespace pod id was last attached in:
// this process's record, else the pinned rd_pod_netns entry naming the pod.
func (l *Loader) recordedNetNS(id uint32) (uint32, bool) {
	l.mu.Lock()
	ino, ok := l.podNetNS[id]
	l.mu.Unlock()
	if ok {
		return ino, true
	}
	all, err := l.maps.ListPodNetNS()
	if err != nil {
		return 0, false
	}
	for ino, e := range all {
		if e.PodID == id {
			return ino, true
		}
	}
	return 0, false
}

// AttachedNetNS is the inode of the network namespace the pod uid is
// attached in (what its links and rd_pod_netns entry were made for), which
// its metadata's path may no longer name: a new sandbox can be given the
// old one's path. ok is false when the pod is not attached or no record
// says.
func (l *Loader) AttachedNetNS(uid string) (ino uint64, ok bool) {
	st, attached, err := l.PodState(uid)
	if err != nil || !attached {
		return 0, false
	}
	i, ok := l.recordedNetNS(st.ID)
	return uint64(i), ok
}

// AttachedAt reports whether path names the network namespace the pod uid
// is attached in: by the recorded inode (AttachedNetNS), or, with no
// record, whether path names a namespace at all.
func (l *Loader) AttachedAt(uid, path string) bool {
	cur, err := netnsIno(path)
	if err != nil {
		return false
	}
	ino, ok := l.AttachedNetNS(uid)
	return !ok || ino == uint64(cur)
}

// leaveNetNS undoes what attaching pod id did on its old sandbox, keeping
// its id, metadata and entries: its links (held and pinned), its host-probe
// SNAT and its rd_pod_netns entry. The rules, routes and sysctls left in
// the old namespace are left to it (the runtime tears it down): a path can
// come to name another namespace, and undoing them there would take them
// from a pod that needs them. The attach that follows starts afresh.
func (l *Loader) leaveNetNS(id uint32, meta maps.PodMeta) error {
	errs := []error{l.deletePodNetNS(id, meta)}
	if l.probes != nil {
		errs = append(errs, l.probes.DetachHost(id))
	}
	l.setHostProbe(id, false)
	l.dropLinks(id)
	for _, d := range []direction{ingress, egress} {
		errs = append(errs, l.detachTCX(id, d))
	}
	return errors.Join(errs...)
}

// openAttachedNetNS opens the namespace at meta's path for the detach of
// pod id. A namespace that is gone took the pod's rules and routes with
// it, and its sockets: nil, no error. With recorded set, ino is the
// namespace the pod was attached in: a path that names another one now (a
// new sandbox, maybe another pod's, given the old one's path) is not
// opened either, since what is there is not the pod's. Nor is a namespace
// another pod's capture is in force in (otherPodIn): the kernel gives a new
// namespace a freed one's inode number, so a new sandbox at the old path
// can pass for the old one by inode; its sockets, rules and routes are the
// other pod's, kept in the mesh by its capture.
func (l *Loader) openAttachedNetNS(ctx context.Context, id uint32, meta maps.PodMeta, ino uint32, recorded bool) (*netns.Handle, error) {
	h, err := netns.Open(meta.NetNS)
	if err != nil {
		return nil, l.nsGone(ctx, meta, err)
	}
	cur, err := h.Inode()
	switch {
	case err != nil:
		h.Close()
		return nil, err
	case recorded && cur != uint64(ino):
		h.Close()
		l.log.InfoContext(ctx, "pod's network namespace path names another namespace now: nothing undone there",
			"pod", meta.Namespace+"/"+meta.Name, "netns", meta.NetNS, "attached_inode", ino, "path_inode", cur)
		return nil, nil
	}
	if other, ok := l.otherPodIn(id, cur); ok {
		h.Close()
		l.log.InfoContext(ctx, "pod's network namespace is another attached pod's: nothing undone there, no socket ended",
			"pod", meta.Namespace+"/"+meta.Name, "netns", meta.NetNS, "inode", cur, "other_pod_id", other)
		return nil, nil
	}
	return h, nil
}

// otherPodIn reports whether the capture of another pod than id is in
// force in the namespace of inode ino, as the programs judge it: its
// rd_pod_netns entry names that pod, and so does the enrollment entry of
// the address it names.
func (l *Loader) otherPodIn(id uint32, ino uint64) (uint32, bool) {
	if l.maps.PodNetNS == nil || ino > math.MaxUint32 {
		return 0, false
	}
	e, ok, err := l.maps.PodNetNSOf(uint32(ino))
	if err != nil || !ok || e.PodID == id {
		return 0, false
	}
	s, ok, err := l.maps.Pod(e.Addr)
	return e.PodID, err == nil && ok && s.PodID == e.PodID
}

// nsGone is err, or nil when it says the pod's namespace is gone: the
// namespace being gone (pod deleted) takes its links, rules and routes
// with it; anything else is worth reporting.
func (l *Loader) nsGone(ctx context.Context, meta maps.PodMeta, err error) error {
	if err != nil && errors.Is(err, os.ErrNotExist) {
		l.log.DebugContext(ctx, "pod network namespace already gone", "pod", meta.Namespace+"/"+meta.Name, "netns", meta.NetNS)
		return nil
	}
	return err
}

// undoInNetNS removes the legacy filters, rules and routes attaching left in
// the pod's namespace h (openAttachedNetNS) and restores its sysctls.
func (l *Loader) undoInNetNS(ctx context.Context, h *netns.Handle, meta maps.PodMeta) error {
	return l.nsGone(ctx, meta, h.Do(func() error {
		var errs []error
		iface, err := netlink.LinkByName(meta.Interface)
		if err == nil && meta.AttachMode == maps.AttachTCLegacy {
			errs = append(errs, detachLegacy(iface.Attrs().Index))
		}
		if err == nil {
			l.releaseStrays(iface.Attrs().Index)
		}
		errs = append(errs, l.delRouting(meta.Addrs))
		if err == nil && hasV4(meta.Addrs) {
			if meta.AcceptLocal >= 0 {
				errs = append(errs, writeSysctl(sysctlPath(l.cfg.Settings.ProcDir, "ipv4", meta.Interface, "accept_local"), meta.AcceptLocal))
			}
			if meta.RPFilter >= 0 {
				errs = append(errs, writeSysctl(sysctlPath(l.cfg.Settings.ProcDir, "ipv4", meta.Interface, "rp_filter"), meta.RPFilter))
			}
			if meta.RPFilterAll > 0 { // 0: nothing was changed, or an older agent's entry
				errs = append(errs, writeSysctl(sysctlPath(l.cfg.Settings.ProcDir, "ipv4", "all", "rp_filter"), meta.RPFilterAll))
			}
		}
		return errors.Join(errs...)
	}))
}

// detach undoes what attaching pod id did. With endSockets (a pod leaving
// the mesh), its captured sockets are ended first, while the capture is
// still in place (endCaptured).
func (l *Loader) detach(ctx context.Context, id uint32, meta maps.PodMeta, endSockets bool) error {
	// Which namespace the pod was attached in, before its record goes.
	ino, recorded := l.recordedNetNS(id)
	h, err := l.openAttachedNetNS(ctx, id, meta, ino, recorded)
	errs := []error{err}
	if h != nil {
		defer h.Close()
		if endSockets {
			l.endCaptured(ctx, h, meta)
		}
	}
	errs = append(errs, l.deletePodNetNS(id, meta))
	for _, a := range meta.Addrs {
		errs = append(errs, l.deleteEntry(a, id))
	}
	if l.probes != nil {
		errs = append(errs, l.probes.DetachHost(id))
	}
	if h != nil {
		errs = append(errs, l.undoInNetNS(ctx, h, meta))
	}
	// The held links go with their pins; either alone keeps a link attached.
	l.dropLinks(id)
	for _, d := range []direction{ingress, egress} {
		errs = append(errs, l.detachTCX(id, d))
	}
	// Never recursive: what someone else put there stays, and keeps the
	// directory.
	if err := os.Remove(l.podDir(id)); errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EEXIST) {
		l.log.WarnContext(ctx, "pod pin directory kept: it holds entries this agent did not create", "dir", l.podDir(id))
	} else if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("remove pod pin dir: %w", err))
	}
	for _, a := range meta.Addrs {
		errs = append(errs, l.deleteCounters(a, id))
	}
	if err := l.maps.DeleteMeta(id); err != nil {
		errs = append(errs, err)
	} else {
		l.unindex(id, meta.UID)
	}
	return errors.Join(errs...)
}

// PodState is one attached pod as the pinned state records it.
type PodState struct {
	ID   uint32
	Meta maps.PodMeta
}

// Pods lists the attached pods from the pinned state.
func (l *Loader) Pods() ([]PodState, error) {
	metas, err := l.maps.ListMeta()
	if err != nil {
		return nil, err
	}
	out := make([]PodState, 0, len(metas))
	for id, m := range metas {
		out = append(out, PodState{ID: id, Meta: m})
	}
	return out, nil
}

// PodState returns the attachment of the pod uid, if it is attached, from
// the loader's index (no map read).
func (l *Loader) PodState(uid string) (PodState, bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.loadIndexLocked(); err != nil {
		return PodState{}, false, err
	}
	id, ok := l.byUID[uid]
	if !ok {
		return PodState{}, false, nil
	}
	return PodState{ID: id, Meta: l.metas[id]}, true, nil
}

// PodCount is the number of attached pods, from the loader's index.
func (l *Loader) PodCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.loadIndexLocked() != nil {
		return 0
	}
	return len(l.byUID)
}

func findPod(metas map[uint32]maps.PodMeta, uid string) (uint32, maps.PodMeta, bool) {
	for id, m := range metas {
		if m.UID == uid {
			return id, m, true
		}
	}
	return 0, maps.PodMeta{}, false
}

// freeID picks the smallest unused pod id, starting at 1.
func freeID(metas map[uint32]maps.PodMeta) (uint32, error) {
	for id := uint32(1); id <= uint32(maxPods); id++ {
		if _, used := metas[id]; !used {
			return id, nil
		}
	}
	return 0, fmt.Errorf("all %d pod slots are in use", maxPods)
}

const maxPods = 4096 // MAX_PODS in bpf/include/maps.h

func hasV4(addrs []netip.Addr) bool {
	for _, a := range addrs {
		if a.Is4() {
			return true
		}
	}
	return false
}

func containsAddr(addrs []netip.Addr, a netip.Addr) bool {
	for _, b := range addrs {
		if a == b {
			return true
		}
	}
	return false
}

// KernelOK reports whether the attached pod p still has, for every address,
// its enrollment entry, and its links attached and pinned; with full, also
// its host-probe link pins and its rd_pod_netns entry (one an older agent,
// overlapping an upgrade, attached the pod without), and for a pod attached
// with legacy tc its filters (legacyAttached). A pod with a link Relink
// could not point at this loader's programs fails it. It is the cheap check
// a reconcile makes before attaching a pod again.
func (l *Loader) KernelOK(p PodState, full bool) bool {
	if l.isStale(p.ID) {
		return false // a link may run another agent's program (Relink)
	}
	for _, a := range p.Meta.Addrs {
		if s, ok, err := l.maps.Pod(a); err != nil || !ok || s != p.Meta.Settings {
			return false
		}
	}
	if !l.linksOK(p.ID, p.Meta.AttachMode == maps.AttachTCX) {
		return false
	}
	if full && p.Meta.AttachMode == maps.AttachTCLegacy && !l.legacyAttached(p) {
		return false
	}
	return !full || (l.hostProbeOK(p.ID) && l.podNetNSOK(p))
}

// podNetNSOK reports whether p's namespace has its rd_pod_netns entry,
// naming p.
func (l *Loader) podNetNSOK(p PodState) bool {
	if l.maps.PodNetNS == nil {
		return true // maps of an older layout: nothing to check
	}
	ino, err := netnsIno(p.Meta.NetNS)
	if err != nil {
		return false
	}
	e, ok, err := l.maps.PodNetNSOf(ino)
	return err == nil && ok && e.PodID == p.ID
}

// Matches reports whether the pod is attached as want says: namespace,
// interface, addresses and inbound capture.
func (p PodState) Matches(want Pod) bool {
	iface := want.Interface
	if iface == "" {
		iface = "eth0"
	}
	addrs := slices.Clone(want.Addrs)
	for i := range addrs {
		addrs[i] = addrs[i].Unmap()
	}
	return p.Meta.NetNS == want.NetNS && p.Meta.Interface == iface &&
		slices.Equal(p.Meta.Addrs, addrs) && p.Meta.Settings.CaptureInbound == want.CaptureInbound && p.Meta.Settings.CaptureDNS == want.CaptureDNS
}
