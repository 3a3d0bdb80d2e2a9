package kubernetes_test

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	k8s "k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
	"github.com/redirector-mesh/redirector/pkg/source/kubernetes"
	"github.com/redirector-mesh/redirector/test/kubetest"
)

// waitTimeout bounds how long a change may take to reach a snapshot. It is generous for a
// busy 2-core machine; a healthy run takes well under a second per change.
const waitTimeout = 20 * time.Second

func TestSource(t *testing.T) {
	t.Parallel()
	c := kubetest.Start(t)
	client := c.Client(t)
	ctx := t.Context()

	// Exists before the source starts: must be in the very first snapshot.
	createNamespace(t, client, "apps", map[string]string{"istio.io/dataplane-mode": "ambient"})

	w := runSource(t, c.Config)
	first := w.first(t)
	if !slices.ContainsFunc(first.Namespaces, named[corev1.Namespace]("", "apps")) {
		t.Fatalf("first snapshot lacks namespace apps: %v", names(first.Namespaces))
	}
	if got := first.AuthorizationPolicies; len(got) != 0 {
		t.Errorf("policies without their CRDs: %v", got)
	}

	t.Run("pods", func(t *testing.T) {
		for _, p := range []struct{ name, node, ip, ip6 string }{
			{"web", "node-a", "10.244.1.5", "fd00:10:244:1::5"},
			{"db", "node-b", "10.244.2.7", "fd00:10:244:2::7"}, // a remote pod
		} {
			createRunningPod(t, client, "apps", p.name, p.node, p.ip, p.ip6)
		}
		snap := w.waitFor(t, "running pods web and db with IPs", func(s kubeobj.Objects) bool {
			return slices.ContainsFunc(s.Pods, runningWithIP("apps", "web", "10.244.1.5")) &&
				slices.ContainsFunc(s.Pods, runningWithIP("apps", "db", "10.244.2.7"))
		})
		if got := names(snap.Pods); !slices.IsSorted(got) {
			t.Errorf("pods not sorted: %v", got)
		}
		i := slices.IndexFunc(snap.Pods, named[corev1.Pod]("apps", "db"))
		if db := snap.Pods[i]; db.Spec.NodeName != "node-b" || len(db.Status.PodIPs) != 2 || len(db.ManagedFields) != 0 {
			t.Errorf("pod db: node %q, IPs %v, %d managedFields; want node-b, both IPs, none",
				db.Spec.NodeName, db.Status.PodIPs, len(db.ManagedFields))
		}

		if err := client.CoreV1().Pods("apps").Delete(ctx, "db", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
			t.Fatalf("delete pod: %v", err)
		}
		w.waitFor(t, "pod db gone", func(s kubeobj.Objects) bool {
			return !slices.ContainsFunc(s.Pods, named[corev1.Pod]("apps", "db"))
		})
	})

	t.Run("services and endpointslices", func(t *testing.T) {
		family := corev1.IPFamilyPolicyRequireDualStack
		svc := &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "web"},
			Spec: corev1.ServiceSpec{
				IPFamilyPolicy: &family,
				Selector:       map[string]string{"app": "web"},
				Ports:          []corev1.ServicePort{{Name: "http", Port: 80}},
			},
		}
		if _, err := client.CoreV1().Services("apps").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create service: %v", err)
		}
		// No controller-manager runs, so the slice is written by hand as its controller would.
		ready := true
		eps := &discoveryv1.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{
				Namespace: "apps", Name: "web-abc12",
				Labels: map[string]string{discoveryv1.LabelServiceName: "web"},
			},
			AddressType: discoveryv1.AddressTypeIPv4,
			Endpoints: []discoveryv1.Endpoint{{
				Addresses:  []string{"10.244.1.5"},
				Conditions: discoveryv1.EndpointConditions{Ready: &ready},
				NodeName:   new("node-a"),
			}},
			Ports: []discoveryv1.EndpointPort{{Name: new("http"), Port: new(int32(8080))}},
		}
		if _, err := client.DiscoveryV1().EndpointSlices("apps").Create(ctx, eps, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create endpointslice: %v", err)
		}
		snap := w.waitFor(t, "service web and its endpointslice", func(s kubeobj.Objects) bool {
			return slices.ContainsFunc(s.Services, named[corev1.Service]("apps", "web")) &&
				slices.ContainsFunc(s.EndpointSlices, named[discoveryv1.EndpointSlice]("apps", "web-abc12"))
		})
		i := slices.IndexFunc(snap.Services, named[corev1.Service]("apps", "web"))
		if ips := snap.Services[i].Spec.ClusterIPs; len(ips) != 2 {
			t.Errorf("service web ClusterIPs = %v, want IPv4 and IPv6", ips)
		}

		if err := client.CoreV1().Services("apps").Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
			t.Fatalf("delete service: %v", err)
		}
		w.waitFor(t, "service web gone", func(s kubeobj.Objects) bool {
			return !slices.ContainsFunc(s.Services, named[corev1.Service]("apps", "web"))
		})
	})

	t.Run("annotator", func(t *testing.T) {
		a, err := kubernetes.NewAnnotator(c.Config)
		if err != nil {
			t.Fatal(err)
		}
		annotation := func(s kubeobj.Objects) (string, bool) {
			i := slices.IndexFunc(s.Pods, named[corev1.Pod]("apps", "web"))
			if i < 0 {
				return "", false
			}
			v, ok := s.Pods[i].Annotations[kubernetes.RedirectionAnnotation]
			return v, ok
		}

		if err := a.SetRedirection(ctx, "apps", "web", true); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "annotation enabled on web", func(s kubeobj.Objects) bool {
			v, _ := annotation(s)
			return v == "enabled"
		})
		if err := a.SetRedirection(ctx, "apps", "web", false); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "annotation gone from web", func(s kubeobj.Objects) bool {
			_, ok := annotation(s)
			return !ok && slices.ContainsFunc(s.Pods, named[corev1.Pod]("apps", "web"))
		})

		if err := a.SetRedirection(ctx, "apps", "gone", false); err != nil {
			t.Errorf("unannotate a missing pod: %v, want success", err)
		}
		err = a.SetRedirection(ctx, "apps", "gone", true)
		if !apierrors.IsNotFound(err) || !strings.Contains(err.Error(), "apps/gone") {
			t.Errorf("annotate a missing pod: %v, want a not-found error naming apps/gone", err)
		}
	})

	t.Run("policies after CRD install", func(t *testing.T) {
		dyn := dynamicClient(t, c.Config)
		installCRDs(t, dyn)
		createObject(t, dyn, peerAuthGVR, `
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {namespace: apps, name: strict}
spec:
  mtls: {mode: STRICT}
  portLevelMtls:
    "8080": {mode: PERMISSIVE}
`)
		createObject(t, dyn, authzGVR, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: apps, name: deny-other}
spec:
  action: DENY
  rules:
  - from:
    - source: {notNamespaces: [apps]}
    to:
    - operation: {ports: ["8080"]}
`)
		snap := w.waitFor(t, "both policies", func(s kubeobj.Objects) bool {
			return len(s.PeerAuthentications) == 1 && len(s.AuthorizationPolicies) == 1
		})
		pa := snap.PeerAuthentications[0]
		if pa.Name != "strict" || pa.Spec.MTLS == nil || pa.Spec.MTLS.Mode != policy.ModeStrict ||
			pa.Spec.PortLevelMTLS[8080].Mode != policy.ModePermissive {
			t.Errorf("PeerAuthentication = %+v", pa)
		}
		ap := snap.AuthorizationPolicies[0]
		if ap.Name != "deny-other" || ap.Spec.Action != policy.ActionDeny || len(ap.Spec.Rules) != 1 ||
			!slices.Equal(ap.Spec.Rules[0].From[0].Source.NotNamespaces, []string{"apps"}) ||
			!slices.Equal(ap.Spec.Rules[0].To[0].Operation.Ports, []string{"8080"}) {
			t.Errorf("AuthorizationPolicy = %+v", ap)
		}
	})
}

// TestSourceSurvivesRestart restarts the API server under a running source: its watches must
// reconnect and resume, so objects created afterwards, built-in and custom, still arrive. The
// CRDs are there before the source starts, so the first snapshot must hold the policies.
func TestSourceSurvivesRestart(t *testing.T) {
	t.Parallel()
	c := kubetest.Start(t)
	client := c.Client(t)
	dyn := dynamicClient(t, c.Config)
	installCRDs(t, dyn)
	createNamespace(t, client, "before", nil)
	createObject(t, dyn, authzGVR, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: before, name: allow-nothing}
spec: {action: ALLOW}
`)
	// The CRD is served shortly after it is created; the source looks only once at start.
	waitServed(t, c.Config, authzGVR)
	waitServed(t, c.Config, peerAuthGVR)

	w := runSource(t, c.Config)
	first := w.first(t)
	if len(first.AuthorizationPolicies) != 1 || first.AuthorizationPolicies[0].Name != "allow-nothing" {
		t.Fatalf("first snapshot policies = %+v, want allow-nothing", first.AuthorizationPolicies)
	}

	c.Restart(t)

	createNamespace(t, client, "after", nil)
	createRunningPod(t, client, "after", "late", "node-a", "10.244.3.9", "")
	createObject(t, dyn, authzGVR, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: after, name: late}
spec: {action: DENY}
`)
	w.waitFor(t, "namespace, pod and policy created after the restart", func(s kubeobj.Objects) bool {
		return slices.ContainsFunc(s.Namespaces, named[corev1.Namespace]("", "after")) &&
			slices.ContainsFunc(s.Pods, runningWithIP("after", "late", "10.244.3.9")) &&
			slices.ContainsFunc(s.AuthorizationPolicies, named[policy.AuthorizationPolicy]("after", "late"))
	})
}

// watcher runs a Source and keeps the snapshots it delivers.
type watcher struct {
	mu     sync.Mutex
	snaps  []kubeobj.Objects
	change chan struct{} // signalled on every snapshot
}

// runSource runs a Source until the test ends, then checks that Run returned cleanly.
func runSource(t *testing.T, cfg *rest.Config) *watcher {
	t.Helper()
	return runSourceWith(t, kubernetes.Config{RestConfig: cfg, PolicyRecheck: 200 * time.Millisecond})
}

// first returns the first snapshot delivered.
func (w *watcher) first(t *testing.T) kubeobj.Objects {
	t.Helper()
	w.waitFor(t, "a first snapshot", func(kubeobj.Objects) bool { return true })
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.snaps[0]
}

// waitFor waits until the latest snapshot satisfies ok and returns it.
func (w *watcher) waitFor(t *testing.T, what string, ok func(kubeobj.Objects) bool) kubeobj.Objects {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		w.mu.Lock()
		var last *kubeobj.Objects
		if n := len(w.snaps); n > 0 {
			last = &w.snaps[n-1]
		}
		w.mu.Unlock()
		if last != nil && ok(*last) {
			return *last
		}
		select {
		case <-w.change:
		case <-deadline:
			t.Fatalf("no snapshot with %s after %v", what, waitTimeout)
		}
	}
}

func createNamespace(t *testing.T, client k8s.Interface, name string, labels map[string]string) {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
	if _, err := client.CoreV1().Namespaces().Create(t.Context(), ns, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace %s: %v", name, err)
	}
}

// createRunningPod creates a pod bound to node and then, as that node's kubelet would, marks
// it Running with its IPs (ip6 may be empty).
func createRunningPod(t *testing.T, client k8s.Interface, ns, name, node, ip, ip6 string) {
	t.Helper()
	ctx := t.Context()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			NodeName:   node, // no scheduler runs
			Containers: []corev1.Container{{Name: "app", Image: "registry.invalid/app:1"}},
		},
	}
	pod, err := client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", ns, name, err)
	}
	pod.Status.Phase = corev1.PodRunning
	pod.Status.PodIP = ip
	pod.Status.PodIPs = []corev1.PodIP{{IP: ip}}
	if ip6 != "" {
		pod.Status.PodIPs = append(pod.Status.PodIPs, corev1.PodIP{IP: ip6})
	}
	if _, err := client.CoreV1().Pods(ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("update status of pod %s/%s: %v", ns, name, err)
	}
}

var (
	peerAuthGVR = schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: "peerauthentications"}
	authzGVR    = schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: "authorizationpolicies"}
	crdGVR      = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
)

func dynamicClient(t *testing.T, cfg *rest.Config) dynamic.Interface {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return dyn
}

// installCRDs creates the stand-in Istio CRDs of testdata.
func installCRDs(t *testing.T, dyn dynamic.Interface) {
	t.Helper()
	for _, f := range []string{"testdata/crd-peerauthentication.yaml", "testdata/crd-authorizationpolicy.yaml"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		createObject(t, dyn, crdGVR, string(b))
	}
}

// createObject creates the YAML manifest as a gvr object.
func createObject(t *testing.T, dyn dynamic.Interface, gvr schema.GroupVersionResource, manifest string) {
	t.Helper()
	var u unstructured.Unstructured
	if err := yaml.Unmarshal([]byte(manifest), &u.Object); err != nil {
		t.Fatalf("parse manifest: %v", err)
	}
	ctx := t.Context()
	var err error
	// Creating a custom object right after its CRD gets NotFound until the resource is served.
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(100 * time.Millisecond) {
		_, err = dyn.Resource(gvr).Namespace(u.GetNamespace()).Create(ctx, &u, metav1.CreateOptions{})
		if !apierrors.IsNotFound(err) || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatalf("create %s %s/%s: %v", gvr.Resource, u.GetNamespace(), u.GetName(), err)
	}
}

// waitServed waits until discovery lists gvr, which is what the source looks at.
func waitServed(t *testing.T, cfg *rest.Config, gvr schema.GroupVersionResource) {
	t.Helper()
	disc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(waitTimeout); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		list, err := disc.ServerResourcesForGroupVersion(gvr.GroupVersion().String())
		if err == nil && slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Name == gvr.Resource }) {
			return
		}
	}
	t.Fatalf("%s not served after %v", gvr, waitTimeout)
}

func named[T any, P interface {
	*T
	GetNamespace() string
	GetName() string
}](ns, name string) func(T) bool {
	return func(o T) bool {
		p := P(&o)
		return p.GetNamespace() == ns && p.GetName() == name
	}
}

func runningWithIP(ns, name, ip string) func(corev1.Pod) bool {
	return func(p corev1.Pod) bool {
		return p.Namespace == ns && p.Name == name && p.Status.Phase == corev1.PodRunning && p.Status.PodIP == ip
	}
}

func names[T any, P interface {
	*T
	GetNamespace() string
	GetName() string
}](objs []T) []string {
	out := make([]string, len(objs))
	for i := range objs {
		p := P(&objs[i])
		out[i] = fmt.Sprintf("%s/%s", p.GetNamespace(), p.GetName())
	}
	return out
}
