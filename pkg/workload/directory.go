package workload

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"sync/atomic"
)

// Directory indexes the workloads and services of one snapshot. It is
// immutable: build a new one for the next snapshot.
type Directory struct {
	all      []*Workload // sorted by namespace, name
	byName   map[nameKey]*Workload
	byAddr   map[netip.Addr]*Workload
	byNode   map[string][]*Workload
	services []*Service // sorted by namespace, name
	byVIP    map[netip.Addr]*Service
	// byVIPIn holds the VIPs of NamespaceOnly services, by namespace.
	byVIPIn map[string]map[netip.Addr]*Service
	// byCIDR and byCIDRIn hold the services with CIDRs, as byVIP and
	// byVIPIn hold VIPs.
	byCIDR   cidrIndex
	byCIDRIn map[string]*cidrIndex
	// selecting lists, per workload, the services it is an endpoint of, in
	// service order: the destination side names the service of an inbound
	// connection among these only.
	selecting map[*Workload][]*Service
	// sites memoizes site, per node.
	sites map[string]*Workload
	// scanned memoizes named's scans while NewDirectory runs: a name
	// can have many workloads (a ServiceEntry's endpoints), and many
	// endpoints name one pod (each service it serves).
	scanned map[podRef]*Workload
}

// podRef is a pod as an endpoint names it.
type podRef struct{ namespace, name, uid string }

// NewDirectory indexes workloads and services (the services are copied, so
// their endpoints can be linked to this directory's workloads). Where two
// claim one address, the one that is not terminating keeps it, then the
// enrolled one, then the first by namespace/name (see claimsOver); where
// two claim one VIP, the first by namespace/name. The other is reported in
// the returned errors, each naming both; the rest is indexed.
func NewDirectory(workloads []*Workload, services []*Service) (*Directory, []error) {
	d := &Directory{
		byName:    make(map[nameKey]*Workload, len(workloads)),
		byAddr:    make(map[netip.Addr]*Workload, len(workloads)),
		byNode:    map[string][]*Workload{},
		byVIP:     make(map[netip.Addr]*Service, len(services)),
		byVIPIn:   map[string]map[netip.Addr]*Service{},
		byCIDRIn:  map[string]*cidrIndex{},
		selecting: map[*Workload][]*Service{},
	}
	var errs []error
	workloads = sortedByName(workloads, func(w *Workload) (string, string) { return w.Namespace, w.Name })
	for _, w := range workloads {
		d.all = append(d.all, w)
		// istiod names every endpoint of a ServiceEntry after it: Pod
		// (by name) finds the first, this node's pods are unique.
		if k := (nameKey{w.Namespace, w.Name}); d.byName[k] == nil {
			d.byName[k] = w
		}
		if w.Node != "" {
			d.byNode[w.Node] = append(d.byNode[w.Node], w)
		}
		for _, a := range w.Addrs {
			other, ok := d.byAddr[a]
			switch {
			case !ok:
				d.byAddr[a] = w
			case claimsOver(w, other):
				errs = append(errs, fmt.Errorf("pod %s: address %s already belongs to pod %s", other, a, w))
				d.byAddr[a] = w
			default:
				errs = append(errs, fmt.Errorf("pod %s: address %s already belongs to pod %s", w, a, other))
			}
		}
	}
	services = sortedByName(services, func(s *Service) (string, string) { return s.Namespace, s.Name })
	for _, s := range services {
		if err := d.addService(s); err != nil {
			errs = append(errs, err)
		}
	}
	d.scanned = nil
	return d, errs
}

// claimsOver says whether w takes an address from other, which came
// before it by name. A pod that is not terminating wins (a terminating
// pod's address may be a new pod's already), then an enrolled one, then
// one its node records captured (Redirected): an object outside the mesh
// at a meshed pod's address (stale, or lying) would make connections to
// it plaintext passthrough, where the meshed one, if wrong, fails closed
// (its HBONE is not answered).
func claimsOver(w, other *Workload) bool {
	if w.Terminating != other.Terminating {
		return !w.Terminating
	}
	if w.Enrolled != other.Enrolled {
		return w.Enrolled
	}
	return w.Redirected && !other.Redirected
}

// nameKey is namespace and name.
type nameKey struct{ namespace, name string }

// sortedByName returns list ordered by namespace and name, stable, so the
// first of two conflicting objects is always the same one. Sources
// usually hand out ordered lists: those are used as they are.
func sortedByName[T any](list []T, key func(T) (string, string)) []T {
	compare := func(a, b T) int {
		an, aa := key(a)
		bn, bb := key(b)
		return cmp.Or(cmp.Compare(an, bn), cmp.Compare(aa, bb))
	}
	if slices.IsSortedFunc(list, compare) {
		return list
	}
	list = slices.Clone(list)
	slices.SortStableFunc(list, compare)
	return list
}

