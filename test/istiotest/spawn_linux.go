package istiotest

import (
	"os/exec"
	"runtime"
	"sync"
	"syscall"
)

// spawn starts cmd in its own process group with Pdeathsig=SIGKILL, forked from one
// dedicated locked thread (Pdeathsig fires when the forking thread exits), so istiod never
// outlives a test binary that dies without running its cleanups. As in test/kubetest.
func spawn(cmd *exec.Cmd) error {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	spawnerOnce.Do(func() { go spawner() })
	errc := make(chan error)
	spawnRequests <- spawnRequest{cmd: cmd, errc: errc}
	return <-errc
}

type spawnRequest struct {
	cmd  *exec.Cmd
	errc chan error
}

var (
	spawnerOnce   sync.Once
	spawnRequests = make(chan spawnRequest)
)

func spawner() {
	runtime.LockOSThread() // never unlocked: this thread must outlive every child
	for r := range spawnRequests {
		r.errc <- r.cmd.Start()
	}
}
