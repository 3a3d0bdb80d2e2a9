package main

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"

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
	uid   string
	netns string // as the agent opens it (see netns.HostPath)
	addrs []netip.Addr
}

// cniWait bounds how long an ADD waits for the source to know the pod.
const cniWait = 20 * time.Second

// handleCNI answers the chained plugin. ADD returns only once a selected pod
// is redirected, so its first packet is meshed; a pod the agent cannot
// decide on fails the ADD (the runtime retries), never starts unmeshed.
func (a *agent) handleCNI(ctx context.Context, ev cni.PodEvent) (cni.Response, error) {
	key := ev.PodNamespace + "/" + ev.PodName
	switch ev.Command {
	case cni.CommandDel:
		a.mu.Lock()
		delete(a.cniPods, key)
		a.mu.Unlock()
		a.applyLatest(ctx, false)
		return cni.Response{}, nil
	case cni.CommandAdd:
		var addrs []netip.Addr
		for _, p := range ev.IPs {
			addrs = append(addrs, p.Addr().Unmap())
		}
		a.mu.Lock()
		a.cniPods[key] = cniPod{uid: ev.PodUID, netns: netns.HostPath(a.cfg.procDir, ev.NetNS), addrs: addrs}
		a.mu.Unlock()
	}
	deadline := time.Now().Add(cniWait)
	for {
		next := a.applyAndWatch(ctx)
		w, known := a.tun.State().Dir.Pod(ev.PodNamespace, ev.PodName)
		switch {
		case known && !w.Enrolled:
			return cni.Response{Reason: w.Reason}, nil
		case known && a.attached(podUID(w)):
			return cni.Response{Enrolled: true, Reason: w.Reason}, nil
		case known && ev.Command == cni.CommandCheck:
			return cni.Response{}, fmt.Errorf("pod %s is selected (%s) but not redirected", key, w.Reason)
		case time.Now().After(deadline) || ctx.Err() != nil:
			if !known {
				return cni.Response{}, fmt.Errorf("pod %s is unknown to the agent's source after %s; refusing to start it unmeshed", key, cniWait)
			}
			return cni.Response{}, fmt.Errorf("pod %s is selected (%s) but could not be redirected; see the agent's log", key, w.Reason)
		}
		// A new snapshot (the source learning of the pod) wakes the wait;
		// the poll covers what a snapshot does not bring (an attach retried).
		select {
		case <-ctx.Done():
		case <-next:
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (a *agent) attached(uid string) bool {
	pods, err := a.ld.Pods()
	if err != nil {
		return false
	}
	return slices.ContainsFunc(pods, func(p loader.PodState) bool { return p.Meta.UID == uid })
}

// withCNIAddrs returns the snapshot with the addresses the CNI plugin
// reported filled into pods whose status has none yet, so a pod is enrolled
// while its sandbox is being created. The snapshot itself is shared and
// stays untouched.
func withCNIAddrs(s source.Snapshot, cniPods map[string]cniPod) source.Snapshot {
	if len(cniPods) == 0 {
		return s
	}
	pods := slices.Clone(s.Pods)
	for i := range pods {
		p := &pods[i]
		rec, ok := cniPods[p.Namespace+"/"+p.Name]
		if !ok || (rec.uid != "" && string(p.UID) != "" && rec.uid != string(p.UID)) {
			continue
		}
		if p.Status.PodIP != "" || len(p.Status.PodIPs) > 0 || len(rec.addrs) == 0 {
			continue
		}
		status := p.Status.DeepCopy()
		for _, a := range rec.addrs {
			status.PodIPs = append(status.PodIPs, corev1.PodIP{IP: a.String()})
		}
		status.PodIP = status.PodIPs[0].IP
		p.Status = *status
	}
	s.Pods = pods
	return s
}

// cniNetNS returns the namespace path the CNI plugin reported for w, if any.
func (a *agent) cniNetNS(w *workload.Workload) string {
	rec, ok := a.cniPods[w.Namespace+"/"+w.Name]
	if !ok || (rec.uid != "" && w.UID != "" && rec.uid != w.UID) {
		return ""
	}
	return rec.netns
}

// writeHint records which namespaces are ambient for the plugin to consult
// when the agent is down; it is rewritten only when it changes.
func (a *agent) writeHint(s source.Snapshot) {
	if a.cfg.cniSocket == "" {
		return
	}
	var ambient []string
	for _, ns := range s.Namespaces {
		if ns.Labels[selection.DataplaneModeLabel] == selection.DataplaneModeAmbient {
			ambient = append(ambient, ns.Name)
		}
	}
	key := strings.Join(ambient, ",") + "|" + strings.Join(a.cfg.selection.ExcludeNamespaces, ",")
	if key == a.lastHint {
		return
	}
	path := filepath.Join(filepath.Dir(a.cfg.cniSocket), filepath.Base(cni.DefaultHintPath))
	if err := cni.WriteSelectionHint(path, ambient, a.cfg.selection.ExcludeNamespaces); err != nil {
		a.log.Error("write CNI selection hint", "path", path, "error", err)
		return
	}
	a.lastHint = key
}
