package xds

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
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
// Both halves end in the model: the local pods through kubeobj (the
// selection rules), istiod's workloads and services as its translation
// made them, policies as policy.CompiledSet; no wire type leaves the
// package.
type Source struct {
	client *Client
	pods   *nodepods.Watcher
	node   string
	// selection decides which of this node's pods are enrolled.
	selection selection.Config
	log       *slog.Logger
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
func NewSource(client *Client, pods *nodepods.Watcher, node string, cfg selection.Config, log *slog.Logger) *Source {
	if log == nil {
		log = slog.Default()
	}
	cfg.NamespaceViewLags = true // the node's pod watcher watches namespaces: one missing is one not seen yet
	return &Source{client: client, pods: pods, node: node, selection: cfg, log: log.With("source", "xds")}
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
	var last kubeobj.LastGood // this node's pods, for a pod whose object turns malformed
	var reported map[string]bool
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
				snap, errs := merge(*l, m, s.node, s.selection, &last)
				s.client.cfg.Metrics.setAddressConflicts(countConflicts(errs))
				reported = reportNew(s.log, reported, errs)
				update(snap)
				s.synced.Store(m != nil)
			}
		}
	}
}

// merge builds the agent's snapshot: this node's pods as the API has them
// (their enrollment decided here, with cfg), the rest of istiod's
// workloads, the services with their endpoints, and the compiled policies.
// mesh is nil before istiod's first answer. A local pod whose address no
// longer parses keeps its version in last (as istiod's workloads keep
// theirs: the client NACKs a malformed one and holds the previous); last
// may be nil in tests.
//
// This node's pods own their addresses and their policy selection: an
// istiod workload keeps only the addresses no one before it claimed, in
// claimOrder (an istiod pod claiming a local pod's address is reported),
// and a local
// pod's selection is that of istiod's copy of it (the pod of that name on
// this node, in this cluster), never of another workload of the same name.
// A local pod istiod has no single copy of is listed as unknown, so the
// tunnel refuses its inbound connections instead of serving them without
// its workload-selector policies. Only that copy stands aside for the
// local pod: istiod names a WorkloadEntry, a ServiceEntry's endpoints and
// another cluster's pods by their own objects, so they may bear a local
// pod's name, and they are other hosts at their own addresses.
func merge(local nodepods.State, mesh *Snapshot, node string, cfg selection.Config, last *kubeobj.LastGood) (source.Snapshot, []error) {
	snap, errs := kubeobj.Translate(kubeobj.Objects{Namespaces: local.Namespaces, Pods: local.Pods, RuntimeClasses: local.RuntimeClasses}, cfg)
	if last != nil {
		errs = last.Keep(&snap, errs)
	}
	snap.Compiled = &policy.CompiledSet{}
	if mesh == nil {
		return snap, errs
	}
	snap.Compiled = &policy.CompiledSet{Synced: true, Policies: mesh.Policies, Selected: map[string][]string{}, Unresolved: mesh.Unresolved}
	localNames, nLocal := make(map[string]bool, len(snap.Workloads)), len(snap.Workloads)
	localUIDs := make(map[string]string, nLocal) // namespace/name -> the API's uid
	// An address belongs to one workload in the directory: this node's
	// pods first, then pods elsewhere, then the rest (a ServiceEntry's
	// endpoint at a pod's address is that pod).
	claimed := map[netip.Addr]claim{}
	for _, w := range snap.Workloads {
		localNames[w.String()] = true
		localUIDs[w.String()] = w.UID
		for _, a := range w.Addrs {
			claimed[a] = claim{key: w.String(), local: true}
		}
	}
	copies, elsewhere := localCopies(mesh.Workloads, localNames, node, mesh.Cluster)
	unknown := func(key, reason string) {
		if snap.Compiled.Unknown == nil {
			snap.Compiled.Unknown = map[string]string{}
		}
		snap.Compiled.Unknown[key] = reason
	}
	for _, w := range snap.Workloads[:nLocal] {
		key := w.String()
		switch c := copies[key]; {
		case len(c) == 1 && c[0].Network != mesh.Network:
			// The agent's NETWORK disagrees with istiod's: every workload
			// of this network would be left out, so refuse loudly.
			unknown(key, fmt.Sprintf("istiod puts pod %s on network %q, this agent is on network %q (NETWORK)", key, c[0].Network, mesh.Network))
			errs = append(errs, fmt.Errorf("istiod puts this node's pod %s on network %q, but this agent is on network %q (NETWORK): its inbound connections are refused until they agree", key, c[0].Network, mesh.Network))
		case len(c) == 1:
			if len(c[0].Policies) > 0 {
				snap.Compiled.Selected[key] = c[0].Policies
			}
		case len(c) == 0 && len(elsewhere[key]) > 0:
			// The agent's CLUSTER_ID disagrees with istiod's, or istiod
			// has not sent this cluster's pod yet: another cluster's pod
			// of the name is not it.
			o := elsewhere[key][0]
			unknown(key, fmt.Sprintf("istiod describes pod %s on node %s only in cluster %q, this agent is in cluster %q (CLUSTER_ID)", key, node, o.Cluster, mesh.Cluster))
			errs = append(errs, fmt.Errorf("istiod describes this node's pod %s only in cluster %q (%s), but this agent is in cluster %q (CLUSTER_ID): its inbound connections are refused until they agree", key, o.Cluster, o.UID, mesh.Cluster))
		case len(c) == 0:
			unknown(key, "istiod describes no pod "+key+" on node "+node)
		default:
			unknown(key, fmt.Sprintf("istiod describes %d pods %s on node %s (%s, %s)", len(c), key, node, c[0].UID, c[1].UID))
		}
	}
	// The nodes' addresses (hostNetwork pods'), which the directory does
	// not index, for the ranges that would take them (nodeRanges).
	var nodeAddrs []nodeAddr
	// istiod's uids of local pods' copies, the API's uid of each, and the
	// services they serve, whose endpoints name the local pods (asLocal).
	copyUIDs, copyServices := map[string]string{}, map[string]bool{}
	for _, w := range claimOrder(mesh.Workloads) {
		if w.Network != mesh.Network {
			continue // a workload elsewhere is not at its address here
		}
		key := w.Namespace + "/" + w.Name
		// istiod's copy of a local pod, wherever istiod says it is (a
		// lagging copy too): the pod comes from the API server.
		localCopy := localNames[key] && ownPod(w, mesh.Cluster)
		// A pod of another cluster on a node named like this one (node
		// names are each cluster's own: hostnames, alike in clusters on
		// one network) is on another host, not one of this node's pods
		// the node's watch has not seen yet. It is added as any other
		// node's pod, with no node: the directory's nodes are this
		// cluster's (LocalPods lists this node's pods to capture). Left
		// out, its service endpoints were refused (they name it), and
		// before they named it, dialled in plain TCP though istiod said
		// HBONE. One named like a local pod is more likely that pod,
		// under a CLUSTER_ID that disagrees with istiod's (refused and
		// reported above), and stays out.
		foreign := w.Node == node && isPod(w) && !ownPod(w, mesh.Cluster) && !localNames[key]
		if localCopy {
			copyUIDs[w.UID] = localUIDs[key]
			for svc := range w.Services {
				copyServices[svc] = true
			}
		}
		if w.HostNetwork {
			// Its addresses are its node's (this node's too): not the
			// pod's to index, as the API source does not index a
			// hostNetwork pod's (and ztunnel does not look it up by
			// them). They stay claimed, so no ServiceEntry takes a
			// node's address as its VIP. istiod marks so an endpoint of
			// a hand-made EndpointSlice too (a host it knows nothing of,
			// outside the cluster maybe): only a pod's is a node's, for
			// the ranges (an egress entry's range was left out whole,
			// past its waypoint, for a Service's endpoint in it).
			for _, a := range w.Addrs {
				if _, taken := claimed[a]; !taken {
					claimed[a] = claim{key: key, uid: w.UID}
				}
				if isPod(w) {
					nodeAddrs = append(nodeAddrs, nodeAddr{a, key})
				}
			}
			if localCopy || w.Node == node && !foreign {
				continue
			}
			c := w.Workload
			c.Addrs = nil
			if foreign {
				c.Node = ""
			}
			snap.Workloads = append(snap.Workloads, &c)
			continue
		}
		if localCopy {
			continue // this node's pods come from the API server
		}
		if _, ok := snap.Compiled.Selected[key]; !ok && !localNames[key] && len(w.Policies) > 0 {
			snap.Compiled.Selected[key] = w.Policies
		}
		if w.Node == node && !foreign {
			continue
		}
		free := make([]netip.Addr, 0, len(w.Addrs))
		for _, a := range w.Addrs {
			owner, taken := claimed[a]
			if !taken {
				free = append(free, a)
				claimed[a] = claim{key: key, uid: w.UID}
				continue
			}
			switch {
			case isPod(w) && owner.local:
				errs = append(errs, addressConflict{fmt.Errorf("istiod's workload %s (%s) lists address %s of this node's pod %s: the address stays the local pod's", key, w.UID, a, owner.key)})
			case isPod(w) && strings.Contains(owner.uid, "/Pod/"):
				// Two live pods at one address (a stale object, a lie):
				// the directory gives it to one, and the other's service
				// endpoints there are not dialled as it (see
				// buildSnapshot).
				errs = append(errs, addressConflict{fmt.Errorf("istiod's pods %s (%s) and %s (%s) both list address %s: the first keeps it, and the second's service endpoints there are not dialled", owner.key, owner.uid, key, w.UID, a)})
			}
		}
		switch {
		case len(free) == 0:
		case len(free) == len(w.Addrs) && !foreign:
			snap.Workloads = append(snap.Workloads, &w.Workload)
		default:
			c := w.Workload
			c.Addrs = free
			if foreign {
				c.Node = ""
			}
			snap.Workloads = append(snap.Workloads, &c)
		}
	}
	fromIstiod(snap.Workloads[:nLocal], copies)
	services := make([]*workload.Service, 0, len(mesh.Services))
	canonical := make([]bool, 0, len(mesh.Services))
	slices.SortFunc(nodeAddrs, func(a, b nodeAddr) int { return a.addr.Compare(b.addr) })
	for _, svc := range mesh.Services {
		s := routed(svc, node)
		if copyServices[svc.Key()] {
			s = asLocal(s, copyUIDs)
		}
		s, taken := foreignVIPs(s, claimed, mesh.Cluster)
		for _, a := range taken {
			errs = append(errs, addressConflict{fmt.Errorf("istiod's service %s lists VIP %s, an address of workload %s, which does not serve it: the address stays the workload's", s.Namespace+"/"+s.Hostname, a, claimed[a].key)})
		}
		s, spared := nodeRanges(s, nodeAddrs)
		errs = append(errs, spared...)
		services = append(services, s)
		canonical = append(canonical, svc.Canonical)
	}
	services, shared := sharedVIPs(services, canonical)
	errs = append(errs, shared...)
	standIns, rejected := rejectedStandIns(mesh.Rejected, claimed, services)
	services = append(services, standIns...)
	errs = append(errs, rejected...)
	snap.Services = append(snap.Services, services...)
	return snap, errs
}

