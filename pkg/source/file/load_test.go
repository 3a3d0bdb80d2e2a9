package file

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

const everyKind = `# the demo cluster
apiVersion: v1
kind: Namespace
metadata:
  name: shop
  labels:
    istio.io/dataplane-mode: ambient
---
apiVersion: v1
kind: Node
metadata:
  name: node-a
  labels: {topology.kubernetes.io/region: eu-west, topology.kubernetes.io/zone: eu-west-1a}
---
apiVersion: v1
kind: Pod
metadata:
  name: web-1
  namespace: shop
  labels: {app: web}
spec:
  nodeName: node-a
  serviceAccountName: web
  containers:
  - name: web
    image: nginx
    ports:
    - {name: http, containerPort: 8080}
status:
  phase: Running
  podIP: 10.0.0.5
  podIPs:
  - ip: 10.0.0.5
  - ip: fd00::5
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  selector: {app: web}
  trafficDistribution: PreferClose
  ports:
  - {name: http, port: 80, targetPort: http}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
endpoints:
- addresses: [10.0.0.5]
  conditions: {ready: true}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: shop}
spec:
  mtls: {mode: STRICT}
  portLevelMtls:
    8080: {mode: PERMISSIVE}
---
apiVersion: security.istio.io/v1beta1
kind: AuthorizationPolicy
metadata: {name: allow-front, namespace: shop}
spec:
  selector:
    matchLabels: {app: web}
  action: ALLOW
  rules:
  - from:
    - source:
        principals: [cluster.local/ns/shop/sa/front]
    to:
    - operation:
        ports: ["8080"]
`

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestLoadEveryKind(t *testing.T) {
	path := writeFile(t, t.TempDir(), "cluster.yaml", everyKind)
	snap, errs := Load(path)
	if len(errs) > 0 {
		t.Fatalf("errors: %v", errs)
	}
	if len(snap.Namespaces) != 1 || snap.Namespaces[0].Labels["istio.io/dataplane-mode"] != "ambient" {
		t.Errorf("namespaces = %+v", snap.Namespaces)
	}
	if len(snap.Pods) != 1 {
		t.Fatalf("pods = %d, want 1", len(snap.Pods))
	}
	pod := snap.Pods[0]
	if pod.Spec.NodeName != "node-a" || pod.Status.PodIP != "10.0.0.5" || len(pod.Status.PodIPs) != 2 ||
		pod.Status.PodIPs[1].IP != "fd00::5" || pod.Spec.Containers[0].Ports[0].ContainerPort != 8080 {
		t.Errorf("pod = %+v", pod)
	}
	if len(snap.Nodes) != 1 || snap.Nodes[0].Namespace != "" || snap.Nodes[0].Labels["topology.kubernetes.io/zone"] != "eu-west-1a" {
		t.Errorf("nodes = %+v", snap.Nodes)
	}
	if len(snap.Services) != 1 || snap.Services[0].Spec.ClusterIP != "10.96.0.10" || snap.Services[0].Spec.Ports[0].TargetPort.StrVal != "http" ||
		*snap.Services[0].Spec.TrafficDistribution != "PreferClose" {
		t.Errorf("services = %+v", snap.Services)
	}
	if len(snap.EndpointSlices) != 1 || snap.EndpointSlices[0].Endpoints[0].Addresses[0] != "10.0.0.5" ||
		*snap.EndpointSlices[0].Ports[0].Port != 8080 {
		t.Errorf("endpointslices = %+v", snap.EndpointSlices)
	}
	if len(snap.PeerAuthentications) != 1 {
		t.Fatalf("peerauthentications = %d, want 1", len(snap.PeerAuthentications))
	}
	pa := snap.PeerAuthentications[0].Spec
	if pa.MTLS.Mode != policy.ModeStrict || pa.PortLevelMTLS[8080].Mode != policy.ModePermissive {
		t.Errorf("peerauthentication spec = %+v", pa)
	}
	if len(snap.AuthorizationPolicies) != 1 {
		t.Fatalf("authorizationpolicies = %d, want 1", len(snap.AuthorizationPolicies))
	}
	ap := snap.AuthorizationPolicies[0]
	if ap.APIVersion != "security.istio.io/v1beta1" || ap.Spec.Action != policy.ActionAllow ||
		ap.Spec.Rules[0].From[0].Source.Principals[0] != "cluster.local/ns/shop/sa/front" ||
		ap.Spec.Rules[0].To[0].Operation.Ports[0] != "8080" {
		t.Errorf("authorizationpolicy = %+v", ap)
	}
}

