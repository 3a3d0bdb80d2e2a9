package kubernetes

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
	kjson "sigs.k8s.io/json"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
)

// istioSecurityGroup is the API group of the policies.
const istioSecurityGroup = "security.istio.io"

// policyVersions are the versions of istioSecurityGroup the source reads, preferred first.
// Istio serves its security types in v1 since 1.22 and in v1beta1 before and alongside, with
// the same schema (the file source takes both too), so a cluster whose CRDs serve only
// v1beta1 has its policies read there.
var policyVersions = []string{"v1", "v1beta1"}

// policyKind is one Istio policy resource, watched once its CRD is served.
type policyKind struct {
	resource string
	// check reports whether an object converts to the policy types, and what is lost.
	check func(*unstructured.Unstructured) (leftOut bool, err error)

	// failClosed stands for an object that never converted: a policy that enforces at least
	// what the author can have meant (see decodeObjects).
	failClosed func(*unstructured.Unstructured) any

	informer      cache.SharedIndexInformer // nil while the CRD is missing
	version       string                    // the version the informer watches
	stop          context.CancelFunc        // stops the informer
	loggedMissing bool
	// gone is set when the API server answers 404 for the version watched: the CRD was
	// deleted, or no longer serves that version. The kind is then looked up again.
	gone atomic.Bool
	// lastGood is the last version of each object (by UID) that converted; only the model
	// (the Run goroutine) reads and writes it.
	lastGood map[types.UID]*goodVersion
	// held is what decodeAll returned last ([]*T): the policies of the kind while an informer
	// of its new version lists.
	held any
}

// goodVersion is an object's last version that converted: its resourceVersion and the
// policy. A snapshot takes an object at that same resourceVersion as it is, without decoding
// it again: decoding every policy for each change cost about a second at 10k policies, during
// which no pod change reached a snapshot.
type goodVersion struct {
	rv string
	v  any
}

// policyWatch starts the policy informers when (and if) their CRDs appear. The agent must run
// in clusters without Istio's CRDs, so a missing CRD is not an error: it is looked up again
// every Config.PolicyRecheck. A kind whose version the API server stops serving (404: its CRD
// deleted, or serving the kind in another version only) is looked up again the same way: a
// kind served in another version it reads is watched there (its policies as they were until
// the new list is in), a kind whose CRD is gone has no policies left, and a kind that cannot
// be told (discovery fails, the CRD serves no version the agent reads, or the agent may not
// read CRDs) keeps its last policies. Before, the informer retried its version for ever: a
// policy made since never applied and one deleted stayed in force.
//
// A kind is watched in the first of policyVersions that discovery lists it in. A kind that
// discovery lists only in other versions (a CRD serving only a version this agent cannot
// read) is an error, not a missing kind: its policies exist, and snapshots without them
// would drop every DENY and STRICT they hold, so no snapshot is delivered until a version
// the agent reads is served.
//
// Discovery not listing a kind does not prove its CRD is missing: an API server that has just
// started serves a CRD's discovery a moment after its CRDs are loaded. Starting without the
// policies then would drop every PeerAuthentication (STRICT) until the next check. So a kind
// that discovery does not list is looked up as a CustomResourceDefinition: if it exists and
// serves any version, check fails (no first snapshot yet; a later check retries). Only a 404
// (or a CRD serving no version) counts as "not installed". Without RBAC to read the CRD (an
// older chart) discovery alone decides, as before.
type policyWatch struct {
	s      *Source
	kinds  []*policyKind
	notify func()
	runs   sync.WaitGroup // the informers' goroutines

	loggedNoCRDAccess bool
}

// check starts the informers of the policy kinds the API server now serves in a version it
// reads: look, then start. Run's first check calls it; later ones look on another goroutine.
func (w *policyWatch) check(ctx context.Context) error {
	versions, err := w.look(ctx, w.missingKinds())
	if err != nil {
		return err
	}
	w.start(ctx, versions)
	return nil
}

// missingKinds are the resources of the kinds not watched yet, or no longer served.
func (w *policyWatch) missingKinds() []string {
	var out []string
	for _, k := range w.kinds {
		if k.informer == nil || k.gone.Load() {
			out = append(out, k.resource)
		}
	}
	return out
}

// found is what look found of a kind: the version to watch, else whether its CRD is known
// to be absent (404), not only unlisted by discovery (the agent may not read CRDs).
type found struct {
	version string
	absent  bool
}

