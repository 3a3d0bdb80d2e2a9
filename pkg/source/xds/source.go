package xds

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/nodepods"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Source is the agent's source.Source for --source xds: enrollment comes
// from this node's own pods (nodepods), so a CNI ADD never waits for
// istiod; who the other workloads are, the services and the policies come
// from istiod (Client).
//
// Until the first istiod snapshot, snapshots carry the local pods and an
// unsynced policy set, which refuses inbound connections (fails closed).
//
// The directory and the agent still take a source.Snapshot, so the remote
// workloads and services are handed over as the minimal Pod, Service and
// EndpointSlice objects workload.Build reads (remote workloads are
// enrolled exactly when istiod says they take HBONE); policies go as
// policy.CompiledSet, never as wire types.
type Source struct {
	client *Client
	pods   *nodepods.Watcher
	node   string
	log    *slog.Logger
	// synced is set once istiod's first snapshot was delivered.
	synced atomic.Bool
}

// Synced reports whether istiod's state has been delivered (readiness:
// until then inbound connections are refused), with the reason if not.
func (s *Source) Synced() (bool, string) {
	return s.synced.Load(), "no state from istiod yet (xDS)"
}

var _ source.Source = (*Source)(nil)

// NewSource joins a client to istiod and this node's pod watcher.
func NewSource(client *Client, pods *nodepods.Watcher, node string, log *slog.Logger) *Source {
	if log == nil {
		log = slog.Default()
	}
	return &Source{client: client, pods: pods, node: node, log: log.With("source", "xds")}
}

// debounce turns a burst of istiod pushes or pod events into one
// snapshot, as the Kubernetes source does.
var debounce = source.Debounce{Quiet: 10 * time.Millisecond, MaxWait: 50 * time.Millisecond, MinGap: 50 * time.Millisecond}

// Run runs both halves and calls update (from Run's goroutine, one call at
// a time) with the merged state after each burst of changes, once the
// node's pods are synced. It returns nil when ctx is done, or the pod
// watcher's error.
func (s *Source) Run(ctx context.Context, update func(source.Snapshot)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		mu    sync.Mutex
		local *nodepods.State
		mesh  *Snapshot
	)
	changed := make(chan struct{}, 1)
	notify := func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	clientDone := make(chan struct{})
	defer func() { cancel(); <-clientDone }()
	go func() {
		defer close(clientDone)
		_ = s.client.Run(ctx, func(m *Snapshot) {
			mu.Lock()
			mesh = m
			mu.Unlock()
			notify()
		})
	}()
	podsErr := make(chan error, 1)
	go func() {
		podsErr <- s.pods.Run(ctx, func(st nodepods.State) {
			mu.Lock()
			local = &st
			mu.Unlock()
			notify()
		})
	}()
	due := source.NewDebouncer(debounce)
	defer due.Stop()
	for {
		select {
		case <-ctx.Done():
			<-podsErr
			return nil
		case err := <-podsErr:
			return err
		case <-changed:
			due.Changed()
		case <-due.C():
			if !due.Due() {
				continue
			}
			mu.Lock()
			l, m := local, mesh
			mu.Unlock()
			if l != nil {
				update(merge(*l, m, s.node))
				s.synced.Store(m != nil)
			}
		}
	}
}

