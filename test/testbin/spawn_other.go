//go:build !linux

package testbin

import (
	"os/exec"
	"syscall"
)

// Spawn starts cmd in its own process group, so cleanup can signal the whole group.
func Spawn(cmd *exec.Cmd) error {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return cmd.Start()
}
