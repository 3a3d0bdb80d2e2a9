//go:build !linux

package kubetest

import (
	"os/exec"
	"syscall"
)

// spawn starts cmd in its own process group, so cleanup can signal the whole group.
func spawn(cmd *exec.Cmd) error {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return cmd.Start()
}
