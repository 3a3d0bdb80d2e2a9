package netnstest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/redirector-mesh/redirector/pkg/maps"
)

// enrolledNames reads the pinned pod metadata of an agent: namespace/name -> id.
func enrolledNames(root string) (map[string]uint32, error) {
	m, err := maps.OpenPinned(root)
	if err != nil {
		return nil, err
	}
	defer m.Close()
	metas, err := m.ListMeta()
	if err != nil {
		return nil, err
	}
	out := map[string]uint32{}
	for id, meta := range metas {
		// Enrolled once its entries are written as recorded: the last
		// step of an attach (metadata is the first, and pods attach
		// concurrently).
		done := true
		for _, a := range meta.Addrs {
			s, ok, err := m.Pod(a)
			done = done && err == nil && ok && s == meta.Settings
		}
		if done {
			out[meta.Namespace+"/"+meta.Name] = id
		}
	}
	return out, nil
}

func mustEnrolledNames(t *testing.T, root string) map[string]uint32 {
	t.Helper()
	got, err := enrolledNames(root)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func entryCount(t *testing.T, root string) int {
	t.Helper()
	m, err := maps.OpenPinned(root)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	pods, err := m.ListPods()
	if err != nil {
		t.Fatal(err)
	}
	return len(pods)
}

func waitEnrolled(t *testing.T, root string, timeout time.Duration, want ...string) {
	t.Helper()
	Eventually(t, timeout, func() error {
		got, err := enrolledNames(root)
		if err != nil {
			return err
		}
		if len(got) != len(want) {
			return fmt.Errorf("enrolled %v, want %v", got, want)
		}
		for _, w := range want {
			if _, ok := got[w]; !ok {
				return fmt.Errorf("enrolled %v, want %v", got, want)
			}
		}
		return nil
	})
}

func TestEnrollmentFollowsLabels(t *testing.T) {
	tp := New(t, 1)
	a, b := tp.Nodes[0].AddPod("a"), tp.Nodes[0].AddPod("b")
	dir := t.TempDir()
	manifest, ca := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "ca")
	write := func(nsLabels []string, bLabels ...string) {
		m := (&Manifest{}).Namespace("shop", nsLabels...).Pod(a, "shop", "a").Pod(b, "shop", "b", bLabels...)
		if err := m.Write(manifest); err != nil {
			t.Fatal(err)
		}
	}
	write([]string{"istio.io/dataplane-mode=ambient"})
	initCA(t, ca)
	ag := StartAgent(t, tp.Nodes[0], AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca})
	waitEnrolled(t, ag.BPFRoot, 10*time.Second, "shop/a", "shop/b")

	// Pod relabelled none: only that pod leaves.
	write([]string{"istio.io/dataplane-mode=ambient"}, "istio.io/dataplane-mode=none")
	waitEnrolled(t, ag.BPFRoot, 2*time.Second, "shop/a")

	// Namespace label removed: every pod leaves within a second, entries and all.
	write(nil)
	start := time.Now()
	waitEnrolled(t, ag.BPFRoot, time.Second)
	if n := entryCount(t, ag.BPFRoot); n != 0 {
		t.Errorf("%d enrollment entries left after the namespace label was removed", n)
	}
	t.Logf("namespace label removed -> pods unenrolled in %s", time.Since(start).Round(time.Millisecond))
}

func TestRestartConverges(t *testing.T) {
	tp := New(t, 1)
	n := tp.Nodes[0]
	a, b, c := n.AddPod("a"), n.AddPod("b"), n.AddPod("c")
	dir := t.TempDir()
	manifest, ca, root := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "ca"), filepath.Join(dir, "bpf")
	m := (&Manifest{}).Namespace("shop", "istio.io/dataplane-mode=ambient").Pod(a, "shop", "a").Pod(b, "shop", "b").Pod(c, "shop", "c", "istio.io/dataplane-mode=none")
	if err := m.Write(manifest); err != nil {
		t.Fatal(err)
	}
	initCA(t, ca)
	opts := AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca, BPFRoot: root}
	first := StartAgent(t, n, opts)
	waitEnrolled(t, root, 10*time.Second, "shop/a", "shop/b")
	before := mustEnrolledNames(t, root)
	linkID := pinnedLinkID(t, root, before["shop/a"])

	first.Kill() // kill -9: no drain, no cleanup
	// While it is down: b leaves the mesh, c joins.
	m = (&Manifest{}).Namespace("shop", "istio.io/dataplane-mode=ambient").Pod(a, "shop", "a").Pod(b, "shop", "b", "istio.io/dataplane-mode=none").Pod(c, "shop", "c")
	if err := m.Write(manifest); err != nil {
		t.Fatal(err)
	}
	second := StartAgent(t, n, opts)
	waitEnrolled(t, root, 10*time.Second, "shop/a", "shop/c")
	after := mustEnrolledNames(t, root)
	if after["shop/a"] != before["shop/a"] || pinnedLinkID(t, root, after["shop/a"]) != linkID {
		t.Errorf("pod a was re-attached (id %d -> %d, link %d -> %d); its state was right", before["shop/a"], after["shop/a"], linkID, pinnedLinkID(t, root, after["shop/a"]))
	}
	log := second.Log()
	if strings.Contains(log, "pod enrolled pod=shop/a") || strings.Contains(log, "pod repaired pod=shop/a") {
		t.Errorf("the restarted agent touched pod a:\n%s", log)
	}
	// a's captured traffic works again through the new process.
	HTTPApp(t, b, 8080, "b")
	Eventually(t, 5*time.Second, func() error { _, err := Curl(a, URL(b.IPv4, 8080)); return err })
}