// look asks the API server which version of each of resources to watch. It fails when
// discovery gives no answer, or a kind is served (or its CRD installed) only in versions the
// agent cannot read; a kind that is not installed is not an error. It only reads the API
// server (and loggedNoCRDAccess), so it may run on another goroutine than the model's, one
// look at a time: an API server slow to answer discovery then holds back no snapshot (before,
// every pod change waited for the look-up, up to the discovery client's 32 s a request, while
// a new pod's CNI ADD gives up after 20 s).
func (w *policyWatch) look(ctx context.Context, resources []string) (map[string]found, error) {
	servedIn, err := w.servedVersions(ctx)
	if err != nil {
		return nil, err
	}
	out := make(map[string]found, len(resources))
	for _, resource := range resources {
		versions := servedIn[resource]
		if v := readable(versions); v != "" {
			out[resource] = found{version: v}
			continue
		}
		if len(versions) > 0 {
			return nil, fmt.Errorf("%s.%s is served only in %v; this agent reads %v: no snapshot until one of those is served, since its policies would be dropped",
				resource, istioSecurityGroup, versions, policyVersions)
		}
		crdVersions, absent, err := w.crdServed(ctx, resource)
		if err != nil {
			return nil, err
		}
		switch {
		case readable(crdVersions) != "":
			return nil, fmt.Errorf("CRD %s.%s is installed but %s/%s is not served yet", resource, istioSecurityGroup, istioSecurityGroup, readable(crdVersions))
		case len(crdVersions) > 0:
			return nil, fmt.Errorf("CRD %s.%s serves only %v; this agent reads %v: no snapshot until one of those is served, since its policies would be dropped",
				resource, istioSecurityGroup, crdVersions, policyVersions)
		}
		out[resource] = found{absent: absent}
	}
	return out, nil
}

// start starts the informers of the kinds look found served (by resource), on the model's
// goroutine: decodeAll reads the kinds' informers there. A kind watched in a version no
// longer served (gone) moves to the version found, or, when its CRD is absent, is dropped.
func (w *policyWatch) start(ctx context.Context, kinds map[string]found) {
	for _, k := range w.kinds {
		f, looked := kinds[k.resource]
		if !looked {
			continue
		}
		if k.informer != nil {
			switch {
			case !k.gone.Load():
				continue
			case f.version == k.version, f.version == "" && !f.absent:
				// Still served (the 404 passed), or cannot be told: the informer keeps
				// retrying and its policies stay.
				k.gone.Store(false)
				continue
			}
			w.s.log.Warn("Istio policy version no longer served; watching the kind again",
				"resource", k.resource, "was", k.version, "now", cmp.Or(f.version, "CRD not installed"))
			k.stop()
			k.informer, k.version, k.stop = nil, "", nil
			k.gone.Store(false)
			if f.version == "" {
				k.lastGood, k.held = nil, nil
				w.notify()
			}
		}
		switch {
		case f.version != "":
			k.version = f.version
			gvr := schema.GroupVersionResource{Group: istioSecurityGroup, Version: k.version, Resource: k.resource}
			// inf, not k.informer, in what runs on other goroutines: a later start
			// replaces (or clears) k.informer on this one.
			inf := dynamicinformer.NewFilteredDynamicInformer(w.s.dynamic, gvr, metav1.NamespaceAll, w.s.cfg.Resync,
				cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}, nil).Informer()
			k.informer = inf
			if err := inf.SetTransform(trimPolicy); err != nil {
				w.s.log.Warn("set informer transform", "resource", k.resource, "err", err)
			}
			if _, err := inf.AddEventHandler(w.handler(k)); err != nil {
				w.s.log.Warn("add event handler", "resource", k.resource, "err", err)
			}
			if err := inf.SetWatchErrorHandlerWithContext(func(ctx context.Context, r *cache.Reflector, err error) {
				w.s.watchError(ctx, r, err)
				if apierrors.IsNotFound(err) {
					k.gone.Store(true)
				}
			}); err != nil {
				w.s.log.Warn("set watch error handler", "resource", k.resource, "err", err)
			}
			w.s.log.Info("watching Istio policies", "resource", k.resource, "version", gvr.GroupVersion().String())
			kctx, stop := context.WithCancel(ctx)
			k.stop = stop
			w.runs.Go(func() { inf.RunWithContext(kctx) })
			// Policies of a kind enter snapshots only once its informer synced (a partial
			// list of ALLOW/DENY policies would be wrong, not just stale); snapshot on that
			// moment even if the list was empty and fired no event. The wait ends with the
			// informer: one stopped before it synced (its kind moved on) syncs never.
			w.runs.Go(func() {
				if cache.WaitForCacheSync(kctx.Done(), inf.HasSynced) {
					w.notify()
				}
			})
		case !k.loggedMissing:
			w.s.log.Info("Istio policy CRD not installed; checking again periodically",
				"resource", k.resource+"."+istioSecurityGroup, "every", w.s.cfg.PolicyRecheck)
			k.loggedMissing = true
		}
	}
}

