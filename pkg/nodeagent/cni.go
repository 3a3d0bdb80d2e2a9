package nodeagent

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// cniPod is what the CNI plugin told the agent about a pod sandbox: the
// namespace it lives in and the addresses the primary CNI gave it. At ADD
// time the API does not know the addresses yet.
type cniPod struct {
	uid string
	// container is the sandbox's id (CNI_CONTAINERID): only its own DEL
	// drops the report.
	container string
	netns     string // as the agent opens it (see netns.HostPath)
	ino       uint64 // the namespace's inode when the ADD came
	addrs     []netip.Addr
	// deleted marks the sandbox's own DEL: its report no longer counts,
	// and what the loader recorded for the pod must not stand in for it
	// (withAttachedPending) while the namespace still exists. It goes
	// with the namespace (pruneCNIPods).
	deleted bool
}

// cniWait bounds how long an ADD waits for the source to know the pod.
const cniWait = 20 * time.Second

// podInterface is the sandbox interface the capture is attached to (the
// loader's default, loader.Pod.Interface), whose ADD enrolls the pod.
const podInterface = "eth0"

// HandleCNI answers the chained plugin. ADD returns only once a selected pod
// is redirected, so its first packet is meshed; a pod the agent cannot
// decide on fails the ADD (the runtime retries), never starts unmeshed.
func (a *Agent) HandleCNI(ctx context.Context, ev cni.PodEvent) (cni.Response, error) {
	key := ev.PodNamespace + "/" + ev.PodName
	var addrErr error // the ADD's addresses were refused
	var ino uint64    // the inode of the namespace the ADD or CHECK names
	// check: the event only asks whether the pod is as it should be. An
	// ADD of another interface of the sandbox (a second network's, as
	// Multus adds when the plugin is chained there too) is one: its
	// addresses are not on the interface the capture is on, and taken as
	// the pod's report they replaced its eth0 addresses (in the directory
	// too), the attach failed, and that ADD failed, so the pod never started.
	check := ev.Command == cni.CommandCheck
	otherIface := ev.Command == cni.CommandAdd && ev.IfName != "" && ev.IfName != podInterface
	switch ev.Command {
	case cni.CommandDel:
		if ev.IfName != "" && ev.IfName != podInterface {
			// Another interface going (a second network's DEL, at the
			// sandbox's end or unplugged from a running pod by Multus's
			// dynamic networks): the pod's eth0 stays, and so does its report.
			return cni.Response{Reason: "interface " + ev.IfName + " is not the one the pod is enrolled on (" + podInterface + ")"}, nil
		}
		// Only the reported sandbox's own DEL drops its report. Runtimes
		// repeat DEL for a sandbox they tear down or collect late, after
		// the pod's next sandbox (or the next pod of the name) was added:
		// dropping the newer report would send a pod whose source knows no
		// address yet back to pending, and detach it.
		a.mu.Lock()
		rec, ok := a.cniPods[key]
		stale := ok && (rec.container != ev.ContainerID || (rec.uid != "" && ev.PodUID != "" && rec.uid != ev.PodUID))
		if ok && !stale {
			a.cniPods[key] = cniPod{uid: rec.uid, container: rec.container, netns: rec.netns, ino: rec.ino, deleted: true}
			a.publishReportsLocked()
		}
		a.mu.Unlock()
		if stale {
			a.log.InfoContext(ctx, "CNI DEL of an earlier sandbox ignored: the pod's current sandbox stays",
				"pod", key, "container", ev.ContainerID, "uid", ev.PodUID, "current_container", rec.container, "current_uid", rec.uid)
			return cni.Response{Reason: "an earlier sandbox of the pod; the current one (container " + rec.container + ") stays"}, nil
		}
		a.applyLatest(ctx, false)
		return cni.Response{}, nil
	case cni.CommandAdd, cni.CommandCheck:
		path := netns.HostPath(a.cfg.ProcDir, ev.NetNS)
		var err error
		if ino, err = a.checkCNINetNS(ev, path); err != nil {
			return cni.Response{}, err
		}
		if check || otherIface {
			check = true
			break
		}
		addrs, err := checkCNIAddrs(ev, path)
		if err != nil {
			// The report is not recorded: the pod's previous one (or its
			// source's addresses) stays, so an enrolled pod is not
			// detached by a broken result. A selected pod fails the ADD.
			addrErr = err
			break
		}
		a.mu.Lock()
		a.cniPods[key] = cniPod{uid: ev.PodUID, container: ev.ContainerID, netns: path, ino: ino, addrs: addrs}
		a.publishReportsLocked()
		a.mu.Unlock()
	}
	deadline := time.Now().Add(cniWait)
	// One apply puts the reported namespace and addresses into the wanted
	// state (the workers converge the pod); after that the ADD only waits
	// for the state to say so: the main loop applies new snapshots.
	next, synced := a.applyAndWatch(ctx)
	for {
		w, known := a.cfg.Tunnel.State().Dir.Pod(ev.PodNamespace, ev.PodName)
		if known && ev.PodUID != "" && w.UID != "" && ev.PodUID != w.UID {
			// The source still has an earlier pod of this name (a
			// StatefulSet's): not this sandbox's until it learns the new one.
			known = false
		}
		refused := a.refusedErr(w)
		switch {
		case known && addrErr != nil && (w.Enrolled || w.Pending != "" || w.Undecided != ""):
			return cni.Response{}, fmt.Errorf("pod %s is selected but its ADD is refused: %w; refusing to start it with these addresses", key, addrErr)
		case known && addrErr != nil:
			return cni.Response{Reason: w.Reason}, nil
		case known && refused != nil:
			// Selected, but its address is another pod's: it must not
			// start unmeshed, so the runtime retries.
			return cni.Response{}, refused
		case known && !w.Enrolled && w.Undecided != "":
			return cni.Response{}, fmt.Errorf("pod %s cannot be judged yet: %s; refusing to start it unmeshed", key, w.Undecided)
		case known && !w.Enrolled && w.Pending != "":
			// Selected, but the plugin gave no address it can be enrolled
			// with: it must not start unmeshed, so the runtime retries.
			why := "the CNI result (prevResult) carries no address for the pod's interface"
			switch {
			case otherIface:
				why = otherIfaceWhy(ev)
			case len(ev.IPs) > 0:
				why = w.Reason
			}
			return cni.Response{}, fmt.Errorf("pod %s is selected (%s) but cannot be enrolled: %s; refusing to start it unmeshed", key, w.Pending, why)
		case known && !w.Enrolled:
			return cni.Response{Reason: w.Reason}, nil
		case known && a.converged(w.Key()):
			if check {
				if err := a.attachedElsewhereErr(w.Key(), key, ev, ino); err != nil {
					return cni.Response{}, err
				}
			} else if err := a.supersededErr(key, ev, ino); err != nil {
				return cni.Response{}, err
			}
			return cni.Response{Enrolled: true, Reason: w.Reason}, nil
		case known && otherIface:
			return cni.Response{}, fmt.Errorf("pod %s is selected (%s) but not redirected: %s", key, w.Reason, otherIfaceWhy(ev))
		case known && check:
			return cni.Response{}, fmt.Errorf("pod %s is selected (%s) but not redirected", key, w.Reason)
		case !known && slices.Contains(a.cfg.Selection.ExcludeNamespaces, ev.PodNamespace):
			// Never enrolled whatever the source says: no need to wait
			// for it (after a reboot, CoreDNS and the rest of kube-system
			// start before the agent's source answers).
			return cni.Response{Reason: "namespace " + ev.PodNamespace + " is excluded"}, nil
		case time.Now().After(deadline) || ctx.Err() != nil:
			if !known && addrErr != nil {
				return cni.Response{}, fmt.Errorf("pod %s is unknown to the agent's source after %s, and its ADD is refused: %w", key, cniWait, addrErr)
			}
			if !known {
				return cni.Response{}, fmt.Errorf("pod %s is unknown to the agent's source after %s; refusing to start it unmeshed", key, cniWait)
			}
			return cni.Response{}, fmt.Errorf("pod %s is selected (%s) but could not be redirected; see the agent's log", key, w.Reason)
		}
		// A new snapshot (the source learning of the pod) or a pod the
		// workers converged wakes the wait; the poll is a backstop.
		select {
		case <-ctx.Done():
		case <-next:
		case <-synced:
		case <-time.After(200 * time.Millisecond):
		}
		next, synced = a.watch()
	}
}