// rejectedStandIns makes a Contested, Rejected service of each rejected
// resource (see Rejected) at its addresses that no workload claims and no
// service lists as a VIP: connections to them are refused (the tunnel
// looks VIPs up first), where as addresses of no workload they left the
// pod in plaintext. An address a workload or service istiod sent has stays
// theirs: a rejected resource takes nothing from the accepted ones. It
// returns an error per stand-in, naming the addresses refused.
func rejectedStandIns(list []*Rejected, claimed map[netip.Addr]claim, services []*workload.Service) ([]*workload.Service, []error) {
	if len(list) == 0 {
		return nil, nil
	}
	taken := map[netip.Addr]bool{}
	for _, s := range services {
		for _, a := range s.VIPs {
			taken[a] = true
		}
	}
	var out []*workload.Service
	var errs []error
	for _, r := range list {
		var free []netip.Addr
		for _, a := range r.Addrs {
			if _, ok := claimed[a]; ok || taken[a] {
				continue
			}
			taken[a] = true
			free = append(free, a)
		}
		if len(free) == 0 {
			continue
		}
		out = append(out, &workload.Service{Name: "rejected " + r.Name, Namespace: r.Namespace, VIPs: free, Contested: true, Rejected: true})
		errs = append(errs, fmt.Errorf("istiod's %s was rejected (see the NACK) and no version of it is held: connections to %v are refused until istiod sends one that translates or removes it", r.Name, free))
	}
	return out, errs
}

