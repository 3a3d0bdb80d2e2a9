package netnstest

import (
	"fmt"
	"os"
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
	m.docs = append(m.docs, fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %s
  namespace: %s
  uid: uid-%s-%s
%sspec:
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
`, p.Name, ns, ns, p.Name, labelBlock("  ", labels), p.Node.Index, sa, p.IPv4, p.IPv4, p.IPv6))
	return m
}

// Raw adds a YAML document as is (policies, services).
func (m *Manifest) Raw(doc string) *Manifest {
	m.docs = append(m.docs, strings.TrimSpace(doc)+"\n")
	return m
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