// otherIfaceWhy says why an ADD of another interface than podInterface
// does not enroll the pod.
func otherIfaceWhy(ev cni.PodEvent) string {
	return fmt.Sprintf("this ADD is for interface %s (CNI_IFNAME), and a pod is enrolled on %s by the ADD of %s (redirector-cni chained into the pod's primary network)", ev.IfName, podInterface, podInterface)
}

// supersededErr is why the ADD ev no longer speaks for the pod once it is
// converged: another sandbox's ADD replaced its report while it waited (the
// pod is attached there, not in this sandbox, which would start unmeshed),
// its own DEL came, or its namespace ended. Callers do not hold a.mu.
func (a *Agent) supersededErr(key string, ev cni.PodEvent, ino uint64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	rec, ok := a.cniPods[key]
	switch {
	case !ok:
		return fmt.Errorf("pod %s: the report of container %s is gone (its namespace %s ended) while its ADD waited", key, ev.ContainerID, ev.NetNS)
	case rec.container != ev.ContainerID || rec.ino != ino:
		return fmt.Errorf("pod %s: the ADD of container %s (namespace %s) was superseded by container %s's (namespace %s) while it waited; the pod is attached there, not in this sandbox", key, ev.ContainerID, ev.NetNS, rec.container, rec.netns)
	case rec.deleted:
		return fmt.Errorf("pod %s: container %s was DELeted while its ADD waited", key, ev.ContainerID)
	}
	return nil
}

