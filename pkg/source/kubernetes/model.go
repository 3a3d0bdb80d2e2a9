package kubernetes

import (
	"cmp"
	"errors"
	"iter"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// kind is a kind of object whose changes the model tracks by key.
type kind int

const (
	kindNamespace kind = iota
	kindRuntimeClass
	kindPod
	// kindService keys are services: a Service event or an event of one of
	// its EndpointSlices both make the service translated again.
	kindService
	// kindNode keys are node names: a change of a node's locality labels
	// makes its pods translated again.
	kindNode
	numKinds
)

// Index names on the informers (added before they start).
const (
	podsByRuntimeClass = "runtimeClass"
	podsByNode         = "node"
	slicesByService    = "service"
)

// changes are the keys (namespace/name, or name) of the objects that
// changed since the model last applied changes, by kind.
type changes struct {
	keys     [numKinds]map[string]struct{}
	policies bool
}

func (c *changes) add(k kind, key string) {
	if c.keys[k] == nil {
		c.keys[k] = map[string]struct{}{}
	}
	c.keys[k][key] = struct{}{}
}

// pending collects the keys informer event handlers report, from their own
// goroutines, until the Run goroutine takes them. A key is kept once however
// often its object changes, so what it holds is bounded by the number of
// objects, not events.
type pending struct {
	mu     sync.Mutex
	c      changes
	notify func()
}

// mark records keys of kind k (policies when k is numKinds) and asks for a
// snapshot.
func (p *pending) mark(k kind, keys ...string) {
	p.mu.Lock()
	if k == numKinds {
		p.c.policies = true
	}
	for _, key := range keys {
		if key != "" {
			p.c.add(k, key)
		}
	}
	p.mu.Unlock()
	p.notify()
}

// markPolicies records a change of a policy (or that a policy informer
// synced).
func (p *pending) markPolicies() { p.mark(numKinds) }

// take returns what changed and starts over.
func (p *pending) take() changes {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.c
	p.c = changes{}
	return c
}

// handler records the keys keysOf gives for each added, updated or
// deleted object of kind k (both the old and new object's on update).
func (p *pending) handler(k kind, keysOf func(obj any) string) cache.ResourceEventHandlerFuncs {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { p.mark(k, keysOf(obj)) },
		UpdateFunc: func(old, obj any) { p.mark(k, keysOf(old), keysOf(obj)) },
		DeleteFunc: func(obj any) { p.mark(k, keysOf(obj)) },
	}
}

// nodeHandler records the names of Nodes added or deleted, and of those
// updated where their locality changed: the model reads nothing else of a
// Node, and every node's status is written at least every few minutes
// (conditions, images, controllers' annotations), which would otherwise
// rebuild every agent's directory for nothing.
func (p *pending) nodeHandler() cache.ResourceEventHandlerFuncs {
	h := p.handler(kindNode, objectKey)
	h.UpdateFunc = func(old, obj any) {
		o, _ := old.(*metav1.PartialObjectMetadata)
		n, _ := obj.(*metav1.PartialObjectMetadata)
		if o != nil && n != nil && o.Name == n.Name && kubeobj.NodeLocality(o.Labels) == kubeobj.NodeLocality(n.Labels) {
			return
		}
		p.mark(kindNode, objectKey(old), objectKey(obj))
	}
	return h
}

// objectKey is an object's cache key (namespace/name, or name), tombstones
// included.
func objectKey(obj any) string {
	key, _ := cache.DeletionHandlingMetaNamespaceKeyFunc(obj) // fails only for objects without metadata
	return key
}

// sliceServiceKey is the key of the service an EndpointSlice belongs to.
func sliceServiceKey(obj any) string {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	es, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok || es.Labels[discoveryv1.LabelServiceName] == "" {
		return ""
	}
	return kubeobj.SliceService(es)
}

// indexPodsByRuntimeClass indexes pods by their runtimeClassName, so a
// RuntimeClass change re-translates only its pods.
func indexPodsByRuntimeClass(obj any) ([]string, error) {
	if p, ok := obj.(*kubeobj.CompactPod); ok && p.RuntimeClassName != nil {
		return []string{*p.RuntimeClassName}, nil
	}
	return nil, nil
}

