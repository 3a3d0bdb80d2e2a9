package main

import (
	"fmt"
	"os"
	"sync"
)

// runner gives the test harness (netnstest) what it needs outside `go
// test`: a cleanup stack and a Fatalf that unwinds to protect.
type runner struct {
	mu       sync.Mutex
	cleanups []func()
	failed   bool
	once     sync.Once
}

func newRunner() *runner { return &runner{} }

// failure carries a Fatalf through panic to protect.
type failure struct{ msg string }

func (r *runner) Helper() {}

func (r *runner) Fatalf(format string, args ...any) {
	r.mu.Lock()
	r.failed = true
	r.mu.Unlock()
	panic(failure{fmt.Sprintf(format, args...)})
}

func (r *runner) Logf(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }

func (r *runner) Skip(args ...any) { r.Fatalf("%s", fmt.Sprint(args...)) }

func (r *runner) Cleanup(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cleanups = append(r.cleanups, f)
}

func (r *runner) TempDir() string {
	dir, err := os.MkdirTemp("", "meshbench-")
	if err != nil {
		r.Fatalf("temp dir: %v", err)
	}
	r.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func (r *runner) Failed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failed
}

// protect runs f and turns a Fatalf from the harness into an error.
func (r *runner) protect(f func() error) (err error) {
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

// close runs the cleanups, last registered first, once. A second caller
// waits for the first to finish.
func (r *runner) close() {
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
