package kubernetes_test

import (
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	nodev1 "k8s.io/api/node/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	k8s "k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
	"github.com/redirector-mesh/redirector/pkg/source/kubernetes"
	"github.com/redirector-mesh/redirector/pkg/workload"
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
	if !slices.Equal(first.AmbientNamespaces, []string{"apps"}) {
		t.Fatalf("first snapshot's ambient namespaces = %v, want apps", first.AmbientNamespaces)
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
		snap := w.waitFor(t, "running pods web and db with IPs", func(s source.Snapshot) bool {
			return slices.ContainsFunc(s.Workloads, withIP("apps", "web", "10.244.1.5")) &&
				slices.ContainsFunc(s.Workloads, withIP("apps", "db", "10.244.2.7"))
		})
		if got := workloadNames(snap.Workloads); !slices.IsSorted(got) {
			t.Errorf("workloads not sorted: %v", got)
		}
		db := snap.Workloads[slices.IndexFunc(snap.Workloads, isWorkload("apps", "db"))]
		if db.Node != "node-b" || len(db.Addrs) != 2 || !db.Enrolled || db.Labels["app"] != "db" || db.UID == "" {
			t.Errorf("pod db = %+v; want node-b, both IPs, enrolled (ambient namespace), its labels and uid", db)
		}

		setPodLabel(t, client, "apps", "db", "version", "v2")
		w.waitFor(t, "pod db's new label", func(s source.Snapshot) bool {
			i := slices.IndexFunc(s.Workloads, isWorkload("apps", "db"))
			return i >= 0 && s.Workloads[i].Labels["version"] == "v2"
		})

		if err := client.CoreV1().Pods("apps").Delete(ctx, "db", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
			t.Fatalf("delete pod: %v", err)
		}
		w.waitFor(t, "pod db gone", func(s source.Snapshot) bool {
			return !slices.ContainsFunc(s.Workloads, isWorkload("apps", "db"))
		})
	})

	t.Run("namespace label re-translates its pods", func(t *testing.T) {
		createNamespace(t, client, "late", nil)
		createRunningPod(t, client, "late", "app", "node-a", "10.244.1.9", "")
		enrolled := func(want bool) func(source.Snapshot) bool {
			return func(s source.Snapshot) bool {
				i := slices.IndexFunc(s.Workloads, withIP("late", "app", "10.244.1.9"))
				return i >= 0 && s.Workloads[i].Enrolled == want && slices.Contains(s.AmbientNamespaces, "late") == want
			}
		}
		w.waitFor(t, "late/app, not enrolled", enrolled(false))
		setNamespaceLabel(t, client, "late", "istio.io/dataplane-mode", "ambient")
		w.waitFor(t, "late/app enrolled once its namespace is ambient", enrolled(true))
		setNamespaceLabel(t, client, "late", "istio.io/dataplane-mode", "")
		w.waitFor(t, "late/app unenrolled again", enrolled(false))
	})

	t.Run("runtime class re-translates its pods", func(t *testing.T) {
		// runSource skips the handler "kata". (The API server refuses pods of a class that
		// does not exist, so the class comes first.)
		ctx := t.Context()
		createRuntimeClass(t, client, "sandbox", "kata")
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "sandboxed"},
			Spec: corev1.PodSpec{NodeName: "node-a", RuntimeClassName: new("sandbox"),
				Containers: []corev1.Container{{Name: "app", Image: "registry.invalid/app:1"}}},
		}
		markRunning(t, client, mustCreatePod(t, client, pod), "10.244.1.20", "")
		reason := func(want string) func(source.Snapshot) bool {
			return func(s source.Snapshot) bool {
				i := slices.IndexFunc(s.Workloads, withIP("apps", "sandboxed", "10.244.1.20"))
				return i >= 0 && strings.Contains(s.Workloads[i].Reason, want)
			}
		}
		w.waitFor(t, "sandboxed pod skipped for its handler", reason("handler kata) is skipped"))
		if err := client.NodeV1().RuntimeClasses().Delete(ctx, "sandbox", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "sandboxed pod's class gone", reason("unknown runtime class"))
		createRuntimeClass(t, client, "sandbox", "runc")
		w.waitFor(t, "sandboxed pod enrolled under runc", func(s source.Snapshot) bool {
			i := slices.IndexFunc(s.Workloads, withIP("apps", "sandboxed", "10.244.1.20"))
			return i >= 0 && s.Workloads[i].Enrolled
		})
	})

	t.Run("services and endpointslices", func(t *testing.T) {
		family := corev1.IPFamilyPolicyRequireDualStack
		svc := &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "web"},
			Spec: corev1.ServiceSpec{
				IPFamilyPolicy: &family,
				Selector:       map[string]string{"app": "web"},
				Ports:          []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
			},
		}
		if _, err := client.CoreV1().Services("apps").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create service: %v", err)
		}
		// No controller-manager runs, so the slice is written by hand as its controller would.
		eps := endpointSlice("web", "web-abc12", 8080, "10.244.1.5")
		if _, err := client.DiscoveryV1().EndpointSlices("apps").Create(ctx, eps, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create endpointslice: %v", err)
		}
		snap := w.waitFor(t, "service web and its endpoint", func(s source.Snapshot) bool {
			return slices.Equal(endpointsOf(s, "apps", "web"), []string{"10.244.1.5"})
		})
		web := snap.Services[slices.IndexFunc(snap.Services, isService("apps", "web"))]
		if len(web.VIPs) != 2 || len(web.Ports) != 1 || web.Ports[0].TargetPortName != "http" || web.Endpoints[0].Ports["http"] != 8080 {
			t.Errorf("service web = %+v, want IPv4 and IPv6 VIPs, port http, endpoint port 8080", web)
		}

		// A second slice of the same service merges in; deleting the first leaves the second's.
		if _, err := client.DiscoveryV1().EndpointSlices("apps").Create(ctx, endpointSlice("web", "web-def34", 8080, "10.244.1.6"), metav1.CreateOptions{}); err != nil {
			t.Fatalf("create endpointslice: %v", err)
		}
		w.waitFor(t, "both slices' endpoints", func(s source.Snapshot) bool {
			return slices.Equal(endpointsOf(s, "apps", "web"), []string{"10.244.1.5", "10.244.1.6"})
		})
		if err := client.DiscoveryV1().EndpointSlices("apps").Delete(ctx, "web-abc12", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "the first slice's endpoint gone", func(s source.Snapshot) bool {
			return slices.Equal(endpointsOf(s, "apps", "web"), []string{"10.244.1.6"})
		})

		if err := client.CoreV1().Services("apps").Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
			t.Fatalf("delete service: %v", err)
		}
		w.waitFor(t, "service web gone", func(s source.Snapshot) bool {
			return !slices.ContainsFunc(s.Services, isService("apps", "web"))
		})
		// A slice whose service comes later: the service gets its endpoints.
		if _, err := client.CoreV1().Services("apps").Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "web"},
			Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80}}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create service: %v", err)
		}
		w.waitFor(t, "the service back with the remaining slice's endpoint", func(s source.Snapshot) bool {
			return slices.Equal(endpointsOf(s, "apps", "web"), []string{"10.244.1.6"})
		})
	})

	t.Run("annotator", func(t *testing.T) {
		a, err := kubernetes.NewAnnotator(c.Config)
		if err != nil {
			t.Fatal(err)
		}
		redirected := func(want bool) func(source.Snapshot) bool {
			return func(s source.Snapshot) bool {
				i := slices.IndexFunc(s.Workloads, isWorkload("apps", "web"))
				return i >= 0 && s.Workloads[i].Redirected == want
			}
		}

		web, err := client.CoreV1().Pods("apps").Get(ctx, "web", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		uid := string(web.UID)
		if err := a.SetRedirection(ctx, "apps", "web", uid, true); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "annotation enabled on web", redirected(true))
		if err := a.SetRedirection(ctx, "apps", "web", uid, false); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "annotation gone from web", redirected(false))

		if err := a.SetRedirection(ctx, "apps", "gone", "", false); err != nil {
			t.Errorf("unannotate a missing pod: %v, want success", err)
		}
		err = a.SetRedirection(ctx, "apps", "gone", "", true)
		if !apierrors.IsNotFound(err) || !strings.Contains(err.Error(), "apps/gone") {
			t.Errorf("annotate a missing pod: %v, want a not-found error naming apps/gone", err)
		}

		// A pod of the same name with another UID (a StatefulSet's, recreated before the
		// agent saw it) is not the one meant: not annotated for it, nor unannotated.
		const replaced = "00000000-0000-0000-0000-000000000001"
		err = a.SetRedirection(ctx, "apps", "web", replaced, true)
		if err == nil || !strings.Contains(err.Error(), "replaced") {
			t.Errorf("annotate web for another pod's UID: %v, want an error saying it was replaced", err)
		}
		if err := a.SetRedirection(ctx, "apps", "web", uid, true); err != nil {
			t.Fatal(err)
		}
		if err := a.SetRedirection(ctx, "apps", "web", replaced, false); err != nil {
			t.Errorf("unannotate a replaced pod: %v, want success", err)
		}
		got, err := client.CoreV1().Pods("apps").Get(ctx, "web", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if v := got.Annotations[kubernetes.RedirectionAnnotation]; v != "enabled" {
			t.Errorf("web's annotation %q after a removal meant for another UID, want enabled", v)
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
		snap := w.waitFor(t, "both policies", func(s source.Snapshot) bool {
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

	t.Run("waypoint labels", func(t *testing.T) {
		// The waypoint is named by its Service; the labels may come before it.
		createNamespace(t, client, "wp", map[string]string{"istio.io/dataplane-mode": "ambient"})
		createRunningPod(t, client, "wp", "app", "node-b", "10.244.2.40", "")
		setPodLabel(t, client, "wp", "app", "istio.io/use-waypoint", "waypoint")
		svc := func(name string, labels map[string]string) *corev1.Service {
			return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "wp", Name: name, Labels: labels},
				Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80}}}}
		}
		if _, err := client.CoreV1().Services("wp").Create(ctx, svc("app-svc", nil), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		want := &workload.Waypoint{Namespace: "wp", Hostname: "waypoint.wp.svc.cluster.local", HBONEPort: 15008}
		waypoints := func(pod, service *workload.Waypoint) func(source.Snapshot) bool {
			return func(s source.Snapshot) bool {
				i, j := slices.IndexFunc(s.Workloads, isWorkload("wp", "app")), slices.IndexFunc(s.Services, isService("wp", "app-svc"))
				return i >= 0 && j >= 0 && reflect.DeepEqual(s.Workloads[i].Waypoint, pod) && reflect.DeepEqual(s.Services[j].Waypoint, service)
			}
		}
		w.waitFor(t, "no waypoint while its Service is missing", waypoints(nil, nil))
		if _, err := client.CoreV1().Services("wp").Create(ctx, svc("waypoint", map[string]string{"istio.io/waypoint-for": "all"}), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "the pod's waypoint once its Service exists", waypoints(want, nil))
		setNamespaceLabel(t, client, "wp", "istio.io/use-waypoint", "waypoint")
		w.waitFor(t, "the service's waypoint from its namespace's label", waypoints(want, want))
		if err := client.CoreV1().Services("wp").Delete(ctx, "waypoint", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "no waypoint once its Service is gone", waypoints(nil, nil))
	})

	// istiod reads an object's own use-waypoint label when it is there, empty too:
	// an empty one names no waypoint, and the namespace's is not taken. The source
	// follows the label coming and going, though its value stays "" (until 8 December
	// an empty label fell back to the namespace's waypoint, and the change was not
	// seen at all).
	t.Run("empty waypoint label as istiod", func(t *testing.T) {
		createNamespace(t, client, "wpe", map[string]string{"istio.io/dataplane-mode": "ambient", "istio.io/use-waypoint": "ns-wp"})
		svc := func(name string, labels map[string]string) *corev1.Service {
			return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "wpe", Name: name, Labels: labels},
				Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80}}}}
		}
		for _, s := range []*corev1.Service{svc("ns-wp", map[string]string{"istio.io/waypoint-for": "all"}), svc("web", nil)} {
			if _, err := client.CoreV1().Services("wpe").Create(ctx, s, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		want := &workload.Waypoint{Namespace: "wpe", Hostname: "ns-wp.wpe.svc.cluster.local", HBONEPort: 15008}
		webWaypoint := func(wp *workload.Waypoint) func(source.Snapshot) bool {
			return func(s source.Snapshot) bool {
				j := slices.IndexFunc(s.Services, isService("wpe", "web"))
				return j >= 0 && reflect.DeepEqual(s.Services[j].Waypoint, wp)
			}
		}
		w.waitFor(t, "web's waypoint from its namespace", webWaypoint(want))
		empty := []byte(`{"metadata":{"labels":{"istio.io/use-waypoint":""}}}`)
		if _, err := client.CoreV1().Services("wpe").Patch(ctx, "web", types.MergePatchType, empty, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "no waypoint for web labelled istio.io/use-waypoint=\"\"", webWaypoint(nil))
		if _, err := client.CoreV1().Services("wpe").Patch(ctx, "web", types.MergePatchType, labelPatch("istio.io/use-waypoint", ""), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "web's waypoint from its namespace again once the label is gone", webWaypoint(want))
		// On the namespace, an empty use-waypoint-namespace names no namespace.
		emptyNS := []byte(`{"metadata":{"labels":{"istio.io/use-waypoint-namespace":""}}}`)
		if _, err := client.CoreV1().Namespaces().Patch(ctx, "wpe", types.MergePatchType, emptyNS, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "no waypoint for web once its namespace says istio.io/use-waypoint-namespace=\"\"", webWaypoint(nil))
		setNamespaceLabel(t, client, "wpe", "istio.io/use-waypoint-namespace", "")
		w.waitFor(t, "web's waypoint again once the namespace's label is gone", webWaypoint(want))
	})

	// A Service's trafficDistribution (kube-proxy honours it for unmeshed pods) and its
	// namespace's Istio annotation give it a routing preference, as istiod derives it; pods
	// take their node's locality labels, and follow a change of them.
	t.Run("node locality and traffic distribution", func(t *testing.T) {
		createNamespace(t, client, "zoned", nil)
		createRunningPod(t, client, "zoned", "near", "node-z1", "10.244.7.5", "")
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-z1", Labels: map[string]string{
			corev1.LabelTopologyRegion: "eu-west", corev1.LabelTopologyZone: "eu-west-1a", "kubernetes.io/os": "linux"}}}
		if _, err := client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		zone := func(want string) func(source.Snapshot) bool {
			return func(s source.Snapshot) bool {
				i := slices.IndexFunc(s.Workloads, isWorkload("zoned", "near"))
				return i >= 0 && s.Workloads[i].Region == "eu-west" && s.Workloads[i].Zone == want
			}
		}
		w.waitFor(t, "zoned/near in its node's zone", zone("eu-west-1a"))
		node.Labels[corev1.LabelTopologyZone] = "eu-west-1b"
		if _, err := client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "zoned/near in the node's new zone", zone("eu-west-1b"))

		if _, err := client.CoreV1().Services("zoned").Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "zoned", Name: "close"},
			Spec: corev1.ServiceSpec{TrafficDistribution: new(corev1.ServiceTrafficDistributionPreferClose),
				Ports: []corev1.ServicePort{{Name: "http", Port: 80}}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := client.CoreV1().Services("zoned").Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "zoned", Name: "plain"},
			Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80}}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		routing := func(name string, scopes ...workload.Scope) func(source.Snapshot) bool {
			return func(s source.Snapshot) bool {
				i := slices.IndexFunc(s.Services, isService("zoned", name))
				if i < 0 {
					return false
				}
				if r := s.Services[i].Routing; r == nil {
					return len(scopes) == 0
				}
				return slices.Equal(s.Services[i].Routing.Scopes, scopes) && !s.Services[i].Routing.Strict
			}
		}
		preferClose := []workload.Scope{workload.ScopeNetwork, workload.ScopeRegion, workload.ScopeZone}
		sameNode := append(slices.Clone(preferClose), workload.ScopeSubzone, workload.ScopeNode)
		w.waitFor(t, "zoned/close preferring its zone", routing("close", preferClose...))
		w.waitFor(t, "zoned/plain without a preference", routing("plain"))
		// The namespace's annotation reaches the Service that has no field.
		if _, err := client.CoreV1().Namespaces().Patch(ctx, "zoned", types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"`+kubeobj.TrafficDistributionAnnotation+`":"PreferSameNode"}}}`), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "zoned/plain preferring its node, from its namespace", routing("plain", sameNode...))
		w.waitFor(t, "zoned/close keeping its own field", routing("close", preferClose...))

		// And back: what was removed takes its preference or locality with it.
		if _, err := client.CoreV1().Namespaces().Patch(ctx, "zoned", types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"`+kubeobj.TrafficDistributionAnnotation+`":null}}}`), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "zoned/plain without a preference once its namespace's annotation is gone", routing("plain"))
		if _, err := client.CoreV1().Services("zoned").Patch(ctx, "close", types.MergePatchType,
			[]byte(`{"spec":{"trafficDistribution":null}}`), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "zoned/close without a preference once its field is gone", routing("close"))
		if err := client.CoreV1().Nodes().Delete(ctx, "node-z1", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "zoned/near without a locality once its node is gone", func(s source.Snapshot) bool {
			i := slices.IndexFunc(s.Workloads, isWorkload("zoned", "near"))
			return i >= 0 && s.Workloads[i].Region == "" && s.Workloads[i].Zone == ""
		})
		// A node created after its pods gives them its locality.
		node = &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-z1", Labels: map[string]string{corev1.LabelTopologyRegion: "eu-north", kubeobj.SubzoneLabel: "rack1"}}}
		if _, err := client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		w.waitFor(t, "zoned/near in the new node's region", func(s source.Snapshot) bool {
			i := slices.IndexFunc(s.Workloads, isWorkload("zoned", "near"))
			return i >= 0 && s.Workloads[i].Region == "eu-north" && s.Workloads[i].Zone == "" && s.Workloads[i].Subzone == "rack1"
		})
	})

	// Whatever the order of events, the incremental model ends where a whole translation of
	// the API's objects does.
	t.Run("incremental equals whole translation", func(t *testing.T) {
		w.waitFor(t, "the same model as kubeobj.Translate of everything listed", func(s source.Snapshot) bool {
			return sameModel(s, translateAll(t, client))
		})
	})
}

