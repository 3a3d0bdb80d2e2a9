package manifests

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/releaseutil"
	"helm.sh/helm/v3/pkg/strvals"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

const (
	chartDir         = "charts/redirector"
	releaseName      = "redirector"
	releaseNamespace = "istio-system"
	// peerAuthnAPI is what a cluster with Istio's CRDs serves; tests that render the strict
	// profile pass it as helm template's --api-versions does.
	peerAuthnAPI = "security.istio.io/v1/PeerAuthentication"
)

// peerAuthentication is the part of security.istio.io/v1 PeerAuthentication the chart
// writes. Unknown fields fail the strict decode, as they do for the k8s.io/api types.
type peerAuthentication struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		MTLS struct {
			Mode string `json:"mode"`
		} `json:"mtls"`
	} `json:"spec"`
}

// rendered is one install's objects, each decoded strictly into its API type.
type rendered struct {
	DaemonSet          *appsv1.DaemonSet
	ServiceAccount     *corev1.ServiceAccount
	ConfigMap          *corev1.ConfigMap
	ClusterRole        *rbacv1.ClusterRole
	ClusterRoleBinding *rbacv1.ClusterRoleBinding
	Role               *rbacv1.Role
	RoleBinding        *rbacv1.RoleBinding
	PeerAuthentication *peerAuthentication
	UninstallJob       *batchv1.Job // the pre-delete hook
	// The hook's own account and the one grant it has (names ending -uninstall).
	UninstallServiceAccount *corev1.ServiceAccount
	UninstallRole           *rbacv1.Role
	UninstallRoleBinding    *rbacv1.RoleBinding
	PodMonitor              *podMonitor       // monitoring.podMonitor (monitoring_test.go)
	Dashboards              *corev1.ConfigMap // monitoring.dashboard: the Grafana sidecar's ConfigMap
	Notes                   string
	Manifest                string // the whole rendered manifest, for failure messages
}

// renderOpts are the inputs of one `helm install --dry-run`.
type renderOpts struct {
	set         []string // --set arguments, parsed as the helm CLI parses them
	valuesYAML  string   // the content of a -f file
	apiVersions []string // extra API versions the "cluster" serves
	kubeVersion string   // the "cluster's" version; empty: v1.34.0
}

// chartOnce is the chart loaded once per test binary. Rendering must not change it: a test
// reuses it after another rendered with other values.
var chartOnce = func() func(t *testing.T) *chart.Chart {
	var c *chart.Chart
	var err error
	return func(t *testing.T) *chart.Chart {
		t.Helper()
		if c == nil && err == nil {
			c, err = loader.Load(chartDir)
		}
		if err != nil {
			t.Fatalf("load chart: %v", err)
		}
		return c
	}
}()

// render installs the chart client-only (as `helm template` and `helm install --dry-run`
// do) and decodes the manifest. It returns the install's error instead of failing, for tests
// that expect one.
func render(t *testing.T, o renderOpts) (*rendered, error) {
	t.Helper()
	vals := map[string]any{}
	if o.valuesYAML != "" {
		if err := yaml.Unmarshal([]byte(o.valuesYAML), &vals); err != nil {
			t.Fatalf("values file: %v", err)
		}
	}
	for _, s := range o.set {
		if err := strvals.ParseInto(s, vals); err != nil {
			t.Fatalf("--set %s: %v", s, err)
		}
	}
	install := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
	install.DryRun = true
	install.ClientOnly = true
	install.Replace = true
	install.ReleaseName = releaseName
	install.Namespace = releaseNamespace
	kv := cmp.Or(o.kubeVersion, "v1.34.0")
	parsed, err := chartutil.ParseKubeVersion(kv)
	if err != nil {
		t.Fatalf("kube version %s: %v", kv, err)
	}
	install.KubeVersion = parsed
	install.APIVersions = o.apiVersions
	rel, err := install.Run(chartOnce(t), vals)
	if err != nil {
		return nil, err
	}
	r := &rendered{Notes: rel.Info.Notes, Manifest: rel.Manifest}
	for _, h := range rel.Hooks {
		if err := r.add(h.Manifest); err != nil {
			t.Fatalf("hook %s: %v\n---\n%s", h.Name, err, h.Manifest)
		}
		r.Manifest += "\n---\n" + h.Manifest
	}
	docs := releaseutil.SplitManifests(rel.Manifest)
	keys := make([]string, 0, len(docs))
	for k := range docs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if err := r.add(docs[k]); err != nil {
			t.Fatalf("%v\n---\n%s", err, docs[k])
		}
	}
	return r, nil
}