// addService adds s. A VIP another service has already is left out of
// s (and reported); the rest of s stays: a second claimant (a stale or
// hostile object) must not take every other VIP and the endpoints of the
// first one's name with it.
func (d *Directory) addService(s *Service) error {
	var err error
	own := *s
	vips := d.byVIP
	if s.NamespaceOnly {
		if d.byVIPIn[s.Namespace] == nil {
			d.byVIPIn[s.Namespace] = map[netip.Addr]*Service{}
		}
		vips = d.byVIPIn[s.Namespace]
	}
	own.VIPs = slices.DeleteFunc(slices.Clone(s.VIPs), func(vip netip.Addr) bool {
		other, ok := vips[vip]
		if ok && err == nil {
			err = fmt.Errorf("service %s: cluster IP %s already belongs to service %s: left out", s, vip, other)
		}
		return ok
	})
	// The service and its endpoints are copied: a source may hand the
	// same service to the next directory while this one's readers run.
	own.Endpoints = slices.Clone(s.Endpoints)
	for _, vip := range own.VIPs {
		vips[vip] = &own
	}
	if len(own.CIDRs) > 0 {
		idx := &d.byCIDR
		if s.NamespaceOnly {
			if idx = d.byCIDRIn[s.Namespace]; idx == nil {
				idx = &cidrIndex{}
				d.byCIDRIn[s.Namespace] = idx
			}
		}
		idx.add(&own)
	}
	d.services = append(d.services, &own)
	for i := range own.Endpoints {
		e := &own.Endpoints[i]
		// An address belongs to one workload: the directory's. Where the
		// endpoint names its pod (a slice's targetRef, istiod's workload),
		// it must be that one: a pod that left may have its address given
		// to another pod while the slice, watched apart from pods, still
		// lists it (a publishNotReadyAddresses service lists a pod until
		// its object is deleted, after its sandbox freed the address), or
		// two live pods claim one address (a stale object, a lie) and the
		// other keeps it; the service's connections went to that other
		// workload, its identity required and proved, or in plain TCP.
		// Such an endpoint is not dialled.
		e.Workload = d.byAddr[e.Addr]
		e.Unresolved = false
		if w := e.Workload; w != nil && e.PodName != "" && !e.names(w) {
			e.Workload, e.Unresolved = nil, true
		}
		if e.Workload == nil && !e.Unresolved && e.PodName != "" {
			named := d.named(e)
			e.Unresolved = named == nil || named.TakesHBONE()
		}
		e.Site = nil
		if e.Workload == nil && e.Node != "" {
			e.Site = d.site(e.Node)
		}
		if e.Workload != nil && !slices.Contains(d.selecting[e.Workload], &own) {
			d.selecting[e.Workload] = append(d.selecting[e.Workload], &own)
		}
	}
	return err
}

// names reports whether w is the pod e names (PodNamespace, PodName and,
// where set, PodUID).
func (e *Endpoint) names(w *Workload) bool {
	return w.Namespace == e.PodNamespace && w.Name == e.PodName && (e.PodUID == "" || w.UID == e.PodUID)
}

// named returns the workload e names, nil if the directory has none: of
// its namespace and name, and of its uid where e gives one. Not merely
// the first of the name (byName): istiod names pods of several clusters
// alike, and a ServiceEntry's or WorkloadEntry's workloads after the
// entry, so the first may be another, and an endpoint at no workload's
// address (a hostNetwork pod's, at its node's) was refused as unknown
// though the directory had its pod (TestEndpointNamedAmongWorkloadsOfOneName).
func (d *Directory) named(e *Endpoint) *Workload {
	key := nameKey{e.PodNamespace, e.PodName}
	if w := d.byName[key]; w == nil || e.names(w) {
		return w
	}
	ref := podRef{e.PodNamespace, e.PodName, e.PodUID}
	if w, ok := d.scanned[ref]; ok {
		return w
	}
	// d.all is sorted by namespace and name: the others of the name
	// follow the first.
	var found *Workload
	i, _ := slices.BinarySearchFunc(d.all, key, func(w *Workload, k nameKey) int {
		return cmp.Or(cmp.Compare(w.Namespace, k.namespace), cmp.Compare(w.Name, k.name))
	})
	for ; i < len(d.all) && d.all[i].Namespace == key.namespace && d.all[i].Name == key.name; i++ {
		if e.names(d.all[i]) {
			found = d.all[i]
			break
		}
	}
	if d.scanned == nil {
		d.scanned = map[podRef]*Workload{}
	}
	d.scanned[ref] = found
	return found
}

