package manifests

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	k8ssource "github.com/redirector-mesh/redirector/pkg/source/kubernetes"
	"github.com/redirector-mesh/redirector/pkg/source/nodepods"
	"github.com/redirector-mesh/redirector/pkg/workload"
	"github.com/redirector-mesh/redirector/test/kubetest"
)

// Tests against a real kube-apiserver (test/kubetest): what a render cannot show, that the
// API server accepts every object (its validation rejects, for example, Bidirectional
// propagation in an unprivileged container), and that the chart's RBAC lets the agent's own
// Kubernetes code do its work.

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

const clusterTimeout = 30 * time.Second

func startCluster(t *testing.T) (*kubetest.Cluster, kubernetes.Interface, dynamic.Interface) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts kube-apiserver and etcd; skipped with -short")
	}
	c := kubetest.Start(t)
	dyn, err := dynamic.NewForConfig(c.Config)
	if err != nil {
		t.Fatal(err)
	}
	// Istio's policy CRDs, as the agent's source tests install them.
	for _, f := range []string{"crd-peerauthentication.yaml", "crd-authorizationpolicy.yaml"} {
		createUnstructured(t, dyn, crdGVR, readFile(t, filepath.Join(repoRoot, "pkg/source/kubernetes/testdata", f)))
	}
	waitServed(t, c.Config, "security.istio.io/v1", "peerauthentications")
	client := c.Client(t)
	for _, ns := range []string{releaseNamespace, "apps"} {
		if _, err := client.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	return c, client, dyn
}

func createUnstructured(t *testing.T, dyn dynamic.Interface, gvr schema.GroupVersionResource, manifest string) {
	t.Helper()
	var u unstructured.Unstructured
	if err := yaml.Unmarshal([]byte(manifest), &u.Object); err != nil {
		t.Fatal(err)
	}
	if _, err := dyn.Resource(gvr).Namespace(u.GetNamespace()).Create(t.Context(), &u, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("create %s %s: %v", gvr.Resource, u.GetName(), err)
	}
}

func waitServed(t *testing.T, cfg *rest.Config, groupVersion, resource string) {
	t.Helper()
	disc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(clusterTimeout); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		list, err := disc.ServerResourcesForGroupVersion(groupVersion)
		if err == nil && slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Name == resource }) {
			return
		}
	}
	t.Fatalf("%s %s not served after %v", groupVersion, resource, clusterTimeout)
}

// apply creates every object of r, with strict field validation; dryRun leaves the cluster
// as it was.
func apply(t *testing.T, client kubernetes.Interface, dyn dynamic.Interface, r *rendered, dryRun bool) {
	t.Helper()
	ctx := t.Context()
	opts := metav1.CreateOptions{FieldValidation: "Strict"}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	check := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("the API server refuses the %s: %v", what, err)
		}
	}
	_, err := client.CoreV1().ServiceAccounts(releaseNamespace).Create(ctx, r.ServiceAccount, opts)
	check("ServiceAccount", err)
	_, err = client.CoreV1().ConfigMaps(releaseNamespace).Create(ctx, r.ConfigMap, opts)
	check("ConfigMap", err)
	_, err = client.RbacV1().ClusterRoles().Create(ctx, r.ClusterRole, opts)
	check("ClusterRole", err)
	_, err = client.RbacV1().ClusterRoleBindings().Create(ctx, r.ClusterRoleBinding, opts)
	check("ClusterRoleBinding", err)
	_, err = client.RbacV1().Roles(releaseNamespace).Create(ctx, r.Role, opts)
	check("Role", err)
	_, err = client.RbacV1().RoleBindings(releaseNamespace).Create(ctx, r.RoleBinding, opts)
	check("RoleBinding", err)
	_, err = client.CoreV1().ServiceAccounts(releaseNamespace).Create(ctx, r.UninstallServiceAccount, opts)
	check("the hook's ServiceAccount", err)
	_, err = client.RbacV1().Roles(releaseNamespace).Create(ctx, r.UninstallRole, opts)
	check("the hook's Role", err)
	_, err = client.RbacV1().RoleBindings(releaseNamespace).Create(ctx, r.UninstallRoleBinding, opts)
	check("the hook's RoleBinding", err)
	_, err = client.AppsV1().DaemonSets(releaseNamespace).Create(ctx, r.DaemonSet, opts)
	check("DaemonSet", err)
	_, err = client.BatchV1().Jobs(releaseNamespace).Create(ctx, r.UninstallJob, opts)
	check("pre-delete hook Job", err)
	if pa := r.PeerAuthentication; pa != nil {
		obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(pa)
		if err != nil {
			t.Fatal(err)
		}
		gvr := schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: "peerauthentications"}
		_, err = dyn.Resource(gvr).Namespace(pa.Namespace).Create(ctx, &unstructured.Unstructured{Object: obj}, opts)
		check("PeerAuthentication", err)
	}
}