// sharedVIPs settles the VIPs that more than one service lists where they
// compete: among the services every namespace reaches, and among one
// namespace's NamespaceOnly ones (a client's own namespace's comes first,
// in the directory, so those two never compete). A ServiceEntry's
// addresses are anyone's to write in their namespace, and the directory
// gives a VIP to one service: a tenant's entry at kube-dns's cluster IP
// would take the cluster's DNS to its own endpoints. So a shared VIP goes,
// as in ztunnel, to the one claimant istiod marks canonical (the owner of
// its host name: a Kubernetes Service, not an entry naming the same
// host); failing that, to the one shaped like a Kubernetes Service
// (hostname name.namespace.svc.<domain>, which an entry can copy only in
// its own namespace). When neither tells one apart (istiod marks canonical
// also a ServiceEntry whose host name is its own, so a tenant's entry
// named like a Kubernetes Service of its namespace ties with the real one),
// no claimant keeps it: connections to it go to the address, where the
// cluster's service proxy (kube-proxy) knows which Service really has it,
// so no entry's endpoints are reached that way. Refusing instead would let
// any namespace cut every meshed client off kube-dns. (Among one
// namespace's NamespaceOnly services a Contested stand-in takes it and
// its connections are refused.) Each claimant keeps its other VIPs. canonical[i] is istiod's mark on services[i].
// Returns the services (copies where a VIP was taken out, stand-ins
// added) and an addressConflict per VIP settled.
func sharedVIPs(services []*workload.Service, canonical []bool) ([]*workload.Service, []error) {
	type scope struct {
		namespace string // "" for the services every namespace reaches
		vip       netip.Addr
	}
	claimants := map[scope][]int{}
	for i, s := range services {
		ns := ""
		if s.NamespaceOnly {
			ns = s.Namespace
		}
		for _, a := range s.VIPs {
			k := scope{ns, a}
			if c := claimants[k]; len(c) == 0 || c[len(c)-1] != i { // a VIP listed twice is one claim
				claimants[k] = append(c, i)
			}
		}
	}
	lost := map[int]map[netip.Addr]bool{}
	var errs []error
	var standIns []*workload.Service
	for k, list := range claimants {
		if len(list) < 2 {
			continue
		}
		keeper := onlyOne(list, func(i int) bool { return canonical[i] })
		how := "istiod's canonical service"
		if keeper == -1 {
			keeper = onlyOne(list, func(i int) bool { return kubernetesShaped(services[i]) })
			how = "the Kubernetes Service"
		}
		names := make([]string, 0, len(list))
		for _, i := range list {
			names = append(names, services[i].Namespace+"/"+services[i].Hostname)
			if i == keeper {
				continue
			}
			if lost[i] == nil {
				lost[i] = map[netip.Addr]bool{}
			}
			lost[i][k.vip] = true
		}
		slices.Sort(names)
		outcome := "no service keeps it: connections to it go to the address, where the cluster's service proxy knows the real owner"
		switch {
		case keeper != -1:
			outcome = "it stays " + how + "'s, " + services[keeper].Namespace + "/" + services[keeper].Hostname
		case k.namespace != "":
			// Within one namespace's NamespaceOnly services nothing
			// outside decides: refuse rather than guess.
			outcome = "no service keeps it, and connections to it from namespace " + k.namespace + " are refused"
			standIns = append(standIns, &workload.Service{Name: "contested " + k.vip.String(), Namespace: k.namespace,
				VIPs: []netip.Addr{k.vip}, NamespaceOnly: true, Contested: true})
		}
		errs = append(errs, addressConflict{fmt.Errorf("istiod's services %s all list VIP %s: %s", strings.Join(names, ", "), k.vip, outcome)})
	}
	if len(lost) == 0 {
		return services, nil
	}
	out := slices.Clone(services)
	for i, vips := range lost {
		c := *out[i]
		c.VIPs = slices.DeleteFunc(slices.Clone(c.VIPs), func(a netip.Addr) bool { return vips[a] })
		out[i] = &c
	}
	slices.SortFunc(standIns, func(a, b *workload.Service) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), a.VIPs[0].Compare(b.VIPs[0]))
	})
	out = append(out, standIns...)
	slices.SortFunc(errs, func(a, b error) int { return strings.Compare(a.Error(), b.Error()) })
	return out, errs
}

