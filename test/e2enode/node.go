//go:build e2enode && linux

package e2enode

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

const (
	// nodeIP is the first node's address on its uplink, inside its own network namespace;
	// node i (from 0) has 10.254.0.(i+1) and pod CIDR 10.244.i.0/24.
	nodeIP = "10.254.0.1"
	// apiVIP is the first Service address, the "kubernetes" Service. There is no kube-proxy:
	// the node holds the address itself and kube-apiserver listens on :443, so in-cluster
	// clients (the agent, redirector-node's curl) reach it as on a real cluster.
	apiVIP      = "10.96.0.1"
	serviceCIDR = "10.96.0.0/16"
	// clusterDNS is the nameserver the kubelet writes into pods' resolv.conf, where a
	// cluster's kube-dns Service would be. The control node holds the address, as it holds
	// apiVIP (no kube-proxy); ServeClusterDNS runs a resolver there, else nothing answers.
	clusterDNS   = "10.96.0.10"
	podCIDR      = "10.244.0.0/24"
	maxNodes     = 8
	bridgeName   = "cni0"
	pauseImage   = "localhost/e2enode/pause:1"
	AppImage     = "localhost/e2enode/app:1"
	startTimeout = 3 * time.Minute
)

// kubeletSysctls are the global (not per network namespace) settings the kubelet changes at
// start-up (pkg/kubelet/cm's setupKernelTunables); the node restores them when it stops.
var kubeletSysctls = []string{
	"vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
	"kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes",
}

// hostMountpoints are the host directories the node hides behind tmpfs mounts of its own
// mount namespace: the runtime's and kubelet's state, the CNI configuration and binaries.
// Those missing on the host are created (empty, as mount points) and removed again by the
// last node out (hostshare.go).
var hostMountpoints = []string{
	"/run", "/etc/cni", "/opt/cni", "/var/lib/kubelet", "/var/log/pods", "/var/log/containers", "/var/lib/cni",
}

// Node is one single-node cluster. Stop undoes everything Start did, in reverse order; it is
// idempotent and also runs on SIGINT/SIGTERM (see TestMain).
type Node struct {
	Name       string
	Dir        string
	IP         string // the node's address (InternalIP)
	PodCIDR    string
	Index      int   // 0 for the node that runs the control plane
	control    *Node // that node, for a worker (Index > 0)
	Bins       string
	Images     string
	ImageTag   string
	Kubeconfig string
	Config     *rest.Config
	Client     kubernetes.Interface

	token      string
	holder     *exec.Cmd
	cgroupRoot string   // the kubelet's cgroupRoot, the same relative path in every hierarchy
	hierarchy  []string // mount points of the cgroup hierarchies
	procs      []*process

	rec record // what a later run needs to clean up after a crash of this one

	mu       sync.Mutex
	undo     []func() error
	stopOnce sync.Once // a second Stop (signal handler and t.Cleanup) waits for the first
	stopErr  error
}

// process is a daemon of the node. A supervised one is started again when it exits without
// being asked to, as systemd does for a real node's kubelet (which counts on a babysitter to
// restart it after a failed start).
type process struct {
	name string
	log  string
	done chan struct{} // closed once it has ended for good

	mu       sync.Mutex
	cmd      *exec.Cmd // the current run
	stopping bool
	restarts int
}

// Logf is where the node reports progress (a test's t.Logf).
type Logf func(format string, args ...any)

// StartNode brings the node up. On error, what was already done is undone.
func StartNode(ctx context.Context, logf Logf, bins, images, imageTag string) (n *Node, err error) {
	return startNode(ctx, logf, &Node{Bins: bins, Images: images, ImageTag: imageTag, IP: nodeIP, PodCIDR: podCIDR})
}

// AddNode brings up one more node, a worker of c's control plane: its own network namespace
// (linked to c's by a veth pair, with routes to each other's pods), mount namespace, cgroups,
// containerd and kubelet (own root-dir and runtime state on its own tmpfs mounts), and the
// same images. Stop it before c: c restores the global sysctls both kubelets changed.
func (c *Node) AddNode(ctx context.Context, logf Logf) (*Node, error) {
	nodesMu.Lock()
	index := 0
	for _, m := range nodes {
		if m.control == c {
			index = max(index, m.Index)
		}
	}
	nodesMu.Unlock()
	index++
	if index >= maxNodes {
		return nil, fmt.Errorf("at most %d nodes", maxNodes)
	}
	return startNode(ctx, logf, &Node{Bins: c.Bins, Images: c.Images, ImageTag: c.ImageTag, Index: index, control: c,
		IP: fmt.Sprintf("10.254.0.%d", index+1), PodCIDR: fmt.Sprintf("10.244.%d.0/24", index)})
}