// TestLoadIstioFieldsL4DoesNotEnforce: fields of a valid Istio manifest
// that the node does not enforce (a CUSTOM policy's provider, trustDomains)
// still load; refusing them would refuse the whole load.
func TestLoadIstioFieldsL4DoesNotEnforce(t *testing.T) {
	path := writeFile(t, t.TempDir(), "policies.yaml", `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: ext-authz, namespace: shop}
spec:
  action: CUSTOM
  provider: {name: my-authz}
  rules: [{to: [{operation: {paths: [/admin]}}]}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: td, namespace: shop}
spec:
  rules: [{from: [{source: {trustDomains: [cluster.local], notTrustDomains: [old.example]}}]}]
`)
	snap, errs := Load(path)
	if len(errs) > 0 {
		t.Fatalf("errors: %v", errs)
	}
	if len(snap.AuthorizationPolicies) != 2 {
		t.Fatalf("authorizationpolicies = %d, want 2", len(snap.AuthorizationPolicies))
	}
	if p := snap.AuthorizationPolicies[0].Spec.Provider; p == nil || p.Name != "my-authz" {
		t.Errorf("provider = %+v", p)
	}
	if s := snap.AuthorizationPolicies[1].Spec.Rules[0].From[0].Source; s.TrustDomains[0] != "cluster.local" || s.NotTrustDomains[0] != "old.example" {
		t.Errorf("source = %+v", s)
	}
}

func TestLoadListSortAndDefaults(t *testing.T) {
	const list = `apiVersion: v1
kind: List
metadata: {resourceVersion: ""}
items:
- apiVersion: v1
  kind: Pod
  metadata: {name: b, namespace: x}
- apiVersion: v1
  kind: Pod
  metadata: {name: a, namespace: x}
- apiVersion: v1
  kind: Pod
  metadata: {name: z}
- apiVersion: v1
  kind: Secret
  metadata: {name: s}
---
apiVersion: v1
kind: Namespace
metadata: {name: x, namespace: ignored}
`
	path := writeFile(t, t.TempDir(), "list.yaml", list)
	snap, errs := Load(path)
	var got []string
	for _, p := range snap.Pods {
		got = append(got, p.Namespace+"/"+p.Name)
	}
	if strings.Join(got, " ") != "default/z x/a x/b" {
		t.Errorf("pods = %v, want sorted, namespace defaulted", got)
	}
	if len(snap.Namespaces) != 1 || snap.Namespaces[0].Namespace != "" {
		t.Errorf("namespaces = %+v", snap.Namespaces)
	}
	wantErrs(t, errs, path+": document 1 (line 1) item 4: unsupported kind Secret in apiVersion v1")
}

func TestLoadMalformed(t *testing.T) {
	pod := func(name string) string {
		return "apiVersion: v1\nkind: Pod\nmetadata: {name: " + name + ", namespace: shop}\n"
	}
	tests := []struct {
		name     string
		stream   string
		wantPods string
		wantErrs []string
	}{
		{
			name:     "syntax error in document 2 of 3",
			stream:   pod("a") + "---\napiVersion: v1\nkind: Pod\nmetadata: {name: [b\n---\n" + pod("c"),
			wantPods: "a c",
			wantErrs: []string{"document 2 (line 5): error converting YAML to JSON"},
		},
		{
			name:     "unknown kind",
			stream:   pod("a") + "---\napiVersion: v1\nkind: Frobnicator\nmetadata: {name: f}\n---\n" + pod("c"),
			wantPods: "a c",
			wantErrs: []string{"document 2 (line 5): unsupported kind Frobnicator in apiVersion v1"},
		},
		{
			name:     "kind in the wrong group",
			stream:   "apiVersion: v1\nkind: EndpointSlice\nmetadata: {name: e}\n",
			wantErrs: []string{"document 1 (line 1): unsupported kind EndpointSlice in apiVersion v1"},
		},
		{
			name:     "unknown field",
			stream:   pod("a") + "---\n" + pod("b") + "spec:\n  unknownField: 1\n---\n" + pod("c"),
			wantPods: "a c",
			wantErrs: []string{`document 2 (line 5): strict decoding: unknown field "spec.unknownField"`},
		},
		{
			name:     "bad field type",
			stream:   pod("a") + "spec:\n  hostNetwork: maybe\n",
			wantErrs: []string{"document 1 (line 1): decode: json: cannot unmarshal string into Go struct field PodSpec.spec.hostNetwork of type bool"},
		},
		{
			// As kubectl sends it: the API server refuses it too.
			name:     "unquoted number where a string belongs",
			stream:   "apiVersion: v1\nkind: Pod\nmetadata: {name: a, namespace: shop, labels: {version: 1}}\n",
			wantErrs: []string{"document 1 (line 1): decode: json: cannot unmarshal number into Go struct field ObjectMeta.metadata.labels of type string"},
		},
		{
			name:     "missing name",
			stream:   "apiVersion: v1\nkind: Pod\nmetadata: {namespace: shop}\n---\n" + pod("b"),
			wantPods: "b",
			wantErrs: []string{"document 1 (line 1): metadata.name is required"},
		},
		{
			name:     "missing kind",
			stream:   "apiVersion: v1\nmetadata: {name: x}\n",
			wantErrs: []string{"document 1 (line 1): apiVersion and kind are required"},
		},
		{
			name:     "not a mapping",
			stream:   "- a\n- b\n---\n" + pod("b"),
			wantPods: "b",
			wantErrs: []string{"document 1 (line 1): error unmarshaling JSON"},
		},
		{
			name:     "traffic distribution the API server refuses",
			stream:   pod("a") + "---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {trafficDistribution: Nearby}\n",
			wantPods: "a",
			wantErrs: []string{`document 2 (line 5): spec.trafficDistribution: Unsupported value: "Nearby"`},
		},
		{
			name:     "duplicate",
			stream:   pod("a") + "---\n" + pod("a"),
			wantPods: "a",
			wantErrs: []string{"document 2 (line 5): duplicate Pod shop/a, first defined in "},
		},
		{
			name:     "blank and comment-only documents are not counted",
			stream:   "---\n# nothing\n---\n\n---\n" + pod("a") + "---\nkind: Pod\n",
			wantPods: "a",
			wantErrs: []string{"document 2 (line 10): apiVersion and kind are required"},
		},
		{
			name:     "content after separator",
			stream:   pod("a") + "--- kind: Pod\n" + "---  # fine\n" + pod("c"),
			wantPods: "a c",
			wantErrs: []string{`document 2 (line 4): content after a "---" separator on the same line is not supported`},
		},
		{
			name:     "CRLF line endings",
			stream:   strings.ReplaceAll(pod("a")+"---\n"+pod("b"), "\n", "\r\n"),
			wantPods: "a b",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := writeFile(t, t.TempDir(), "c.yaml", tt.stream)
			snap, errs := Load(path)
			if got := podNames(snap.Pods); got != tt.wantPods {
				t.Errorf("pods = %q, want %q", got, tt.wantPods)
			}
			var want []string
			for _, w := range tt.wantErrs {
				want = append(want, path+": "+w)
			}
			wantErrs(t, errs, want...)
			for _, err := range errs {
				var de *DocError
				if !errors.As(err, &de) || de.File != path {
					t.Errorf("error %v is not a *DocError for %s", err, path)
				}
			}
		})
	}
}