// attachedElsewhereErr is why a CHECK of the sandbox in namespace ino
// fails although the pod is converged: it is attached in another namespace
// (another sandbox's), so this one is not meshed.
func (a *Agent) attachedElsewhereErr(uid, key string, ev cni.PodEvent, ino uint64) error {
	st, attached, err := a.cfg.Loader.PodState(uid)
	if err != nil {
		return fmt.Errorf("pod %s: read its attachment: %w", key, err)
	}
	if !attached {
		return fmt.Errorf("pod %s is selected but not attached", key)
	}
	// By the namespace the pod was attached in, not the one its path names
	// now: a new sandbox may have been given the old one's path.
	cur, ok := a.cfg.Loader.AttachedNetNS(uid)
	if !ok {
		var err error
		if cur, err = netns.Inode(st.Meta.NetNS); err != nil {
			cur = 0
		}
	}
	if cur == 0 || cur != ino {
		return fmt.Errorf("pod %s is attached in network namespace %s (inode %d), not in %s (inode %d, CNI_NETNS of container %s): this sandbox is not redirected", key, st.Meta.NetNS, cur, ev.NetNS, ino, ev.ContainerID)
	}
	return nil
}

// maxCNIAddrs bounds the addresses one ADD may report; a pod has one per
// family, a few more with secondary ranges.
const maxCNIAddrs = 16

// checkCNIAddrs returns the addresses the ADD reports (prevResult), unmapped
// and without duplicates, once each is one a pod can have and is configured
// in the namespace at path, the one the ADD names. The plugin's word is not
// enough here either: the report replaces the pod's addresses (withCNIAddrs),
// so an address that is not the pod's would enroll it with another pod's
// address, and one that cannot be a pod's would detach a pod that is
// enrolled. Errors name the field and the address.
func checkCNIAddrs(ev cni.PodEvent, path string) ([]netip.Addr, error) {
	if len(ev.IPs) > maxCNIAddrs {
		return nil, fmt.Errorf("prevResult has %d addresses for the pod, at most %d are taken", len(ev.IPs), maxCNIAddrs)
	}
	var addrs []netip.Addr
	for i, p := range ev.IPs {
		ad := p.Addr().Unmap()
		if err := selection.CheckPodAddr(ad); err != nil {
			return nil, fmt.Errorf("prevResult ips[%d] %s: %w", i, p, err)
		}
		if !slices.Contains(addrs, ad) {
			addrs = append(addrs, ad)
		}
	}
	if len(addrs) == 0 {
		return nil, nil
	}
	have, err := netns.Addrs(path)
	if err != nil {
		return nil, fmt.Errorf("prevResult addresses: %w", err)
	}
	for i, p := range ev.IPs {
		if !slices.Contains(have, p.Addr().Unmap()) {
			return nil, fmt.Errorf("prevResult ips[%d] %s: not configured in network namespace %s, so not the pod's", i, p, ev.NetNS)
		}
	}
	return addrs, nil
}