// indexPodsByNode indexes pods by their node, so a change of a node's
// locality re-translates only its pods.
func indexPodsByNode(obj any) ([]string, error) {
	if p, ok := obj.(*kubeobj.CompactPod); ok && p.NodeName != "" {
		return []string{p.NodeName}, nil
	}
	return nil, nil
}

// indexSlicesByService indexes EndpointSlices by their service's key.
func indexSlicesByService(obj any) ([]string, error) {
	if key := sliceServiceKey(obj); key != "" {
		return []string{key}, nil
	}
	return nil, nil
}

// informerSet is the informers the model reads (their stores are the truth;
// events only say which keys to read again).
type informerSet struct {
	namespaces, runtimeClasses, pods, services, endpointSlices, nodes cache.SharedIndexInformer
	peerAuthn, authz                                                  *policyKind
}

// model is the translated state: every pod as a workload, every service
// with its endpoints, the ambient namespaces and the policies. Only the Run
// goroutine uses it. apply translates only what changed; snapshot hands
// out the model without translating or sorting anything again. A workload
// or service handed out is never modified: a change replaces it.
type model struct {
	cfg selection.Config
	log *slog.Logger
	inf informerSet
	// metrics counts pods whose object is malformed (may be nil).
	metrics *source.Metrics

	namespaces map[string]*corev1.Namespace // trimmed: name and dataplane-mode label
	handlers   map[string]string            // RuntimeClass name -> handler
	localities map[string]kubeobj.Locality  // node name -> its locality labels
	ambient    []string                     // replaced, never modified, when it changes
	workloads  sortedMap[*workload.Workload]
	services   sortedMap[*workload.Service]
	// waypointLabels are each Service's waypoint labels, joined, to tell
	// when a change of a Service changes whose waypoint it is.
	waypointLabels map[string]string
	// waypointsChanged asks for every object's waypoint again: a
	// namespace's or a Service's waypoint labels, or a Service's
	// existence, changed.
	waypointsChanged bool
	peerAuthn        []policy.PeerAuthentication
	authz            []policy.AuthorizationPolicy
}

func newModel(cfg selection.Config, log *slog.Logger, inf informerSet) *model {
	cfg.NamespaceViewLags = true // namespaces are watched: one missing is one not seen yet
	return &model{cfg: cfg, log: log, inf: inf, namespaces: map[string]*corev1.Namespace{}, handlers: map[string]string{}, localities: map[string]kubeobj.Locality{}, waypointLabels: map[string]string{}}
}

// everything is a change of every object in the caches: the first
// snapshot's.
func (m *model) everything() changes {
	var c changes
	for k, inf := range map[kind]cache.SharedIndexInformer{
		kindNamespace: m.inf.namespaces, kindRuntimeClass: m.inf.runtimeClasses, kindPod: m.inf.pods, kindService: m.inf.services, kindNode: m.inf.nodes,
	} {
		for _, key := range inf.GetStore().ListKeys() {
			c.add(k, key)
		}
	}
	c.policies = true
	return c
}

