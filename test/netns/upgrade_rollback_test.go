package netnstest

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// TestUpgradeRolledBack: the new agent of an upgrade is removed (SIGTERM,
// as a rollback deletes it) while the old one still runs. The new agent
// gives the node up as it stops, and the old one, which yielded it, takes
// it back: it answers readiness on its port again, and enrolls a pod made
// after the rollback. Before, the old agent stayed yielded for as long as
// it ran: no pod of the node was enrolled, detached or repaired any more,
// its readiness port stayed closed (the chart's liveness probe then
// restarted it, and every connection it carried was lost), and under
// STRICT the new pod's traffic went uncaptured.
//
// Taking the node back also points every pinned link (the pods' tcx links,
// their host-probe links, the local-routing sock_ops link) back at the old
// agent's own programs. The new agent swapped its programs into them as it
// started, and until 7 December they stayed there after the rollback: one
// made for a program bug kept the bug on the pods until the old agent
// restarted. The two agents' programs are told apart by their ids.
func TestUpgradeRolledBack(t *testing.T) {
	ms, client, server, plain := meshed(t, strictMesh)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[0]
	n := old.Node
	own := pinnedLinkPrograms(t, old.BPFRoot)
	next := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot,
		Args: []string{"--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}})
	Eventually(t, 20*time.Second, func() error { _, err := curlOK(n.Path(), "http://127.0.0.1:25021/healthz/ready"); return err })
	old.WaitLog(t, "a newer agent holds the node", 10*time.Second)
	next.WaitLog(t, "pod listeners taken over from the predecessor", time.Second)
	for pin, id := range pinnedLinkPrograms(t, old.BPFRoot) {
		if own[pin] == id {
			t.Fatalf("%s runs the old agent's program %d with the new agent started: the check below shows nothing", pin, id)
		}
	}

	// The rollback: the new agent goes, the old one stays.
	if err := next.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	old.WaitLog(t, "this agent holds it again", 10*time.Second)
	if got := pinnedLinkPrograms(t, old.BPFRoot); len(got) != len(own) {
		t.Errorf("pinned links after the rollback: %v, before the upgrade: %v", got, own)
	} else {
		for pin, id := range got {
			if own[pin] != id {
				t.Errorf("%s runs program %d after the rollback, not the old agent's %d", pin, id, own[pin])
			}
		}
	}
	Eventually(t, 10*time.Second, func() error { _, err := curlOK(n.Path(), "http://127.0.0.1:15021/healthz/ready"); return err })
	if out, err := Curl(client, URL(server.IPv4, 8080)); err != nil || !strings.Contains(out, "server peer=") {
		t.Fatalf("through the mesh after the rollback: %q, %v", out, err)
	}

	// A pod made after the rollback is enrolled by the old agent, and
	// reaches the STRICT server through the mesh.
	late := ms.topo.Nodes[0].AddPod("late")
	m := &Manifest{}
	m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
		Pod(client, "mesh", "client-sa", "app=client").
		Pod(server, "mesh", "server-sa", "app=server").
		Pod(plain, "plain", "default").
		Pod(late, "mesh", "client-sa", "app=late").
		Raw(strictMesh)
	if err := m.Write(ms.manifest); err != nil {
		t.Fatal(err)
	}
	Eventually(t, 10*time.Second, func() error {
		out, err := Curl(late, URL(server.IPv4, 8080))
		if err == nil && !strings.Contains(out, "server peer="+late.IPv4.String()) {
			t.Errorf("answer %q", out)
		}
		return err
	})
	enrolled := false
	for _, line := range strings.Split(old.Log(), "\n") {
		enrolled = enrolled || strings.Contains(line, `msg="pod enrolled"`) && strings.Contains(line, " pod=mesh/late")
	}
	if !enrolled {
		t.Error("the old agent did not log the late pod's enrollment")
	}
}

// TestUpgradeRolledBackAcceleration: with sockops acceleration on, the
// take-back also puts the old agent's acceleration programs back on their
// hooks, and connections through the mesh keep working.
func TestUpgradeRolledBackAcceleration(t *testing.T) {
	args := []string{"--sockops-acceleration=true"}
	ms, client, server := newMeshPair(t, args)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[0]
	n := old.Node
	own := pinnedLinkPrograms(t, old.BPFRoot)
	if _, ok := own["accel/sockops"]; !ok {
		t.Fatalf("no acceleration link pinned: %v", own)
	}
	next := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot,
		Args: append(args, "--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000")})
	old.WaitLog(t, "a newer agent holds the node", 20*time.Second)
	next.WaitLog(t, "pod listeners taken over from the predecessor", 10*time.Second)
	if got := pinnedLinkPrograms(t, old.BPFRoot); got["accel/sockops"] == own["accel/sockops"] {
		t.Fatalf("the new agent left the old one's acceleration program %d: the check below shows nothing", got["accel/sockops"])
	}
	if err := next.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	old.WaitLog(t, "this agent holds it again", 10*time.Second)
	for pin, id := range pinnedLinkPrograms(t, old.BPFRoot) {
		if own[pin] != id {
			t.Errorf("%s runs program %d after the rollback, not the old agent's %d", pin, id, own[pin])
		}
	}
	Eventually(t, 10*time.Second, func() error {
		out, err := Curl(client, URL(server.IPv4, 8080))
		if err == nil && !strings.Contains(out, "server peer=") {
			return fmt.Errorf("answer %q", out)
		}
		return err
	})
}