// TestAPIServerAcceptsEveryProfile creates each profile's objects in dry-run mode, so the API
// server's own validation judges them.
func TestAPIServerAcceptsEveryProfile(t *testing.T) {
	_, client, dyn := startCluster(t)
	for _, p := range profiles(t) {
		t.Run(p, func(t *testing.T) {
			apply(t, client, dyn, mustRender(t, renderOpts{set: []string{"profile=" + p}, apiVersions: []string{peerAuthnAPI}}), true)
		})
	}
	// The check is real: the API server refuses Bidirectional propagation in the agent.
	r := mustRender(t, renderOpts{})
	agent := container(t, r.DaemonSet, "agent")
	bidirectional := corev1.MountPropagationBidirectional
	agent.VolumeMounts[0].MountPropagation = &bidirectional
	_, err := client.AppsV1().DaemonSets(releaseNamespace).Create(t.Context(), r.DaemonSet,
		metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	if !apierrors.IsInvalid(err) {
		t.Errorf("an unprivileged agent with a Bidirectional mount was not refused: %v", err)
	}
}

// installAsAgent installs the chart rendered with opts into a new cluster, with a pod web in
// namespace apps on node-a, and returns the cluster, an admin client, the render, and a
// config that authenticates as the DaemonSet's pods do (its ServiceAccount).
func installAsAgent(t *testing.T, opts renderOpts) (*kubetest.Cluster, kubernetes.Interface, *rendered, *rest.Config) {
	t.Helper()
	c, client, dyn := startCluster(t)
	r := mustRender(t, opts)
	apply(t, client, dyn, r, false)
	if t.Failed() {
		t.FailNow()
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "apps"},
		Spec:       corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "web", Image: "web"}}},
	}
	if _, err := client.CoreV1().Pods("apps").Create(t.Context(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	asAgent := rest.CopyConfig(c.Config)
	asAgent.Impersonate = rest.ImpersonationConfig{
		UserName: fmt.Sprintf("system:serviceaccount:%s:%s", releaseNamespace, r.ServiceAccount.Name),
	}
	return c, client, r, asAgent
}

// firstUpdate runs run until its first update and returns it. A run that stops, or no update
// before ctx ends, fails t: as the agent, that is an informer its RBAC does not let list or
// watch.
func firstUpdate[T any](ctx context.Context, t *testing.T, what string, run func(context.Context, func(T)) error) T {
	t.Helper()
	first := make(chan T, 1)
	runErr := make(chan error, 1)
	go func() {
		runErr <- run(ctx, func(v T) {
			select {
			case first <- v:
			default:
			}
		})
	}()
	select {
	case v := <-first:
		return v
	case err := <-runErr:
		t.Fatalf("%s: the watch stopped as the agent: %v", what, err)
	case <-ctx.Done():
		t.Fatalf("no %s as the agent: its informers cannot list or watch something (RBAC?)", what)
	}
	panic("unreachable")
}

// TestRBACIsEnoughForTheAgent installs the chart, then runs the agent's Kubernetes source and
// pod annotator as the chart's ServiceAccount: a missing rule would stall the source's
// informers or fail the patch. Requests beyond the chart's rules must be forbidden.
func TestRBACIsEnoughForTheAgent(t *testing.T) {
	c, client, r, asAgent := installAsAgent(t, renderOpts{set: []string{"profile=strict"}, apiVersions: []string{peerAuthnAPI}})
	ctx, cancel := context.WithTimeout(t.Context(), clusterTimeout)
	defer cancel()
	src, err := k8ssource.New(k8ssource.Config{RestConfig: asAgent, NodeName: "node-a", Logger: warnLogger()})
	if err != nil {
		t.Fatal(err)
	}
	s := firstUpdate(ctx, t, "source snapshot", src.Run)
	if !slices.ContainsFunc(s.Workloads, func(w *workload.Workload) bool { return w.Name == "web" }) ||
		len(s.PeerAuthentications) != 1 || s.PeerAuthentications[0].Name != "default" {
		t.Errorf("first snapshot as the agent: workloads %d, PeerAuthentications %v", len(s.Workloads), s.PeerAuthentications)
	}
	checkAnnotatesAsAgent(ctx, t, asAgent)

	// Least privilege: neighbouring verbs and resources stay forbidden.
	agentClient := clientFor(t, asAgent)
	agentDyn, err := dynamic.NewForConfig(asAgent)
	if err != nil {
		t.Fatal(err)
	}
	crds := agentDyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	if _, err := crds.Get(ctx, "peerauthentications.security.istio.io", metav1.GetOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("the source cannot read the PeerAuthentication CRD: %v", err)
	}
	checkForbidden(t, "the agent", map[string]func() error{
		"delete a pod": func() error { return agentClient.CoreV1().Pods("apps").Delete(ctx, "web", metav1.DeleteOptions{}) },
		"patch a pod itself (its spec)": func() error {
			_, err := agentClient.CoreV1().Pods("apps").Patch(ctx, "web", k8stypes.MergePatchType,
				[]byte(`{"spec":{"containers":[{"name":"web","image":"evil"}]}}`), metav1.PatchOptions{})
			return err
		},
		"delete another DaemonSet": func() error {
			return agentClient.AppsV1().DaemonSets(releaseNamespace).Delete(ctx, "kube-proxy", metav1.DeleteOptions{})
		},
		"read secrets": func() error {
			_, err := agentClient.CoreV1().Secrets(releaseNamespace).List(ctx, metav1.ListOptions{})
			return err
		},
		"update a namespace": func() error {
			ns, err := client.CoreV1().Namespaces().Get(ctx, "apps", metav1.GetOptions{})
			if err != nil {
				return err
			}
			_, err = agentClient.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{})
			return err
		},
		"read another DaemonSet": func() error {
			_, err := agentClient.AppsV1().DaemonSets(releaseNamespace).Get(ctx, "kube-proxy", metav1.GetOptions{})
			return err
		},
		"list CRDs": func() error {
			_, err := crds.List(ctx, metav1.ListOptions{})
			return err
		},
		"list DaemonSets": func() error {
			_, err := agentClient.AppsV1().DaemonSets(releaseNamespace).List(ctx, metav1.ListOptions{})
			return err
		},
	})
	// node-setup's one read: its own DaemonSet. Deleting it would turn the mesh off on every
	// node: that is the pre-delete hook's alone, under an account no agent pod has.
	if _, err := agentClient.AppsV1().DaemonSets(releaseNamespace).Get(ctx, r.DaemonSet.Name, metav1.GetOptions{}); err != nil {
		t.Errorf("node-setup cannot read its DaemonSet: %v", err)
	}
	dryRun := metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}}
	if err := agentClient.AppsV1().DaemonSets(releaseNamespace).Delete(ctx, r.DaemonSet.Name, dryRun); !apierrors.IsForbidden(err) {
		t.Errorf("the agent deleting its DaemonSet: %v, want forbidden", err)
	}
	asHook := rest.CopyConfig(c.Config)
	asHook.Impersonate = rest.ImpersonationConfig{
		UserName: fmt.Sprintf("system:serviceaccount:%s:%s", releaseNamespace, r.UninstallServiceAccount.Name),
	}
	if err := clientFor(t, asHook).AppsV1().DaemonSets(releaseNamespace).Delete(ctx, r.DaemonSet.Name, dryRun); err != nil {
		t.Errorf("the pre-delete hook cannot delete its DaemonSet: %v", err)
	}
}

