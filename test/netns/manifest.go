package netnstest

import (
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
)

// Manifest builds the file source's YAML for simulated pods.
type Manifest struct {
	docs []string
}

// Namespace adds a namespace with labels ("k=v").
func (m *Manifest) Namespace(name string, labels ...string) *Manifest {
	m.docs = append(m.docs, fmt.Sprintf("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: %s\n%s", name, labelBlock("  ", labels)))
	return m
}

// Pod adds pod p in namespace ns with service account sa and labels ("k=v").
func (m *Manifest) Pod(p *Pod, ns, sa string, labels ...string) *Manifest {
	m.docs = append(m.docs, podDoc(p, ns, sa, "", labels))
	return m
}

// OwnedPodDoc is a pod document as a Deployment's ReplicaSet creates it:
// generated name, pod-template-hash label, controller owner reference, so
// Istio's rules name the Deployment deploy as its workload.
func OwnedPodDoc(p *Pod, ns, sa, deploy, hash string, labels ...string) string {
	owner := fmt.Sprintf(`  generateName: %s-%s-
  ownerReferences:
  - {apiVersion: apps/v1, kind: ReplicaSet, name: %s-%s, uid: rs-%s, controller: true}
`, deploy, hash, deploy, hash, deploy)
	return podDoc(p, ns, sa, owner, append(slices.Clone(labels), "pod-template-hash="+hash))
}

// podDoc is the pod document of p; owner holds extra metadata lines.
func podDoc(p *Pod, ns, sa, owner string, labels []string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %s
  namespace: %s
  uid: uid-%s-%s
%s%sspec:
  nodeName: node%d
  serviceAccountName: %s
  containers:
  - name: app
    image: app
    ports:
    - name: http
      containerPort: 8080
status:
  phase: Running
  podIP: %s
  podIPs:
  - ip: %s
  - ip: %s
`, p.Name, ns, ns, p.Name, owner, labelBlock("  ", labels), p.Node.Index, sa, p.IPv4, p.IPv4, p.IPv6)
}

// Raw adds a YAML document as is (policies, services).
func (m *Manifest) Raw(doc string) *Manifest {
	m.docs = append(m.docs, strings.TrimSpace(doc)+"\n")
	return m
}

// readyEndpointSlice is the EndpointSlice of Service svc in namespace mesh
// with one ready IPv4 endpoint, addr, on the http port 8080: what the
// EndpointSlice controller writes for a Service in front of one pod's app.
func readyEndpointSlice(svc string, addr netip.Addr) string {
	return fmt.Sprintf(`apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: %s-1
  namespace: mesh
  labels: {kubernetes.io/service-name: %s}
addressType: IPv4
ports:
- {name: http, port: 8080}
endpoints:
- addresses: [%q]
  conditions: {ready: true}
`, svc, svc, addr)
}

// String is the multi-document stream.
func (m *Manifest) String() string { return strings.Join(m.docs, "---\n") }

// Write writes the stream to path atomically (write + rename), as an editor
// or a ConfigMap update would.
func (m *Manifest) Write(path string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(m.String()), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func labelBlock(indent string, labels []string) string {
	if len(labels) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString(indent + "labels:\n")
	for _, l := range labels {
		k, v, _ := strings.Cut(l, "=")
		fmt.Fprintf(&b, "%s  %s: %q\n", indent, k, v)
	}
	return b.String()
}

// strictMesh is a STRICT PeerAuthentication for the namespace mesh.
const strictMesh = `apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: mesh}
spec:
  mtls: {mode: STRICT}`