func startNode(ctx context.Context, logf Logf, n *Node) (_ *Node, err error) {
	id := strings.ToLower(rand.Text()[:6])
	n.Name = "e2enode-" + id
	if err := SweepStale(logf); err != nil {
		logf("sweeping stale nodes: %v", err)
	}
	register(n)
	defer func() {
		if err != nil {
			if serr := n.Stop(logf); serr != nil {
				logf("stop after failed start: %v", serr)
			}
			n = nil
		}
	}()
	start := time.Now()
	n.Dir, err = os.MkdirTemp("", n.Name+"-")
	if err != nil {
		return n, err
	}
	n.push(func() error { return os.RemoveAll(n.Dir) })
	n.push(func() error {
		if err := os.Remove(recordPath(n.Name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		return nil
	})
	// The host's mount points and global sysctls are shared by every node of every test
	// process: the first in saves, the last out restores (hostshare.go).
	if err := n.acquireHost(logf); err != nil {
		return n, err
	}
	if err := n.netns(); err != nil {
		return n, err
	}
	if err := n.startHolder(); err != nil {
		return n, err
	}
	if err := n.cgroups(); err != nil {
		return n, err
	}
	// From here on everything the node runs is in its cgroups, the holder too, and the
	// record lets a later run clean up if this one dies without Stop.
	if err := n.join(n.holder.Process.Pid); err != nil {
		return n, err
	}
	n.rec.Name, n.rec.Dir, n.rec.Owner = n.Name, n.Dir, os.Getpid()
	n.rec.CgroupRoot, n.rec.Hierarchy = n.cgroupRoot, n.hierarchy
	if err := n.writeRecord(); err != nil {
		return n, err
	}
	if c := n.control; c != nil {
		n.token, n.Config, n.Client, n.Kubeconfig = c.token, c.Config, c.Client, c.Kubeconfig
	} else {
		if err := n.controlPlane(ctx); err != nil {
			return n, err
		}
		logf("control plane up after %v", time.Since(start).Round(time.Millisecond))
	}
	if err := n.runtime(ctx); err != nil {
		return n, err
	}
	logf("containerd up, images imported after %v", time.Since(start).Round(time.Millisecond))
	if err := n.kubelet(ctx, logf); err != nil {
		return n, err
	}
	logf("node %s Ready after %v", n.Name, time.Since(start).Round(time.Millisecond))
	return n, nil
}

func (n *Node) push(f func() error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.undo = append(n.undo, f)
}

// Stop undoes Start in reverse order, going on past errors, and returns them joined. A
// concurrent or later call waits for the first one and returns its result.
func (n *Node) Stop(logf Logf) error {
	n.stopOnce.Do(func() {
		n.mu.Lock()
		undo := n.undo
		n.undo = nil
		n.mu.Unlock()
		var errs []error
		for i := len(undo) - 1; i >= 0; i-- {
			if err := undo[i](); err != nil {
				errs = append(errs, err)
			}
		}
		unregister(n)
		n.stopErr = errors.Join(errs...)
	})
	return n.stopErr
}

func sysctlPath(k string) string {
	return "/proc/sys/" + strings.ReplaceAll(k, ".", "/")
}

func (n *Node) netns() error {
	if out, err := exec.Command("ip", "netns", "add", n.Name).CombinedOutput(); err != nil {
		return fmt.Errorf("ip netns add %s: %w: %s", n.Name, err, out)
	}
	n.push(func() error {
		if out, err := exec.Command("ip", "netns", "del", n.Name).CombinedOutput(); err != nil {
			return fmt.Errorf("ip netns del %s: %w: %s", n.Name, err, out)
		}
		return nil
	})
	steps := [][]string{
		{"link", "set", "lo", "up"},
		// The node's uplink: a veth pair inside the namespace (no dummy module on every
		// kernel), its peer the wire to nowhere.
		{"link", "add", "eth0", "type", "veth", "peer", "name", "uplink"},
		{"link", "set", "uplink", "up"},
		{"addr", "add", n.IP + "/24", "dev", "eth0"},
		{"addr", "add", apiVIP + "/32", "dev", "eth0"},
		{"addr", "add", clusterDNS + "/32", "dev", "eth0"},
		{"link", "set", "eth0", "up"},
		// A default route for the components that look for one; nothing is on the other
		// end.
		{"route", "add", "default", "dev", "eth0"},
	}
	var peer string
	if c := n.control; c != nil {
		// A worker's uplink is a veth pair to the control node's namespace, where its end
		// has no address of its own (the control node answers ARP with its eth0 address)
		// and routes to the worker and its pods. The worker's default route (the API
		// server, the kubernetes Service address, the control node's pods) is the control
		// node. Deleting the worker's namespace deletes the pair, and the routes with it.
		peer = "to-" + strings.TrimPrefix(n.Name, "e2enode-")
		steps = [][]string{
			{"link", "set", "lo", "up"},
			{"link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", c.Name},
			{"addr", "add", n.IP + "/24", "dev", "eth0"},
			{"link", "set", "eth0", "up"},
			{"route", "add", "default", "via", c.IP, "dev", "eth0"},
		}
	}
	for _, args := range steps {
		if out, err := exec.Command("ip", append([]string{"-n", n.Name}, args...)...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip -n %s %v: %w: %s", n.Name, args, err, out)
		}
	}
	if c := n.control; c != nil {
		for _, args := range [][]string{
			{"link", "set", peer, "up"},
			{"route", "add", n.IP + "/32", "dev", peer, "src", c.IP},
			{"route", "add", n.PodCIDR, "via", n.IP, "dev", peer},
		} {
			if out, err := exec.Command("ip", append([]string{"-n", c.Name}, args...)...).CombinedOutput(); err != nil {
				return fmt.Errorf("ip -n %s %v: %w: %s", c.Name, args, err, out)
			}
		}
	}
	return nil
}

// holderScript runs in the node's own mount namespace (a slave of the host's: host mounts
// show up, the node's never leave it) and network namespace. It mounts no bpffs: the chart's
// mount-bpffs does, and its mount reaches the node through the shared propagation. Shared propagation inside it lets
// the chart's Bidirectional bpffs mount reach the node's other containers. The namespace
// lives as long as one of its processes does; with it go every mount the node made.
const holderScript = `set -e
mount --make-rshared /
for d in ` + "/run /etc/cni /opt/cni /var/lib/kubelet /var/log/pods /var/log/containers /var/lib/cni" + `; do
	mount -t tmpfs -o mode=0755 e2enode "$d"
done
mkdir -p /etc/cni/net.d /opt/cni/bin /run/netns
echo ready
exec sleep infinity
`

func (n *Node) startHolder() error {
	cmd := exec.Command("unshare", "--mount", "--propagation", "slave", "--",
		"nsenter", "--net=/run/netns/"+n.Name, "--", "sh", "-c", holderScript)
	// No Pdeathsig: it fires when the forking OS thread exits, and DialContext's
	// namespace-locked threads do exit. Stop and the signal handler end the node instead.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the node's namespace holder: %w", err)
	}
	n.holder = cmd
	n.push(func() error {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if strings.TrimSpace(line) != "ready" {
		return fmt.Errorf("node namespace holder: %q %v: %s", line, err, stderr.String())
	}
	return nil
}

// Root is the node's view of path: the host's file system with the node's own mounts.
func (n *Node) Root(path string) string {
	return fmt.Sprintf("/proc/%d/root%s", n.holder.Process.Pid, path)
}

// cgroups makes the node's cgroup root below this process's own cgroup (cgroup v1 needs the
// same relative path in every hierarchy, the kubelet's cgroupRoot), with a "system" child for
// the node's daemons. Stop kills whatever still runs in it, then removes it.
func (n *Node) cgroups() error {
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return err
	}
	// The memory hierarchy's path is the one that matters for accounting.
	base := "/"
	for _, line := range strings.Split(strings.TrimSpace(string(self)), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) == 3 && slices.Contains(strings.Split(f[1], ","), "memory") {
			base = f[2]
		}
	}
	n.cgroupRoot = filepath.Join(base, n.Name)
	entries, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return err
	}
	var st unix.Statfs_t
	if unix.Statfs("/sys/fs/cgroup", &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
		n.hierarchy = []string{"/sys/fs/cgroup"}
	} else {
		for _, e := range entries {
			p := filepath.Join("/sys/fs/cgroup", e.Name())
			if e.IsDir() && unix.Statfs(p, &st) == nil && (st.Type == unix.CGROUP_SUPER_MAGIC || st.Type == unix.CGROUP2_SUPER_MAGIC) {
				n.hierarchy = append(n.hierarchy, p)
			}
		}
	}
	n.push(n.removeCgroups)
	for _, h := range n.hierarchy {
		// Parents that do not exist in this hierarchy yet are created too (and removed by
		// removeCgroups, which walks up to the first one it did not make).
		dir := filepath.Join(h, n.cgroupRoot, "system")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("create cgroup %s: %w", dir, err)
		}
		if filepath.Base(h) == "cpuset" {
			// A cpuset cgroup takes tasks only once it has cpus and mems.
			// Each level from the hierarchy's root down inherits its parent's, if empty.
			rel, _ := filepath.Rel(h, dir)
			p := h
			for _, c := range strings.Split(rel, "/") {
				p = filepath.Join(p, c)
				for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
					if v, _ := os.ReadFile(filepath.Join(p, f)); len(strings.TrimSpace(string(v))) > 0 {
						continue
					}
					v, _ := os.ReadFile(filepath.Join(filepath.Dir(p), f))
					if err := os.WriteFile(filepath.Join(p, f), v, 0o644); err != nil {
						return fmt.Errorf("cpuset %s: %w", p, err)
					}
				}
			}
		}
	}
	return nil
}

