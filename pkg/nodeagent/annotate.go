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
	// off is set while a newer agent holds the node (Agent.yield): it
	// annotates the node's pods then, and a write queued here before, made
	// late (the queue drains one API call after another), undid its own.
	off  bool
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
	if q.off {
		q.mu.Unlock()
		return
	}
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

// handOver drops what is queued and queues nothing more: a newer agent
// holds the node.
func (q *annotations) handOver() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.off = true
	q.want = map[string]annotation{}
}

// resume queues writes again: this agent took the node back.
func (q *annotations) resume() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.off = false
}

// handedOver says whether a newer agent holds the node.
func (q *annotations) handedOver() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.off
}

// putBack queues again the writes taken but not made, unless a later
// write of the same pod replaced one meanwhile.
func (q *annotations) putBack(m map[string]annotation) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.off {
		return
	}
	for k, an := range m {
		if _, later := q.want[k]; !later {
			q.want[k] = an
		}
	}
}

// annotationTimeout bounds one write: a hung API server must not keep the
// writes of the node's other pods waiting for ever.
const annotationTimeout = 10 * time.Second

// annotationFlush bounds the writes made as the agent stops.
const annotationFlush = 5 * time.Second

// runAnnotations writes the queued annotations until ctx ends, and then
// what is still queued (flushAnnotations). A write that fails is logged;
// the next apply compares again (syncAnnotations) and queues it anew.
func (a *Agent) runAnnotations(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			a.flushAnnotations(ctx)
			return
		case <-a.annots.kick:
		}
		a.writeAnnotations(ctx)
	}
}

// flushAnnotations writes, within annotationFlush, what is queued as the
// agent stops: its pods stay as they are through its drain and after, and
// a pod attached or detached just before would keep saying otherwise to
// istiod until another agent's first pass (its peers sending it plaintext
// it refuses, or HBONE nothing captures). Not once a newer agent holds the
// node: that one annotates.
func (a *Agent) flushAnnotations(ctx context.Context) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), annotationFlush)
	defer cancel()
	a.writeAnnotations(fctx)
}

// writeAnnotations writes what is queued now. The writes that ctx's end
// cuts off, or leaves unmade, are queued again (for flushAnnotations);
// those of a node handed over are dropped.
func (a *Agent) writeAnnotations(ctx context.Context) {
	todo := a.annots.take()
	for key, an := range todo {
		if ctx.Err() != nil || a.annots.handedOver() {
			break
		}
		wctx, cancel := context.WithTimeout(ctx, annotationTimeout)
		err := a.cfg.Annotator.SetRedirection(wctx, an.namespace, an.name, an.uid, an.enabled)
		cancel()
		if err != nil && ctx.Err() != nil {
			break // cut off by the stop: made again by the flush
		}
		delete(todo, key)
		if err != nil {
			a.log.Error("annotate pod", "error", err)
		}
	}
	a.annots.putBack(todo)
}
