// Package kubernetes is the production source.Source: cluster state from the Kubernetes API
// through client-go informers, translated into the mesh model (kubeobj) and delivered as
// complete snapshots.
//
// It watches Namespaces, Pods (of every node: the workload directory needs remote pods too,
// so no spec.nodeName field selector), Services, discovery.k8s.io/v1 EndpointSlices,
// node.k8s.io/v1 RuntimeClasses, Nodes' metadata (their locality labels only, for Services' traffic
// distribution; snapshots do not wait for them) and,
// when their CRDs are installed, security.istio.io PeerAuthentications and
// AuthorizationPolicies (v1, else v1beta1: the same schema; a CRD serving only another
// version holds snapshots back, see policyWatch). The Annotator patches pods.
//
// # Scale
//
// Every node caches every pod, service and slice of the cluster, so the caches hold trimmed
// objects (kubeobj.CompactPod, kubeobj.TrimService and friends, applied by an informer
// transform before an object is stored): only the fields translation reads. Events only mark
// keys changed; at each debounced snapshot the source translates just those objects again (a
// pod; a service with its slices; the pods of a namespace whose dataplane-mode label changed,
// or of a RuntimeClass whose handler changed) into a model it keeps, and hands out the model
// as it stands, without translating, copying or sorting the rest (see model). A second,
// node-scoped pod watch would save nothing: a remote pod needs the same fields as a local one
// (its enrollment decides HBONE or plaintext towards it, its named ports resolve service
// target ports), and a cached pod holds no more than those. BENCHMARKS.md has the numbers.
//
// RBAC the agent's ClusterRole needs for this package:
//
//	""                   namespaces, pods, services        get, list, watch
//	""                   nodes                             list, watch (optional)
//	""                   pods/status                       patch   (Annotator)
//	discovery.k8s.io     endpointslices                    get, list, watch
//	node.k8s.io          runtimeclasses                    get, list, watch
//	security.istio.io    peerauthentications,
//	                     authorizationpolicies             get, list, watch
//	apiextensions.k8s.io customresourcedefinitions         get     (those two CRDs, by name;
//	                                                                optional, see policyWatch)
//
// Discovery of security.istio.io needs no rule: system:discovery allows it to every
// authenticated user.
//
// # Never fail open
//
// Snapshots are read from the informers' caches, which only a complete list replaces: a list
// or watch that fails (API server unreachable, 5xx, 403 after an RBAC change) leaves the
// cache as it was, and the informer retries with backoff. A policy kind whose version answers
// 404 (its CRD deleted, or no longer serving that version) is looked up again: see
// policyWatch. So through an outage
// every snapshot is the last good state, never a partial or empty one. No snapshot is
// delivered before every informer has synced once (an API server unreachable at start means
// no snapshot, and the agent stays unready); policies of a kind enter snapshots only once
// their informer synced. Every list or watch error is logged and counted in
// redirector_source_errors_total{source="kubernetes",reason="list_watch"}, discovery
// failures under reason="discovery". A policy that does not convert to the policy types is
// not left out (that would drop a DENY, an ALLOW or a STRICT): its last version that converted
// stays, or, if none did, a stand-in fails closed (reason="invalid"; see decodeObjects). Nor is
// a pod whose address stops parsing (status.podIP(s) "10.0.0.05", say): it is still there, so
// it keeps its last good version, enrollment included, with the error logged naming the pod
// and field and counted (reason="invalid"); one malformed from the start is left out.
package kubernetes

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
)

// debounce says when changes become a snapshot: a rollout fires hundreds of events, and
// consumers diff whole snapshots, so a burst is one snapshot and there is at most one per
// 50 ms, at most 50 ms after a change; a lone change (a new pod) waits only 10 ms for
// company.
var debounce = source.Debounce{Quiet: 10 * time.Millisecond, MaxWait: 50 * time.Millisecond, MinGap: 50 * time.Millisecond}

// defaultPolicyRecheck is how often to look again for missing Istio CRDs.
const defaultPolicyRecheck = 30 * time.Second

// Config configures a Source.
type Config struct {
	// RestConfig reaches the API server (from a kubeconfig or rest.InClusterConfig).
	RestConfig *rest.Config
	// NodeName is the node the agent runs on; it only labels logs, since pods of all nodes
	// are watched.
	NodeName string
	// Logger receives the source's logs; nil means slog.Default().
	Logger *slog.Logger
	// Resync re-delivers every cached object this often, which yields a fresh snapshot even
	// without changes, so consumers repair drift periodically. 0 disables it.
	Resync time.Duration
	// PolicyRecheck is how often to check whether the PeerAuthentication and
	// AuthorizationPolicy CRDs got installed while they are missing; 0 means 30 s.
	PolicyRecheck time.Duration
	// Metrics counts list, watch and discovery errors; nil counts nothing.
	Metrics *source.Metrics
	// Selection is the operator's part of the enrollment rules, applied to every pod.
	Selection selection.Config
}

// Source is a source.Source backed by the Kubernetes API.
type Source struct {
	cfg       Config
	log       *slog.Logger
	client    kubernetes.Interface
	dynamic   dynamic.Interface
	metadata  metadata.Interface
	discovery *discovery.DiscoveryClient
}

