package netnstest

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/unixsock"
)

// TestCNISocketFollowsTheNodesHolder: the CNI socket at the path is the
// agent's that holds the node, whoever installed last. Two new agents of one
// node (a rollout begun while the last one's surge pod was still starting)
// each install their socket as they start, after their claim; the one
// that claimed first but was slower to install puts its socket over the
// holder's, yields, and removes its socket as it stops. Before, the holder
// never looked at the path again: every CNI ADD on the node failed from
// then on (no socket, or one served by a yielded agent, whose enrollment
// never converges) while the holder passed for ready.
//
// The late agent is a stand-in: the test installs a socket over the path
// the way an agent does (unixsock.Install, a rename), then removes it as
// that agent's stop does (RemoveIfOwn). Two real agents hit that order only
// when one is descheduled for a moment between its claim and its install.
// The second half checks the other way round with a real newer agent: the
// yielded agent leaves the holder's socket alone.
func TestCNISocketFollowsTheNodesHolder(t *testing.T) {
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
	if err := os.Mkdir(sockDir, 0o700); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(sockDir, "cni.sock")
	holder := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca, Args: []string{"--cni-socket", sock}})
	holder.WaitLog(t, "pod enrolled", 10*time.Second)
	holder.WaitLog(t, "CNI event server listening", 5*time.Second)

	// The late agent's socket, renamed over the holder's; then its stop.
	l, ino, err := unixsock.Install("stand-in agent's CNI socket", sock, "unix")
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	l.Close()
	unixsock.RemoveIfOwn(sock, ino)
	Eventually(t, 5*time.Second, func() error {
		c, err := net.Dial("unix", sock)
		if err != nil {
			return fmt.Errorf("no CNI socket served at the path: %w", err)
		}
		return c.Close()
	})
	holder.WaitLog(t, "CNI event socket installed again", time.Second)
	if !strings.Contains(holder.Log(), "CNI event socket at the path is not this agent's") {
		t.Errorf("the holder did not say why it installed its socket again:\n%s", lastLines(holder.Log(), 10))
	}

	// A real newer agent claims the node and installs its socket: the
	// yielded one must not take the path back while the newer one holds it.
	next := StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca, BPFRoot: holder.BPFRoot,
		Args: []string{"--cni-socket", sock, "--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}})
	holder.WaitLog(t, "a newer agent holds the node", 10*time.Second)
	next.WaitLog(t, "CNI event server listening", 10*time.Second)
	inoAt := func() uint64 {
		fi, err := os.Lstat(sock)
		if err != nil {
			t.Fatalf("CNI socket: %v", err)
		}
		return fi.Sys().(*syscall.Stat_t).Ino
	}
	nextIno := inoAt()
	time.Sleep(3 * time.Second) // several of the holder's checks
	if got := inoAt(); got != nextIno {
		t.Errorf("the CNI socket at the path changed while the newer agent held the node (inode %d, was %d):\nold agent:\n%s",
			got, nextIno, lastLines(holder.Log(), 10))
	}
	if strings.Count(holder.Log(), "CNI event socket installed again") != 1 {
		t.Errorf("the yielded agent installed its CNI socket again:\n%s", lastLines(holder.Log(), 10))
	}
}