// apply translates the objects of c again from the informer caches, and
// what depends on them: a namespace's pods when its dataplane-mode label
// changed and its Services when its traffic-distribution annotation did,
// a RuntimeClass's pods when its handler changed, a node's pods when its
// locality did.
func (m *model) apply(c changes) {
	for name := range c.keys[kindNode] {
		obj, ok, _ := m.inf.nodes.GetStore().GetByKey(name)
		n, _ := obj.(*metav1.PartialObjectMetadata)
		if !ok {
			n = nil
		}
		was, had := m.localities[name]
		var now kubeobj.Locality
		if n != nil {
			now = kubeobj.NodeLocality(n.Labels)
		}
		if n != nil {
			m.localities[name] = now
		} else {
			delete(m.localities, name)
		}
		if had == (n != nil) && was == now {
			continue
		}
		pods, _ := m.inf.pods.GetIndexer().ByIndex(podsByNode, name)
		for _, p := range pods {
			c.add(kindPod, objectKey(p))
		}
	}

	for name := range c.keys[kindRuntimeClass] {
		obj, ok, _ := m.inf.runtimeClasses.GetStore().GetByKey(name)
		handler, exists := "", false
		if rc, isRC := obj.(*nodev1.RuntimeClass); ok && isRC {
			handler, exists = rc.Handler, true
		}
		was, had := m.handlers[name]
		if exists {
			m.handlers[name] = handler
		} else {
			delete(m.handlers, name)
		}
		if had == exists && was == handler {
			continue
		}
		pods, _ := m.inf.pods.GetIndexer().ByIndex(podsByRuntimeClass, name)
		for _, p := range pods {
			c.add(kindPod, objectKey(p))
		}
	}

	nsChanged := false
	for name := range c.keys[kindNamespace] {
		obj, ok, _ := m.inf.namespaces.GetStore().GetByKey(name)
		ns, _ := obj.(*corev1.Namespace)
		if !ok {
			ns = nil
		}
		old := m.namespaces[name]
		if ns != nil {
			m.namespaces[name] = ns
		} else {
			delete(m.namespaces, name)
		}
		if waypointKey(labelsOf(old)) != waypointKey(labelsOf(ns)) {
			m.waypointsChanged = true
		}
		if trafficDistribution(old) != trafficDistribution(ns) {
			svcs, _ := m.inf.services.GetIndexer().ByIndex(cache.NamespaceIndex, name)
			for _, svc := range svcs {
				c.add(kindService, objectKey(svc))
			}
		}
		if (old == nil) == (ns == nil) && dataplaneMode(old) == dataplaneMode(ns) {
			continue
		}
		nsChanged = true
		pods, _ := m.inf.pods.GetIndexer().ByIndex(cache.NamespaceIndex, name)
		for _, p := range pods {
			c.add(kindPod, objectKey(p))
		}
	}
	if nsChanged {
		var ambient []string
		for name, ns := range m.namespaces {
			if dataplaneMode(ns) == selection.DataplaneModeAmbient {
				ambient = append(ambient, name)
			}
		}
		slices.Sort(ambient)
		m.ambient = ambient
	}

	for key := range c.keys[kindPod] {
		m.applyPod(key)
	}
	for key := range c.keys[kindService] {
		m.applyService(key)
	}
	if m.waypointsChanged {
		m.waypointsChanged = false
		m.applyWaypoints()
	}
	if c.policies {
		m.peerAuthn = sortedValues(decodeAll[policy.PeerAuthentication](m.inf.peerAuthn))
		m.authz = sortedValues(decodeAll[policy.AuthorizationPolicy](m.inf.authz))
	}
}

func trafficDistribution(ns *corev1.Namespace) string {
	if ns == nil {
		return ""
	}
	return ns.Annotations[kubeobj.TrafficDistributionAnnotation]
}

func dataplaneMode(ns *corev1.Namespace) string {
	if ns == nil {
		return ""
	}
	return ns.Labels[selection.DataplaneModeLabel]
}

// lookup is the selection rules' view of the RuntimeClasses.
func (m *model) lookup(class string) (string, bool) {
	h, ok := m.handlers[class]
	return h, ok
}

func (m *model) applyPod(key string) {
	k := splitKey(key)
	obj, ok, _ := m.inf.pods.GetStore().GetByKey(key)
	pod, isPod := obj.(*kubeobj.CompactPod)
	if !ok || !isPod {
		m.workloads.delete(k)
		return
	}
	p := pod.Pod()
	w, err := kubeobj.Pod(m.cfg, m.namespaces[pod.Namespace], p, m.lookup)
	if w == nil && errors.As(err, new(*selection.PodAddrError)) {
		// The pod is still there, its object malformed: it did not leave,
		// so it keeps its last good version (its enrollment with it).
		m.metrics.Error("kubernetes", source.ReasonInvalid)
		if old, had := m.workloads.m[k]; had && old.UID == kubeobj.PodUID(p) {
			m.log.Error("pod object malformed; its last good version is kept", "error", err)
			return
		}
		m.log.Error("pod left out", "error", err)
		m.workloads.delete(k)
		return
	}
	old, had := m.workloads.m[k]
	if had && w != nil && errors.As(err, new(*selection.RuntimeClassError)) && kubeobj.KeepDecision(w, old) {
		// Its RuntimeClass was deleted under it: the sandbox keeps its
		// handler, so the pod keeps its enrollment.
		m.log.Error("pod's runtime class is gone; its last decision (enrolled) is kept", "error", err)
		err = nil
	}
	if why := undecided(w); had && why != "" && kubeobj.KeepDecision(w, old) {
		// Its namespace left the view while the pod is there (the API
		// server removes a namespace only after its pods): the view lags,
		// and the pod keeps its enrollment rather than being detached.
		m.log.Error("pod cannot be judged now; its last decision (enrolled) is kept", "pod", key, "reason", why)
	}
	if err != nil {
		m.log.Error("pod left out or not enrolled", "error", err)
	}
	if w == nil {
		m.workloads.delete(k)
		return
	}
	w.Waypoint = m.waypointRules().For(w.Namespace, "", w.Labels, kubeobj.WaypointForWorkload)
	m.localities[w.Node].Set(w)
	m.workloads.set(k, w)
}