// onlyOne returns the one element of list that is, -1 if none or several
// are.
func onlyOne(list []int, is func(int) bool) int {
	found := -1
	for _, i := range list {
		if is(i) {
			if found != -1 {
				return -1
			}
			found = i
		}
	}
	return found
}

// kubernetesShaped reports whether s is named as istiod names a
// Kubernetes Service: hostname name.namespace.svc.<domain>.
func kubernetesShaped(s *workload.Service) bool {
	rest, ok := strings.CutPrefix(s.Hostname, s.Name+"."+s.Namespace+".svc.")
	return ok && rest != ""
}

// reportNew logs the errors that were not in the last merge's (reported)
// and returns this merge's: an error that persists is logged once, not at
// every snapshot (a tenant's ServiceEntries can make thousands).
func reportNew(log *slog.Logger, reported map[string]bool, errs []error) map[string]bool {
	next := make(map[string]bool, len(errs))
	for _, err := range errs {
		msg := err.Error()
		if !reported[msg] {
			log.Error(kubeobj.SkipMessage(err), "error", err)
		}
		next[msg] = true
	}
	return next
}

// addressConflict is merge's error for an address istiod gives a second
// owner, counted in redirector_xds_address_conflicts.
type addressConflict struct{ error }

// countConflicts counts the addressConflicts in errs.
func countConflicts(errs []error) int {
	n := 0
	for _, err := range errs {
		var c addressConflict
		if errors.As(err, &c) {
			n++
		}
	}
	return n
}

