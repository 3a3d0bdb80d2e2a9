package netnstest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
)

// TestUpgradeHandsOverEndpoints: an upgrade on the same HTTP ports. The new
// agent takes the old one's metrics, readiness and admin sockets over the
// hand-over socket, so the two share them while they overlap, and nothing
// else in the node's namespace can bind those ports, with SO_REUSEPORT or
// without, before, during or after the upgrade (before, any process of the
// agent's user could join them and answer kubelet's probes).
func TestUpgradeHandsOverEndpoints(t *testing.T) {
	ms, client, server, _ := meshed(t)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	old := ms.agents[0]
	n := old.Node
	cannotJoin := func(when string) {
		t.Helper()
		for _, addr := range []string{"[::]:15021", "127.0.0.1:15021", "[::]:15020", "127.0.0.1:15000"} {
			l, err := netns.Listen(context.Background(), n.Path(), "tcp", addr, netns.SocketOptions{ReusePort: true})
			if err == nil {
				l.Close()
				t.Errorf("%s: a socket with SO_REUSEPORT bound %s in the node's namespace", when, addr)
			}
		}
	}
	cannotJoin("before the upgrade")
	next := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot})
	old.WaitLog(t, "a newer agent holds the node", 20*time.Second)
	next.WaitLog(t, "HTTP endpoint socket taken over from the predecessor", 5*time.Second)
	for _, e := range []string{"metrics", "readiness", "admin"} {
		taken := false
		for _, line := range strings.Split(next.Log(), "\n") {
			taken = taken || strings.Contains(line, "HTTP endpoint socket taken over from the predecessor") && strings.Contains(line, " endpoint="+e+" ")
		}
		if !taken {
			t.Errorf("the new agent did not take the %s endpoint's socket over", e)
		}
	}
	Eventually(t, 20*time.Second, func() error { _, err := curlOK(n.Path(), "http://127.0.0.1:15021/healthz/ready"); return err })
	cannotJoin("while both agents run")
	if err := old.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		if _, err := curlOK(n.Path(), "http://127.0.0.1:15021/healthz/ready"); err != nil {
			t.Fatalf("readiness after the old agent left: %v", err)
		}
	}
	cannotJoin("after the upgrade")
	if strings.Contains(next.Log(), "not taken over from the predecessor") {
		t.Errorf("the new agent bound an endpoint beside the predecessor instead of taking it over:\n%s", next.Log())
	}
	if out, err := Curl(client, URL(server.IPv4, 8080)); err != nil || !strings.Contains(out, "server peer=") {
		t.Errorf("through the mesh after the upgrade: %q, %v", out, err)
	}
}