// checkCNINetNS says whether path, the namespace ev names (as the agent
// opens it), can be the pod's, and returns its inode. The plugin's word is
// not enough: a path that leads to the host's namespace, or to one another
// pod is attached in or was reported in, would mesh the node or give this
// pod's identity to the other pod's traffic. Such an event is refused with
// an error naming the path, before anything is recorded or entered.
func (a *Agent) checkCNINetNS(ev cni.PodEvent, path string) (uint64, error) {
	key := ev.PodNamespace + "/" + ev.PodName
	ino, err := netns.CheckPodPath(path, a.cfg.ProcDir)
	if err != nil {
		return 0, fmt.Errorf("pod %s: CNI_NETNS %s refused: %w", key, ev.NetNS, err)
	}
	if owner := a.netnsOwner(key, ev.PodUID, ino); owner != "" {
		return 0, fmt.Errorf("pod %s: CNI_NETNS %s refused: it is the network namespace of pod %s: %w", key, ev.NetNS, owner, netns.ErrNotPodNetNS)
	}
	return ino, nil
}

// netnsOwner names another pod than key (uid, if known) that the namespace
// with inode ino is the namespace of: one attached in it, or one a CNI
// report names it for (a DELeted report too, while that namespace lives).
// "" if none.
func (a *Agent) netnsOwner(key, uid string, ino uint64) string {
	uid = uidOf(key, uid)
	other := func(namespace, name, otherUID string) bool {
		k := namespace + "/" + name
		otherUID = uidOf(k, otherUID)
		return k != key || (otherUID != "" && uid != "" && otherUID != uid)
	}
	owner := ""
	if a.cfg.Loader != nil {
		if pods, err := a.cfg.Loader.Pods(); err == nil {
			for _, p := range pods {
				if !other(p.Meta.Namespace, p.Meta.Name, p.Meta.UID) {
					continue
				}
				// Only while the other pod is attached in this namespace
				// (its recorded inode, else what its path names): a freed
				// namespace's inode number is reused, and a path can be
				// given to a new sandbox.
				if a.cfg.Loader.AttachedAt(p.Meta.UID, p.Meta.NetNS) && a.attachedIno(p) == ino {
					owner = p.Meta.Namespace + "/" + p.Meta.Name
					break
				}
			}
		}
	}
	if owner == "" {
		// A DELeted report counts while its namespace lives: a DEL does
		// not free a namespace for another pod (the runtime destroys it
		// next), and each live namespace stays one pod's report, which
		// bounds the reports by the node's namespaces.
		if m := a.reportedNetNS.Load(); m != nil {
			for _, rec := range (*m)[ino] {
				ns, name, _ := strings.Cut(rec.key, "/")
				if !other(ns, name, rec.uid) {
					continue
				}
				if cur, err := netns.Inode(rec.netns); err == nil && cur == ino {
					owner = rec.key
					break
				}
			}
		}
	}
	return owner
}

// attachedIno is the inode of the namespace the attached pod p is in: the
// loader's record, else what its path names (0 if nothing).
func (a *Agent) attachedIno(p loader.PodState) uint64 {
	if ino, ok := a.cfg.Loader.AttachedNetNS(p.Meta.UID); ok {
		return ino
	}
	ino, _ := netns.Inode(p.Meta.NetNS)
	return ino
}

// foreignNetNS says why the namespace at path, found by the address of the
// pod key (uid), cannot be that pod's, or "": another pod is attached in it
// or was reported in it, or its processes run in another pod's cgroup. An
// address alone does not make a namespace a pod's: the API can still give
// a pod the address its new sandbox no longer has, which the runtime may
// have given another pod, one outside the mesh even, whose traffic would
// then leave with this pod's identity.
func (a *Agent) foreignNetNS(key, uid, path string) string {
	uid = uidOf(key, uid)
	ino, err := netns.Inode(path)
	if err != nil {
		return ""
	}
	if owner := a.netnsOwner(key, uid, ino); owner != "" {
		return "it is the network namespace of pod " + owner
	}
	if uids := netns.PodUIDsIn(a.procDir(), ino); len(uids) > 0 && uid != "" && !uids[uid] {
		return "its processes belong to another pod (uid " + strings.Join(slices.Sorted(maps.Keys(uids)), ", ") + ")"
	}
	return ""
}