// mustRender is render for tests that expect success.
func mustRender(t *testing.T, o renderOpts) *rendered {
	t.Helper()
	r, err := render(t, o)
	if err != nil {
		t.Fatalf("render %+v: %v", o, err)
	}
	return r
}

// add decodes one manifest into its typed field. Unknown kinds and duplicates fail: every
// object the chart makes must be known to, and checked by, these tests.
func (r *rendered) add(doc string) error {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
		return fmt.Errorf("read kind: %w", err)
	}
	var meta struct {
		Metadata metav1.ObjectMeta `json:"metadata"`
	}
	if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
		return fmt.Errorf("read metadata: %w", err)
	}
	if strings.HasSuffix(meta.Metadata.Name, "-uninstall") {
		switch tm.APIVersion + "/" + tm.Kind {
		case "v1/ServiceAccount":
			return strictNew(doc, &r.UninstallServiceAccount)
		case "rbac.authorization.k8s.io/v1/Role":
			return strictNew(doc, &r.UninstallRole)
		case "rbac.authorization.k8s.io/v1/RoleBinding":
			return strictNew(doc, &r.UninstallRoleBinding)
		}
	}
	decode := map[string]func() error{
		"apps/v1/DaemonSet":                               func() error { return strictNew(doc, &r.DaemonSet) },
		"v1/ServiceAccount":                               func() error { return strictNew(doc, &r.ServiceAccount) },
		"v1/ConfigMap":                                    func() error { return r.addConfigMap(doc) },
		"monitoring.coreos.com/v1/PodMonitor":             func() error { return strictNew(doc, &r.PodMonitor) },
		"rbac.authorization.k8s.io/v1/ClusterRole":        func() error { return strictNew(doc, &r.ClusterRole) },
		"rbac.authorization.k8s.io/v1/ClusterRoleBinding": func() error { return strictNew(doc, &r.ClusterRoleBinding) },
		"rbac.authorization.k8s.io/v1/Role":               func() error { return strictNew(doc, &r.Role) },
		"rbac.authorization.k8s.io/v1/RoleBinding":        func() error { return strictNew(doc, &r.RoleBinding) },
		"security.istio.io/v1/PeerAuthentication":         func() error { return strictNew(doc, &r.PeerAuthentication) },
		"batch/v1/Job":                                    func() error { return strictNew(doc, &r.UninstallJob) },
	}[tm.APIVersion+"/"+tm.Kind]
	if decode == nil {
		return fmt.Errorf("unexpected object %s %s", tm.APIVersion, tm.Kind)
	}
	return decode()
}

// strictNew decodes doc into a new T: unknown or duplicate fields are errors, as they are
// for kubectl's strict field validation.
func strictNew[T any](doc string, slot **T) error {
	if *slot != nil {
		return fmt.Errorf("second %T in the chart", *slot)
	}
	v := new(T)
	if err := yaml.UnmarshalStrict([]byte(doc), v); err != nil {
		return fmt.Errorf("strict decode into %T: %w", v, err)
	}
	*slot = v
	return nil
}

// profiles lists the chart's profiles from its files/ directory, so that a new profile is
// rendered by the tests without being named in them.
func profiles(t *testing.T) []string {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(chartDir, "files", "profile-*.yaml"))
	if err != nil || len(paths) == 0 {
		t.Fatalf("no profiles in %s/files: %v", chartDir, err)
	}
	var names []string
	for _, p := range paths {
		names = append(names, strings.TrimSuffix(strings.TrimPrefix(filepath.Base(p), "profile-"), ".yaml"))
	}
	slices.Sort(names)
	return names
}

// container returns the pod's container or init container of that name.
func container(t *testing.T, ds *appsv1.DaemonSet, name string) *corev1.Container {
	t.Helper()
	spec := &ds.Spec.Template.Spec
	for _, list := range [][]corev1.Container{spec.InitContainers, spec.Containers} {
		for i := range list {
			if list[i].Name == name {
				return &list[i]
			}
		}
	}
	t.Fatalf("no container %q", name)
	return nil
}

// volume returns the pod volume of that name.
func volume(t *testing.T, ds *appsv1.DaemonSet, name string) *corev1.Volume {
	t.Helper()
	for i, v := range ds.Spec.Template.Spec.Volumes {
		if v.Name == name {
			return &ds.Spec.Template.Spec.Volumes[i]
		}
	}
	t.Fatalf("no volume %q", name)
	return nil
}

// env returns the value of a plain (value:) environment variable of c, and whether it is set.
func env(c *corev1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

// readFile reads a file of the module, failing the test when it cannot.
func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
