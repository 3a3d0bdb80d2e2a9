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

// TestPortLevelMTLSUnderSelectorlessNamespacePolicy: with an older
// namespace-wide PeerAuthentication written `selector: {}` (PERMISSIVE) and
// a newer one with no selector (STRICT), a workload policy with
// portLevelMtls is enforced as istiod converts it for ztunnel, under the
// selector-less STRICT policy: plaintext is refused on every port but the
// PERMISSIVE one. Before the fix, the agent read the other ports as
// PERMISSIVE and the plaintext pod reached the server on 8080.
func TestPortLevelMTLSUnderSelectorlessNamespacePolicy(t *testing.T) {
	const pas = `apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: old-wide, namespace: mesh, creationTimestamp: "2024-01-01T00:00:00Z"}
spec:
  selector: {}
  mtls: {mode: PERMISSIVE}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: mesh, creationTimestamp: "2024-06-01T00:00:00Z"}
spec:
  mtls: {mode: STRICT}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: server, namespace: mesh, creationTimestamp: "2024-06-01T00:00:00Z"}
spec:
  selector: {matchLabels: {app: server}}
  portLevelMtls:
    8081: {mode: STRICT}
    8082: {mode: PERMISSIVE}`
	ms, _, server, plain := meshed(t, pas)
	HTTPApp(t, server, 8082, "server")
	// The PERMISSIVE port takes plaintext: the path works.
	Eventually(t, 10*time.Second, func() error { _, err := Curl(plain, URL(server.IPv4, 8082)); return err })
	if out, err := Curl(plain, URL(server.IPv4, 8080)); err == nil {
		t.Fatalf("plaintext reached port 8080, which ztunnel refuses under the converted port-level policy: %q", out)
	}
	ms.agents[1].WaitLog(t, "mTLS is STRICT", 5*time.Second)
}