// join moves pid into the node's system cgroup in every hierarchy.
func (n *Node) join(pid int) error {
	for _, h := range n.hierarchy {
		f := filepath.Join(h, n.cgroupRoot, "system", "cgroup.procs")
		if err := os.WriteFile(f, []byte(strconv.Itoa(pid)), 0o644); err != nil {
			return fmt.Errorf("move %d into %s: %w", pid, f, err)
		}
	}
	return nil
}

// removeCgroups kills every process left in the node's cgroups (containers, shims, daemons),
// then removes the cgroups, deepest first.
func (n *Node) removeCgroups() error {
	var errs []error
	for _, h := range n.hierarchy {
		root := filepath.Join(h, n.cgroupRoot)
		if _, err := os.Stat(root); err != nil {
			continue
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			pids := cgroupPids(root)
			if len(pids) == 0 {
				break
			}
			if time.Now().After(deadline) {
				errs = append(errs, fmt.Errorf("processes %v survive in %s", pids, root))
				break
			}
			for _, p := range pids {
				_ = unix.Kill(p, unix.SIGKILL)
			}
			time.Sleep(100 * time.Millisecond)
		}
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := rmdirRetry(dirs[i]); err != nil {
				errs = append(errs, err)
			}
		}
		// Parents made for this node only (hierarchies other than memory's may not have had
		// the base path): remove them while they are empty.
		for p := filepath.Dir(root); p != h; p = filepath.Dir(p) {
			if os.Remove(p) != nil {
				break
			}
		}
	}
	return errors.Join(errs...)
}