func TestLoadDirectory(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "b.yml", "apiVersion: v1\nkind: Namespace\nmetadata: {name: b}\n")
	a := writeFile(t, dir, "a.yaml", "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\nkind: Oops\napiVersion: v9\n")
	writeFile(t, dir, "notes.txt", "not yaml at all: [")
	writeFile(t, dir, ".#a.yaml", "not yaml at all: [") // an editor lock file
	if err := os.Mkdir(filepath.Join(dir, "sub.yaml"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/nonexistent", filepath.Join(dir, "dangling.yaml")); err != nil {
		t.Fatal(err)
	}
	snap, errs := Load(dir)
	if len(snap.Namespaces) != 2 || snap.Namespaces[0].Name != "a" || snap.Namespaces[1].Name != "b" {
		t.Errorf("namespaces = %+v", snap.Namespaces)
	}
	// A manifest name that holds no file is an error, not skipped (a file
	// replaced by one must not read as removed).
	wantErrs(t, errs, a+": document 2 (line 5): unsupported kind Oops in apiVersion v9",
		filepath.Join(dir, "dangling.yaml")+": not a regular file: a symlink to nothing",
		filepath.Join(dir, "sub.yaml")+": not a regular file: a directory")
}

func TestLoadDuplicateAcrossFiles(t *testing.T) {
	dir := t.TempDir()
	a := writeFile(t, dir, "a.yaml", "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n")
	b := writeFile(t, dir, "b.yaml", "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n")
	snap, errs := Load(dir)
	if len(snap.Namespaces) != 1 {
		t.Errorf("namespaces = %+v", snap.Namespaces)
	}
	wantErrs(t, errs, b+": document 1 (line 1): duplicate Namespace x, first defined in "+a+" document 1 (line 1)")
}

func TestLoadMissing(t *testing.T) {
	snap, errs := Load(filepath.Join(t.TempDir(), "nope.yaml"))
	if len(errs) != 1 || !errors.Is(errs[0], os.ErrNotExist) {
		t.Fatalf("errors = %v, want one not-exist error", errs)
	}
	if len(snap.Pods)+len(snap.Namespaces) != 0 {
		t.Errorf("snapshot not empty: %+v", snap)
	}
}

func podNames(pods []corev1.Pod) string {
	var names []string
	for _, p := range pods {
		names = append(names, p.Name)
	}
	return strings.Join(names, " ")
}