// wait waits for the informers' goroutines, which end with the context start was given.
func (w *policyWatch) wait() { w.runs.Wait() }

// readable is the first of policyVersions among versions, or "".
func readable(versions []string) string {
	for _, v := range policyVersions {
		if slices.Contains(versions, v) {
			return v
		}
	}
	return ""
}

// servedVersions lists, by resource, the versions of istioSecurityGroup that discovery serves
// it in (every version of the group, so one the agent cannot read is seen too).
func (w *policyWatch) servedVersions(ctx context.Context) (map[string][]string, error) {
	groups, err := w.s.discovery.ServerGroupsWithContext(ctx)
	if err != nil {
		return nil, fmt.Errorf("look up API groups: %w", err)
	}
	var versions []string
	for _, g := range groups.Groups {
		if g.Name == istioSecurityGroup {
			for _, v := range g.Versions {
				versions = append(versions, v.Version)
			}
		}
	}
	// The versions the agent reads are asked for even when the group list lacks them: the
	// list may lag behind a version that is served.
	for _, v := range policyVersions {
		if !slices.Contains(versions, v) {
			versions = append(versions, v)
		}
	}
	out := map[string][]string{}
	for _, v := range versions {
		gv := schema.GroupVersion{Group: istioSecurityGroup, Version: v}.String()
		resources, err := w.s.discovery.ServerResourcesForGroupVersionWithContext(ctx, gv)
		if apierrors.IsNotFound(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("look up %s resources: %w", gv, err)
		}
		for _, r := range resources.APIResources {
			if !slices.Contains(out[r.Name], v) {
				out[r.Name] = append(out[r.Name], v)
			}
		}
	}
	return out, nil
}

// trimPolicy is the policy informers' transform: an object enters the cache with only what
// decoding reads (kind, name, namespace, UID, resourceVersion, creation time, labels, the
// dry-run annotation, spec). Every node caches every policy of the cluster, and their authors
// (tenants) decide their size: annotations alone may take 256 KiB an object, kept in the cache
// and again in each decoded policy. Trimming a trimmed object changes nothing.
func trimPolicy(obj any) (any, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return kubeobj.DropManagedFields(obj)
	}
	out := &unstructured.Unstructured{Object: map[string]any{}}
	for _, f := range []string{"apiVersion", "kind", "spec"} {
		if v, ok := u.Object[f]; ok {
			out.Object[f] = v
		}
	}
	meta := map[string]any{}
	if m, ok := u.Object["metadata"].(map[string]any); ok {
		for _, f := range []string{"name", "namespace", "uid", "resourceVersion", "creationTimestamp", "labels", "deletionTimestamp"} {
			if v, ok := m[f]; ok {
				meta[f] = v
			}
		}
		if a, ok := m["annotations"].(map[string]any); ok {
			if v, ok := a[policy.DryRunAnnotation]; ok {
				meta["annotations"] = map[string]any{policy.DryRunAnnotation: v}
			}
		}
	}
	out.Object["metadata"] = meta
	return out, nil
}

// crdGVR is where CustomResourceDefinitions are read.
var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// crdServed returns the versions the CRD of resource serves, though discovery lists none of
// them. Not found: none, absent. Forbidden (no RBAC for CRDs): none, not known absent,
// logged once.
func (w *policyWatch) crdServed(ctx context.Context, resource string) (served []string, absent bool, err error) {
	name := resource + "." + istioSecurityGroup
	crd, err := w.s.dynamic.Resource(crdGVR).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, true, nil
	case apierrors.IsForbidden(err):
		if !w.loggedNoCRDAccess {
			w.s.log.Warn("cannot read CustomResourceDefinitions (RBAC); trusting discovery alone for Istio policy kinds", "crd", name, "err", err)
			w.loggedNoCRDAccess = true
		}
		return nil, false, nil
	case err != nil:
		return nil, false, fmt.Errorf("look up CRD %s: %w", name, err)
	}
	versions, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
	for _, v := range versions {
		m, ok := v.(map[string]any)
		if name, isName := m["name"].(string); ok && isName && m["served"] == true {
			served = append(served, name)
		}
	}
	return served, len(served) == 0, nil
}