// TestSourceSurvivesRestart restarts the API server under a running source: its watches must
// reconnect and resume, so objects created afterwards, built-in and custom, still arrive. The
// CRDs are there before the source starts, so the first snapshot must hold the policies.
func TestSourceSurvivesRestart(t *testing.T) {
	t.Parallel()
	c, client, dyn := startWithPolicyCRDs(t, "v1")
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

	createNamespace(t, client, "after", ambient)
	createRunningPod(t, client, "after", "late", "node-a", "10.244.3.9", "")
	createObject(t, dyn, authzGVR, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: after, name: late}
spec: {action: DENY}
`)
	w.waitFor(t, "namespace, pod and policy created after the restart", func(s source.Snapshot) bool {
		return slices.Contains(s.AmbientNamespaces, "after") &&
			slices.ContainsFunc(s.Workloads, withIP("after", "late", "10.244.3.9")) &&
			slices.ContainsFunc(s.AuthorizationPolicies, named[policy.AuthorizationPolicy]("after", "late"))
	})
}

// TestSourceResync: with Config.Resync the informers deliver their cached objects again,
// which are compact pods and trimmed objects by then: they must translate as before, every
// resync a fresh snapshot with everything in it.
func TestSourceResync(t *testing.T) {
	t.Parallel()
	c := kubetest.Start(t)
	client := c.Client(t)
	createNamespace(t, client, "shop", ambient)
	createRunningPod(t, client, "shop", "web", "node-a", "10.244.1.5", "")
	w := runSourceWith(t, kubernetes.Config{RestConfig: c.Config, Resync: 300 * time.Millisecond, PolicyRecheck: 200 * time.Millisecond})
	enrolled := func(s source.Snapshot) bool {
		i := slices.IndexFunc(s.Workloads, withIP("shop", "web", "10.244.1.5"))
		return i >= 0 && s.Workloads[i].Enrolled && s.Workloads[i].Labels["app"] == "web"
	}
	w.waitFor(t, "shop/web enrolled", enrolled)
	n := w.count()
	w.waitFor(t, "three resyncs", func(source.Snapshot) bool { return w.count() >= n+3 })
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, s := range w.snaps[n-1:] {
		if !enrolled(s) {
			t.Errorf("snapshot %d after a resync lacks shop/web: %d workloads", n+i, len(s.Workloads))
		}
	}
}

// watcher runs a Source and keeps the snapshots it delivers.
type watcher struct {
	mu     sync.Mutex
	snaps  []source.Snapshot
	change chan struct{} // signalled on every snapshot
}

// runSource runs a Source until the test ends, then checks that Run returned cleanly. Pods
// whose RuntimeClass handler is "kata" are not enrolled.
func runSource(t *testing.T, cfg *rest.Config) *watcher {
	t.Helper()
	return runSourceWith(t, kubernetes.Config{RestConfig: cfg, PolicyRecheck: 200 * time.Millisecond,
		Selection: selection.Config{SkipRuntimeClasses: []string{"kata"}}})
}

// first returns the first snapshot delivered.
func (w *watcher) first(t *testing.T) source.Snapshot {
	t.Helper()
	w.waitFor(t, "a first snapshot", func(source.Snapshot) bool { return true })
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.snaps[0]
}

// waitFor waits until the latest snapshot satisfies ok and returns it.
func (w *watcher) waitFor(t *testing.T, what string, ok func(source.Snapshot) bool) source.Snapshot {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		w.mu.Lock()
		var last *source.Snapshot
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

// ambient is the namespace label that enrolls its pods.
var ambient = map[string]string{selection.DataplaneModeLabel: selection.DataplaneModeAmbient}

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
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			NodeName:   node, // no scheduler runs
			Containers: []corev1.Container{{Name: "app", Image: "registry.invalid/app:1"}},
		},
	}
	markRunning(t, client, mustCreatePod(t, client, pod), ip, ip6)
}

func mustCreatePod(t *testing.T, client k8s.Interface, pod *corev1.Pod) *corev1.Pod {
	t.Helper()
	pod, err := client.CoreV1().Pods(pod.Namespace).Create(t.Context(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod: %v", err)
	}
	return pod
}

// markRunning does what the pod's kubelet would: phase Running, its IPs (ip6 may be empty).
func markRunning(t *testing.T, client k8s.Interface, pod *corev1.Pod, ip, ip6 string) {
	t.Helper()
	pod.Status.Phase = corev1.PodRunning
	pod.Status.PodIP = ip
	pod.Status.PodIPs = []corev1.PodIP{{IP: ip}}
	if ip6 != "" {
		pod.Status.PodIPs = append(pod.Status.PodIPs, corev1.PodIP{IP: ip6})
	}
	if _, err := client.CoreV1().Pods(pod.Namespace).UpdateStatus(t.Context(), pod, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("update status of pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
}

// setPodLabel sets (or, with an empty value, removes) a label of a pod.
func setPodLabel(t *testing.T, client k8s.Interface, ns, name, key, value string) {
	t.Helper()
	if _, err := client.CoreV1().Pods(ns).Patch(t.Context(), name, types.MergePatchType, labelPatch(key, value), metav1.PatchOptions{}); err != nil {
		t.Fatalf("label pod %s/%s: %v", ns, name, err)
	}
}

// setNamespaceLabel sets (or, with an empty value, removes) a label of a namespace.
func setNamespaceLabel(t *testing.T, client k8s.Interface, name, key, value string) {
	t.Helper()
	if _, err := client.CoreV1().Namespaces().Patch(t.Context(), name, types.MergePatchType, labelPatch(key, value), metav1.PatchOptions{}); err != nil {
		t.Fatalf("label namespace %s: %v", name, err)
	}
}

func labelPatch(key, value string) []byte {
	var v any = value
	if value == "" {
		v = nil
	}
	b, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{key: v}}})
	return b
}

func createRuntimeClass(t *testing.T, client k8s.Interface, name, handler string) {
	t.Helper()
	rc := &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Handler: handler}
	if _, err := client.NodeV1().RuntimeClasses().Create(t.Context(), rc, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create runtime class %s: %v", name, err)
	}
}

// endpointSlice is a slice of service with one ready endpoint per address, on port http.
func endpointSlice(service, name string, port int32, addrs ...string) *discoveryv1.EndpointSlice {
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: service}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: new("http"), Port: new(port)}},
	}
	for _, a := range addrs {
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{Addresses: []string{a}, Conditions: discoveryv1.EndpointConditions{Ready: new(true)}})
	}
	return es
}

// translateAll lists every object the source watches (but policies) and translates them
// whole, as the source did before it translated incrementally.
func translateAll(t *testing.T, client k8s.Interface) source.Snapshot {
	t.Helper()
	ctx := t.Context()
	var objs kubeobj.Objects
	nss, err1 := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	pods, err2 := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	svcs, err3 := client.CoreV1().Services("").List(ctx, metav1.ListOptions{})
	eps, err4 := client.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{})
	rcs, err5 := client.NodeV1().RuntimeClasses().List(ctx, metav1.ListOptions{})
	nodes, err6 := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err := errors.Join(err1, err2, err3, err4, err5, err6); err != nil {
		t.Fatalf("list: %v", err)
	}
	objs.Namespaces, objs.Pods, objs.Services, objs.EndpointSlices, objs.RuntimeClasses, objs.Nodes = nss.Items, pods.Items, svcs.Items, eps.Items, rcs.Items, nodes.Items
	snap, _ := kubeobj.Translate(objs, selection.Config{SkipRuntimeClasses: []string{"kata"}})
	return snap
}

// sameModel reports whether two snapshots hold equal workloads, services and ambient
// namespaces, in whatever order.
func sameModel(a, b source.Snapshot) bool {
	byName := func(x, y interface{ String() string }) int { return strings.Compare(x.String(), y.String()) }
	ws := func(s []*workload.Workload) []*workload.Workload {
		s = slices.Clone(s)
		slices.SortFunc(s, func(x, y *workload.Workload) int { return byName(x, y) })
		return s
	}
	ss := func(s []*workload.Service) []*workload.Service {
		s = slices.Clone(s)
		slices.SortFunc(s, func(x, y *workload.Service) int { return byName(x, y) })
		return s
	}
	return reflect.DeepEqual(ws(a.Workloads), ws(b.Workloads)) && reflect.DeepEqual(ss(a.Services), ss(b.Services)) &&
		slices.Equal(a.AmbientNamespaces, b.AmbientNamespaces)
}

var (
	peerAuthGVR = policyGVR("v1", "peerauthentications")
	authzGVR    = policyGVR("v1", "authorizationpolicies")
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

// startWithPolicyCRDs starts an API server with the stand-in Istio policy CRDs installed,
// serving version of security.istio.io ("v1", as testdata has them, or another one a
// cluster may serve instead), and returns it with a typed and a dynamic client: the start
// of every test of how the source reads policies.
func startWithPolicyCRDs(t *testing.T, version string) (*kubetest.Cluster, k8s.Interface, dynamic.Interface) {
	t.Helper()
	c := kubetest.Start(t)
	client := c.Client(t)
	dyn := dynamicClient(t, c.Config)
	if version == "v1" {
		installCRDs(t, dyn)
	} else {
		installCRDsServing(t, dyn, version)
	}
	return c, client, dyn
}

// policyGVR is the resource of an Istio security policy kind ("peerauthentications",
// "authorizationpolicies") in version of security.istio.io.
func policyGVR(version, resource string) schema.GroupVersionResource {
	return schema.GroupVersionResource{Group: "security.istio.io", Version: version, Resource: resource}
}

// createStrictPeerAuthentication creates the PeerAuthentication ns/strict (mTLS STRICT) in
// version of security.istio.io: the policy whose loss would admit plaintext.
func createStrictPeerAuthentication(t *testing.T, dyn dynamic.Interface, version, ns string) {
	t.Helper()
	createObject(t, dyn, policyGVR(version, "peerauthentications"), `
apiVersion: security.istio.io/`+version+`
kind: PeerAuthentication
metadata: {namespace: `+ns+`, name: strict}
spec: {mtls: {mode: STRICT}}
`)
}

// createDenyAll creates the AuthorizationPolicy ns/name that denies every request, in version
// of security.istio.io: the policy whose loss would allow everything.
func createDenyAll(t *testing.T, dyn dynamic.Interface, version, ns, name string) {
	t.Helper()
	createObject(t, dyn, policyGVR(version, "authorizationpolicies"), `
apiVersion: security.istio.io/`+version+`
kind: AuthorizationPolicy
metadata: {namespace: `+ns+`, name: `+name+`}
spec: {action: DENY, rules: [{}]}
`)
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

func isWorkload(ns, name string) func(*workload.Workload) bool {
	return func(w *workload.Workload) bool { return w.Namespace == ns && w.Name == name }
}

func isService(ns, name string) func(*workload.Service) bool {
	return func(s *workload.Service) bool { return s.Namespace == ns && s.Name == name }
}

// withIP matches the workload ns/name when ip is among its addresses.
func withIP(ns, name, ip string) func(*workload.Workload) bool {
	a := netip.MustParseAddr(ip)
	return func(w *workload.Workload) bool {
		return w.Namespace == ns && w.Name == name && slices.Contains(w.Addrs, a)
	}
}

func workloadNames(ws []*workload.Workload) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.Namespace + "\x00" + w.Name // sorts as namespace, then name
	}
	return out
}

// endpointsOf lists the endpoint addresses of the service ns/name in s.
func endpointsOf(s source.Snapshot, ns, name string) []string {
	i := slices.IndexFunc(s.Services, isService(ns, name))
	if i < 0 {
		return nil
	}
	var out []string
	for _, e := range s.Services[i].Endpoints {
		out = append(out, e.Addr.String())
	}
	return out
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

// TestSourceWithoutNodeAccess: nodes only give pods a locality, a
// preference among a Service's endpoints. An agent whose ClusterRole
// predates that rule (no nodes) must still deliver snapshots (the mesh
// works, balanced without a preference), with the refused list counted and
// logged, not hang waiting for a list the API server will never give.
func TestSourceWithoutNodeAccess(t *testing.T) {
	t.Parallel()
	c := kubetest.Start(t)
	client := c.Client(t)
	ctx := t.Context()
	createNamespace(t, client, "apps", map[string]string{"istio.io/dataplane-mode": "ambient"})
	createRunningPod(t, client, "apps", "web", "node-a", "10.244.1.5", "")
	if _, err := client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a",
		Labels: map[string]string{corev1.LabelTopologyZone: "z1"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	all := []string{"get", "list", "watch"}
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "agent-before-nodes"}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces", "pods", "services"}, Verbs: all},
		{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: all},
		{APIGroups: []string{"node.k8s.io"}, Resources: []string{"runtimeclasses"}, Verbs: all},
		{APIGroups: []string{"security.istio.io"}, Resources: []string{"peerauthentications", "authorizationpolicies"}, Verbs: all},
	}}
	if _, err := client.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "agent-before-nodes"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role.Name},
		Subjects: []rbacv1.Subject{{Kind: "User", APIGroup: "rbac.authorization.k8s.io", Name: "agent-before-nodes"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	limited := rest.CopyConfig(c.Config)
	limited.Impersonate = rest.ImpersonationConfig{UserName: "agent-before-nodes"}
	if _, err := k8s.NewForConfigOrDie(limited).CoreV1().Nodes().List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("listing nodes as the limited user: %v, want forbidden", err)
	}
	m := source.NewMetrics(nil)
	w := runSourceWith(t, kubernetes.Config{RestConfig: limited, Metrics: m, PolicyRecheck: 200 * time.Millisecond})
	snap := w.waitFor(t, "a snapshot with apps/web", func(s source.Snapshot) bool {
		return slices.ContainsFunc(s.Workloads, withIP("apps", "web", "10.244.1.5"))
	})
	if web := snap.Workloads[slices.IndexFunc(snap.Workloads, isWorkload("apps", "web"))]; web.Zone != "" {
		t.Errorf("apps/web in zone %q though the nodes cannot be read", web.Zone)
	}
	deadline := time.Now().Add(waitTimeout)
	for errorCount(t, m, source.ReasonListWatch) < 1 {
		if time.Now().After(deadline) {
			t.Fatal("the refused node list was not counted as a list_watch error")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