var _ source.Source = (*Source)(nil)

// New returns a Source for cfg. It does not contact the API server; Run does.
func New(cfg Config) (*Source, error) {
	if cfg.RestConfig == nil {
		return nil, errors.New("kubernetes source: no rest config")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.PolicyRecheck <= 0 {
		cfg.PolicyRecheck = defaultPolicyRecheck
	}
	rc := rest.CopyConfig(cfg.RestConfig)
	if rc.UserAgent == "" {
		rc.UserAgent = "redirector/" + cfg.NodeName
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("dynamic client: %w", err)
	}
	disc, err := discovery.NewDiscoveryClientForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("discovery client: %w", err)
	}
	meta, err := metadata.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("metadata client: %w", err)
	}
	// Built-in types travel as protobuf: cheaper to decode than JSON for thousands of pods.
	// The dynamic and discovery clients above keep JSON, which CRDs require.
	rc.ContentType = runtime.ContentTypeProtobuf
	rc.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return &Source{
		cfg:       cfg,
		log:       cfg.Logger.With("source", "kubernetes", "node", cfg.NodeName),
		client:    client,
		dynamic:   dyn,
		metadata:  meta,
		discovery: disc,
	}, nil
}

// Run watches the cluster and calls update with a full snapshot: first once every informer
// has synced (so the first snapshot is complete, not the early part of a list), then after
// each burst of changes, debounced. update is called from Run's goroutine, one call at a time.
// Run returns nil when ctx is done, or an error if the informers cannot be set up.
func (s *Source) Run(ctx context.Context, update func(source.Snapshot)) error {
	ctx, cancel := context.WithCancel(ctx)

	changed := make(chan struct{}, 1)
	notify := func() {
		select {
		case changed <- struct{}{}:
		default: // a snapshot is already due
		}
	}
	todo := &pending{notify: notify}

	factory := informers.NewSharedInformerFactoryWithOptions(s.client, s.cfg.Resync,
		informers.WithTransform(trim))
	// Nodes only give pods their locality, a preference among a Service's
	// endpoints: snapshots do not wait for their list, so an API server
	// that refuses it (a ClusterRole without nodes) costs the preference,
	// logged and counted as a watch error, not the mesh. Their metadata is
	// all that is read (the labels), so only that is watched: a Node's
	// status (conditions, images, tens of kB) is written every few
	// minutes, and every agent would receive each write whole.
	nodeFactory := metadatainformer.NewFilteredSharedInformerFactory(s.metadata, s.cfg.Resync, "", nil)
	// Informer goroutines and policy look-ups end with ctx; Shutdown and looks wait for
	// them, so cancel comes first.
	var looks sync.WaitGroup
	pw := &policyWatch{s: s, notify: todo.markPolicies}
	defer func() {
		cancel()
		looks.Wait()
		pw.wait()
		factory.Shutdown()
		nodeFactory.Shutdown()
	}()

	inf := informerSet{
		namespaces:     factory.Core().V1().Namespaces().Informer(),
		runtimeClasses: factory.Node().V1().RuntimeClasses().Informer(),
		pods:           factory.Core().V1().Pods().Informer(),
		services:       factory.Core().V1().Services().Informer(),
		endpointSlices: factory.Discovery().V1().EndpointSlices().Informer(),
		nodes:          nodeFactory.ForResource(corev1.SchemeGroupVersion.WithResource("nodes")).Informer(),
		peerAuthn:      &policyKind{resource: "peerauthentications", check: checkSpec[policy.PeerAuthenticationSpec], failClosed: failClosedPeerAuthn},
		authz:          &policyKind{resource: "authorizationpolicies", check: checkSpec[policy.AuthorizationPolicySpec], failClosed: failClosedAuthz},
	}
	if err := inf.nodes.SetTransform(trim); err != nil {
		return fmt.Errorf("set node transform: %w", err)
	}
	if err := inf.pods.AddIndexers(cache.Indexers{podsByRuntimeClass: indexPodsByRuntimeClass, podsByNode: indexPodsByNode}); err != nil {
		return fmt.Errorf("add pod index: %w", err)
	}
	if err := inf.endpointSlices.AddIndexers(cache.Indexers{slicesByService: indexSlicesByService}); err != nil {
		return fmt.Errorf("add endpointslice index: %w", err)
	}
	var delivered []cache.InformerSynced // the initial lists' events reached the handlers
	for _, h := range []struct {
		inf     cache.SharedIndexInformer
		handler cache.ResourceEventHandler
	}{
		{inf.namespaces, todo.handler(kindNamespace, objectKey)},
		{inf.runtimeClasses, todo.handler(kindRuntimeClass, objectKey)},
		{inf.pods, todo.handler(kindPod, objectKey)},
		{inf.services, todo.handler(kindService, objectKey)},
		{inf.endpointSlices, todo.handler(kindService, sliceServiceKey)},
		{inf.nodes, todo.nodeHandler()},
	} {
		reg, err := h.inf.AddEventHandler(h.handler)
		if err != nil {
			return fmt.Errorf("add event handler: %w", err)
		}
		if h.inf != inf.nodes {
			delivered = append(delivered, reg.HasSynced)
		}
		if err := h.inf.SetWatchErrorHandlerWithContext(s.watchError); err != nil {
			return fmt.Errorf("set watch error handler: %w", err)
		}
	}
	start := time.Now()
	factory.Start(ctx.Done())
	nodeFactory.Start(ctx.Done())

	// The first snapshot must not lack policies only because the API server did not answer
	// discovery yet (that would drop DENY policies until the next check): retry until it does.
	pw.kinds = []*policyKind{inf.peerAuthn, inf.authz}
	for {
		err := pw.check(ctx)
		if err == nil {
			break
		}
		s.cfg.Metrics.Error("kubernetes", source.ReasonDiscovery)
		s.log.Warn("Istio policy discovery failed; no snapshot until it answers", "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}

	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("sync %v informer", typ)
		}
	}
	if !cache.WaitForCacheSync(ctx.Done(), pw.synced) {
		return nil // ctx done
	}
	// The handlers have seen the initial lists' events too, so the keys they marked so far are
	// all in the caches the first snapshot translates whole: drop them, not to translate every
	// object twice. (Keys marked later only translate their object again.)
	if !cache.WaitForCacheSync(ctx.Done(), delivered...) {
		return nil
	}
	select {
	case <-changed:
	default:
	}
	todo.take()
	m := newModel(s.cfg.Selection, s.log, inf)
	m.metrics = s.cfg.Metrics
	m.apply(m.everything())
	snap := m.snapshot()
	s.log.Info("kubernetes source synced", "took", time.Since(start).Round(time.Millisecond),
		"namespaces", len(m.namespaces), "workloads", len(snap.Workloads), "services", len(snap.Services),
		"endpointSlices", len(inf.endpointSlices.GetStore().ListKeys()), "peerAuthentications", len(snap.PeerAuthentications),
		"authorizationPolicies", len(snap.AuthorizationPolicies))
	update(snap)

	recheck := time.NewTicker(s.cfg.PolicyRecheck)
	defer recheck.Stop()
	// A policy look-up runs on its own goroutine, one at a time (looking), and hands what it
	// found back here, where the informers are started: an API server slow to answer
	// discovery must not hold back snapshots of pod changes.
	type lookResult struct {
		kinds map[string]found
		err   error
	}
	looked := make(chan lookResult, 1)
	looking := false
	due := source.NewDebouncer(debounce)
	defer due.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
			due.Changed()
		case <-due.C():
			if due.Due() {
				m.apply(todo.take())
				update(m.snapshot())
			}
		case <-recheck.C:
			if looking || !pw.missing() {
				continue
			}
			looking = true
			kinds := pw.missingKinds()
			looks.Go(func() {
				v, err := pw.look(ctx, kinds)
				looked <- lookResult{v, err}
			})
		case r := <-looked:
			looking = false
			if r.err != nil {
				if ctx.Err() == nil {
					s.cfg.Metrics.Error("kubernetes", source.ReasonDiscovery)
					s.log.Warn("Istio policy discovery failed", "err", r.err)
				}
				continue
			}
			pw.start(ctx, r.kinds)
		}
	}
}