// missing reports whether a policy kind waits for its CRD, or for its version to be looked
// up again.
func (w *policyWatch) missing() bool {
	return slices.ContainsFunc(w.kinds, func(k *policyKind) bool { return k.informer == nil || k.gone.Load() })
}

// synced reports whether every started policy informer has synced.
func (w *policyWatch) synced() bool {
	for _, k := range w.kinds {
		if k.informer != nil && !k.informer.HasSynced() {
			return false
		}
	}
	return true
}

// handler logs objects that do not convert (once per change, not once per snapshot) and
// asks for a snapshot.
func (w *policyWatch) handler(k *policyKind) cache.ResourceEventHandlerFuncs {
	checkObj := func(obj any) {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			return
		}
		leftOut, err := k.check(u)
		switch {
		case leftOut:
			w.s.cfg.Metrics.Error("kubernetes", source.ReasonInvalid)
			w.s.log.Error("Istio policy does not convert; its last version that did stays, or, with none, it fails closed",
				"resource", k.resource, "namespace", u.GetNamespace(), "name", u.GetName(), "err", err)
		case err != nil:
			w.s.cfg.Metrics.Error("kubernetes", source.ReasonInvalid)
			w.s.log.Error("Istio policy has a field this agent does not know; it fails closed (an AuthorizationPolicy ALLOW admits nothing and a DENY denies all it selects; a PeerAuthentication is STRICT for what it selects)",
				"resource", k.resource, "namespace", u.GetNamespace(), "name", u.GetName(), "err", err)
		}
	}
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { checkObj(obj); w.notify() },
		UpdateFunc: func(_, obj any) { checkObj(obj); w.notify() },
		DeleteFunc: func(any) { w.notify() },
	}
}

// decodeAll converts the cached objects of k to T (see decodeObjects). Before the informer
// has synced it returns what it returned last: nothing for a kind watched for the first time,
// the policies of the version watched before for a kind that moved to another.
func decodeAll[T any](k *policyKind) []*T {
	if k.informer == nil || !k.informer.HasSynced() {
		held, _ := k.held.([]*T) // an informer of a new version lists: the old one's policies
		return held
	}
	out, next := decodeObjects[T](k.informer.GetStore().List(), k.lastGood, k.failClosed)
	k.lastGood, k.held = next, out
	return out
}

// decodeObjects converts objs to T. Leaving out a policy that does not convert would fail
// open (a DENY or ALLOW policy gone, a STRICT PeerAuthentication gone), so an object that
// does not convert is replaced by its last version that did (lastGood, by UID), or, if it
// never did, by failClosed's stand-in. An object whose UID and resourceVersion are its last
// good version's is that version, not decoded again (the API server gives every change a new
// resourceVersion). It returns the policies (shared with earlier calls: read-only) and the
// new lastGood.
func decodeObjects[T any](objs []any, lastGood map[types.UID]*goodVersion, failClosed func(*unstructured.Unstructured) any) ([]*T, map[types.UID]*goodVersion) {
	next := make(map[types.UID]*goodVersion, len(objs))
	var out []*T
	for _, obj := range objs {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		uid, rv := u.GetUID(), u.GetResourceVersion()
		last := lastGood[uid]
		if lv, ok := last.value().(*T); ok && rv != "" && last.rv == rv {
			next[uid] = last
			out = append(out, lv)
			continue
		}
		v, err := decode[T](u)
		if err == nil {
			next[uid] = &goodVersion{rv: rv, v: v}
		} else if lv, ok := last.value().(*T); ok {
			v = lv
			next[uid] = last
		} else if stand, ok := failClosed(u).(*T); ok {
			v = stand
		} else {
			continue // no stand-in of this type: a programming error, caught by the tests
		}
		out = append(out, v)
	}
	return out, next
}

// value is the policy of g, nil for none.
func (g *goodVersion) value() any {
	if g == nil {
		return nil
	}
	return g.v
}

// unconvertible is the action or mode of a stand-in for a policy that never converted. The
// policy package reads an unknown AuthorizationPolicy action as "deny everything selected"
// and an unknown PeerAuthentication mode as STRICT.
const unconvertible = "UNCONVERTIBLE"