// undecided is w's Undecided reason, "" for none or no w.
func undecided(w *workload.Workload) string {
	if w == nil {
		return ""
	}
	return w.Undecided
}

func (m *model) applyService(key string) {
	k := splitKey(key)
	obj, ok, _ := m.inf.services.GetStore().GetByKey(key)
	svc, isSvc := obj.(*corev1.Service)
	if !ok || !isSvc {
		m.services.delete(k)
		if _, had := m.waypointLabels[key]; had {
			delete(m.waypointLabels, key)
			m.waypointsChanged = true
		}
		return
	}
	if was, had := m.waypointLabels[key]; !had || was != waypointKey(svc.Labels) {
		m.waypointLabels[key] = waypointKey(svc.Labels)
		m.waypointsChanged = true
	}
	s, err := kubeobj.Service(svc)
	if err != nil {
		m.log.Error("service left out", "error", err)
		m.services.delete(k)
		return
	}
	if s.Routing, err = kubeobj.Routing(svc, m.namespaces[svc.Namespace]); err != nil {
		m.log.Error("service's traffic distribution ignored", "error", err)
	}
	objs, _ := m.inf.endpointSlices.GetIndexer().ByIndex(slicesByService, key)
	list := make([]*discoveryv1.EndpointSlice, 0, len(objs))
	for _, o := range objs {
		if es, ok := o.(*discoveryv1.EndpointSlice); ok {
			list = append(list, es)
		}
	}
	// Slices of one service that disagree on a port's number merge in
	// name order, whatever order the cache lists them in.
	slices.SortFunc(list, func(a, b *discoveryv1.EndpointSlice) int { return cmp.Compare(a.Name, b.Name) })
	var errs []error
	s.Endpoints, errs = kubeobj.Endpoints(list)
	for _, err := range errs {
		m.log.Error("endpoint left out", "service", key, "error", err)
	}
	s.Waypoint = m.waypointRules().For(s.Namespace, s.Name, svc.Labels, kubeobj.WaypointForService)
	m.services.set(k, s)
}

// waypointRules read the Services' and namespaces' waypoint labels from
// the (trimmed) caches.
func (m *model) waypointRules() kubeobj.WaypointRules {
	return kubeobj.WaypointRules{
		Service: func(ns, name string) (map[string]string, bool) {
			obj, ok, _ := m.inf.services.GetStore().GetByKey(ns + "/" + name)
			svc, isSvc := obj.(*corev1.Service)
			if !ok || !isSvc {
				return nil, false
			}
			return svc.Labels, true
		},
		Namespace: func(name string) map[string]string { return labelsOf(m.namespaces[name]) },
	}
}

// applyWaypoints gives every workload and service its waypoint again.
// One whose waypoint changed is replaced by a copy: what a snapshot handed
// out is never modified.
func (m *model) applyWaypoints() {
	rules := m.waypointRules()
	for k, w := range m.workloads.entries() {
		if wp := rules.For(w.Namespace, "", w.Labels, kubeobj.WaypointForWorkload); !sameWaypoint(wp, w.Waypoint) {
			c := *w
			c.Waypoint = wp
			m.workloads.set(k, &c)
		}
	}
	for k, s := range m.services.entries() {
		obj, ok, _ := m.inf.services.GetStore().GetByKey(s.Namespace + "/" + s.Name)
		svc, isSvc := obj.(*corev1.Service)
		if !ok || !isSvc {
			continue
		}
		if wp := rules.For(s.Namespace, s.Name, svc.Labels, kubeobj.WaypointForService); !sameWaypoint(wp, s.Waypoint) {
			c := *s
			c.Waypoint = wp
			m.services.set(k, &c)
		}
	}
}

