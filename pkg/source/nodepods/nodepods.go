// Package nodepods watches what enrollment needs to know on one node: the
// pods scheduled on it (field selector spec.nodeName, so the cost does not
// grow with the cluster), every namespace (their labels opt pods in), and
// RuntimeClasses. It is the Kubernetes half of the xDS source: enrollment
// is decided on the node from these, so a CNI ADD never waits for istiod.
package nodepods

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
)

// State is the node's view at one moment. Treat it as read-only.
type State struct {
	Namespaces     []corev1.Namespace
	Pods           []corev1.Pod
	RuntimeClasses []nodev1.RuntimeClass
}

// debounce turns bursts of pod events into one state, as the Kubernetes
// source does.
var debounce = source.Debounce{Quiet: 10 * time.Millisecond, MaxWait: 50 * time.Millisecond, MinGap: 50 * time.Millisecond}

// Watcher watches one node's pods.
type Watcher struct {
	client  kubernetes.Interface
	node    string
	log     *slog.Logger
	metrics *source.Metrics
}

// New returns a watcher of node's pods; Run starts it.
func New(rc *rest.Config, node string, log *slog.Logger, metrics *source.Metrics) (*Watcher, error) {
	if rc == nil || node == "" {
		return nil, errors.New("node pod watcher: rest config and node name are required")
	}
	rc = rest.CopyConfig(rc)
	if rc.UserAgent == "" {
		rc.UserAgent = "redirector/" + node
	}
	rc.ContentType = runtime.ContentTypeProtobuf
	rc.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return NewForClient(cs, node, log, metrics), nil
}

// NewForClient is New with a ready client (tests).
func NewForClient(cs kubernetes.Interface, node string, log *slog.Logger, metrics *source.Metrics) *Watcher {
	if log == nil {
		log = slog.Default()
	}
	return &Watcher{client: cs, node: node, log: log.With("source", "nodepods"), metrics: metrics}
}

// Run calls update with the full state once every informer synced, then
// after each burst of changes. It returns nil when ctx is done, or an
// error if the informers cannot be set up.
func (w *Watcher) Run(ctx context.Context, update func(State)) error {
	ctx, cancel := context.WithCancel(ctx)
	all := informers.NewSharedInformerFactoryWithOptions(w.client, 0, informers.WithTransform(trim))
	local := informers.NewSharedInformerFactoryWithOptions(w.client, 0, informers.WithTransform(trim),
		informers.WithTweakListOptions(func(o *v1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", w.node).String()
		}))
	defer func() {
		cancel()
		all.Shutdown()
		local.Shutdown()
	}()
	changed := make(chan struct{}, 1)
	notify := func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	handler := cache.ResourceEventHandlerFuncs{AddFunc: func(any) { notify() }, UpdateFunc: func(any, any) { notify() }, DeleteFunc: func(any) { notify() }}
	ns, pods, rcs := all.Core().V1().Namespaces(), local.Core().V1().Pods(), all.Node().V1().RuntimeClasses()
	for _, inf := range []cache.SharedIndexInformer{ns.Informer(), pods.Informer(), rcs.Informer()} {
		if _, err := inf.AddEventHandler(handler); err != nil {
			return fmt.Errorf("add event handler: %w", err)
		}
		if err := inf.SetWatchErrorHandlerWithContext(w.watchError); err != nil {
			return fmt.Errorf("set watch error handler: %w", err)
		}
	}
	all.Start(ctx.Done())
	local.Start(ctx.Done())
	for _, f := range []informers.SharedInformerFactory{all, local} {
		for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
			if !ok {
				if ctx.Err() != nil {
					return nil
				}
				return fmt.Errorf("sync %v informer", typ)
			}
		}
	}
	snapshot := func() State {
		var s State
		nl, _ := ns.Lister().List(labels.Everything())
		for _, n := range nl {
			s.Namespaces = append(s.Namespaces, *n)
		}
		pl, _ := pods.Lister().List(labels.Everything())
		for _, p := range pl {
			s.Pods = append(s.Pods, *p)
		}
		rl, _ := rcs.Lister().List(labels.Everything())
		for _, r := range rl {
			s.RuntimeClasses = append(s.RuntimeClasses, *r)
		}
		return s
	}
	select {
	case <-changed:
	default:
	}
	first := snapshot()
	w.log.Info("node pods synced", "pods", len(first.Pods), "namespaces", len(first.Namespaces))
	update(first)
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
				update(snapshot())
			}
		}
	}
}

// watchError is every informer's WatchErrorHandler: a list or watch failed, and the informer
// retries with backoff, its cache unchanged. A watch that merely ended (EOF) or expired (410,
// answered with a relist) is not an error, as in the Kubernetes source; the log names the
// informer (before, neither: a relist was counted as a failure, and a refused watch did not
// say of what).
func (w *Watcher) watchError(ctx context.Context, r *cache.Reflector, err error) {
	cache.DefaultWatchErrorHandler(ctx, r, err)
	if errors.Is(err, io.EOF) || apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
		return
	}
	w.metrics.Error("nodepods", source.ReasonListWatch)
	w.log.Warn("list or watch failed; keeping the last state until it recovers", "informer", r.TypeDescription(), "error", err)
}

// trim is the informers' transform: pods and namespaces enter the caches
// with only what kubeobj.Translate reads (the Kubernetes source's trims),
// since their authors decide their size (annotations up to 256 KiB, a
// pod's environment and command up to the object's 1.5 MiB); other
// objects without their managedFields.
func trim(obj any) (any, error) {
	switch o := obj.(type) {
	case *corev1.Pod:
		return kubeobj.NewCompactPod(o).Pod(), nil
	case *corev1.Namespace:
		return kubeobj.TrimNamespace(o), nil
	}
	return kubeobj.DropManagedFields(obj)
}
