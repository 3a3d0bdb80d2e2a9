package netnstest

import (
	"net/netip"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// mesh is a two-node cluster with the real agent on each node.
type mesh struct {
	topo     *Topology
	manifest string
	caDir    string
	agents   []*Agent
}

func newMesh(t *testing.T, build func(tp *Topology, m *Manifest)) *mesh {
	t.Helper()
	return newMeshWith(t, nil, build)
}

// newMeshWith is newMesh with extra agent arguments.
func newMeshWith(t *testing.T, args []string, build func(tp *Topology, m *Manifest)) *mesh {
	t.Helper()
	tp := New(t, 2)
	m := &Manifest{}
	build(tp, m)
	dir := t.TempDir()
	ms := &mesh{topo: tp, manifest: filepath.Join(dir, "cluster.yaml"), caDir: filepath.Join(dir, "ca")}
	if err := m.Write(ms.manifest); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(redirectorBin(), "ca", "init", "--dir", ms.caDir).CombinedOutput(); err != nil {
		t.Fatalf("ca init: %v: %s", err, out)
	}
	for _, n := range tp.Nodes {
		ms.agents = append(ms.agents, StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, Args: args}))
	}
	return ms
}

// newMeshPair is newMeshWith's common case: an ambient client pod on node 1
// and an ambient server pod on node 2 (namespace mesh) serving HTTPApp on
// 8080, both enrolled when it returns.
func newMeshPair(t *testing.T, args []string) (ms *mesh, client, server *Pod) {
	t.Helper()
	ms = newMeshWith(t, args, func(tp *Topology, m *Manifest) {
		client = tp.Nodes[0].AddPod("client")
		server = tp.Nodes[1].AddPod("server")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").
			Pod(client, "mesh", "client-sa").
			Pod(server, "mesh", "server-sa")
	})
	HTTPApp(t, server, 8080, "server")
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	return ms, client, server
}

func TestMeshCurlAcrossNodes(t *testing.T) {
	ms, client, server := newMeshPair(t, nil)
	for _, fam := range []struct {
		name           string
		client, server netip.Addr
	}{{"ipv4", client.IPv4, server.IPv4}, {"ipv6", client.IPv6, server.IPv6}} {
		t.Run(fam.name, func(t *testing.T) {
			var out string
			Eventually(t, 10*time.Second, func() error {
				var err error
				out, err = Curl(client, URL(fam.server, 8080))
				return err
			})
			if want := "server peer=" + fam.client.String(); !strings.Contains(out, want) {
				t.Errorf("curl answered %q, want %q (the app must see the client pod's address)", out, want)
			}
		})
	}
	// The server side saw the client's SPIFFE identity.
	ms.agents[1].WaitLog(t, "spiffe://cluster.local/ns/mesh/sa/client-sa", 5*time.Second)
}

// TestDemo runs `make demo`'s program: it must finish, show the flows with
// their outcomes, and leave nothing behind.
func TestDemo(t *testing.T) {
	out, err := exec.Command(filepath.Join(bin, "redirector-demo"), "--bin", bin).CombinedOutput()
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	for _, want := range []string{
		`shop/frontend -> shop/backend +ok`,
		`plain/outsider -> shop/backend +refused`,
		`kubelet probe\) -> shop/backend +ok +169\.254\.7\.127`,
		`source_principal="spiffe://cluster\.local/ns/shop/sa/frontend"`,
		`cleaned up`,
	} {
		if !regexp.MustCompile(want).Match(out) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
	m := regexp.MustCompile(`network namespaces (rd[0-9a-f]+)-\*`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("demo did not say which namespaces it made:\n%s", out)
	}
	after, _ := exec.Command("ip", "netns", "list").Output()
	if strings.Contains(string(after), string(m[1])+"-") {
		t.Errorf("demo left namespaces %s-* behind:\n%s", m[1], after)
	}
}
