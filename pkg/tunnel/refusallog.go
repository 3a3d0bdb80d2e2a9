package tunnel

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// refusalLogEvery is how often one kind of per-connection refusal is
// logged. Refusals are counted in metrics one by one; the log only has to
// say that they happen and show one example, so a flood of plaintext
// connections to a STRICT pod writes two lines per interval, not one per
// connection.
const refusalLogEvery = 10 * time.Second

// refusalLog rate-limits the logs of refused or failed connections, per
// message: the first of an interval is logged with its details, the
// others are counted and summed up in one line when the interval ends.
type refusalLog struct {
	log   *slog.Logger
	level slog.Level
	every time.Duration
	now   func() time.Time
	// after schedules the end-of-interval summary (time.AfterFunc).
	after func(time.Duration, func())

	mu    sync.Mutex
	kinds map[string]*refusalKind // by message: a fixed set of strings
}

type refusalKind struct {
	logged     time.Time // when the last line was written
	suppressed uint64    // noted since, not logged
	pending    bool      // a summary is scheduled
}

func newRefusalLog(log *slog.Logger, level slog.Level) *refusalLog {
	return &refusalLog{log: log, level: level, every: refusalLogEvery, now: time.Now,
		after: func(d time.Duration, f func()) { time.AfterFunc(d, f) }, kinds: map[string]*refusalKind{}}
}

// note logs msg with attrs unless msg was logged less than an interval
// ago; then it only counts it for the summary. Errors among attrs are
// logged bounded (errText): they may carry a peer's text.
func (r *refusalLog) note(ctx context.Context, msg string, attrs ...any) {
	r.mu.Lock()
	k := r.kinds[msg]
	if k == nil {
		k = &refusalKind{}
		r.kinds[msg] = k
	}
	now := r.now()
	if k.logged.IsZero() || now.Sub(k.logged) >= r.every {
		if k.suppressed > 0 {
			attrs = append(attrs, "more_since_last_log", k.suppressed)
		}
		k.logged, k.suppressed = now, 0
		r.mu.Unlock()
		for i, a := range attrs {
			if err, ok := a.(error); ok {
				attrs[i] = errText(err)
			}
		}
		r.log.Log(ctx, r.level, msg, attrs...)
		return
	}
	k.suppressed++
	schedule := !k.pending
	k.pending = true
	wait := r.every - now.Sub(k.logged)
	r.mu.Unlock()
	if schedule {
		r.after(wait, func() { r.flush(msg) })
	}
}

// flush writes the summary of msg's suppressed lines, if any.
func (r *refusalLog) flush(msg string) {
	r.mu.Lock()
	k := r.kinds[msg]
	if k == nil {
		r.mu.Unlock()
		return
	}
	k.pending = false
	n := k.suppressed
	if n == 0 {
		r.mu.Unlock()
		return
	}
	since := k.logged
	k.logged, k.suppressed = r.now(), 0
	r.mu.Unlock()
	r.log.Log(context.Background(), r.level, msg+" (summary)", "count", n, "since", since.UTC().Format(time.RFC3339))
}