// site returns the workload whose locality stands for node's (see
// Endpoint.Site): its first by name that has one, else its first; nil
// for a node with no workload.
func (d *Directory) site(node string) *Workload {
	if w, ok := d.sites[node]; ok {
		return w
	}
	var site *Workload
	if pods := d.byNode[node]; len(pods) > 0 {
		site = pods[0]
		for _, w := range pods {
			if w.Region != "" || w.Zone != "" || w.Subzone != "" || w.Cluster != "" {
				site = w
				break
			}
		}
	}
	if d.sites == nil {
		d.sites = map[string]*Workload{}
	}
	d.sites[node] = site
	return site
}

// ByAddr returns the pod at a. IPv4-mapped IPv6 addresses, as a dual-stack
// socket reports them, match the IPv4 address.
func (d *Directory) ByAddr(a netip.Addr) (*Workload, bool) {
	w, ok := d.byAddr[a.Unmap()]
	return w, ok
}

// Pod returns the workload namespace/name, as a CNI event names it.
func (d *Directory) Pod(namespace, name string) (*Workload, bool) {
	w, ok := d.byName[nameKey{namespace, name}]
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

// ServiceByVIP returns the service whose cluster IP is a, of those every
// namespace reaches.
func (d *Directory) ServiceByVIP(a netip.Addr) (*Service, bool) {
	s, ok := d.byVIP[a.Unmap()]
	return s, ok
}

// ServiceByVIPFor returns the service a client in namespace reaches at a:
// its own namespace's NamespaceOnly service first, as ztunnel prefers the
// client's namespace, then the one every namespace reaches; failing a
// VIP, and unless a workload is at a, the service with the longest range
// (CIDRs) holding a, in the same order. Another namespace's NamespaceOnly
// service is never it.
func (d *Directory) ServiceByVIPFor(a netip.Addr, namespace string) (*Service, bool) {
	if s, ok := d.byVIPIn[namespace][a.Unmap()]; ok {
		return s, true
	}
	if s, ok := d.ServiceByVIP(a); ok {
		return s, true
	}
	// Then the ranges (CIDRs), as ztunnel, except at a workload's address:
	// the workload comes first, as a VIP at it would not be the service's
	// (a ServiceEntry's ranges are anyone's to write in their namespace).
	if _, ok := d.ByAddr(a); ok {
		return nil, false
	}
	if s := d.byCIDRIn[namespace].best(a.Unmap()); s != nil {
		return s, true
	}
	if s := d.byCIDR.best(a.Unmap()); s != nil {
		return s, true
	}
	return nil, false
}

// cidrIndex finds the service whose range holding an address is the
// longest. Every connection to an address that is no VIP and no
// workload's asks it, so it costs a map lookup per prefix length in use,
// whatever the number of ranges: a scan of every range, as before (7
// December), cost 0.14 ms per connection at 10k ServiceEntry ranges and
// 4 ms at 100k, and anyone who may write a ServiceEntry in a namespace
// could add them for every pod of every node.
type cidrIndex struct {
	byPrefix map[netip.Prefix][]*Service // masked range -> its services, each once
	lens     []int                       // prefix lengths in use, longest first
}

func (x *cidrIndex) add(s *Service) {
	if x.byPrefix == nil {
		x.byPrefix = map[netip.Prefix][]*Service{}
	}
	for _, p := range s.CIDRs {
		p = p.Masked()
		if slices.Contains(x.byPrefix[p], s) {
			continue
		}
		x.byPrefix[p] = append(x.byPrefix[p], s)
		if i, found := slices.BinarySearchFunc(x.lens, p.Bits(), func(have, want int) int { return cmp.Compare(want, have) }); !found {
			x.lens = slices.Insert(x.lens, i, p.Bits())
		}
	}
}

// best returns the service whose range holding a is the longest, nil if
// none or if two services tie there (no one can tell which is meant: the
// connection goes to the address, as for a VIP two services claim that
// neither owns). x may be nil.
func (x *cidrIndex) best(a netip.Addr) *Service {
	if x == nil || a.Zone() != "" {
		return nil // as Prefix.Contains: a zoned address is in no range
	}
	for _, bits := range x.lens {
		p, err := a.Prefix(bits)
		if err != nil {
			continue // longer than a's family
		}
		switch ss := x.byPrefix[p]; len(ss) {
		case 0:
		case 1:
			return ss[0]
		default:
			return nil
		}
	}
	return nil
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