// TestUpgradeRolledBackLocalRoute: a new agent run with local routing off
// removes the local-routing link as it starts; the old agent, which runs
// with it on, attaches it again as it takes the node back, as its start
// did. The take-back follows the old agent's settings, not the new one's.
func TestUpgradeRolledBackLocalRoute(t *testing.T) {
	ms, client, server, _ := meshed(t)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[0]
	own := pinnedLinkPrograms(t, old.BPFRoot)
	if _, ok := own["sockops"]; !ok {
		t.Skipf("no local-routing link pinned (no cgroup v2 here?): %v", own)
	}
	next := StartAgent(t, old.Node, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot,
		Args: []string{"--local-route=false", "--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}})
	old.WaitLog(t, "a newer agent holds the node", 20*time.Second)
	next.WaitLog(t, "pod listeners taken over from the predecessor", 10*time.Second)
	if _, ok := pinnedLinkPrograms(t, old.BPFRoot)["sockops"]; ok {
		t.Fatal("the new agent, local routing off, left the local-routing link: the check below shows nothing")
	}
	if err := next.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	old.WaitLog(t, "this agent holds it again", 10*time.Second)
	if got := pinnedLinkPrograms(t, old.BPFRoot); got["sockops"] != own["sockops"] {
		t.Errorf("local-routing link after the rollback runs program %d, want the old agent's %d", got["sockops"], own["sockops"])
	}
	if out, err := Curl(client, URL(server.IPv4, 8080)); err != nil || !strings.Contains(out, "server peer=") {
		t.Fatalf("through the mesh after the rollback: %q, %v", out, err)
	}
}

// TestUpgradeRolledBackLegacyTC: pods attached with legacy tc (no links to
// relink) get the old agent's programs back on their filters from the full
// pass that follows the take-back, whose check compares the filters'
// program ids.
func TestUpgradeRolledBackLegacyTC(t *testing.T) {
	args := []string{"--tc-attach=legacy"}
	ms, client, server := newMeshPair(t, args)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[0]
	own := filterPrograms(t, client)
	next := StartAgent(t, old.Node, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot,
		Args: append(args, "--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000")})
	old.WaitLog(t, "a newer agent holds the node", 20*time.Second)
	Eventually(t, 10*time.Second, func() error {
		if got := filterPrograms(t, client); got == own {
			return fmt.Errorf("the new agent's programs are not on the pod's filters yet: %v", got)
		}
		return nil
	})
	if err := next.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	old.WaitLog(t, "this agent holds it again", 10*time.Second)
	Eventually(t, 5*time.Second, func() error {
		if got := filterPrograms(t, client); got != own {
			return fmt.Errorf("the pod's filters run programs %v after the rollback, want the old agent's %v", got, own)
		}
		return nil
	})
	if out, err := Curl(client, URL(server.IPv4, 8080)); err != nil || !strings.Contains(out, "server peer=") {
		t.Fatalf("through the mesh after the rollback: %q, %v", out, err)
	}
}

// filterPrograms are the ids of the programs of the cls_bpf filters on eth0
// of pod p, ingress then egress (0 where there is none).
func filterPrograms(t *testing.T, p *Pod) [2]int {
	t.Helper()
	var ids [2]int
	err := netns.Do(p.Path(), func() error {
		iface, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		for i, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			fs, err := netlink.FilterList(iface, parent)
			if err != nil {
				return err
			}
			for _, f := range fs {
				if bf, ok := f.(*netlink.BpfFilter); ok {
					ids[i] = bf.Id
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// TestUpgradeRolledBackCNISocket: after a rollback the CNI socket at the
// path is the old agent's again. The new agent renamed its own over the
// old one's as it started, and removed it as it stopped: the old agent,
// taking the node back, installs its socket there again. Before, the path
// stayed empty for as long as the old agent ran, and every CNI ADD of an
// ambient pod on the node failed as if no agent ran.
func TestUpgradeRolledBackCNISocket(t *testing.T) {
	tp := New(t, 1)
	n := tp.Nodes[0]
	pod := n.AddPod("web")
	dir := t.TempDir()
	manifest, ca := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "ca")
	if err := (&Manifest{}).Namespace("mesh", "istio.io/dataplane-mode=ambient").Pod(pod, "mesh", "web").Write(manifest); err != nil {
		t.Fatal(err)
	}
	initCA(t, ca)
	sockDir := filepath.Join(dir, "cni")
	if err := os.Mkdir(sockDir, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(sockDir, "cni.sock")
	old := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca, Args: []string{"--cni-socket", sock}})
	old.WaitLog(t, "pod enrolled", 10*time.Second)
	next := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca, BPFRoot: old.BPFRoot,
		Args: []string{"--cni-socket", sock, "--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}})
	old.WaitLog(t, "a newer agent holds the node", 10*time.Second)
	next.WaitLog(t, "CNI event server listening", 10*time.Second)
	if err := next.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	old.WaitLog(t, "this agent holds it again", 10*time.Second)
	Eventually(t, 10*time.Second, func() error {
		c, err := net.Dial("unix", sock)
		if err != nil {
			return err
		}
		return c.Close()
	})
	old.WaitLog(t, "CNI event socket installed again", time.Second)
}

// pinnedLinkPrograms are the ids of the programs the links pinned under a
// node's pin root run, by pin: every pod's tcx and host-probe links, and
// the local-routing and acceleration sock_ops links if there are.
func pinnedLinkPrograms(t *testing.T, root string) map[string]ebpf.ProgramID {
	t.Helper()
	pins, err := filepath.Glob(filepath.Join(root, "pods", "*", "*"))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"sockops", "accel/sockops"} {
		if _, err := os.Lstat(filepath.Join(root, name)); err == nil {
			pins = append(pins, filepath.Join(root, name))
		}
	}
	ids := map[string]ebpf.ProgramID{}
	for _, p := range pins {
		lk, err := link.LoadPinnedLink(p, &ebpf.LoadPinOptions{})
		if err != nil {
			t.Fatalf("open pinned link %s: %v", p, err)
		}
		info, err := lk.Info()
		lk.Close()
		if err != nil {
			t.Fatalf("link info of %s: %v", p, err)
		}
		ids[strings.TrimPrefix(p, root+"/")] = info.Program
	}
	if len(ids) == 0 {
		t.Fatalf("no pinned links under %s", root)
	}
	return ids
}
