package netnstest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/internal/syncbuf"
)

// BuildBinaries builds the repository's commands into dir and returns dir.
// Tests call it once from TestMain.
func BuildBinaries(dir string) error {
	cmd := exec.Command("go", "build", "-o", dir+"/", "github.com/redirector-mesh/redirector/cmd/...")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build: %w: %s", err, out)
	}
	return nil
}

// Agent is a `redirector run` process inside a simulated node's namespace.
type Agent struct {
	Node    *Node
	BPFRoot string
	cmd     *exec.Cmd
	log     *syncbuf.Buffer
	done    chan struct{}
}

// AgentOptions configure StartAgent.
type AgentOptions struct {
	Binary   string // path of the redirector binary
	Manifest string // file source
	CADir    string
	BPFRoot  string // default: a fresh directory under the test's temp dir
	Env      []string
	Args     []string
}

// StartAgent runs the agent for node n. Its output goes to the test log
// when the test fails. The process is killed in t.Cleanup, and the pinned
// state is uninstalled, so nothing outlives the test.
func StartAgent(t TB, n *Node, o AgentOptions) *Agent {
	t.Helper()
	if o.BPFRoot == "" {
		o.BPFRoot = filepath.Join(t.TempDir(), "bpf-"+n.Name)
	}
	a := &Agent{Node: n, BPFRoot: o.BPFRoot, log: &syncbuf.Buffer{}, done: make(chan struct{})}
	args := []string{"run", "--node-name", fmt.Sprintf("node%d", n.Index)}
	if o.Manifest != "" {
		args = append(args, "--source", "file:"+o.Manifest)
	}
	// The hand-over socket sits next to the pin root: an agent started on
	// another's pin root (an upgrade) finds the running one's.
	handover := filepath.Join(filepath.Dir(o.BPFRoot), "handover-"+n.Name+".sock")
	args = append(append(args,
		"--ca-dir", o.CADir, "--bpf-root", o.BPFRoot, "--handover-socket", handover, "--reconcile-period", "2s", "--log-level", "debug"), o.Args...)
	a.cmd = Command(context.Background(), n.Path(), o.Binary, args...)
	a.cmd.Env = append(os.Environ(), o.Env...)
	a.cmd.Stdout, a.cmd.Stderr = a.log, a.log
	a.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := a.cmd.Start(); err != nil {
		t.Fatalf("start agent on %s: %v", n.Name, err)
	}
	go func() { _ = a.cmd.Wait(); close(a.done) }()
	t.Cleanup(func() {
		a.Kill()
		if t.Failed() {
			t.Logf("agent %s log:\n%s", n.Name, a.log.String())
		}
		un := Command(context.Background(), n.Path(), o.Binary, "uninstall", "--bpf-root", o.BPFRoot)
		if out, err := un.CombinedOutput(); err != nil {
			t.Logf("uninstall %s: %v: %s", o.BPFRoot, err, out)
		}
		_ = unix.Unmount(o.BPFRoot, unix.MNT_DETACH)
	})
	return a
}

// Log returns what the agent printed so far.
func (a *Agent) Log() string { return a.log.String() }

// Kill ends the agent with SIGKILL, as a crash would.
func (a *Agent) Kill() {
	if a.cmd.Process != nil {
		_ = syscall.Kill(-a.cmd.Process.Pid, syscall.SIGKILL)
	}
	<-a.done
}

// Stop sends SIGTERM and waits for the agent to drain and exit.
func (a *Agent) Stop(timeout time.Duration) error {
	_ = syscall.Kill(-a.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-a.done:
		return nil
	case <-time.After(timeout):
		a.Kill()
		return fmt.Errorf("agent on %s did not stop within %s", a.Node.Name, timeout)
	}
}

// WaitLog waits until the agent's log contains s.
func (a *Agent) WaitLog(t TB, s string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if strings.Contains(a.log.String(), s) {
			return
		}
		select {
		case <-a.done:
			t.Fatalf("agent on %s exited while waiting for %q:\n%s", a.Node.Name, s, a.log.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
	t.Fatalf("agent on %s: %q not logged within %s", a.Node.Name, s, timeout)
}

// Eventually polls f until it returns nil or the timeout passes.
func Eventually(t TB, timeout time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		if err = f(); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("not within %s: %v", timeout, err)
}