// TestRBACIsEnoughForTheXDSAgent: with source=xds the chart's ClusterRole is only what the
// xDS source reads itself; its node-pod watch and the annotator run as the chart's
// ServiceAccount, and what only the Kubernetes source reads is forbidden.
func TestRBACIsEnoughForTheXDSAgent(t *testing.T) {
	_, _, _, asAgent := installAsAgent(t, renderOpts{set: []string{"source=xds"}})
	ctx, cancel := context.WithTimeout(t.Context(), clusterTimeout)
	defer cancel()
	w, err := nodepods.New(asAgent, "node-a", warnLogger(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if s := firstUpdate(ctx, t, "node-pod state", w.Run); !slices.ContainsFunc(s.Pods, func(p corev1.Pod) bool { return p.Name == "web" }) {
		t.Errorf("first node-pod state as the agent has no pod web: %d pods", len(s.Pods))
	}
	checkAnnotatesAsAgent(ctx, t, asAgent)
	agentClient := clientFor(t, asAgent)
	checkForbidden(t, "the xDS agent (istiod sends the mesh)", map[string]func() error{
		"list Services": func() error {
			_, err := agentClient.CoreV1().Services("").List(ctx, metav1.ListOptions{})
			return err
		},
		"list EndpointSlices": func() error {
			_, err := agentClient.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{})
			return err
		},
		"list nodes": func() error {
			_, err := agentClient.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
			return err
		},
	})
}

// warnLogger logs warnings and errors of the agent's code run as the agent: what tells why
// a watch stalls.
func warnLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// clientFor is a clientset authenticating as cfg does (an impersonated account).
func clientFor(t *testing.T, cfg *rest.Config) kubernetes.Interface {
	t.Helper()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// checkAnnotatesAsAgent checks the agent's one write to pods, which both sources need: its
// annotator marks the pod apps/web redirected, as the chart's ServiceAccount.
func checkAnnotatesAsAgent(ctx context.Context, t *testing.T, asAgent *rest.Config) {
	t.Helper()
	annotator, err := k8ssource.NewAnnotator(asAgent)
	if err != nil {
		t.Fatal(err)
	}
	if err := annotator.SetRedirection(ctx, "apps", "web", "", true); err != nil {
		t.Errorf("annotate a pod as the agent: %v", err)
	}
}

// checkForbidden checks that the API server forbids every call (named by what it does) made
// as who: the chart grants least privilege.
func checkForbidden(t *testing.T, who string, calls map[string]func() error) {
	t.Helper()
	for what, call := range calls {
		if err := call(); !apierrors.IsForbidden(err) {
			t.Errorf("%s as %s: %v, want forbidden", what, who, err)
		}
	}
}