// failClosedAuthz stands for an AuthorizationPolicy that never converted: it denies
// everything it selects (its selector and target references if those convert, else the
// whole namespace).
func failClosedAuthz(u *unstructured.Unstructured) any {
	ap := &policy.AuthorizationPolicy{Meta: standInMeta(u)}
	ap.Spec.Selector = specField[policy.WorkloadSelector](u, "selector")
	ap.Spec.TargetRef = specField[policy.PolicyTargetReference](u, "targetRef")
	if refs := specField[[]policy.PolicyTargetReference](u, "targetRefs"); refs != nil {
		ap.Spec.TargetRefs = *refs
	}
	ap.Spec.Action = unconvertible
	return ap
}

// failClosedPeerAuthn stands for a PeerAuthentication that never converted: STRICT for what
// it selects (its selector if that converts, else the whole namespace).
func failClosedPeerAuthn(u *unstructured.Unstructured) any {
	pa := &policy.PeerAuthentication{Meta: standInMeta(u)}
	pa.Spec.Selector = specField[policy.WorkloadSelector](u, "selector")
	pa.Spec.MTLS = &policy.MTLS{Mode: unconvertible}
	return pa
}

// standInMeta is the metadata a stand-in keeps of u.
func standInMeta(u *unstructured.Unstructured) policy.Meta {
	return policy.Meta{Namespace: u.GetNamespace(), Name: u.GetName(), UID: string(u.GetUID()),
		CreationTimestamp: u.GetCreationTimestamp().Time, ResourceVersion: u.GetResourceVersion(), Labels: u.GetLabels()}
}

// specField decodes spec.<name> of u into a new T; nil if it is absent or does not decode.
func specField[T any](u *unstructured.Unstructured, name string) *T {
	raw, ok, err := unstructured.NestedFieldNoCopy(u.Object, "spec", name)
	if !ok || err != nil {
		return nil
	}
	b, err := json.Marshal(raw)
	if err != nil {
		return nil
	}
	v := new(T)
	if kjson.UnmarshalCaseSensitivePreserveInts(b, v) != nil {
		return nil
	}
	return v
}

// decode converts an unstructured object to T through JSON, the encoding the policy types
// are written for (their port maps have integer keys, which the unstructured converter does
// not handle). Field names match case-sensitively, as for the API server and Istio: a
// "Rules" is a field the types do not know, not "rules".
func decode[T any](u *unstructured.Unstructured) (*T, error) {
	b, err := u.MarshalJSON()
	if err != nil {
		return nil, fmt.Errorf("encode %s/%s: %w", u.GetNamespace(), u.GetName(), err)
	}
	v := new(T)
	if err := kjson.UnmarshalCaseSensitivePreserveInts(b, v); err != nil {
		return nil, fmt.Errorf("decode %s/%s: %w", u.GetNamespace(), u.GetName(), err)
	}
	// A field the types do not know is dropped by decoding, and a rule
	// without it may match more: an ALLOW would admit more than written.
	// The policy is kept, marked, and fails closed (see policy.Validate).
	// A PeerAuthentication without it may select or relax more: it is
	// read as STRICT (see policy.EffectiveMode).
	switch p := any(v).(type) {
	case *policy.AuthorizationPolicy:
		if _, err := checkSpec[policy.AuthorizationPolicySpec](u); err != nil {
			p.Unrecognized = err.Error()
		}
	case *policy.PeerAuthentication:
		if _, err := checkSpec[policy.PeerAuthenticationSpec](u); err != nil {
			p.Unrecognized = err.Error()
		}
	}
	return v, nil
}

// checkSpec decodes the spec of u into S, as decode will. leftOut means it does not decode
// (and the object stays out of snapshots); otherwise a non-nil err names a field the policy
// types do not know (a typo, a newer Istio field), which decoding drops.
func checkSpec[S any](u *unstructured.Unstructured) (leftOut bool, err error) {
	b, err := json.Marshal(u.Object["spec"])
	if err != nil {
		return true, fmt.Errorf("encode spec: %w", err)
	}
	if err := kjson.UnmarshalCaseSensitivePreserveInts(b, new(S)); err != nil {
		return true, fmt.Errorf("decode spec: %w", err)
	}
	if err := kubeobj.DecodeStrict(b, new(S)); err != nil {
		return false, fmt.Errorf("decode spec: %w", err)
	}
	return false, nil
}
