package workload

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"sync/atomic"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
)

// Directory indexes the workloads and services of one snapshot. It is
// immutable: build a new one for the next snapshot.
type Directory struct {
	all      []*Workload // sorted by namespace, name
	byName   map[string]*Workload
	byAddr   map[netip.Addr]*Workload
	byNode   map[string][]*Workload
	services []*Service // sorted by namespace, name
	byVIP    map[netip.Addr]*Service
	// selecting lists, per workload, the services it is an endpoint of, in
	// service order: the destination side names the service of an inbound
	// connection among these only.
	selecting map[*Workload][]*Service
}

// Build indexes snap, deciding enrollment with cfg and lookup (see
// selection.Decide). Objects it cannot use are left out and reported in the
// returned errors, each naming the object: pods and services with malformed
// addresses, addresses claimed twice (the first by namespace/name keeps
// them), unusable endpoint addresses, and pods whose RuntimeClass is
// unknown (these stay in, not enrolled).
func Build(snap source.Snapshot, cfg selection.Config, lookup selection.HandlerLookup) (*Directory, []error) {
	d := &Directory{
		byName: map[string]*Workload{},
		byAddr: map[netip.Addr]*Workload{},
		byNode: map[string][]*Workload{},
		byVIP:  map[netip.Addr]*Service{},
	}
	var errs []error
	namespaces := make(map[string]*corev1.Namespace, len(snap.Namespaces))
	for i := range snap.Namespaces {
		namespaces[snap.Namespaces[i].Name] = &snap.Namespaces[i]
	}
	for _, pod := range sortedByName(snap.Pods) {
		w, err := d.addPod(cfg, namespaces[pod.Namespace], pod, lookup)
		if err != nil {
			errs = append(errs, err)
		}
		if w != nil {
			errs = append(errs, d.indexAddrs(pod, w)...)
		}
	}
	byName := map[string]*Service{}
	for _, svc := range sortedByName(snap.Services) {
		s, err := d.addService(svc)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		byName[s.String()] = s
	}
	errs = append(errs, d.addEndpoints(byName, sortedByName(snap.EndpointSlices))...)
	return d, errs
}

// addPod adds the pod as a workload; the error is a malformed address (the
// pod is left out) or a selection problem (the pod stays, not enrolled).
func (d *Directory) addPod(cfg selection.Config, ns *corev1.Namespace, pod *corev1.Pod, lookup selection.HandlerLookup) (*Workload, error) {
	addrs, err := selection.PodAddrs(pod)
	if err != nil {
		return nil, err
	}
	dec := selection.Decide(cfg, ns, pod, lookup)
	w := &Workload{
		Name:           pod.Name,
		Namespace:      pod.Namespace,
		UID:            string(pod.UID),
		ServiceAccount: cmp.Or(pod.Spec.ServiceAccountName, "default"),
		Node:           pod.Spec.NodeName,
		Addrs:          addrs,
		Labels:         pod.Labels,
		Enrolled:       dec.Enrolled,
		Reason:         dec.Reason,
		BypassInbound:  dec.BypassInbound,
		ContainerPorts: namedPorts(pod),
	}
	w.WorkloadName, _, w.WorkloadType = WorkloadMeta(pod)
	w.CanonicalName, w.CanonicalRevision = CanonicalService(pod.Labels, w.WorkloadName)
	d.all = append(d.all, w)
	d.byName[w.String()] = w
	if w.Node != "" {
		d.byNode[w.Node] = append(d.byNode[w.Node], w)
	}
	return w, dec.Err
}

// indexAddrs makes w findable by its addresses, unless they are not its own:
// a hostNetwork pod shares the node's, and a finished pod's may already
// belong to a new pod.
func (d *Directory) indexAddrs(pod *corev1.Pod, w *Workload) []error {
	if pod.Spec.HostNetwork || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		return nil
	}
	var errs []error
	for _, a := range w.Addrs {
		if other, ok := d.byAddr[a]; ok {
			errs = append(errs, fmt.Errorf("pod %s: address %s already belongs to pod %s", w, a, other))
			continue
		}
		d.byAddr[a] = w
	}
	return errs
}

func namedPorts(pod *corev1.Pod) map[string]int32 {
	var ports map[string]int32
	for _, c := range slices.Concat(pod.Spec.InitContainers, pod.Spec.Containers) {
		for _, p := range c.Ports {
			if p.Name == "" {
				continue
			}
			if ports == nil {
				ports = map[string]int32{}
			}
			if _, dup := ports[p.Name]; !dup {
				ports[p.Name] = p.ContainerPort
			}
		}
	}
	return ports
}

func (d *Directory) addService(svc *corev1.Service) (*Service, error) {
	ips := svc.Spec.ClusterIPs
	if len(ips) == 0 && svc.Spec.ClusterIP != "" {
		ips = []string{svc.Spec.ClusterIP}
	}
	s := &Service{Name: svc.Name, Namespace: svc.Namespace}
	for _, ip := range ips {
		if ip == corev1.ClusterIPNone {
			continue
		}
		a, err := netip.ParseAddr(ip)
		if err != nil || a.Zone() != "" {
			return nil, fmt.Errorf("service %s: bad cluster IP %q", s, ip)
		}
		s.VIPs = append(s.VIPs, a.Unmap())
	}
	for _, vip := range s.VIPs {
		if other, ok := d.byVIP[vip]; ok {
			return nil, fmt.Errorf("service %s: cluster IP %s already belongs to service %s", s, vip, other)
		}
	}
	for _, vip := range s.VIPs {
		d.byVIP[vip] = s
	}
	for _, p := range svc.Spec.Ports {
		s.Ports = append(s.Ports, ServicePort{
			Name:       p.Name,
			Port:       p.Port,
			TargetPort: p.TargetPort,
			Protocol:   cmp.Or(p.Protocol, corev1.ProtocolTCP),
		})
	}
	d.services = append(d.services, s)
	return s, nil
}