// foreignVIPs returns svc without the VIPs at the address of a workload
// that does not serve it (a copy if any is left out), and those. The
// tunnel, as ztunnel, looks a destination up as a VIP before as a
// workload's address, and a ServiceEntry's addresses are anyone's to write
// in their namespace: at another pod's address it would take that pod's
// traffic (this node's pods included) to its own endpoints, plaintext
// maybe. A VIP at one of its own endpoints (a ServiceEntry naming its VM's
// address) stays: an endpoint that is the claimant itself, not one of its
// name (a ServiceEntry names its endpoints after itself, so one named like
// a pod of its namespace, listing the pod's address as its VIP and as an
// endpoint, passed for serving it and took the pod's connections).
// cluster is the agent's (see ownPod).
func foreignVIPs(svc *workload.Service, claimed map[netip.Addr]claim, cluster string) (*workload.Service, []netip.Addr) {
	foreign := func(a netip.Addr) bool {
		owner, ok := claimed[a]
		return ok && !slices.ContainsFunc(svc.Endpoints, func(ep workload.Endpoint) bool {
			return ep.Addr == a && ep.Workload != nil && owner.is(ep.Workload, cluster)
		})
	}
	var taken []netip.Addr
	for _, a := range svc.VIPs {
		if foreign(a) {
			taken = append(taken, a)
		}
	}
	if len(taken) == 0 {
		return svc, nil
	}
	c := *svc
	c.VIPs = make([]netip.Addr, 0, len(svc.VIPs)-len(taken))
	for _, a := range svc.VIPs {
		if !foreign(a) {
			c.VIPs = append(c.VIPs, a)
		}
	}
	return &c, taken
}

// claim is whom an address belongs to in the directory: an istiod
// workload (key namespace/name, and uid istiod's name for it), or a local
// pod (from the API server: its uid is not istiod's).
type claim struct {
	key, uid string
	local    bool
}