func rmdirRetry(p string) error {
	var err error
	for range 50 {
		if err = os.Remove(p); err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("remove cgroup %s: %w", p, err)
}

func cgroupPids(root string) []int {
	var pids []int
	_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
			return nil
		}
		b, _ := os.ReadFile(p)
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
		return nil
	})
	return pids
}

// spawn starts a node daemon inside the node's namespaces and system cgroup; Stop ends it
// (SIGTERM, then SIGKILL after grace).
func (n *Node) spawn(name, bin string, args ...string) (*process, error) {
	return n.spawnSupervised(0, name, bin, args...)
}

// spawnSupervised starts a daemon in the node's namespaces and cgroups, and starts it again
// up to restarts times when it exits unasked; each run appends to its log.
func (n *Node) spawnSupervised(restarts int, name, bin string, args ...string) (*process, error) {
	logPath := filepath.Join(n.Dir, name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	start := func() (*exec.Cmd, error) {
		cmd := exec.Command("nsenter", append([]string{"-t", strconv.Itoa(n.holder.Process.Pid), "-m", "-n", "--", bin}, args...)...)
		cmd.Stdout, cmd.Stderr = f, f
		cmd.Env = append(os.Environ(), "HOME="+n.Dir)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("start %s: %w", name, err)
		}
		if err := n.join(cmd.Process.Pid); err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			return nil, err
		}
		return cmd, nil
	}
	cmd, err := start()
	if err != nil {
		f.Close()
		return nil, err
	}
	p := &process{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		defer f.Close()
		for {
			_ = cmd.Wait()
			p.mu.Lock()
			again := !p.stopping && p.restarts < restarts
			if again {
				p.restarts++
			}
			p.mu.Unlock()
			if !again {
				return
			}
			fmt.Fprintf(f, "e2enode: %s exited unasked (%v); starting it again (restart %d of %d)\n", name, cmd.ProcessState, p.restarts, restarts)
			time.Sleep(time.Second)
			p.mu.Lock()
			if p.stopping {
				p.mu.Unlock()
				return
			}
			next, err := start()
			if err != nil {
				p.mu.Unlock()
				fmt.Fprintf(f, "e2enode: %v\n", err)
				return
			}
			cmd, p.cmd = next, next
			p.mu.Unlock()
		}
	}()
	n.procs = append(n.procs, p)
	n.push(func() error {
		p.mu.Lock()
		p.stopping = true
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		p.mu.Unlock()
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			p.mu.Lock()
			_ = p.cmd.Process.Kill()
			p.mu.Unlock()
			<-p.done
		}
		return nil
	})
	return p, nil
}