// wantErrs checks that errs has one error per prefix, in order.
func wantErrs(t *testing.T, errs []error, prefixes ...string) {
	t.Helper()
	if len(errs) != len(prefixes) {
		t.Fatalf("got %d errors %v, want %d", len(errs), errs, len(prefixes))
	}
	for i, err := range errs {
		if !strings.HasPrefix(err.Error(), prefixes[i]) {
			t.Errorf("error %d = %q\nwant prefix  %q", i, err, prefixes[i])
		}
	}
}

// TestLoadFieldNamesCaseSensitive: field names match as the API server
// matches them, case-sensitively, and a field given twice is an error.
// encoding/json (behind sigs.k8s.io/yaml) matches any case and keeps the
// last: a pod with "hostNetwork: false" then "hostnetwork: true" was read
// as hostNetwork (so left out of the mesh), where Kubernetes refuses the
// field; a reader of the manifest sees one thing, the agent did another.
func TestLoadFieldNamesCaseSensitive(t *testing.T) {
	ns := "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}\n---\n"
	for _, tt := range []struct{ name, doc, field string }{
		{"pod field in another case", "apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: shop}\nspec: {hostNetwork: false, hostnetwork: true}\n", "hostnetwork"},
		{"metadata field in another case", "apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: shop, Labels: {istio.io/dataplane-mode: none}}\n", "Labels"},
		{"policy field in another case", "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: p, namespace: shop}\nspec: {action: DENY, Action: ALLOW}\n", "Action"},
		{"list item field in another case", "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Pod, metadata: {name: web, namespace: shop}, Spec: {hostNetwork: true}}\n", "Spec"},
		{"duplicate in a list item", "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Pod, metadata: {name: web, namespace: shop}, spec: {hostNetwork: false}, spec: {hostNetwork: true}}\n", "spec"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := writeFile(t, t.TempDir(), "c.yaml", ns+tt.doc)
			_, errs := Load(path)
			if len(errs) != 1 || errorReason(errs[0]) != "invalid" || !strings.Contains(errs[0].Error(), tt.field+`"`) {
				t.Fatalf("errors = %v, want one invalid naming %s", errs, tt.field)
			}
		})
	}
}

// TestLoadYAMLBombs: an alias bomb ("billion laughs") and deep nesting are
// refused by the decoder, quickly, as invalid documents; the rest loads. A
// guard (not a change): the YAML decoder bounds aliasing and depth.
func TestLoadYAMLBombs(t *testing.T) {
	bomb := "apiVersion: v1\nkind: Namespace\nmetadata: {name: bomb}\nx0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
	for i := 1; i < 10; i++ {
		bomb += fmt.Sprintf("x%d: &x%d [%s]\n", i, i, strings.TrimSuffix(strings.Repeat(fmt.Sprintf("*x%d, ", i-1), 9), ", "))
	}
	deep := "apiVersion: v1\nkind: Namespace\nmetadata: {name: deep}\nx: " + strings.Repeat("[", 100000) + strings.Repeat("]", 100000) + "\n"
	path := writeFile(t, t.TempDir(), "c.yaml", namespaceDoc("a")+"---\n"+bomb+"---\n"+deep)
	start := time.Now()
	snap, errs := Load(path)
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Load took %v", d)
	}
	if len(errs) != 2 || !strings.Contains(errs[0].Error(), "excessive aliasing") || !strings.Contains(errs[1].Error(), "exceeded max depth") {
		t.Errorf("errors = %v, want the bomb and the nesting refused", errs)
	}
	if got := nsNames(snap); got != "a" {
		t.Errorf("namespaces = %q, want a", got)
	}
}

// TestDanglingEnd: a file whose last line opens a value that never comes
// is cut short; every other ending is not.
func TestDanglingEnd(t *testing.T) {
	for data, want := range map[string]bool{
		"metadata:\n  labels:\n":            true,
		"metadata:\n  labels:\r\n":          true,
		"metadata:\n  labels: # none\n\n":   true,
		"items:\n- a\n-\n":                  true,
		"items:\n- name:\n":                 true,
		"annotations:\n  note: |\n":         true,
		"annotations:\n  note: >-\n# end\n": true,
		"metadata:\n  name: a\n":            false,
		"spec: {}\n":                        false,
		"items:\n- a\n":                     false,
		"key: \"a #b:\"\n":                  false,
		"key: 'x:'\n":                       false,
		"url: http://x\n":                   false,
		"kind: Namespace\n---\n":            false,
		"kind: Namespace\n...\n":            false,
		"kind: Namespace\n# a comment:\n":   false,
		"note: |\n  text:\n  more\n":        false,
		"note: a > b\n":                     false,
		"":                                  false,
		"\n\n":                              false,
		"labels:":                           true, // without its newline: refused for that already
	} {
		if _, got := danglingEnd([]byte(data)); got != want {
			t.Errorf("danglingEnd(%q) = %v, want %v", data, got, want)
		}
	}
}