// is reports whether w, istiod's workload, is the claimant: the same
// resource, or for a local pod istiod's copy of it.
func (c claim) is(w *workload.Workload, cluster string) bool {
	if c.local {
		return podOf(w, cluster) && w.Namespace+"/"+w.Name == c.key
	}
	return w.UID == c.uid
}

// routed returns svc as this node's pods reach it (a copy if that
// differs): a nodeLocal service only through its endpoints on this node;
// a passthrough one not at its VIPs (a connection goes to the address
// called, as in ztunnel), unless it has a waypoint, which takes
// connections to its VIPs first.
func routed(svc *Service, node string) *workload.Service {
	s := &svc.Service
	if svc.nodeLocal {
		c := *s
		c.Endpoints = slices.DeleteFunc(slices.Clone(s.Endpoints), func(ep workload.Endpoint) bool {
			return ep.Workload == nil || ep.Workload.Node != node
		})
		s = &c
	}
	if svc.passthrough && s.Waypoint == nil && len(s.VIPs)+len(s.CIDRs) > 0 {
		c := *s
		c.VIPs, c.CIDRs = nil, nil
		s = &c
	}
	return s
}

// asLocal returns svc with its endpoints that name istiod's copy of a
// local pod naming the local pod by the uid the directory's pod carries,
// the API's (uids maps istiod's to it), a copy if any does: the local pod
// is built from the node's watch, not from istiod's copy, and the
// directory resolves an endpoint that names a pod only to the workload of
// that uid at its address.
func asLocal(svc *workload.Service, uids map[string]string) *workload.Service {
	named := func(ep workload.Endpoint) bool { _, ok := uids[ep.PodUID]; return ok }
	i := slices.IndexFunc(svc.Endpoints, named)
	if i < 0 {
		return svc
	}
	c := *svc
	c.Endpoints = slices.Clone(svc.Endpoints)
	for j := i; j < len(c.Endpoints); j++ {
		if uid, ok := uids[c.Endpoints[j].PodUID]; ok {
			c.Endpoints[j].PodUID = uid
		}
	}
	return &c
}

// nodeAddr is a node's address and a hostNetwork pod there.
type nodeAddr struct {
	addr netip.Addr
	pod  string
}

// nodeRanges returns svc without the ranges (CIDRs) that hold a node's
// address (a copy if any is left out), and an error naming each. The
// directory leaves a workload's address to the workload before it looks
// at ranges, but a node's address is no workload's there (hostNetwork
// pods are not indexed), so a ServiceEntry's range over the nodes would
// take connections to them, kubelets included, to its endpoints, as a VIP
// at a node's address would (foreignVIPs). nodes is sorted by address.
func nodeRanges(svc *workload.Service, nodes []nodeAddr) (*workload.Service, []error) {
	var errs []error
	keep := make([]netip.Prefix, 0, len(svc.CIDRs))
	for _, p := range svc.CIDRs {
		// The first node address at or after the range's start.
		j, _ := slices.BinarySearchFunc(nodes, p.Addr(), func(n nodeAddr, a netip.Addr) int { return n.addr.Compare(a) })
		if j < len(nodes) && p.Contains(nodes[j].addr) {
			errs = append(errs, addressConflict{fmt.Errorf("istiod's service %s lists range %s, which holds node address %s (of %s): the range is left out", svc.Namespace+"/"+svc.Hostname, p, nodes[j].addr, nodes[j].pod)})
			continue
		}
		keep = append(keep, p)
	}
	if len(errs) == 0 {
		return svc, nil
	}
	c := *svc
	c.CIDRs = keep
	return &c, errs
}

