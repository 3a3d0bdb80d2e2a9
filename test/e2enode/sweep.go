//go:build e2enode && linux

package e2enode

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// record is what cleaning up a node takes, written when it starts: a run that dies without
// running Stop (SIGKILL, `go test -timeout`'s panic) leaves its node running, and the next
// run's StartNode sweeps it from this.
type record struct {
	Name       string
	Dir        string
	Owner      int // pid of the test process
	CgroupRoot string
	Hierarchy  []string
	Sysctls    map[string]string // the host's values before any kubelet (see hostShare)
}

func recordPath(name string) string {
	return filepath.Join(os.TempDir(), name+".json")
}

func (n *Node) writeRecord() error {
	b, err := json.Marshal(n.rec)
	if err != nil {
		return err
	}
	if err := os.WriteFile(recordPath(n.Name), b, 0o600); err != nil {
		return fmt.Errorf("write node record: %w", err)
	}
	return nil
}

// alive reports whether pid is a running test binary (a recycled pid runs something else).
func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	return err == nil && strings.Contains(string(b), ".test")
}

// SweepStale stops the nodes of test runs that died without stopping them.
func SweepStale(logf Logf) error {
	files, _ := filepath.Glob(filepath.Join(os.TempDir(), "e2enode-*.json"))
	var errs []error
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var r record
		if err := json.Unmarshal(b, &r); err != nil || !strings.HasPrefix(r.Name, "e2enode-") {
			errs = append(errs, fmt.Errorf("node record %s: %v", f, err))
			continue
		}
		if alive(r.Owner) {
			continue
		}
		logf("sweeping node %s of a run that died (pid %d)", r.Name, r.Owner)
		stale := &Node{Name: r.Name, cgroupRoot: r.CgroupRoot, hierarchy: r.Hierarchy}
		// Everything the node ran is in its cgroups, its namespace holder included.
		if err := stale.removeCgroups(); err != nil {
			errs = append(errs, err)
		}
		if _, err := os.Stat("/run/netns/" + r.Name); err == nil {
			if out, err := exec.Command("ip", "netns", "del", r.Name).CombinedOutput(); err != nil {
				errs = append(errs, fmt.Errorf("ip netns del %s: %w: %s", r.Name, err, out))
			}
		}
		// The sysctls and the host's mount points are the shared host state's: it drops
		// this node as a user, and restores them if no live node is left.
		if r.Dir != "" && strings.Contains(r.Dir, r.Name) {
			if err := os.RemoveAll(r.Dir); err != nil {
				errs = append(errs, err)
			}
		}
		_ = os.Remove(f)
	}
	// The images' folders of test processes that died (nodeInputs).
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "e2enode-images-*-*"))
	for _, d := range dirs {
		f := strings.Split(filepath.Base(d), "-")
		if pid, err := strconv.Atoi(f[2]); err == nil && !alive(pid) {
			logf("removing %s of a run that died (pid %d)", d, pid)
			if err := os.RemoveAll(d); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}
