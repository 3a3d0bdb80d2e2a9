package nodeagent

import (
	"context"
	"sync"
	"time"
)

// annotations are the redirection annotations waiting to be written, by
// pod namespace/name. One goroutine writes them (runAnnotations), off the
// agent's lock: each is an API call, which a slow or hung API server holds
// for as long as it likes, and made under a.mu (every apply patched the
// pods whose annotation lagged) it held up every CNI ADD and DEL of the
// node, in the mesh or not, and the main loop; made by a pod worker, it
// held the worker, and with every worker held no pod converged.
type annotations struct {
	mu   sync.Mutex
	want map[string]annotation
	kick chan struct{}
}

// annotation is one write: uid names the pod it is meant for, so a write
// that waited is not made on a new pod of the same name.
type annotation struct {
	namespace, name, uid string
	enabled              bool
}

func newAnnotations() *annotations {
	return &annotations{want: map[string]annotation{}, kick: make(chan struct{}, 1)}
}

// set queues writes, a later write of a pod replacing an earlier one. The
// queue holds a write per pod at most, so it is bounded by the node's pods
// however long the API server takes.
func (q *annotations) set(as ...annotation) {
	q.mu.Lock()
	for _, an := range as {
		q.want[an.namespace+"/"+an.name] = an
	}
	n := len(q.want)
	q.mu.Unlock()
	if n > 0 {
		select {
		case q.kick <- struct{}{}:
		default:
		}
	}
}

// take returns what is queued and empties the queue.
func (q *annotations) take() map[string]annotation {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := q.want
	q.want = map[string]annotation{}
	return out
}

// annotationTimeout bounds one write: a hung API server must not keep the
// writes of the node's other pods waiting for ever.
const annotationTimeout = 10 * time.Second

// runAnnotations writes the queued annotations until ctx ends. A write
// that fails is logged; the next apply compares again (syncAnnotations) and
// queues it anew.
func (a *Agent) runAnnotations(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.annots.kick:
		}
		a.writeAnnotations(ctx)
	}
}

// writeAnnotations writes what is queued now.
func (a *Agent) writeAnnotations(ctx context.Context) {
	for _, an := range a.annots.take() {
		if ctx.Err() != nil {
			return
		}
		wctx, cancel := context.WithTimeout(ctx, annotationTimeout)
		err := a.cfg.Annotator.SetRedirection(wctx, an.namespace, an.name, an.uid, an.enabled)
		cancel()
		if err != nil {
			a.log.Error("annotate pod", "error", err)
		}
	}
}
