package netnstest

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// httpApp serves "<name> peer=<client addr>" on :8080 inside the pod.
func httpApp(t *testing.T, p *Pod, name string) *http.Server {
	t.Helper()
	l, err := netns.Listen(context.Background(), p.Path(), "tcp", "[::]:8080", netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		a, _ := netip.ParseAddr(host)
		fmt.Fprintf(w, "%s peer=%s\n", name, a.Unmap())
	})}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return srv
}

// curl fetches url from inside pod p.
func curl(p *Pod, url string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := Exec(ctx, p.Path(), "curl", "-sS", "-g", "--max-time", "5", url)
	return string(out), err
}

func urlOf(a netip.Addr, port int) string {
	return "http://" + netip.AddrPortFrom(a, uint16(port)).String() + "/"
}

// mesh is a two-node cluster with the real agent on each node.
type mesh struct {
	topo     *Topology
	manifest string
	caDir    string
	agents   []*Agent
}

func newMesh(t *testing.T, build func(tp *Topology, m *Manifest)) *mesh {
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
		ms.agents = append(ms.agents, StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir}))
	}
	return ms
}

func TestMeshCurlAcrossNodes(t *testing.T) {
	var client, server *Pod
	ms := newMesh(t, func(tp *Topology, m *Manifest) {
		client = tp.Nodes[0].AddPod("client")
		server = tp.Nodes[1].AddPod("server")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").
			Pod(client, "mesh", "client-sa").
			Pod(server, "mesh", "server-sa")
	})
	httpApp(t, server, "server")
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	for _, fam := range []struct {
		name           string
		client, server netip.Addr
	}{{"ipv4", client.IPv4, server.IPv4}, {"ipv6", client.IPv6, server.IPv6}} {
		t.Run(fam.name, func(t *testing.T) {
			var out string
			Eventually(t, 10*time.Second, func() error {
				var err error
				out, err = curl(client, urlOf(fam.server, 8080))
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
