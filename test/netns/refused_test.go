package netnstest

import (
	"strings"
	"testing"
	"time"
)

// TestHBONERefusedWhileServerNodeRestarts: while the server pod's node has
// no agent serving it (killed and starting again; or, the same for the
// client, not yet acting on the pod's enrollment that the client's agent
// already saw), the pod's HBONE port refuses the client node's dial. Every
// new connection of a meshed client to that pod was then reset at once.
// A refused dial to a pod is now tried again for a bounded time, so a
// connection made in that gap waits for the server node's agent instead.
func TestHBONERefusedWhileServerNodeRestarts(t *testing.T) {
	ms, client, server, _ := meshed(t)
	url := URL(server.IPv4, 8080)
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, url); return err })
	old := ms.agents[1]
	old.Kill()
	// The pinned capture stays; the HBONE listener went with the process.
	type result struct {
		out  string
		err  error
		took time.Duration
	}
	done := make(chan result, 1)
	go func() {
		start := time.Now()
		out, err := Curl(client, url)
		done <- result{out, err, time.Since(start)}
	}()
	time.Sleep(100 * time.Millisecond) // the request is under way before the agent starts
	StartAgent(t, old.Node, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot})
	r := <-done
	t.Logf("request made while the server node's agent restarted: %v after %s", r.err, r.took.Round(time.Millisecond))
	if r.err != nil || !strings.Contains(r.out, "server peer="+client.IPv4.String()) {
		t.Fatalf("request while the server node's agent restarted: %q, %v; want it served once the agent is back", r.out, r.err)
	}
}