// merge builds the agent's snapshot: this node's pods as the API has them,
// the rest of istiod's workloads, the services with their endpoints, and
// the compiled policies. mesh is nil before istiod's first answer.
func merge(local nodepods.State, mesh *Snapshot, node string) source.Snapshot {
	snap := source.Snapshot{Namespaces: local.Namespaces, Pods: local.Pods, RuntimeClasses: local.RuntimeClasses,
		Compiled: &policy.CompiledSet{}}
	if mesh == nil {
		return snap
	}
	snap.Compiled = &policy.CompiledSet{Synced: true, Policies: mesh.Policies, Selected: map[string][]string{}}
	localNames := make(map[string]bool, len(local.Pods))
	for i := range local.Pods {
		localNames[local.Pods[i].Namespace+"/"+local.Pods[i].Name] = true
	}
	snap.Pods = append([]corev1.Pod(nil), local.Pods...)
	// An address belongs to one workload in the directory: this node's
	// pods first, then pods elsewhere, then the rest (a ServiceEntry's
	// endpoint at a pod's address is that pod).
	claimed := map[netip.Addr]bool{}
	for i := range local.Pods {
		for _, ip := range local.Pods[i].Status.PodIPs {
			if a, err := netip.ParseAddr(ip.IP); err == nil {
				claimed[a] = true
			}
		}
	}
	for _, pods := range []bool{true, false} {
		for _, w := range mesh.Workloads {
			if isPod(w) != pods {
				continue
			}
			key := w.Namespace + "/" + w.Name
			if len(w.Policies) > 0 {
				snap.Compiled.Selected[key] = w.Policies
			}
			if localNames[key] || w.Node == node {
				continue // this node's pods come from the API server
			}
			free := false
			for _, a := range w.Addrs {
				free = free || !claimed[a]
				claimed[a] = true
			}
			if free {
				snap.Pods = append(snap.Pods, remotePod(w))
			}
		}
	}
	for _, svc := range mesh.Services {
		k8sName := serviceName(svc)
		ks := corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: k8sName, Namespace: svc.Namespace}}
		for _, vip := range svc.VIPs {
			ks.Spec.ClusterIPs = append(ks.Spec.ClusterIPs, vip.String())
		}
		if len(ks.Spec.ClusterIPs) == 0 {
			ks.Spec.ClusterIP = corev1.ClusterIPNone
		}
		for _, p := range svc.Ports {
			ks.Spec.Ports = append(ks.Spec.Ports, corev1.ServicePort{Name: p.Name, Port: p.Port, TargetPort: p.TargetPort, Protocol: corev1.ProtocolTCP})
		}
		snap.Services = append(snap.Services, ks)
		// One slice per endpoint: xDS maps ports per workload, slices per
		// slice; the directory merges them by address.
		for i, ep := range svc.Endpoints {
			ready := ep.Ready
			es := discoveryv1.EndpointSlice{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-xds-%d", k8sName, i), Namespace: svc.Namespace,
					Labels: map[string]string{discoveryv1.LabelServiceName: k8sName}},
				AddressType: addressType(ep.Addr),
				Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{ep.Addr.String()}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}}},
			}
			for name, port := range ep.Ports {
				es.Ports = append(es.Ports, discoveryv1.EndpointPort{Name: ptr(name), Port: ptr(port)})
			}
			snap.EndpointSlices = append(snap.EndpointSlices, es)
		}
	}
	return snap
}

// remotePod is the part of a Pod workload.Build reads, for a workload on
// another node (or no node: a ServiceEntry's or VM's).
func remotePod(w *Workload) corev1.Pod {
	mode := selection.DataplaneModeNone
	if w.HBONE {
		mode = selection.DataplaneModeAmbient
	}
	// Labels the directory derives the workload and canonical names from.
	labels := map[string]string{selection.DataplaneModeLabel: mode}
	for k, v := range map[string]string{workload.LabelCanonicalName: w.CanonicalName, workload.LabelCanonicalRevision: w.CanonicalRevision, workload.LabelWorkloadName: w.WorkloadName} {
		if v != "" {
			labels[k] = v
		}
	}
	p := corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: w.Name, Namespace: w.Namespace, UID: types.UID(w.UID), Labels: labels},
		Spec:       corev1.PodSpec{NodeName: w.Node, ServiceAccountName: w.ServiceAccount},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning},
	}
	for _, a := range w.Addrs {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: a.String()})
	}
	if len(w.Addrs) > 0 {
		p.Status.PodIP = w.Addrs[0].String()
	}
	return p
}

// isPod: istiod names a Pod's workload <cluster>//Pod/<namespace>/<name>.
func isPod(w *Workload) bool { return strings.Contains(w.UID, "/Pod/") }

// serviceName is a name unique in the namespace: the Kubernetes name for
// a Service (hostname name.namespace.svc...), else the hostname (a
// ServiceEntry may have several).
func serviceName(s *Service) string {
	if strings.HasPrefix(s.Hostname, s.Name+"."+s.Namespace+".svc.") {
		return s.Name
	}
	return s.Hostname
}

func addressType(a netip.Addr) discoveryv1.AddressType {
	if a.Is4() {
		return discoveryv1.AddressTypeIPv4
	}
	return discoveryv1.AddressTypeIPv6
}

func ptr[T any](v T) *T { return &v }
