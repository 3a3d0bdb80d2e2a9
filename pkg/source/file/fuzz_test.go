package file

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
)

// maxFuzzManifest bounds a fuzzed manifest, so that executions stay fast.
const maxFuzzManifest = 64 << 10

// FuzzFileManifest writes the input as one manifest file, loads it and
// translates what loaded. Whatever the bytes, nothing panics, every load
// error is a *DocError or *FileError that names the file (and a document's
// place in it), and every translation error names its object.
func FuzzFileManifest(f *testing.F) {
	const pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: web-1, namespace: shop, uid: u1}\nspec: {nodeName: node-a}\nstatus: {phase: Running, podIP: 10.0.0.5}\n"
	for _, seed := range []string{
		everyKind,
		strings.TrimSuffix(everyKind, "\n"),
		pod,
		"apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Namespace, metadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}}\n- " +
			"{apiVersion: v1, kind: Pod, metadata: {name: a, namespace: shop}, status: {podIPs: [{ip: 10.0.0.6}, {ip: fd00::6}]}}\n",
		"apiVersion: v1\nkind: List\nitems: []\n",
		"apiVersion: v1\nkind: Namespace\nmetadata: {name: shop, labels: &l {app: web}, annotations: *l}\nx: &s abcdef\ny: [*s, *s, *s]\n",
		"apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: strict, namespace: shop}\nspec:\n  mtls: {mode: STRICT}\n" +
			"---\napiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: deny, namespace: shop}\n" +
			"spec: {action: DENY, selector: {matchLabels: {app: web}}, rules: [{from: [{source: {ipBlocks: [10.0.0.0/8]}}]}]}\n...\n",
		"apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}\n" +
			"---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-x, namespace: shop, labels: {kubernetes.io/service-name: web}}\n" +
			"addressType: IPv4\nendpoints: [{addresses: [169.254.169.254]}]\n",
		"apiVersion: v1\nkind: Namespace\nmetadata: {name: shop, annotations: {networking.istio.io/traffic-distribution: PreferSameNode}, labels: {istio.io/use-waypoint: wp}}\n" +
			"---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: web-7d9f-x2x\n  generateName: web-7d9f-\n  namespace: shop\n  uid: 0b6f3a4e-1c2d-4e5f-8a9b-0c1d2e3f4a5b\n" +
			"  labels: {app: web, pod-template-hash: 7d9f}\n" +
			"  ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, name: web-7d9f, uid: 1b6f3a4e-1c2d-4e5f-8a9b-0c1d2e3f4a5b, controller: true}]\n" +
			"spec: {nodeName: n1, serviceAccountName: web, runtimeClassName: kata}\nstatus: {podIP: 10.0.0.9}\n" +
			"---\napiVersion: v1\nkind: Service\nmetadata: {name: wp, namespace: shop, labels: {istio.io/waypoint-for: all}}\n" +
			"spec: {clusterIP: 10.96.0.20, clusterIPs: [10.96.0.20, fd00:96::20], internalTrafficPolicy: Local, ports: [{port: 15008, appProtocol: hbone}]}\n" +
			"---\napiVersion: node.k8s.io/v1\nkind: RuntimeClass\nmetadata: {name: kata}\nhandler: kata-qemu\n",
		"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: a, namespace: shop, labels: {kubernetes.io/service-name: web}}\n" +
			"addressType: IPv6\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [\"fd00::5\"], nodeName: n1, conditions: {ready: false}}]\n" +
			"---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: b, namespace: shop, labels: {kubernetes.io/service-name: web}}\n" +
			"addressType: IPv6\nports: [{name: grpc, port: 9090}]\nendpoints: [{addresses: [\"fd00::5\"]}, {addresses: [\"::ffff:10.0.0.7\"]}]\n" +
			"---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop, annotations: {networking.istio.io/traffic-distribution: Nearby}}\nspec: {clusterIP: None}\n",
		// Broken: the same pod twice, a pod without a name, an address
		// that does not parse, content after a separator or end marker.
		pod + "---\n" + pod,
		"apiVersion: v1\nkind: Pod\nmetadata: {namespace: shop}\n",
		strings.Replace(pod, "10.0.0.5", "10.0.0.05", 1),
		"--- {apiVersion: v1}\n",
		"apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n...\nkind: Pod\n",
		"apiVersion: v1\nkind: Pod\nmetadata: {name: [b\n",
		"\tapiVersion: v1\n",
		"# only a comment\n",
	} {
		f.Add([]byte(seed))
	}
	dir := f.TempDir()
	path := filepath.Join(dir, "manifest.yaml")
	cfg, err := selection.ParseConfig("kube-system", "")
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > maxFuzzManifest {
			t.Skip("over the size bound")
		}
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
		objs, errs := Load(path)
		lines := bytes.Count(data, []byte("\n")) + 1
		for _, err := range errs {
			checkLoadError(t, path, lines, err)
		}
		_, errs = kubeobj.Translate(objs, cfg)
		names := objectNames(objs)
		for _, err := range errs {
			if err == nil || !slices.ContainsFunc(names, func(n string) bool { return strings.HasPrefix(err.Error(), n+": ") }) {
				t.Fatalf("translation error %q names none of the objects %q", err, names)
			}
		}
	})
}

// checkLoadError asserts what Load promises of an error (see DocError and
// FileError).
func checkLoadError(t *testing.T, path string, lines int, err error) {
	t.Helper()
	if err == nil {
		t.Fatal("nil error")
	}
	if !strings.HasPrefix(err.Error(), path+": ") || len(err.Error()) == len(path)+2 {
		t.Fatalf("error %q does not name the file %s, then what is wrong", err, path)
	}
	var de *DocError
	var fe *FileError
	switch {
	case errors.As(err, &de):
		if de.File != path || de.Err == nil || de.Doc < 1 || de.Line < 1 || de.Line > lines || de.Item < 0 ||
			(de.Reason != source.ReasonParse && de.Reason != source.ReasonInvalid) {
			t.Fatalf("document error %q: file %s, document %d, line %d of %d, item %d, reason %q",
				err, de.File, de.Doc, de.Line, lines, de.Item, de.Reason)
		}
	case errors.As(err, &fe):
		if fe.File != path || fe.Err == nil || !slices.Contains([]string{source.ReasonRead, source.ReasonTooLarge,
			source.ReasonTruncated, source.ReasonEmpty, source.ReasonInvalid}, fe.Reason) {
			t.Fatalf("file error %q: file %s, reason %q", err, fe.File, fe.Reason)
		}
	default:
		t.Fatalf("error %q (%T) is neither a *DocError nor a *FileError", err, err)
	}
}

// objectNames are how translation errors name the objects of objs:
// "pod shop/web-1".
func objectNames(objs kubeobj.Objects) []string {
	var names []string
	for i := range objs.Pods {
		names = append(names, "pod "+objs.Pods[i].Namespace+"/"+objs.Pods[i].Name)
	}
	for i := range objs.Services {
		names = append(names, "service "+objs.Services[i].Namespace+"/"+objs.Services[i].Name)
	}
	for i := range objs.EndpointSlices {
		names = append(names, "endpointslice "+objs.EndpointSlices[i].Namespace+"/"+objs.EndpointSlices[i].Name)
	}
	return names
}
