package netnstest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestUpgradeTakesNodeWithFirstSnapshot: the new agent of an upgrade takes
// the node over only once its source delivered a snapshot. One whose
// manifest is refused at its first load (here a List cut before its items)
// leaves the node to the old agent, which has the last good state: it goes
// on enrolling (a pod made meanwhile reaches the STRICT server through the
// mesh) and answers readiness, and the pinned links keep running its
// programs, also once that new agent stopped. The next new agent, whose
// manifest is good, takes the node, the links and the pods' listeners as
// any upgrade does. Before 8 December the new agent claimed the node as it
// started: the old one yielded 2 s later, and nobody enrolled, detached or
// ran the full pass on the node until the new source answered; and one
// that stopped before it claimed left every pod on its programs.
func TestUpgradeTakesNodeWithFirstSnapshot(t *testing.T) {
	ms, client, server, plain := meshed(t, strictMesh)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[0]
	n := old.Node
	own := pinnedLinkPrograms(t, old.BPFRoot)
	sameLinks := func(when string) {
		t.Helper()
		got := pinnedLinkPrograms(t, old.BPFRoot)
		for pin, id := range own {
			if got[pin] != id {
				t.Errorf("%s: %s runs program %d, not the old agent's %d", when, pin, got[pin], id)
			}
		}
	}

	refused := filepath.Join(t.TempDir(), "cluster.yaml")
	if err := os.WriteFile(refused, []byte("apiVersion: v1\nkind: List\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	next := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: refused, CADir: ms.caDir, BPFRoot: old.BPFRoot,
		Args: []string{"--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}})
	next.WaitLog(t, "manifests not applied", 10*time.Second)
	time.Sleep(3 * time.Second) // the old agent yielded 2 s after such a start
	if strings.Contains(old.Log(), "a newer agent holds the node") {
		t.Fatalf("the old agent yielded the node to an agent with no state:\nnew agent:\n%s", lastLines(next.Log(), 10))
	}
	sameLinks("while the new agent has no state")

	// A pod made meanwhile is enrolled by the old agent.
	late := ms.topo.Nodes[0].AddPod("late")
	good := &Manifest{}
	good.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
		Pod(client, "mesh", "client-sa", "app=client").
		Pod(server, "mesh", "server-sa", "app=server").
		Pod(plain, "plain", "default").
		Pod(late, "mesh", "client-sa", "app=late").
		Raw(strictMesh)
	if err := good.Write(ms.manifest); err != nil {
		t.Fatal(err)
	}
	Eventually(t, 10*time.Second, func() error {
		out, err := Curl(late, URL(server.IPv4, 8080))
		if err == nil && !strings.Contains(out, "server peer="+late.IPv4.String()) {
			t.Errorf("answer %q", out)
		}
		return err
	})
	if !logHas(old.Log(), `msg="pod enrolled"`, " pod=mesh/late") {
		t.Error("the old agent did not log the late pod's enrollment")
	}
	if _, err := curlOK(n.Path(), "http://127.0.0.1:15021/healthz/ready"); err != nil {
		t.Errorf("the old agent is not ready while it holds the node: %v", err)
	}

	// That agent removed (a rollback): the node stays as it was.
	if err := next.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	sameLinks("after the new agent with no state stopped")
	if strings.Contains(old.Log(), "a newer agent holds the node") {
		t.Fatal("the old agent yielded the node")
	}

	// A new agent with a good manifest takes the node over.
	next = StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot,
		Args: []string{"--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}})
	next.WaitLog(t, "this agent holds the node", 10*time.Second)
	old.WaitLog(t, "a newer agent holds the node", 10*time.Second)
	Eventually(t, 20*time.Second, func() error { _, err := curlOK(n.Path(), "http://127.0.0.1:25021/healthz/ready"); return err })
	next.WaitLog(t, "pod listeners taken over from the predecessor", 5*time.Second)
	if out, err := Curl(late, URL(server.IPv4, 8080)); err != nil || !strings.Contains(out, "server peer="+late.IPv4.String()) {
		t.Fatalf("through the mesh after the new agent took the node: %q, %v", out, err)
	}
	for pin, id := range pinnedLinkPrograms(t, old.BPFRoot) {
		if own[pin] == id {
			t.Errorf("%s still runs the old agent's program %d after the new agent took the node", pin, id)
		}
	}
}

// logHas reports whether one line of log has every part.
func logHas(log string, parts ...string) bool {
	for _, line := range strings.Split(log, "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			return true
		}
	}
	return false
}