// watchError is every informer's WatchErrorHandler: a list or watch failed, and the informer
// will retry with backoff, its cache unchanged. A watch that merely ended (EOF) or expired
// (410, answered with a relist) is not an error.
func (s *Source) watchError(ctx context.Context, r *cache.Reflector, err error) {
	cache.DefaultWatchErrorHandler(ctx, r, err)
	if errors.Is(err, io.EOF) || apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
		return
	}
	s.cfg.Metrics.Error("kubernetes", source.ReasonListWatch)
	s.log.Warn("list or watch failed; snapshots keep the last listed state until it recovers",
		"informer", r.TypeDescription(), "err", err)
}

// sortedValues sorts objs by namespace and name and returns copies of the objects.
func sortedValues[T any, P interface {
	*T
	GetNamespace() string
	GetName() string
}](objs []P) []T {
	slices.SortFunc(objs, func(a, b P) int {
		return cmp.Or(cmp.Compare(a.GetNamespace(), b.GetNamespace()), cmp.Compare(a.GetName(), b.GetName()))
	})
	out := make([]T, len(objs))
	for i, o := range objs {
		out[i] = *o
	}
	return out
}

// trim is the informers' transform: objects enter the caches trimmed to what translation
// reads (pods as kubeobj.CompactPod), everything else without its managedFields.
func trim(obj any) (any, error) {
	switch o := obj.(type) {
	case *corev1.Pod:
		return kubeobj.NewCompactPod(o), nil
	case *corev1.Service:
		return kubeobj.TrimService(o), nil
	case *discoveryv1.EndpointSlice:
		return kubeobj.TrimEndpointSlice(o), nil
	case *corev1.Namespace:
		return kubeobj.TrimNamespace(o), nil
	case *metav1.PartialObjectMetadata:
		return kubeobj.TrimNodeMeta(o), nil
	}
	return kubeobj.DropManagedFields(obj)
}