func pinnedLinkID(t *testing.T, root string, id uint32) link.ID {
	t.Helper()
	l, err := link.LoadPinnedLink(filepath.Join(root, "pods", fmt.Sprint(id), "egress"), &ebpf.LoadPinOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		t.Fatal(err)
	}
	return info.ID
}

func initCA(t *testing.T, dir string) {
	t.Helper()
	if out, err := Exec(t.Context(), "/proc/self/ns/net", redirectorBin(), "ca", "init", "--dir", dir); err != nil {
		t.Fatalf("ca init: %v: %s", err, out)
	}
}

func TestBadInputIsIsolated(t *testing.T) {
	tp := New(t, 1)
	good, server := tp.Nodes[0].AddPod("good"), tp.Nodes[0].AddPod("server")
	badIP := strings.Replace(tp.Nodes[0].PodAddr4(200).String(), ".200", ".999", 1)
	noNetNS, oddRuntime, vmPod := tp.Nodes[0].PodAddr4(200), tp.Nodes[0].PodAddr4(201), tp.Nodes[0].PodAddr4(202)
	dir := t.TempDir()
	manifest, ca := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "ca")
	m := (&Manifest{}).Namespace("shop", "istio.io/dataplane-mode=ambient").Pod(good, "shop", "good").Raw(`
apiVersion: v1
kind: Pod
metadata: {name: bad-ip, namespace: shop}
spec: {nodeName: node1, containers: [{name: c, image: c}]}
status: {phase: Running, podIP: ` + badIP + `}`).Raw(`
apiVersion: v1
kind: Pod
metadata: {name: no-netns, namespace: shop, uid: uid-no-netns}
spec: {nodeName: node1, containers: [{name: c, image: c}]}
status: {phase: Running, podIP: ` + noNetNS.String() + `}`).Raw(`
apiVersion: v1
kind: Pod
metadata: {name: odd-runtime, namespace: shop}
spec: {nodeName: node1, runtimeClassName: kata-fc, containers: [{name: c, image: c}]}
status: {phase: Running, podIP: ` + oddRuntime.String() + `}`).Raw(`
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: kata-qemu}
handler: kata`).Raw(`
apiVersion: v1
kind: Pod
metadata: {name: vm-pod, namespace: shop}
spec: {nodeName: node1, runtimeClassName: kata-qemu, containers: [{name: c, image: c}]}
status: {phase: Running, podIP: ` + vmPod.String() + `}`)
	// No malformed document: one makes the file source refuse the whole manifest
	// (TestManifestDamageChangesNothing, pkg/source/file).
	if err := os.WriteFile(manifest, []byte(m.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	initCA(t, ca)
	ag := StartAgent(t, tp.Nodes[0], AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca, Env: []string{"SKIP_RUNTIME_CLASSES=kata"}})
	waitEnrolled(t, ag.BPFRoot, 10*time.Second, "shop/good")
	for _, want := range []string{"shop/bad-ip", badIP, "shop/no-netns", "shop/odd-runtime", "kata-fc"} {
		ag.WaitLog(t, want, 5*time.Second)
	}
	HTTPApp(t, server, 8080, "server")
	if out, err := Curl(good, URL(server.IPv4, 8080)); err != nil || !strings.Contains(out, "server peer=") {
		t.Errorf("the good pod does not work next to bad input: %q %v", out, err)
	}
}

// TestUpgradeFailsNoNewConnection: the agent stops (SIGTERM, as in a
// rolling update) while a client opens a connection; the pinned programs
// keep capturing and drop the SYN (fail closed), TCP retransmits it, and
// the new agent, started on the same pins, serves it. The client sees a
// delay, never a failure, and never plaintext.
func TestUpgradeFailsNoNewConnection(t *testing.T) {
	// STRICT on the server: an answer proves the connection went through the mesh.
	ms, client, server, _ := meshed(t, strictMesh)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[0]
	if err := old.Stop(15 * time.Second); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		// Long enough for TCP's SYN retransmissions at 1, 3 and 7 s.
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		b, err := Exec(ctx, client.Path(), "curl", "-sS", "--max-time", "15", URL(server.IPv4, 8080))
		out := string(b)
		if err == nil && !strings.Contains(out, "server peer="+client.IPv4.String()) {
			err = fmt.Errorf("unexpected answer %q", out)
		}
		done <- err
	}()
	time.Sleep(300 * time.Millisecond) // the SYN is in flight, dropped, awaiting retransmission
	StartAgent(t, old.Node, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot})
	if err := <-done; err != nil {
		t.Fatalf("a connection opened during the upgrade failed: %v", err)
	}
	// The gap was real: the first SYN met no listener and was dropped.
	m, err := maps.OpenPinned(old.BPFRoot)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	c, _, err := m.Counters(client.IPv4)
	if err != nil || c.DroppedPackets == 0 {
		t.Errorf("client counters %+v (%v): want the SYN sent during the gap dropped", c, err)
	}
}
