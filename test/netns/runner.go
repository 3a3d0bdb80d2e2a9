package netnstest

import (
	"fmt"
	"os"
	"sync"
)

// Runner gives the harness what it needs outside `go test` (the demo and
// the benchmark suite): a cleanup stack, temporary directories, and a
// Fatalf that unwinds to Protect.
type Runner struct {
	tempPrefix string

	mu       sync.Mutex
	cleanups []func()
	failed   bool
	once     sync.Once
}

// NewRunner returns a runner whose temporary directories start with prefix.
func NewRunner(tempPrefix string) *Runner { return &Runner{tempPrefix: tempPrefix} }

// failure carries a Fatalf through panic to Protect.
type failure struct{ msg string }

// Helper does nothing; it is there for TB.
func (r *Runner) Helper() {}

// Fatalf marks the run failed and unwinds to Protect.
func (r *Runner) Fatalf(format string, args ...any) {
	r.mu.Lock()
	r.failed = true
	r.mu.Unlock()
	panic(failure{fmt.Sprintf(format, args...)})
}

// Logf prints to stderr.
func (r *Runner) Logf(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }

// Skip is fatal outside tests: there is nobody to skip to.
func (r *Runner) Skip(args ...any) { r.Fatalf("%s", fmt.Sprint(args...)) }

// Cleanup registers f to run at Close, last registered first.
func (r *Runner) Cleanup(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cleanups = append(r.cleanups, f)
}

// TempDir makes a directory removed at Close.
func (r *Runner) TempDir() string {
	dir, err := os.MkdirTemp("", r.tempPrefix)
	if err != nil {
		r.Fatalf("temp dir: %v", err)
	}
	r.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// Failed reports whether Fatalf was called.
func (r *Runner) Failed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failed
}

// Protect runs f and turns a Fatalf from the harness into an error.
func (r *Runner) Protect(f func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			fl, ok := v.(failure)
			if !ok {
				panic(v)
			}
			err = fmt.Errorf("%s", fl.msg)
		}
	}()
	return f()
}

// Close runs the cleanups, last registered first, once; a second caller
// (a signal handler, say) waits for the first to finish.
func (r *Runner) Close() {
	r.once.Do(func() {
		r.mu.Lock()
		c := r.cleanups
		r.cleanups = nil
		r.mu.Unlock()
		for i := len(c) - 1; i >= 0; i-- {
			c[i]()
		}
	})
}