// uidOf is uid, or "" when it is the pod's key (namespace/name): a pod the
// source knows no UID of (a mirror pod, whose runtime UID is not the API's:
// kubeobj.PodUID; a manifest's pod without one) is keyed by name, and
// comparing that key with a runtime's UID took the pod's own namespace for
// another pod's.
func uidOf(key, uid string) string {
	if uid == key {
		return ""
	}
	return uid
}

// procDir is the host's /proc as the agent sees it.
func (a *Agent) procDir() string {
	if a.cfg.ProcDir != "" {
		return a.cfg.ProcDir
	}
	return "/proc"
}

// refusedErr is why the local pod w, selected, is refused (claimAddrs), or
// nil.
func (a *Agent) refusedErr(w *workload.Workload) error {
	if w == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.refused[w.Key()]
}

// withCNIAddrs returns the workloads with the addresses the CNI plugin
// reported given to selected pods of the reported uid whose source knows
// no address yet (workload.Workload.Pending), so a pod is enrolled while
// its sandbox is being created, or whose source still has other
// addresses: those of an earlier sandbox of the pod, which the API keeps
// until the kubelet reports the new one, and the kubelet reports it only
// once the ADD succeeded. A live report is the current sandbox's own
// (its DEL or the end of its namespace drops it). The workloads
// themselves are shared and stay untouched; an address that cannot be a
// pod's keeps the pod out.
func withCNIAddrs(ws []*workload.Workload, cniPods map[string]cniPod) []*workload.Workload {
	if len(cniPods) == 0 {
		return ws
	}
	out := slices.Clone(ws)
	for i, w := range out {
		rec, ok := cniPods[w.Namespace+"/"+w.Name]
		if !ok || len(rec.addrs) == 0 || (rec.uid != "" && w.UID != "" && rec.uid != w.UID) {
			continue
		}
		c := *w
		switch {
		case w.Pending != "":
			c.Addrs, c.Enrolled, c.Reason, c.Pending = rec.addrs, true, w.Pending, ""
		case w.Enrolled && !sameAddrs(w.Addrs, rec.addrs):
			c.Addrs = rec.addrs
			c.Reason = fmt.Sprintf("%s; addresses %v from the CNI plugin (the API still has %v, of an earlier sandbox)", w.Reason, rec.addrs, w.Addrs)
		default:
			continue
		}
		for _, a := range rec.addrs {
			if err := selection.CheckPodAddr(a); err != nil {
				// Still pending: selected, and refused at its ADD.
				c.Addrs, c.Enrolled, c.Reason, c.Pending = nil, false, fmt.Sprintf("pod %s: address from the CNI plugin: %v", w, err), cmp.Or(w.Pending, w.Reason)
				break
			}
		}
		out[i] = &c
	}
	return out
}

// sameAddrs says whether a and b hold the same addresses, in any order.
func sameAddrs(a, b []netip.Addr) bool {
	if len(a) != len(b) {
		return false
	}
	for _, x := range a {
		if !slices.Contains(b, x) {
			return false
		}
	}
	return true
}

