// Command pause is the sandbox ("pause") image of the real-node tests (test/e2enode): a static
// program that holds the pod's namespaces and exits on SIGTERM or SIGINT. It is built locally
// by hack/build-image.sh because no registry is reachable to pull registry.k8s.io/pause.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	// As PID 1 of the pod it also inherits orphans; SIGCHLD is ignored so the kernel reaps
	// them instead of leaving zombies.
	signal.Ignore(syscall.SIGCHLD)
	<-sig
}