// SaveArtifacts copies what shows why a test failed into dir, before Stop removes it: the
// node's daemon logs, its pods' and containers' logs (/var/log/pods, also of pods since
// deleted while the kubelet kept them), and, from the control node, the cluster's events
// and objects.
func (n *Node) SaveArtifacts(ctx context.Context, dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	var errs []error
	logs, _ := filepath.Glob(filepath.Join(n.Dir, "*.log"))
	for _, f := range logs {
		if b, err := os.ReadFile(f); err != nil {
			errs = append(errs, err)
		} else if err := os.WriteFile(filepath.Join(dir, filepath.Base(f)), b, 0o644); err != nil {
			errs = append(errs, err)
		}
	}
	if out, err := exec.CommandContext(ctx, "cp", "-rL", n.Root("/var/log/pods"), filepath.Join(dir, "pods")).CombinedOutput(); err != nil {
		errs = append(errs, fmt.Errorf("copy /var/log/pods: %w: %s", err, out))
	}
	if n.control == nil {
		for name, args := range map[string][]string{
			"events.txt":  {"get", "events", "-A", "--sort-by=.lastTimestamp", "-o", "wide"},
			"objects.txt": {"get", "all,daemonsets,configmaps", "-A", "-o", "wide"},
			"pods.yaml":   {"get", "pods", "-A", "-o", "yaml"},
		} {
			out, err := n.Kubectl(ctx, args...)
			if err != nil {
				errs = append(errs, err)
			}
			if err := os.WriteFile(filepath.Join(dir, name), []byte(out), 0o644); err != nil {
				errs = append(errs, err)
			}
		}
	}
	var cni strings.Builder
	for _, d := range []string{"/etc/cni/net.d", "/opt/cni/bin"} {
		entries, err := os.ReadDir(n.Root(d))
		fmt.Fprintf(&cni, "%s (%v):\n", d, err)
		for _, e := range entries {
			fmt.Fprintf(&cni, "  %s\n", e.Name())
			if d == "/etc/cni/net.d" && !e.IsDir() {
				b, _ := os.ReadFile(n.Root(filepath.Join(d, e.Name())))
				fmt.Fprintf(&cni, "%s\n", b)
			}
		}
	}
	_ = os.WriteFile(filepath.Join(dir, "cni.txt"), []byte(cni.String()), 0o644)
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", n.holder.Process.Pid)); err == nil {
		_ = os.WriteFile(filepath.Join(dir, "mountinfo"), b, 0o644)
	}
	return dir, errors.Join(errs...)
}

// LogTail is the end of a daemon's log, for failures: its fatal lines first, then the tail
// without goroutine dumps (a panic's or a fatal error's would fill any tail).
func (n *Node) LogTail(name string, lines int) string {
	b, err := os.ReadFile(filepath.Join(n.Dir, name+".log"))
	if err != nil {
		return err.Error()
	}
	return logExcerpt(string(b), lines)
}

// logExcerpt is the log's fatal and panic lines, then its last lines with goroutine dumps
// left out.
func logExcerpt(log string, lines int) string {
	var fatal, kept []string
	inDump := false
	for _, line := range strings.Split(strings.TrimRight(log, "\n"), "\n") {
		switch {
		case strings.HasPrefix(line, "goroutine ") && strings.HasSuffix(line, ":"):
			inDump = true
		case inDump && !isLogLine(line):
		default:
			inDump = false
			if isFatalLine(line) && len(fatal) < 8 {
				fatal = append(fatal, line)
			}
			kept = append(kept, line)
		}
	}
	tail := kept[max(0, len(kept)-lines):]
	if len(fatal) == 0 {
		return strings.Join(tail, "\n")
	}
	return "fatal: " + strings.Join(fatal, "\nfatal: ") + "\n...\n" + strings.Join(tail, "\n")
}

// isLogLine: a klog line begins with its level and "mmdd ".
func isLogLine(line string) bool {
	return len(line) > 5 && strings.ContainsRune("IWEF", rune(line[0])) &&
		strings.Trim(line[1:5], "0123456789") == "" && line[5] == ' ' || strings.HasPrefix(line, "e2enode:")
}

// isFatalLine: klog's fatal lines, Go's panics and fatal errors, and the supervisor's notes.
func isFatalLine(line string) bool {
	return strings.HasPrefix(line, "panic:") || strings.HasPrefix(line, "fatal error:") ||
		strings.HasPrefix(line, "e2enode:") || isLogLine(line) && line[0] == 'F'
}

// exited reports, once a daemon has ended, how, for a wait to give up early.
func (n *Node) exited(name string) error {
	for _, p := range n.procs {
		if p.name != name {
			continue
		}
		select {
		case <-p.done:
			p.mu.Lock()
			defer p.mu.Unlock()
			return fmt.Errorf("%s exited: %v (after %d restarts)", name, p.cmd.ProcessState, p.restarts)
		default:
		}
	}
	return nil
}

// DialContext connects from inside the node's network namespace: the socket is made on a
// thread that entered the namespace (and that dies with its goroutine, never going back to
// the pool in the wrong namespace).
func (n *Node) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	type result struct {
		c   net.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		if err := enterNetns("/run/netns/" + n.Name); err != nil {
			ch <- result{err: err}
			return
		}
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		ch <- result{c, err}
	}()
	r := <-ch
	return r.c, r.err
}

func enterNetns(path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer unix.Close(fd)
	if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("enter netns %s: %w", path, err)
	}
	return nil
}