func sameWaypoint(a, b *workload.Waypoint) bool {
	return a == b || (a != nil && b != nil && *a == *b)
}

func labelsOf(ns *corev1.Namespace) map[string]string {
	if ns == nil {
		return nil
	}
	return ns.Labels
}

// waypointKey is the waypoint labels among labels, joined.
func waypointKey(labels map[string]string) string {
	var b strings.Builder
	for _, l := range kubeobj.WaypointLabels {
		// A label there with an empty value is not one that is not
		// there: the rules read the object's own use-waypoint labels
		// by presence.
		if v, ok := labels[l]; ok {
			b.WriteByte('=')
			b.WriteString(v)
		}
		b.WriteByte(0)
	}
	return b.String()
}

// snapshot is the model as a Snapshot, sharing its workloads, services and
// lists (read-only, as Snapshot requires).
func (m *model) snapshot() source.Snapshot {
	return source.Snapshot{
		Workloads:             m.workloads.values(),
		Services:              m.services.values(),
		AmbientNamespaces:     m.ambient,
		PeerAuthentications:   m.peerAuthn,
		AuthorizationPolicies: m.authz,
	}
}

// objKey orders objects by namespace, then name.
type objKey struct{ ns, name string }

func (a objKey) compare(b objKey) int {
	return cmp.Or(cmp.Compare(a.ns, b.ns), cmp.Compare(a.name, b.name))
}

func splitKey(key string) objKey {
	ns, name, _ := cache.SplitMetaNamespaceKey(key) // informer keys always split
	return objKey{ns, name}
}

// sortedMap holds values by key and lists them in key order. A change of
// values costs O(1); values then copies the pointers once, in the order it
// kept, and a change of membership merges the new keys in (one sort of the
// new keys, one pass over the old), so no snapshot sorts the whole set.
type sortedMap[V any] struct {
	m       map[objKey]V
	keys    []objKey // sorted; may still hold deleted keys
	added   []objKey // keys set since values, not yet in keys
	members bool     // a key was added or deleted since values
	changed bool     // anything was set or deleted since values
	last    []V      // what values returned last
}

func (s *sortedMap[V]) set(k objKey, v V) {
	if s.m == nil {
		s.m = map[objKey]V{}
	}
	if _, ok := s.m[k]; !ok {
		s.added = append(s.added, k)
		s.members = true
	}
	s.m[k] = v
	s.changed = true
}

func (s *sortedMap[V]) delete(k objKey) {
	if _, ok := s.m[k]; ok {
		delete(s.m, k)
		s.members, s.changed = true, true
	}
}

// values returns every value in key order: the same slice as last time when
// nothing changed, else a new one (the caller may keep the old).
func (s *sortedMap[V]) values() []V {
	if !s.changed && s.last != nil {
		return s.last
	}
	if s.members {
		slices.SortFunc(s.added, objKey.compare)
		keys := make([]objKey, 0, len(s.m))
		old, added := s.keys, s.added
		push := func(k objKey) {
			if _, ok := s.m[k]; ok && (len(keys) == 0 || keys[len(keys)-1] != k) {
				keys = append(keys, k)
			}
		}
		for len(old) > 0 || len(added) > 0 {
			if len(added) == 0 || (len(old) > 0 && old[0].compare(added[0]) <= 0) {
				push(old[0])
				old = old[1:]
			} else {
				push(added[0])
				added = added[1:]
			}
		}
		s.keys, s.added, s.members = keys, nil, false
	}
	out := make([]V, len(s.keys))
	for i, k := range s.keys {
		out[i] = s.m[k]
	}
	s.last, s.changed = out, false
	return out
}

// entries iterates over the keys and values in no order; set may replace
// the value of the key being visited.
func (s *sortedMap[V]) entries() iter.Seq2[objKey, V] { return maps.All(s.m) }
