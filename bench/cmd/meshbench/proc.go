package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// child is a long-running helper process (a server, a relay, a client that
// holds connections) inside a network namespace. It dies with its process
// group in the runner's cleanup, and with meshbench if that is killed.
type child struct {
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string // stdout, line by line
	stderr *lockedBuffer
	done   chan struct{}
	err    error // how the program ended, once done is closed
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.b.Len() > 1<<20 { // keep the start: that is where the reason is
		return len(p), nil
	}
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.TrimSpace(l.b.String())
}

// startChild runs name with args inside the namespace at nsPath. The
// runner kills it at cleanup; with a nil runner the caller must.
func startChild(r *netnstest.Runner, nsPath, label, name string, args ...string) (*child, error) {
	cmd := netnstest.Command(context.Background(), nsPath, name, args...)
	// nsenter execs the program, so this process group and this parent-death
	// signal are the program's own.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	c := &child{name: label, cmd: cmd, lines: make(chan string, 64), stderr: &lockedBuffer{}, done: make(chan struct{})}
	cmd.Stderr = c.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if c.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s (%s): %w", label, name, err)
	}
	if r != nil {
		r.Cleanup(c.kill)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case c.lines <- sc.Text():
			default: // nobody listens: drop
			}
		}
		c.err = cmd.Wait()
		close(c.done)
	}()
	return c, nil
}

// Pid is the program's process id (nsenter exec'd into it).
func (c *child) Pid() int { return c.cmd.Process.Pid }

// waitLine waits for a line of stdout starting with prefix and returns it.
func (c *child) waitLine(ctx context.Context, prefix string, timeout time.Duration) (string, error) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		select {
		case l := <-c.lines:
			if strings.HasPrefix(l, prefix) {
				return l, nil
			}
		case <-c.done:
			return "", fmt.Errorf("%s exited before printing %q: %s", c.name, prefix, c.stderr.String())
		case <-t.C:
			return "", fmt.Errorf("%s did not print %q within %s: %s", c.name, prefix, timeout, c.stderr.String())
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
}

// kill ends the process group and waits for it.
func (c *child) kill() {
	_ = syscall.Kill(-c.cmd.Process.Pid, syscall.SIGKILL)
	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
	}
}

// output runs a program to completion inside the namespace at nsPath and
// returns its standard output; standard error goes into the error.
func output(ctx context.Context, nsPath string, timeout time.Duration, name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := netnstest.Command(ctx, nsPath, name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if len(msg) > 2000 {
			msg = msg[:2000] + "..."
		}
		return stdout.Bytes(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, msg)
	}
	return stdout.Bytes(), nil
}

// waitPort polls until something accepts on 127.0.0.1:port inside the
// namespace (loopback is never captured, so this asks the app itself).
func waitPort(ctx context.Context, nsPath string, port int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		var c net.Conn
		dctx, cancel := context.WithTimeout(ctx, time.Second)
		c, err = netns.Dial(dctx, nsPath, "tcp", fmt.Sprintf("127.0.0.1:%d", port), netns.SocketOptions{})
		cancel()
		if err == nil {
			c.Close()
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("nothing listens on port %d in %s after %s: %w", port, nsPath, timeout, err)
}

// selfPath is this binary, which the suite runs as its helpers.
func selfPath() string {
	p, err := os.Executable()
	if err != nil {
		return os.Args[0]
	}
	return p
}