// addEndpoints joins slices to services by the kubernetes.io/service-name
// label, so services without a selector but with hand-made slices work
// too. An address in several slices (slices are cut by port set, and
// overlap while they are rebalanced) becomes one endpoint with the union of
// their ports, ready if any slice says so.
func (d *Directory) addEndpoints(services map[string]*Service, list []*discoveryv1.EndpointSlice) []error {
	var errs []error
	merged := map[*Service]map[netip.Addr]*Endpoint{}
	for _, es := range list {
		svc := services[es.Namespace+"/"+es.Labels[discoveryv1.LabelServiceName]]
		if svc == nil || es.AddressType == discoveryv1.AddressTypeFQDN {
			continue
		}
		if merged[svc] == nil {
			merged[svc] = map[netip.Addr]*Endpoint{}
		}
		for _, ep := range es.Endpoints {
			if len(ep.Addresses) == 0 {
				continue
			}
			// Addresses of one endpoint are fungible; the API lets
			// consumers use the first.
			a, err := netip.ParseAddr(ep.Addresses[0])
			if err != nil || a.Zone() != "" {
				errs = append(errs, fmt.Errorf("endpointslice %s/%s: bad address %q", es.Namespace, es.Name, ep.Addresses[0]))
				continue
			}
			a = a.Unmap()
			e := merged[svc][a]
			if e == nil {
				e = &Endpoint{Addr: a, Ports: map[string]int32{}, Workload: d.byAddr[a]}
				merged[svc][a] = e
			}
			// A nil ready condition means unknown, which the API says
			// to treat as ready.
			e.Ready = e.Ready || ep.Conditions.Ready == nil || *ep.Conditions.Ready
			for _, p := range es.Ports {
				if p.Port != nil {
					e.Ports[derefOr(p.Name, "")] = *p.Port
				}
			}
		}
	}
	for svc, eps := range merged {
		for _, e := range eps {
			svc.Endpoints = append(svc.Endpoints, *e)
		}
		slices.SortFunc(svc.Endpoints, func(a, b Endpoint) int { return a.Addr.Compare(b.Addr) })
	}
	d.selecting = map[*Workload][]*Service{}
	for _, svc := range d.services {
		for _, e := range svc.Endpoints {
			if e.Workload != nil && !slices.Contains(d.selecting[e.Workload], svc) {
				d.selecting[e.Workload] = append(d.selecting[e.Workload], svc)
			}
		}
	}
	return errs
}

func derefOr[T any](p *T, def T) T {
	if p == nil {
		return def
	}
	return *p
}

// object is what sortedByName needs of a Kubernetes object.
type object interface {
	GetNamespace() string
	GetName() string
}

// sortedByName returns pointers into list sorted by namespace and name, so
// the first of two conflicting objects is always the same one.
func sortedByName[T any, PT interface {
	*T
	object
}](list []T) []PT {
	out := make([]PT, len(list))
	for i := range list {
		out[i] = &list[i]
	}
	slices.SortFunc(out, func(a, b PT) int {
		return cmp.Or(cmp.Compare(a.GetNamespace(), b.GetNamespace()), cmp.Compare(a.GetName(), b.GetName()))
	})
	return out
}

// ByAddr returns the pod at a. IPv4-mapped IPv6 addresses, as a dual-stack
// socket reports them, match the IPv4 address.
func (d *Directory) ByAddr(a netip.Addr) (*Workload, bool) {
	w, ok := d.byAddr[a.Unmap()]
	return w, ok
}

// Pod returns the workload namespace/name, as a CNI event names it.
func (d *Directory) Pod(namespace, name string) (*Workload, bool) {
	w, ok := d.byName[namespace+"/"+name]
	return w, ok
}

// LocalPods returns the pods scheduled on node, enrolled or not, sorted by
// namespace and name.
func (d *Directory) LocalPods(node string) []*Workload { return slices.Clone(d.byNode[node]) }

// All returns every workload, sorted by namespace and name.
func (d *Directory) All() []*Workload { return slices.Clone(d.all) }

// Services returns every service, sorted by namespace and name.
func (d *Directory) Services() []*Service { return slices.Clone(d.services) }

// ServicesOf returns the services w is an endpoint of, sorted by namespace
// and name.
func (d *Directory) ServicesOf(w *Workload) []*Service { return slices.Clone(d.selecting[w]) }

// ServiceByVIP returns the service whose cluster IP is a.
func (d *Directory) ServiceByVIP(a netip.Addr) (*Service, bool) {
	s, ok := d.byVIP[a.Unmap()]
	return s, ok
}

// Store holds the current Directory. Writers build a new Directory and Set
// it; readers Load one and use it for a whole connection or reconcile pass,
// seeing one consistent snapshot without locking.
type Store struct {
	dir atomic.Pointer[Directory]
}

// Load returns the current directory, or an empty one before the first Set.
func (s *Store) Load() *Directory {
	if d := s.dir.Load(); d != nil {
		return d
	}
	return &Directory{}
}

// Set makes d the current directory.
func (s *Store) Set(d *Directory) { s.dir.Store(d) }
