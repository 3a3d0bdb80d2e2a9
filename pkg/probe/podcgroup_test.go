package probe_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/pin"
	"github.com/redirector-mesh/redirector/pkg/probe"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// testCgroups makes, in this machine's cgroup v2 hierarchy, a cgroup for
// the test with the given children (relative paths), removed when the test
// ends. It returns the hierarchy and the test's cgroup, relative to it.
func testCgroups(t *testing.T, children ...string) (hierarchy, base string) {
	t.Helper()
	hierarchy, err := pin.CgroupV2Root()
	if err != nil {
		t.Fatal(err)
	}
	base = fmt.Sprintf("redirector-test-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "-"))
	for _, c := range children {
		dir := filepath.Join(hierarchy, base, c)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		// Deepest first; a cgroup goes once its processes have exited.
		var dirs []string
		_ = filepath.WalkDir(filepath.Join(hierarchy, base), func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := os.Remove(dirs[i]); err != nil {
				t.Errorf("remove test cgroup: %v", err)
			}
		}
	})
	return hierarchy, base
}

// bornIn makes cmd start as a process of the cgroup dir (clone3 with
// CLONE_INTO_CGROUP), never in this test's cgroup first; release closes the
// cgroup's descriptor once cmd has started (or failed to).
func bornIn(t *testing.T, cmd *exec.Cmd, dir string) (release func()) {
	t.Helper()
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
	return func() { syscall.Close(fd) }
}

// curlFromCgroup runs curl in the network namespace at nsPath as a process
// of the cgroup dir (it is born there: clone3 with CLONE_INTO_CGROUP), and
// returns the client address the app saw.
func curlFromCgroup(t *testing.T, nsPath, dir string, dst netip.Addr) (netip.Addr, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	url := fmt.Sprintf("http://%s/", netip.AddrPortFrom(dst, appPort))
	cmd := netnstest.Command(ctx, nsPath, "curl", "-sS", "-g", "--max-time", "3", url)
	defer bornIn(t, cmd, dir)()
	out, err := cmd.CombinedOutput()
	if err != nil {
		return netip.Addr{}, fmt.Errorf("curl %s from cgroup %s: %w: %s", url, dir, err, out)
	}
	return peerAddr(string(out))
}

// TestHostNetworkPodIsNoProbe: a connection from the node's network
// namespace to an enrolled pod is taken for a kubelet probe (SNATed, and so
// passed past STRICT) only when the process that opened it is not below the
// pods' cgroup. A process of a hostNetwork pod shares the node's namespace
// but lives below kubelet's kubepods; before, it passed as kubelet, so any
// hostNetwork pod (an ingress controller, a node exporter) reached a STRICT
// pod of its node in plaintext, where from another node it is refused. Now
// its SYN keeps the node's address and is counted as host_pod_not_probe;
// kubelet (here a process in a sibling cgroup, and this test's own) still
// probes. The cgroups are real, below this machine's cgroup v2 hierarchy;
// the "pods" and "kubelet" in them are curl. Both ways a SYN is judged are
// covered: with the node's socket on the packet, and as a bridge's flooded
// copy without one (the socket found by lookup).
func TestHostNetworkPodIsNoProbe(t *testing.T) {
	hierarchy, base := testCgroups(t, "kubepods/besteffort/podA/ctr", "system/kubelet")
	pc, found, err := probe.FindPodsCgroup(hierarchy, "/"+base+"/kubepods")
	if err != nil || !found || pc.ID == 0 {
		t.Fatalf("FindPodsCgroup: %+v %v %v", pc, found, err)
	}
	hostPod := filepath.Join(hierarchy, base, "kubepods/besteffort/podA/ctr")
	kubelet := filepath.Join(hierarchy, base, "system/kubelet")

	topo := netnstest.New(t, 1)
	node := topo.Nodes[0]
	// app second on the bridge: a flooded packet's original (with the
	// socket) goes to the oldest port, other's, and app gets a clone.
	other, app := node.AddPod("other"), node.AddPod("app")
	serveApp(t, app)
	root := tempBPFFS(t)
	a := load(t, probe.Config{PinRoot: root, PodsCgroupID: pc.ID})
	for i, p := range []*netnstest.Pod{other, app} {
		id := uint32(20 + i)
		enroll(t, root, p, id)
		if err := attachHost(a, p, id); err != nil {
			t.Fatal(err)
		}
	}
	flush := func() {
		if out, err := exec.Command("bridge", "-n", filepath.Base(node.Path()), "fdb", "flush", "dev", "rdbr", "dynamic").CombinedOutput(); err != nil {
			t.Fatalf("flush the bridge's forwarding database: %v: %s", err, out)
		}
	}

	for _, flooded := range []bool{false, true} {
		for _, f := range families(node, probe.DefaultSNATv4, probe.DefaultSNATv6) {
			name := f.name
			if flooded {
				name += "/flooded"
			}
			t.Run(name, func(t *testing.T) {
				dst := f.pod(app)
				for _, c := range []struct {
					who, dir string
					want     netip.Addr
				}{
					{"a hostNetwork pod's process", hostPod, f.node},
					{"kubelet in a cgroup beside the pods'", kubelet, f.snat},
				} {
					before := reasonCount(t, root, "host_pod_not_probe")
					if flooded {
						flush()
					}
					got, err := curlFromCgroup(t, node.Path(), c.dir, dst)
					if err != nil || got != c.want {
						t.Errorf("%s: app saw %v (%v), want %s", c.who, got, err, c.want)
					}
					counted := reasonCount(t, root, "host_pod_not_probe") - before
					if wantCount := c.want == f.node; (counted > 0) != wantCount {
						t.Errorf("%s: host_pod_not_probe grew by %d", c.who, counted)
					}
				}
				// This test's own process, in neither: a probe.
				if flooded {
					flush()
				}
				if got, err := curlPeer(node.Path(), dst); err != nil || got != f.snat {
					t.Errorf("from the test's own cgroup: app saw %v (%v), want %s", got, err, f.snat)
				}
			})
		}
	}
}

