package kubetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"syscall"
	"time"

	"github.com/redirector-mesh/redirector/test/testbin"
)

// process is one running etcd or kube-apiserver, its output appended to a log file.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{} // closed once the process has exited
	err     error         // exit status, valid after done
}

func startProcess(name, path string, args []string, logPath string) (*process, error) {
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	defer logFile.Close() // the child holds its own descriptor

	cmd := exec.Command(path, args...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	if err := testbin.Spawn(cmd); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// stop sends SIGTERM to the process group, and SIGKILL if it has not exited after grace.
func (p *process) stop(grace time.Duration) {
	pgid := p.cmd.Process.Pid // spawn made it a group leader
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-p.done
	}
}

// exitError reports whether the process has exited, with its status.
func (p *process) exitError() error {
	select {
	case <-p.done:
		return fmt.Errorf("%s exited: %v", p.name, p.err)
	default:
		return nil
	}
}

// logTail returns the last n lines of the process log, for failure messages.
func (p *process) logTail(n int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return err.Error()
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// waitHealthy polls url with client until it answers 200 OK, the process exits or the timeout
// passes. The last error is returned on failure.
func (p *process) waitHealthy(client *http.Client, url string, header http.Header, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	last := errors.New("no answer yet")
	for {
		if err := p.exitError(); err != nil {
			return err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		req.Header = header
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("%s: %s", url, resp.Status)
		}
		if ctx.Err() == nil {
			last = err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not healthy after %v: %w", p.name, timeout, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}