func (n *Node) controlPlane(ctx context.Context) error {
	n.token = rand.Text()
	saKey := filepath.Join(n.Dir, "sa.key")
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	if err := os.WriteFile(saKey, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600); err != nil {
		return err
	}
	tokens := filepath.Join(n.Dir, "tokens.csv")
	if err := os.WriteFile(tokens, []byte(n.token+`,e2enode-admin,e2enode-admin,"system:masters"`+"\n"), 0o600); err != nil {
		return err
	}
	if _, err := n.spawn("etcd", filepath.Join(n.Bins, "etcd"),
		"--name=e2enode", "--data-dir="+filepath.Join(n.Dir, "etcd"),
		"--listen-client-urls=http://127.0.0.1:2379", "--advertise-client-urls=http://127.0.0.1:2379",
		"--listen-peer-urls=http://127.0.0.1:2380", "--initial-advertise-peer-urls=http://127.0.0.1:2380",
		"--initial-cluster=e2enode=http://127.0.0.1:2380", "--unsafe-no-fsync", "--log-level=warn"); err != nil {
		return err
	}
	certDir := filepath.Join(n.Dir, "pki")
	if _, err := n.spawn("kube-apiserver", filepath.Join(n.Bins, "kube-apiserver"),
		"--etcd-servers=http://127.0.0.1:2379",
		"--bind-address=0.0.0.0", "--secure-port=443", "--advertise-address="+nodeIP,
		"--cert-dir="+certDir,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+saKey, "--service-account-signing-key-file="+saKey,
		"--token-auth-file="+tokens, "--authorization-mode=RBAC",
		"--service-cluster-ip-range="+serviceCIDR, "--allow-privileged=true", "--profiling=false",
		// The node's name resolves nowhere: logs and exec go to its address.
		"--kubelet-preferred-address-types=InternalIP"); err != nil {
		return err
	}
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext:     n.DialContext,
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true},
	}}
	defer hc.CloseIdleConnections()
	if err := waitFor(ctx, startTimeout, "kube-apiserver /readyz", func() error {
		if err := n.exited("kube-apiserver"); err != nil {
			return giveUp{err}
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+nodeIP+":443/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+n.token)
		resp, err := hc.Do(req)
		if err != nil {
			return err
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s: %s", resp.Status, body)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("%w\n%s", err, n.LogTail("kube-apiserver", 20))
	}
	ca, err := os.ReadFile(filepath.Join(certDir, "apiserver.crt"))
	if err != nil {
		return fmt.Errorf("read apiserver serving certificate: %w", err)
	}
	caFile := filepath.Join(n.Dir, "ca.crt")
	if err := os.WriteFile(caFile, ca, 0o644); err != nil {
		return err
	}
	server := "https://" + nodeIP + ":443"
	n.Config = &rest.Config{Host: server, BearerToken: n.token, TLSClientConfig: rest.TLSClientConfig{CAData: ca},
		Dial: n.DialContext, QPS: 100, Burst: 200, Timeout: 30 * time.Second}
	n.Client, err = kubernetes.NewForConfig(n.Config)
	if err != nil {
		return err
	}
	n.Kubeconfig = filepath.Join(n.Dir, "kubeconfig")
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: e2enode, cluster: {server: %q, certificate-authority: %q}}]
users: [{name: admin, user: {token: %q}}]
contexts: [{name: e2enode, context: {cluster: e2enode, user: admin}}]
current-context: e2enode
`, server, caFile, n.token)
	if err := os.WriteFile(n.Kubeconfig, []byte(kc), 0o600); err != nil {
		return err
	}
	if _, err := n.spawn("kube-controller-manager", filepath.Join(n.Bins, "kube-controller-manager"),
		"--kubeconfig="+n.Kubeconfig, "--leader-elect=false", "--bind-address=127.0.0.1",
		"--service-account-private-key-file="+saKey, "--root-ca-file="+caFile,
		"--use-service-account-credentials=false", "--controllers=*,-nodeipam,-cloud-node-lifecycle",
		"--service-cluster-ip-range="+serviceCIDR); err != nil {
		return err
	}
	if _, err := n.spawn("kube-scheduler", filepath.Join(n.Bins, "kube-scheduler"),
		"--kubeconfig="+n.Kubeconfig, "--leader-elect=false", "--bind-address=127.0.0.1"); err != nil {
		return err
	}
	return nil
}

// runtime starts containerd with all its state in the node's directory (the CRI's CNI
// directories are the node's own tmpfs mounts) and imports the locally built images.
func (n *Node) runtime(ctx context.Context) error {
	cd := filepath.Join(n.Dir, "containerd")
	sock := filepath.Join(cd, "containerd.sock")
	cfg := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  stream_server_address = "127.0.0.1"
  # Without CAP_SYS_RESOURCE (a sandboxed machine) runc cannot lower a container's
  # oom_score_adj below its own: keep pods' at or above containerd's.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
`, filepath.Join(cd, "root"), filepath.Join(cd, "state"), sock, pauseImage)
	if err := os.MkdirAll(cd, 0o755); err != nil {
		return err
	}
	cfgPath := filepath.Join(cd, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return err
	}
	if _, err := n.spawn("containerd", "containerd", "--config", cfgPath); err != nil {
		return err
	}
	if err := waitFor(ctx, time.Minute, "containerd socket", func() error {
		if err := n.exited("containerd"); err != nil {
			return giveUp{err}
		}
		_, err := os.Stat(sock)
		return err
	}); err != nil {
		return fmt.Errorf("%w\n%s", err, n.LogTail("containerd", 20))
	}
	for _, tar := range []string{"pause.tar", "app.tar", "redirector-" + n.ImageTag + ".tar"} {
		if err := n.ImportImage(ctx, filepath.Join(n.Images, tar)); err != nil {
			return err
		}
	}
	// The primary CNI: the reference bridge + host-local plugins, as a simple cluster has.
	for _, p := range []string{"bridge", "host-local", "loopback", "portmap"} {
		b, err := os.ReadFile(filepath.Join("/usr/lib/cni", p))
		if err != nil {
			return fmt.Errorf("CNI plugin %s (package containernetworking-plugins): %w", p, err)
		}
		if err := os.WriteFile(n.Root("/opt/cni/bin/"+p), b, 0o755); err != nil {
			return err
		}
	}
	return os.WriteFile(n.Root("/etc/cni/net.d/10-bridge.conflist"), []byte(strings.ReplaceAll(BridgeConflist, podCIDR, n.PodCIDR)), 0o644)
}