// fromIstiod gives this node's pods (local, built from the API server's
// objects) what only istiod knows of them, from the copies it sent
// (localCopies): the waypoint, since only istiod resolves the Gateway an
// istio.io/use-waypoint label names, and without it traffic to a local
// pod's address would skip its waypoint; and the locality and cluster,
// which istiod reads from the pod's Node, and which services with a
// routing preference rank endpoints against. A pod with no single copy
// keeps no waypoint; since istiod gives every pod of a node the node's
// locality, it takes the one its node's copies agree on (none if they
// disagree: a relabelled node seen half-way), so a pod istiod has not
// sent yet still prefers endpoints close to it.
func fromIstiod(local []*workload.Workload, copies map[string][]*Workload) {
	type site struct{ region, zone, subzone, cluster string }
	var node site
	agreed, seen := true, false
	for _, w := range local {
		c := copies[w.String()]
		if len(c) != 1 {
			continue
		}
		if c[0].Waypoint != nil {
			w.Waypoint = c[0].Waypoint
		}
		w.Region, w.Zone, w.Subzone, w.Cluster = c[0].Region, c[0].Zone, c[0].Subzone, c[0].Cluster
		s := site{w.Region, w.Zone, w.Subzone, w.Cluster}
		if seen && s != node {
			agreed = false
		}
		node, seen = s, true
	}
	if !seen || !agreed {
		return
	}
	for _, w := range local {
		if len(copies[w.String()]) != 1 {
			w.Region, w.Zone, w.Subzone, w.Cluster = node.region, node.zone, node.subzone, node.cluster
		}
	}
}

// localCopies returns, per local pod name (namespace/name), istiod's pods
// of that name on this node in cluster: normally one; none while istiod
// has not seen the pod (or sees it on another node), two only if istiod
// is wrong. elsewhere holds those of other clusters (on a node of this
// name: EKS names nodes by their address, alike in clusters on overlapping
// networks), which are not.
func localCopies(mesh []*Workload, localNames map[string]bool, node, cluster string) (copies, elsewhere map[string][]*Workload) {
	copies, elsewhere = map[string][]*Workload{}, map[string][]*Workload{}
	for _, w := range mesh {
		key := w.Namespace + "/" + w.Name
		switch {
		case !isPod(w) || w.Node != node || !localNames[key]:
		case ownPod(w, cluster):
			copies[key] = append(copies[key], w)
		default:
			elsewhere[key] = append(elsewhere[key], w)
		}
	}
	return copies, elsewhere
}

// isPod: istiod names a Pod's workload <cluster>//Pod/<namespace>/<name>.
func isPod(w *Workload) bool { return strings.Contains(w.UID, "/Pod/") }

// ownPod: w is a pod of cluster, the agent's ("" or a workload naming no
// cluster matches: not known).
func ownPod(w *Workload, cluster string) bool { return podOf(&w.Workload, cluster) }

// podOf is ownPod for the model's workload.
func podOf(w *workload.Workload, cluster string) bool {
	return strings.Contains(w.UID, "/Pod/") && (cluster == "" || w.Cluster == "" || w.Cluster == cluster)
}

// claimOrder returns istiod's workloads in the order they claim addresses,
// as ztunnel ranks workloads at one address: pods first (their addresses
// are the kubelet's; anyone in a namespace writes a ServiceEntry's or a
// WorkloadEntry's), then those that take HBONE, then the healthy ones,
// then by namespace and name (mesh's own order, kept). Two pods at one
// address are a stale copy and the pod there now, or a lie: an HBONE
// claimant, if wrong, fails closed (its HBONE goes unanswered), where a
// plaintext one made connections to a meshed pod plaintext passthrough.
// istiod marks a pod being deleted unhealthy, and its address may be a new
// pod's already (its sandbox is gone before its object): by name alone
// the deleted pod kept it while its object lingered, so the new pod's
// service endpoints were refused (they name the new pod) once it was
// ready. Health comes after HBONE: unhealthy is also a pod not ready yet,
// which a plaintext claimant must not take the address from. The
// directory ranks other sources' claimants alike (workload.NewDirectory),
// where the API says which pod is terminating.
func claimOrder(mesh []*Workload) []*Workload {
	rank := func(w *Workload) int {
		r := 0
		if isPod(w) {
			r += 4
		}
		if w.Enrolled {
			r += 2
		}
		if w.Healthy {
			r++
		}
		return r
	}
	out := slices.Clone(mesh)
	slices.SortStableFunc(out, func(a, b *Workload) int { return rank(b) - rank(a) })
	return out
}