// TestFindPodsCgroup: the setting is a cgroup's path in the hierarchy,
// with or without a leading /, and resolves to a cgroup v2 directory below
// the hierarchy's root; what cannot be one is an error naming the setting;
// empty finds kubelet's usual places or nothing; none is off.
func TestFindPodsCgroup(t *testing.T) {
	hierarchy, base := testCgroups(t, "kubepods", "kubepods.slice")
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(hierarchy, base, "kubepods"), &st); err != nil {
		t.Fatal(err)
	}
	for _, setting := range []string{base + "/kubepods", "/" + base + "/kubepods/"} {
		pc, found, err := probe.FindPodsCgroup(hierarchy, setting)
		if err != nil || !found || pc.ID != st.Ino || pc.Dir != filepath.Join(hierarchy, base, "kubepods") {
			t.Errorf("%s: %+v %v %v, want id %d", setting, pc, found, err, st.Ino)
		}
	}
	if pc, found, err := probe.FindPodsCgroup(hierarchy, probe.PodsCgroupOff); err != nil || !found || pc.ID != 0 {
		t.Errorf("none: %+v %v %v, want off", pc, found, err)
	}
	// The test's hierarchy as the root: its kubepods.slice comes first.
	pc, found, err := probe.FindPodsCgroup(filepath.Join(hierarchy, base), "")
	if err != nil || !found || pc.Dir != filepath.Join(hierarchy, base, "kubepods.slice") {
		t.Errorf("empty, under %s: %+v %v %v, want its kubepods.slice", base, pc, found, err)
	}
	if pc, found, err := probe.FindPodsCgroup(filepath.Join(hierarchy, base, "kubepods"), ""); err != nil || found || pc.ID != 0 {
		t.Errorf("empty, nothing there: %+v %v %v, want off and not found", pc, found, err)
	}
	for setting, want := range map[string]string{
		base + "/nonexistent":           "no such file",
		"/":                             "root of its cgroup hierarchy",
		base + "/..":                    "climb out of it",
		"/../../etc":                    "climb out of it",
		base + "/kubepods/cgroup.procs": "not a cgroup directory",
	} {
		_, _, err := probe.FindPodsCgroup(hierarchy, setting)
		if err == nil || !strings.Contains(err.Error(), probe.EnvPodsCgroup+"="+setting) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error naming %s and %q", setting, err, probe.EnvPodsCgroup, want)
		}
	}
}

// TestSelfPodsCgroup: an agent in a pod finds the pods' cgroup above its own,
// whatever kubelet's cgroup root: the cgroupfs driver's kubepods and the
// systemd driver's *kubepods.slice (kind's kubelet-kubepods.slice here),
// never a QoS or pod slice whose name only contains kubepods. A process
// outside any pod (this test's own) finds none. The processes are sleep,
// born in real cgroups.
func TestSelfPodsCgroup(t *testing.T) {
	hierarchy, base := testCgroups(t, "kubepods/burstable/podA/ctr",
		"kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-podB.slice/cri-x.scope")
	for _, c := range []struct{ cgroup, want string }{
		{"kubepods/burstable/podA/ctr", "kubepods"},
		{"kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-podB.slice/cri-x.scope", "kubelet.slice/kubelet-kubepods.slice"},
	} {
		cmd := exec.Command("sleep", "30")
		release := bornIn(t, cmd, filepath.Join(hierarchy, base, c.cgroup))
		err := cmd.Start()
		release()
		if err != nil {
			t.Fatal(err)
		}
		got, ok := probe.SelfPodsCgroup(hierarchy, cmd.Process.Pid)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if want := filepath.Join(hierarchy, base, c.want); !ok || got != want {
			t.Errorf("a process in %s: %q %v, want %s", c.cgroup, got, ok, want)
		}
	}
	if got, ok := probe.SelfPodsCgroup(hierarchy, os.Getpid()); ok {
		t.Errorf("this test's process, in no pod: found %s", got)
	}
}
