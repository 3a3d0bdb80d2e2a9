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
	"syscall"

	netnstest "github.com/redirector-mesh/redirector/test/netns"
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
	r := netnstest.NewRunner("redirector-demo-")
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sigs
		fmt.Println("\ninterrupted: cleaning up")
		r.Close()
		os.Exit(130)
	}()
	code := 0
	if err := r.Protect(func() error { run(r, filepath.Join(*bin, "redirector"), *verbose); return nil }); err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		code = 1
	}
	r.Close()
	fmt.Println("cleaned up: namespaces, agents, pins and files are gone")
	os.Exit(code)
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "redirector-demo:", err)
	os.Exit(1)
}
