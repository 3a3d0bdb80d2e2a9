package testbin

import (
	"os/exec"
	"runtime"
	"sync"
	"syscall"
)

// Spawn starts cmd in its own process group, so cleanup can signal the whole group, and with
// Pdeathsig=SIGKILL, so that a server does not outlive a test binary that dies without
// running its cleanups (a go test -timeout panic, a SIGKILL).
//
// Pdeathsig fires when the OS thread that forked the child exits, not the process. Go may end
// a thread (a goroutine that exits while locked to it, as netns code does), so every child is
// forked from one dedicated thread that stays locked, and alive, until the process ends.
func Spawn(cmd *exec.Cmd) error {
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
