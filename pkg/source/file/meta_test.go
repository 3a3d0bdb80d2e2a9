package file

import (
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/source"
)

// TestLoadRefusesMetadataTheAPIServerRefuses: the file source stands in for
// the API server, so a document the API server would refuse (a name,
// namespace, label or annotation it does not admit, a service account that
// is no name, a pod uid that reads as another pod's namespace/name key, a
// policy selector no pod's labels can match) is refused too, naming the
// file, document and field. Taken as written, a namespace labelled
// "ambient " (a stray space) was not ambient, and its pods were enrolled by
// no one, silently; a DENY policy selecting "app: web " selected nothing; a
// pod whose uid was "shop/web" took the key of the uid-less pod shop/web.
func TestLoadRefusesMetadataTheAPIServerRefuses(t *testing.T) {
	pod := func(meta, spec string) string {
		return "apiVersion: v1\nkind: Pod\nmetadata: {" + meta + "}\nspec: {nodeName: n1" + spec + "}\nstatus: {podIP: 10.0.0.9}\n"
	}
	for _, tt := range []struct{ name, doc, field string }{
		{"label value with a space", "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop, labels: {istio.io/dataplane-mode: \"ambient \"}}\n", "metadata.labels"},
		{"label value too long", pod("name: web, namespace: shop, labels: {app: "+strings.Repeat("a", 64)+"}", ""), "metadata.labels"},
		{"label key not a name", pod(`name: web, namespace: shop, labels: {"bad key": x}`, ""), "metadata.labels"},
		{"annotations too large", pod("name: web, namespace: shop, annotations: {a: "+strings.Repeat("a", 300<<10)+"}", ""), "metadata.annotations"},
		{"namespace name in upper case", "apiVersion: v1\nkind: Namespace\nmetadata: {name: Shop}\n", "metadata.name"},
		{"pod name with a slash", pod("name: a/b, namespace: shop", ""), "metadata.name"},
		{"pod namespace with a space", pod(`name: web, namespace: "sh op"`, ""), "metadata.namespace"},
		{"service name not a DNS-1035 label", "apiVersion: v1\nkind: Service\nmetadata: {name: 1web, namespace: shop}\nspec: {clusterIP: 10.96.0.9}\n", "metadata.name"},
		{"policy name in upper case", "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: P, namespace: shop}\nspec: {mtls: {mode: STRICT}}\n", "metadata.name"},
		{"service account with slashes", pod("name: web, namespace: shop", ", serviceAccountName: a/sa/b"), "spec.serviceAccountName"},
		{"pod uid with a slash", pod("name: web, namespace: evil, uid: shop/web", ""), "metadata.uid"},
		{"authorization selector value with a space", "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: deny, namespace: shop}\nspec: {action: DENY, selector: {matchLabels: {app: \"web \"}}, rules: [{}]}\n", "spec.selector.matchLabels"},
		{"peer authentication selector key not a name", "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: p, namespace: shop}\nspec: {selector: {matchLabels: {\"a b\": web}}, mtls: {mode: STRICT}}\n", "spec.selector.matchLabels"},
		{"list item", "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Namespace, metadata: {name: shop, labels: {istio.io/dataplane-mode: \" ambient\"}}}\n", "metadata.labels"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := writeFile(t, t.TempDir(), "c.yaml", namespaceDoc("a")+"---\n"+tt.doc)
			_, errs := Load(path)
			if len(errs) != 1 || errorReason(errs[0]) != source.ReasonInvalid || !strings.Contains(errs[0].Error(), tt.field) ||
				!strings.Contains(errs[0].Error(), "c.yaml: document 2") {
				t.Fatalf("errors = %.400v, want one invalid, at document 2, naming %s", errs, tt.field)
			}
		})
	}
	// What the API server takes loads: a dump's metadata as `kubectl get -o yaml` prints it.
	ok := "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web-7d9f-x2x\n  namespace: shop\n  uid: 0b6f3a4e-1c2d-4e5f-8a9b-0c1d2e3f4a5b\n" +
		"  labels: {app: web, istio.io/dataplane-mode: ambient, pod-template-hash: 7d9f}\n" +
		"  annotations: {kubectl.kubernetes.io/restartedAt: \"2024-01-01T00:00:00Z\"}\n" +
		"  ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, name: web-7d9f, uid: 1b6f3a4e-1c2d-4e5f-8a9b-0c1d2e3f4a5b, controller: true}]\n" +
		"spec: {nodeName: n1, serviceAccountName: web}\nstatus: {podIP: 10.0.0.9}\n"
	if _, errs := Load(writeFile(t, t.TempDir(), "c.yaml", ok)); len(errs) != 0 {
		t.Fatalf("a valid pod refused: %v", errs)
	}
}

