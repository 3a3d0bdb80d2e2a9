// Command redirector-demo runs the embedded default: a simulated two-node
// cluster in network namespaces with the real agents and real traffic, and
// prints which flows the mesh captured and authenticated. It needs root and
// cleans up everything it made, on Ctrl-C too.
//
//	redirector-demo [--bin DIR] [--keep-logs]
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
)

func main() {
	bin := flag.String("bin", "", "directory holding the redirector binary (default: next to this one)")
	verbose := flag.Bool("v", false, "print the agents' logs at the end")
	flag.Parse()
	if *bin == "" {
		self, err := os.Executable()
		if err != nil {
			fatal(err)
		}
		*bin = filepath.Dir(self)
	}
	if os.Geteuid() != 0 {
		fatal(fmt.Errorf("the demo creates network namespaces and loads BPF programs: run it as root"))
	}
	r := &runner{}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sigs
		fmt.Println("\ninterrupted: cleaning up")
		r.close()
		os.Exit(130)
	}()
	code := 0
	func() {
		defer func() {
			if v := recover(); v != nil {
				f, ok := v.(failure)
				if !ok {
					panic(v)
				}
				fmt.Fprintln(os.Stderr, "demo failed:", f.msg)
				code = 1
			}
		}()
		run(r, filepath.Join(*bin, "redirector"), *verbose)
	}()
	r.close()
	fmt.Println("cleaned up: namespaces, agents, pins and files are gone")
	os.Exit(code)
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "redirector-demo:", err)
	os.Exit(1)
}

// failure carries a Fatalf through panic to main, which cleans up.
type failure struct{ msg string }

// runner gives the test harness what it needs outside `go test`.
type runner struct {
	mu       sync.Mutex
	cleanups []func()
	failed   bool
	once     sync.Once
}

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
	dir, err := os.MkdirTemp("", "redirector-demo-")
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

// close runs the cleanups, last registered first, once.
func (r *runner) close() {
	r.once.Do(func() {
		r.mu.Lock()
		c := r.cleanups
		r.mu.Unlock()
		for i := len(c) - 1; i >= 0; i-- {
			c[i]()
		}
	})
}
