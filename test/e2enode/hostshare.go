//go:build e2enode && linux

package e2enode

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// hostShare is the host state that every node of every test process shares, kept in
// sharePath under an exclusive lock: the mount points created on the host for the nodes'
// tmpfs mounts, and the global sysctls the kubelets change. The first node in saves them; the
// last one out restores them. Per node this went wrong with two test runs at once: a node
// that stopped removed the host directories it had created, which were then another live
// node's mount points, and the kernel detaches the mounts on a directory removed in another
// mount namespace, so that node's kubelet, containerd and agent went on writing to the
// host's /var/lib/kubelet, /var/log/pods, /etc/cni and /opt/cni (seen: its conflist
// "vanished", its agent pod never became ready, files were left on the host); and a node
// started while another's kubelet had changed the sysctls saved the changed values.
type hostShare struct {
	Users   map[string]int    // node name -> pid of its test process
	Dirs    []string          // directories created on the host, deepest first
	Sysctls map[string]string // the values before the first kubelet
}

const (
	sharePath = "/run/e2enode-host.json"
	shareLock = "/run/e2enode-host.lock"
)

// withShare runs f on the shared state under the lock and writes it back. Users whose test
// process is gone are dropped first; when no user is left, what the last ones did not undo
// (they died) is undone before f runs.
func withShare(logf Logf, f func(s *hostShare) error) error {
	lock, err := os.OpenFile(shareLock, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("host state lock: %w", err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("lock %s: %w", shareLock, err)
	}
	s := hostShare{Users: map[string]int{}, Sysctls: map[string]string{}}
	b, err := os.ReadFile(sharePath)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return fmt.Errorf("read host state: %w", err)
	default:
		if err := json.Unmarshal(b, &s); err != nil {
			return fmt.Errorf("host state %s: %w", sharePath, err)
		}
		if s.Users == nil {
			s.Users = map[string]int{}
		}
		if s.Sysctls == nil {
			s.Sysctls = map[string]string{}
		}
	}
	for name, pid := range s.Users {
		if !alive(pid) {
			logf("host state: node %s of a run that died (pid %d) no longer uses the host", name, pid)
			delete(s.Users, name)
		}
	}
	var errs []error
	if len(s.Users) == 0 {
		errs = append(errs, s.restore(logf))
	}
	errs = append(errs, f(&s))
	if len(s.Users) == 0 && len(s.Dirs) == 0 && len(s.Sysctls) == 0 {
		if err := os.Remove(sharePath); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
		return errors.Join(errs...)
	}
	b, err = json.Marshal(s)
	if err == nil {
		err = os.WriteFile(sharePath+".tmp", b, 0o600)
	}
	if err == nil {
		err = os.Rename(sharePath+".tmp", sharePath)
	}
	if err != nil {
		errs = append(errs, fmt.Errorf("write host state: %w", err))
	}
	return errors.Join(errs...)
}

// restore writes the saved sysctls back and removes the created directories (empty ones
// only: on the host they were only ever mount points).
func (s *hostShare) restore(logf Logf) error {
	var errs []error
	for k, v := range s.Sysctls {
		if err := os.WriteFile(sysctlPath(k), []byte(v), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("restore sysctl %s=%s: %w", k, v, err))
		}
	}
	s.Sysctls = map[string]string{}
	for _, d := range s.Dirs {
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove mount point %s from the host: %w", d, err))
		}
	}
	s.Dirs = nil
	return errors.Join(errs...)
}

// acquireHost registers n as a user of the host state: the first user saves the sysctls,
// and every user creates the mount points that are missing. Its undo releases n.
func (n *Node) acquireHost(logf Logf) error {
	err := withShare(logf, func(s *hostShare) error {
		if len(s.Users) == 0 {
			for _, k := range kubeletSysctls {
				b, err := os.ReadFile(sysctlPath(k))
				if err != nil {
					return fmt.Errorf("read sysctl %s: %w", k, err)
				}
				s.Sysctls[k] = strings.TrimSpace(string(b))
			}
		}
		n.rec.Sysctls = s.Sysctls
		for _, d := range hostMountpoints {
			if _, err := os.Stat(d); err == nil {
				continue
			}
			// MkdirAll may create parents too: remember each created one, deepest first.
			var created []string
			for p := d; p != "/"; p = filepath.Dir(p) {
				if _, err := os.Stat(p); err == nil {
					break
				}
				created = append(created, p)
			}
			if err := os.MkdirAll(d, 0o755); err != nil {
				return fmt.Errorf("create mount point %s: %w", d, err)
			}
			// Deeper directories first, before any parent already listed.
			s.Dirs = append(created, s.Dirs...)
		}
		s.Users[n.Name] = os.Getpid()
		return nil
	})
	if err != nil {
		return err
	}
	n.push(func() error { return n.releaseHost(logf) })
	return nil
}

// releaseHost unregisters n; the last user restores the host.
func (n *Node) releaseHost(logf Logf) error {
	return withShare(logf, func(s *hostShare) error {
		delete(s.Users, n.Name)
		if len(s.Users) == 0 {
			return s.restore(logf)
		}
		return nil
	})
}

// otherHostUsers are the nodes that use the host state now (a stopped node no longer does).
func otherHostUsers(logf Logf) []string {
	var others []string
	_ = withShare(logf, func(s *hostShare) error {
		for name := range s.Users {
			others = append(others, name)
		}
		slices.Sort(others)
		return nil
	})
	return others
}
