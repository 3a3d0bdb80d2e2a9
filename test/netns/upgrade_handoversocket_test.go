package netnstest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/unixsock"
)

// TestHandoverSocketFollowsTheNodesHolder: the hand-over socket at the path
// is the agent's that holds the node, whoever installed last, as the CNI
// socket is (TestCNISocketFollowsTheNodesHolder). Two new agents of one
// node both wait for the old agent's socket to go, then both install their
// own; the one that yielded the node may install last, and removes its
// socket as it stops. Before, the holder never looked at the path again:
// the next agent found no predecessor, bound the pods' ports beside the
// holder (EADDRINUSE) and took them only once the holder exited, the SYNs
// of that gap sent again.
//
// The late agent is a stand-in, as in TestCNISocketFollowsTheNodesHolder:
// the test installs a socket over the path as an agent does, then removes
// it as that agent's stop does. A real next agent must then take the pod's
// listeners from the holder. The second half checks the other way round:
// the holder, yielded to that next agent, leaves the path alone, and the
// next agent puts its socket there once the path stays empty.
func TestHandoverSocketFollowsTheNodesHolder(t *testing.T) {
	tp := New(t, 1)
	n := tp.Nodes[0]
	pod := n.AddPod("web")
	dir := t.TempDir()
	manifest, ca := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "ca")
	if err := (&Manifest{}).Namespace("mesh", "istio.io/dataplane-mode=ambient").Pod(pod, "mesh", "web").Write(manifest); err != nil {
		t.Fatal(err)
	}
	initCA(t, ca)
	holder := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca})
	holder.WaitLog(t, "pod enrolled", 10*time.Second)
	holder.WaitLog(t, "listener hand-over socket listening", 5*time.Second)
	// Where StartAgent puts it.
	sock := filepath.Join(filepath.Dir(holder.BPFRoot), "handover-"+n.Name+".sock")

	// The late agent's socket, renamed over the holder's; then its stop.
	l, ino, err := unixsock.Install("stand-in agent's hand-over socket", sock, "unixpacket")
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	l.Close()
	unixsock.RemoveIfOwn(sock, ino)
	holder.WaitLog(t, "listener hand-over socket installed again", 5*time.Second)
	if !strings.Contains(holder.Log(), "listener hand-over socket at the path is not this agent's") {
		t.Errorf("the holder did not say why it installed its socket again:\n%s", lastLines(holder.Log(), 10))
	}

	// The next agent finds the holder at the path and takes the pod's
	// listeners from it, instead of waiting for its ports.
	next := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca, BPFRoot: holder.BPFRoot,
		Args: []string{"--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}})
	next.WaitLog(t, "connected to the running agent's hand-over socket", 10*time.Second)
	holder.WaitLog(t, "a newer agent holds the node", 20*time.Second)
	next.WaitLog(t, "pod listeners taken over from the predecessor", 10*time.Second)
	if strings.Contains(next.Log(), "pod ports held by another process") {
		t.Errorf("the next agent waited for the pod's ports:\n%s", lastLines(next.Log(), 10))
	}

	// The path emptied while the holder, yielded, still runs: it does not
	// take it back; the next agent, holding the node, does once the path
	// stayed empty.
	if err := os.Remove(sock); err != nil {
		t.Fatal(err)
	}
	next.WaitLog(t, "listener hand-over socket listening", 10*time.Second)
	time.Sleep(2 * time.Second) // two of the yielded agent's checks
	if c := strings.Count(holder.Log(), "listener hand-over socket installed again"); c != 1 {
		t.Errorf("the yielded agent installed its hand-over socket again (%d times in all):\n%s", c, lastLines(holder.Log(), 10))
	}
	select {
	case <-holder.done:
		t.Fatal("the yielded agent exited: the check above shows nothing")
	default:
	}
}
