package netnstest

import (
	"testing"
	"time"
)

// TestUnlabelledPodTakesSelectorPolicies: a pod with no labels at all is
// held to the workload-selector AuthorizationPolicies of its namespace, as
// under ztunnel, where istiod lists every such policy for a pod without
// labels (its label filter does not filter on a nil map). Before the fix,
// the agent applied a selector only to pods whose labels matched it, so the
// client reached the unlabelled server that ztunnel keeps it from.
func TestUnlabelledPodTakesSelectorPolicies(t *testing.T) {
	const deny = `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-client-on-db, namespace: mesh}
spec:
  selector: {matchLabels: {app: db}}
  action: DENY
  rules:
  - from:
    - source: {principals: ["cluster.local/ns/mesh/sa/client-sa"]}`
	var client, server, web *Pod
	ms := newMesh(t, func(tp *Topology, m *Manifest) {
		client = tp.Nodes[0].AddPod("client")
		server = tp.Nodes[1].AddPod("server")
		web = tp.Nodes[1].AddPod("web")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").
			Pod(client, "mesh", "client-sa").
			Pod(server, "mesh", "server-sa"). // no labels
			Pod(web, "mesh", "server-sa", "app=web").
			Raw(deny)
	})
	HTTPApp(t, server, 8080, "server")
	HTTPApp(t, web, 8080, "web")
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	// A labelled pod the selector does not match is reached: the mesh
	// carries the client's connections.
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(web.IPv4, 8080)); return err })
	if out, err := Curl(client, URL(server.IPv4, 8080)); err == nil {
		t.Fatalf("the unlabelled server answered the client that the selector DENY refuses under ztunnel: %q", out)
	}
	ms.agents[1].WaitLog(t, "mesh/deny-client-on-db", 5*time.Second)
}