// BridgeConflist is the first node's primary CNI configuration, before the chart chains into
// it; the other nodes' differ in the subnet only.
const BridgeConflist = `{
  "cniVersion": "1.0.0",
  "name": "e2enode",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "` + bridgeName + `",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "` + podCIDR + `"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`

// ImportImage loads a docker-archive into the node's containerd (namespace k8s.io, the CRI's).
func (n *Node) ImportImage(ctx context.Context, tar string) error {
	sock := filepath.Join(n.Dir, "containerd", "containerd.sock")
	cmd := exec.CommandContext(ctx, "nsenter", "-t", strconv.Itoa(n.holder.Process.Pid), "-m", "-n", "--",
		"ctr", "--address", sock, "-n", "k8s.io", "images", "import", "--no-unpack=false", tar)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("ctr images import %s: %w: %s", tar, err, out)
	}
	return nil
}

// TagImage names an image of the node's containerd anew.
func (n *Node) TagImage(ctx context.Context, from, to string) error {
	sock := filepath.Join(n.Dir, "containerd", "containerd.sock")
	cmd := exec.CommandContext(ctx, "ctr", "--address", sock, "-n", "k8s.io", "images", "tag", "--force", from, to)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("ctr images tag %s %s: %w: %s", from, to, err, out)
	}
	return nil
}