// withAttachedPending returns the CNI reports, completed with what the
// loader recorded for this node's pods that are attached while their
// source knows no address yet and that no report covers. Reports live in
// this process only: after a restart, a pod enrolled at its ADD by the
// previous process would otherwise go back to pending and be detached,
// sending a pod answered "enrolled" in plaintext until its source learns
// the address. Callers hold a.mu.
func (a *Agent) withAttachedPending(ws []*workload.Workload) map[string]cniPod {
	if a.cfg.Loader == nil {
		return a.cniPods
	}
	out, cloned := a.cniPods, false
	for _, w := range ws {
		if w.Node != a.cfg.Node || w.Pending == "" {
			continue
		}
		key := w.Namespace + "/" + w.Name
		if rec, ok := a.cniPods[key]; ok && (rec.uid == "" || w.UID == "" || rec.uid == w.UID) {
			continue
		}
		st, attached, err := a.cfg.Loader.PodState(w.Key())
		if err != nil || !attached || len(st.Meta.Addrs) == 0 {
			continue
		}
		if _, err := netns.CheckPodPath(st.Meta.NetNS, a.cfg.ProcDir); err != nil || !a.cfg.Loader.AttachedAt(w.Key(), st.Meta.NetNS) {
			continue // the sandbox is gone (its path may name another): the pod is detached
		}
		if !cloned {
			out, cloned = maps.Clone(a.cniPods), true
			if out == nil {
				out = map[string]cniPod{}
			}
		}
		out[key] = cniPod{uid: w.UID, netns: st.Meta.NetNS, addrs: slices.Clone(st.Meta.Addrs)}
	}
	return out
}

// pruneCNIPods drops the reports (and DEL marks) whose namespace is gone:
// the sandbox was destroyed, so they say nothing any more. Reports of pods
// the source never delivered would otherwise stay for ever. Callers hold
// a.mu.
func (a *Agent) pruneCNIPods() {
	pruned := false
	for k, rec := range a.cniPods {
		if cur, err := netns.Inode(rec.netns); err != nil || (rec.ino != 0 && cur != rec.ino) {
			delete(a.cniPods, k)
			pruned = true
		}
	}
	if pruned {
		a.publishReportsLocked()
	}
}

// reportedNS is one CNI report's namespace, as netnsOwner reads it.
type reportedNS struct {
	key, uid, netns string
}

// publishReportsLocked publishes the CNI reports' namespaces by inode, for
// netnsOwner to read without a.mu: the full pass asks it while apply holds
// a.mu. Callers hold a.mu and call it after every change of a.cniPods.
func (a *Agent) publishReportsLocked() {
	m := make(map[uint64][]reportedNS, len(a.cniPods))
	for k, rec := range a.cniPods {
		if rec.ino != 0 {
			m[rec.ino] = append(m[rec.ino], reportedNS{key: k, uid: rec.uid, netns: rec.netns})
		}
	}
	a.reportedNetNS.Store(&m)
}

// CNIReports is how many pod sandboxes the CNI plugin reported whose
// namespace still exists (DELeted ones included): at most one a namespace
// (checkCNINetNS), for the metric.
func (a *Agent) CNIReports() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.cniPods)
}

// cniNetNS returns the namespace path the CNI plugin reported for w, if
// any, and the inode it named then.
func (a *Agent) cniNetNS(w *workload.Workload) (path string, ino uint64) {
	rec, ok := a.cniPods[w.Namespace+"/"+w.Name]
	if !ok || rec.deleted || (rec.uid != "" && w.UID != "" && rec.uid != w.UID) {
		return "", 0
	}
	return rec.netns, rec.ino
}

// WriteStartupHint writes the CNI selection hint an agent that has not
// read its source yet can give (cni.WriteStartupHint), where none is.
func (a *Agent) WriteStartupHint() {
	if a.cfg.CNISocket == "" {
		return
	}
	path := filepath.Join(filepath.Dir(a.cfg.CNISocket), filepath.Base(cni.DefaultHintPath))
	if err := cni.WriteStartupHint(path, a.cfg.Selection.ExcludeNamespaces); err != nil {
		a.log.Error("write CNI start-up selection hint", "path", path, "error", err)
	}
}

// writeHint records which namespaces are ambient for the plugin to consult
// when the agent is down; it is rewritten only when it changes.
func (a *Agent) writeHint(s source.Snapshot) {
	if a.cfg.CNISocket == "" {
		return
	}
	ambient := s.AmbientNamespaces
	key := strings.Join(ambient, ",") + "|" + strings.Join(a.cfg.Selection.ExcludeNamespaces, ",")
	if key == a.lastHint {
		return
	}
	path := filepath.Join(filepath.Dir(a.cfg.CNISocket), filepath.Base(cni.DefaultHintPath))
	if err := cni.WriteSelectionHint(path, ambient, a.cfg.Selection.ExcludeNamespaces); err != nil {
		a.log.Error("write CNI selection hint", "path", path, "error", err)
		return
	}
	a.lastHint = key
}
