package netnstest

import (
	"context"
	"encoding/binary"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
)

// sockopsPair is a mesh of two nodes with sockops acceleration on, a
// meshed client pod on the first and a meshed server pod on the second.
func sockopsPair(t *testing.T) (*mesh, *Pod, *Pod) {
	t.Helper()
	var client, server *Pod
	ms := newMeshWith(t, []string{"--sockops-acceleration=true"}, func(tp *Topology, m *Manifest) {
		client, server = tp.Nodes[0].AddPod("client"), tp.Nodes[1].AddPod("server")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Pod(client, "mesh", "client").Pod(server, "mesh", "server")
	})
	return ms, client, server
}

// TestSockopsAccelerationMapsFull: the acceleration's maps are the node's,
// 65536 entries, and one pod's connections can fill them (each connection
// between two of the node's sockets takes two). A connection that finds
// them full must still work, on TCP, and be counted: an operator otherwise
// sees the acceleration stop for every pod with nothing to tell why.
func TestSockopsAccelerationMapsFull(t *testing.T) {
	ms, client, server := sockopsPair(t)
	mirrorServer(t, server, 9000)
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	// Fill the client node's rd_sock_state with keys of no socket
	// (namespace cookie 0 is no namespace's), as many connections would.
	node := ms.agents[0]
	if node.Node != client.Node {
		t.Fatalf("agent 0 serves %s, the client is on %s", node.Node.Name, client.Node.Name)
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(node.BPFRoot, bpf.SockopsMapRdSockState), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var junk []bpf.SockopsSockKey
	t.Cleanup(func() {
		for _, k := range junk {
			m.Delete(&k)
		}
	})
	for i := uint32(0); ; i++ {
		var k bpf.SockopsSockKey
		binary.BigEndian.PutUint32(k.Local[12:], i)
		err := m.Update(&k, bpf.SockopsSockState{}, ebpf.UpdateNoExist)
		if errors.Is(err, ebpf.ErrKeyExist) {
			continue
		}
		if err != nil {
			break // full
		}
		junk = append(junk, k)
		if len(junk) > int(m.MaxEntries()) {
			t.Fatalf("%s took more than its %d entries", bpf.SockopsMapRdSockState, m.MaxEntries())
		}
	}
	t.Logf("filled %s with %d entries", bpf.SockopsMapRdSockState, len(junk))

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	before := accelTotals(t, ms)
	exchangeMirror(t, dialPod(t, ctx, client, server, 9000), 4<<20)
	d := accelTotals(t, ms).Sub(before)
	t.Logf("counters: %+v", d)
	if d.Unpaired < 2 {
		t.Errorf("the client node's two sockets of the connection were left unpaired uncounted: %+v", d)
	}
}