func (n *Node) kubelet(ctx context.Context, logf Logf) error {
	kd := filepath.Join(n.Dir, "kubelet")
	if err := os.MkdirAll(kd, 0o755); err != nil {
		return err
	}
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: %q
cgroupsPerQOS: true
failSwapOn: false
containerRuntimeEndpoint: %q
address: %q
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
imageMinimumGCAge: 8760h
evictionHard: {memory.available: "50Mi", nodefs.available: "1%%", imagefs.available: "1%%"}
podLogsDir: /var/log/pods
resolvConf: ""
clusterDomain: cluster.local
clusterDNS: [%q]
registerNode: true
serializeImagePulls: false
syncFrequency: 10s
fileCheckFrequency: 5s
nodeStatusUpdateFrequency: 5s
podCIDR: %q
`, n.cgroupRoot, "unix://"+filepath.Join(n.Dir, "containerd", "containerd.sock"), n.IP, clusterDNS, n.PodCIDR)
	cfgPath := filepath.Join(kd, "config.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return err
	}
	// Restarted like a real node's systemd unit does: the kubelet exits on some start-up
	// races (a failed ContainerManager start) and relies on its babysitter.
	kubelet, err := n.spawnSupervised(kubeletRestarts, "kubelet", filepath.Join(n.Bins, "kubelet"),
		"--config="+cfgPath, "--kubeconfig="+n.Kubeconfig, "--root-dir=/var/lib/kubelet",
		"--hostname-override="+n.Name, "--node-ip="+n.IP, "--cert-dir="+filepath.Join(kd, "pki"), "--v=1")
	if err != nil {
		return err
	}
	if err := waitFor(ctx, startTimeout, "node Ready", func() error {
		if err := n.exited("kubelet"); err != nil {
			return giveUp{err}
		}
		node, err := n.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range node.Status.Conditions {
			if c.Type == "Ready" {
				if c.Status == "True" {
					return nil
				}
				return fmt.Errorf("Ready=%s: %s", c.Status, c.Message)
			}
		}
		return errors.New("no Ready condition")
	}); err != nil {
		return fmt.Errorf("%w\n%s", err, n.LogTail("kubelet", 30))
	}
	kubelet.mu.Lock()
	restarted := kubelet.restarts
	kubelet.mu.Unlock()
	if restarted > 0 {
		logf("the kubelet of %s exited %d times before it was Ready and was started again; the log's fatal lines:\n%s",
			n.Name, restarted, n.LogTail("kubelet", 0))
	}
	return nil
}

// ServeClusterDNS runs dnsmasq, a real resolver, at the cluster DNS address in the node's
// namespaces, playing the cluster's kube-dns: it answers each name of records (and its
// subdomains) with the address given, refuses the rest, and logs every query with its
// source. It returns the log's path. Stop ends it.
func (n *Node) ServeClusterDNS(records map[string]string) (string, error) {
	args := []string{"--keep-in-foreground", "--no-resolv", "--no-hosts", "--conf-file=/dev/null", "--pid-file=",
		"--bind-interfaces", "--listen-address=" + clusterDNS, "--port=53", "--user=root",
		"--log-queries", "--log-facility=-",
		// The cluster's domain is this resolver's: names it does not know there are
		// NXDOMAIN, as kube-dns answers them, so a client's search list moves on.
		"--local=/cluster.local/"}
	for name, addr := range records {
		args = append(args, "--address=/"+name+"/"+addr)
	}
	p, err := n.spawn("cluster-dns", "dnsmasq", args...)
	if err != nil {
		return "", err
	}
	return p.log, nil
}

// istiodSecurePort is where StartIstiod's istiod serves its CA and xDS (secured gRPC), on the
// node's address, as a Service would route 15012 to it; its other ports are on loopback.
const istiodSecurePort = "15012"

// StartIstiod runs a real istiod (pilot-discovery) as a daemon of the node, ambient on, its own
// CA signing for the agents whose service account is trustedAgent (namespace/name), and serving
// CA and xDS on the node's address. Istio's CRDs must be applied and the istio-system namespace
// made. Clients reach it by the name in its serving certificate, istiod.istio-system.svc, which
// ServeClusterDNS must resolve to the node's address. Stop ends it.
func (n *Node) StartIstiod(istiodBin, trustedAgent string) error {
	dir := filepath.Join(n.Dir, "istiod")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	// env sets istiod's environment and working directory (where it writes a few files).
	_, err := n.spawn("istiod", "env", "-C", dir,
		"POD_NAMESPACE=istio-system", "POD_NAME=istiod-e2enode", "REVISION=default",
		"PILOT_CERT_PROVIDER=istiod", "ENABLE_CA_SERVER=true", "CLUSTER_ID=Kubernetes",
		"CA_TRUSTED_NODE_ACCOUNTS="+trustedAgent, "PILOT_ENABLE_AMBIENT=true",
		istiodBin, "discovery", "--kubeconfig", n.Kubeconfig,
		"--grpcAddr=127.0.0.1:15010", "--secureGRPCAddr="+n.IP+":"+istiodSecurePort,
		"--httpAddr=127.0.0.1:15080", "--httpsAddr=127.0.0.1:15017", "--monitoringAddr=127.0.0.1:15014",
		"--ctrlz_address=127.0.0.1", "--ctrlz_port=15076")
	return err
}

// kubeletRestarts is how often a node's kubelet may exit unasked and be started again.
const kubeletRestarts = 3

// runTimeout bounds every kubectl and helm command (helm's own --wait takes up to 3 min).
const runTimeout = 4 * time.Minute

// Run runs a command in the node's network namespace (kubectl, helm: clients of the API).
func (n *Node) Run(ctx context.Context, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, runTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"--net=/run/netns/" + n.Name, "--", name}, args...)...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+n.Kubeconfig, "HOME="+n.Dir,
		"HELM_CACHE_HOME="+filepath.Join(n.Dir, "helm", "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(n.Dir, "helm", "config"),
		"HELM_DATA_HOME="+filepath.Join(n.Dir, "helm", "data"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// Kubectl runs the node's kubectl.
func (n *Node) Kubectl(ctx context.Context, args ...string) (string, error) {
	return n.Run(ctx, filepath.Join(n.Bins, "kubectl"), args...)
}

// Helm runs the node's helm.
func (n *Node) Helm(ctx context.Context, args ...string) (string, error) {
	return n.Run(ctx, filepath.Join(n.Bins, "helm"), args...)
}

// giveUp, returned by a waitFor condition, ends the wait: nothing will change by waiting.
type giveUp struct{ err error }

func (g giveUp) Error() string { return g.err.Error() }

func waitFor(ctx context.Context, timeout time.Duration, what string, f func() error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var err error
	for {
		if err = f(); err == nil {
			return nil
		}
		if g, ok := err.(giveUp); ok {
			return fmt.Errorf("waiting for %s: %w", what, g.err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w (last: %v)", what, ctx.Err(), err)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// Registry of running nodes, so a signal handler can stop them all.
// in start order.
var (
	nodesMu sync.Mutex
	nodes   []*Node
)

func register(n *Node) {
	nodesMu.Lock()
	defer nodesMu.Unlock()
	nodes = append(nodes, n)
}

func unregister(n *Node) {
	nodesMu.Lock()
	defer nodesMu.Unlock()
	nodes = slices.DeleteFunc(nodes, func(m *Node) bool { return m == n })
}

// StopAll stops every node still running (on SIGINT/SIGTERM), the last started first: a
// worker before its control node, which restores the global sysctls.
func StopAll(logf Logf) {
	nodesMu.Lock()
	all := slices.Clone(nodes)
	nodesMu.Unlock()
	slices.Reverse(all)
	for _, n := range all {
		if err := n.Stop(logf); err != nil {
			logf("stop %s: %v", n.Name, err)
		}
	}
}