// TestLoadRefusesPortsTheAPIServerRefuses: a port the API server would
// refuse (a number no port has, a protocol spelled another way, a named
// targetPort that is no port name, a service port listed twice) is refused
// too, naming the field. Taken as written, a targetPort, slice port or
// container port of 65616 was port 80 to the tunnel, a protocol "tcp" made
// the port no TCP port (every connection to it reset as "no such port"),
// and of two entries for one port the last silently won.
func TestLoadRefusesPortsTheAPIServerRefuses(t *testing.T) {
	svc := func(ports string) string {
		return "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.9, ports: [" + ports + "]}\n"
	}
	slice := func(ports string) string {
		return "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-x, namespace: shop, labels: {kubernetes.io/service-name: web}}\n" +
			"addressType: IPv4\nendpoints: [{addresses: [10.0.0.9]}]\nports: [" + ports + "]\n"
	}
	pod := func(ports string) string {
		return "apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: shop}\nspec: {nodeName: n1, containers: [{name: c, image: x, ports: [" + ports + "]}]}\nstatus: {podIP: 10.0.0.9}\n"
	}
	for _, tt := range []struct{ name, doc, field string }{
		{"service port over 65535", svc("{port: 65616}"), "spec.ports[0].port"},
		{"service port 0", svc("{port: 0}"), "spec.ports[0].port"},
		{"targetPort over 65535", svc("{port: 80, targetPort: 65616}"), "spec.ports[0].targetPort"},
		{"negative targetPort", svc("{port: 80, targetPort: -1}"), "spec.ports[0].targetPort"},
		{"targetPort a number in quotes", svc(`{port: 80, targetPort: "8080"}`), "spec.ports[0].targetPort"},
		{"protocol in lower case", svc("{port: 80, protocol: tcp}"), "spec.ports[0].protocol"},
		{"one port twice", svc("{name: a, port: 80, targetPort: 8080}, {name: b, port: 80, targetPort: 9090}"), "spec.ports[1]"},
		{"one port name twice", svc("{name: a, port: 80}, {name: a, port: 81}"), "spec.ports[1].name"},
		{"two ports, one unnamed", svc("{port: 80}, {name: b, port: 81}"), "spec.ports[0].name"},
		{"slice port over 65535", slice("{name: http, port: 65616}"), "ports[0].port"},
		{"slice protocol in lower case", slice("{name: http, port: 80, protocol: tcp}"), "ports[0].protocol"},
		{"container port over 65535", pod("{name: http, containerPort: 65616}"), "spec.containers[0].ports[0].containerPort"},
		{"container port name not a port name", pod("{name: HTTP, containerPort: 8080}"), "spec.containers[0].ports[0].name"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := writeFile(t, t.TempDir(), "c.yaml", namespaceDoc("shop")+"---\n"+tt.doc)
			_, errs := Load(path)
			if len(errs) != 1 || errorReason(errs[0]) != source.ReasonInvalid || !strings.Contains(errs[0].Error(), tt.field) ||
				!strings.Contains(errs[0].Error(), "c.yaml: document 2") {
				t.Fatalf("errors = %.400v, want one invalid, at document 2, naming %s", errs, tt.field)
			}
		})
	}
	// What the API server takes loads: a named targetPort, a UDP twin of a
	// TCP port, a port with no targetPort, a slice port without a number.
	ok := namespaceDoc("shop") + "---\n" +
		svc(`{name: dns, port: 53, protocol: UDP, targetPort: 5353}, {name: dns-tcp, port: 53, targetPort: dns-tcp}, {name: web, port: 80}`) + "---\n" +
		slice(`{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5353}, {name: web}`) + "---\n" +
		pod(`{name: dns-tcp, containerPort: 5353}, {containerPort: 8080}`)
	if _, errs := Load(writeFile(t, t.TempDir(), "c.yaml", ok)); len(errs) != 0 {
		t.Fatalf("valid ports refused: %v", errs)
	}
}

// TestRunKeepsEnrollmentOverAnInvalidLabel: a running source whose ambient
// namespace's label is edited to a value the API server refuses ("ambient "
// with a stray space) does not deliver it, which would unenroll every pod of
// the namespace: the load is refused naming the field, and the last good
// snapshot stays.
func TestRunKeepsEnrollmentOverAnInvalidLabel(t *testing.T) {
	ns := func(mode string) string {
		return "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: a, labels: {istio.io/dataplane-mode: \"" + mode + "\"}}\n"
	}
	pod := "---\napiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: a, uid: uid-web}\nspec: {nodeName: node1}\nstatus: {podIP: 10.0.0.5}\n"
	dir := t.TempDir()
	path := writeFile(t, dir, "c.yaml", ns("ambient")+pod)
	m := source.NewMetrics(nil)
	r := startWith(t, New(path, nil).WithMetrics(m))
	r.waitFor(t, "a")

	writeFile(t, dir, "c.yaml", ns("ambient ")+pod)
	r.noUpdate(t, 300*time.Millisecond)
	errs := r.refused(t)
	// The first error names the field; the namespace's absence from the
	// refused load is reported after it.
	if len(errs) == 0 || !strings.Contains(errs[0].Error(), "c.yaml: document 1") || !strings.Contains(errs[0].Error(), "metadata.labels") {
		t.Fatalf("Errors() = %v, want document 1's metadata.labels named", errs)
	}
	wantCount(t, m, source.ReasonInvalid, float64(len(errs)))
}
