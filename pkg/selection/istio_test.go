package selection

import (
	"fmt"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	istioutil "istio.io/istio/cni/pkg/util"
)

// istioSelectors are istio-cni's default ambient.enablementSelectors
// (manifests/charts/istio-cni/values.yaml of the Istio version in go.mod):
// a pod labelled ambient, or a pod not labelled none in a namespace
// labelled ambient.
var istioSelectors = []istioutil.EnablementSelector{
	{PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{DataplaneModeLabel: DataplaneModeAmbient}}},
	{
		PodSelector: metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: DataplaneModeLabel, Operator: metav1.LabelSelectorOpNotIn, Values: []string{DataplaneModeNone}},
		}},
		NamespaceSelector: metav1.LabelSelector{MatchLabels: map[string]string{DataplaneModeLabel: DataplaneModeAmbient}},
	},
}

// istioEnrolls is what istio-cni's node agent decides for a running pod
// with an IP (cni/pkg/nodeagent/informers.go, reconcilePod): the
// enablement selectors (which leave out hostNetwork and sidecar pods), the
// excluded namespaces, and pods that finished.
func istioEnrolls(t *testing.T, exclude []string, ns *corev1.Namespace, pod *corev1.Pod) bool {
	t.Helper()
	sel, err := istioutil.NewCompiledEnablementSelectors(istioSelectors)
	if err != nil {
		t.Fatal(err)
	}
	return sel.Matches(pod, ns.Labels) && !slices.Contains(exclude, pod.Namespace) && !podTerminal(pod)
}

// podTerminal is Istio's kube.CheckPodTerminal (pkg/kube/util.go), copied:
// importing that package pulls in most of Istio.
func podTerminal(pod *corev1.Pod) bool {
	return pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded
}

// TestDecideAsIstio: Decide enrolls exactly the pods Istio ambient's own
// code (istio-cni's enablement selectors, excluded namespaces and
// terminal check, called here) enrolls, over every combination of the
// inputs either reads: the dataplane-mode label on pod and namespace with
// odd values (other case, empty), the sidecar status annotation (empty
// too), hostNetwork, an excluded namespace and the pod's phase; and inputs
// neither lets decide: sidecar injection labels, istio-injection and
// istio.io/rev, the redirection annotation, a mirror pod. Istio's own
// waypoints, ztunnel, istio-cni and istiod are out by the
// istio.io/dataplane-mode=none their templates set; an Istio ingress
// gateway (kube-gateway template, no such label) in an ambient namespace
// is in, in Istio as here.
func TestDecideAsIstio(t *testing.T) {
	exclude := []string{"kube-system"}
	cfg := Config{ExcludeNamespaces: exclude}
	nsLabels := []map[string]string{
		nil,
		{DataplaneModeLabel: "ambient"},
		{DataplaneModeLabel: "none"},
		{DataplaneModeLabel: "Ambient"},
		{DataplaneModeLabel: ""},
		{DataplaneModeLabel: "ambient", "istio-injection": "enabled"},
		{DataplaneModeLabel: "ambient", "istio.io/rev": "canary"},
		{"istio-injection": "enabled"},
	}
	podLabels := []map[string]string{
		nil,
		{DataplaneModeLabel: "ambient"},
		{DataplaneModeLabel: "none"},
		{DataplaneModeLabel: "None"},
		{DataplaneModeLabel: "Ambient"},
		{DataplaneModeLabel: ""},
		{"sidecar.istio.io/inject": "true"},
		{"sidecar.istio.io/inject": "false", DataplaneModeLabel: "ambient"},
		{"istio.io/rev": "canary"},
		// Istio's waypoint template.
		{"sidecar.istio.io/inject": "false", DataplaneModeLabel: "none", "gateway.networking.k8s.io/gateway-name": "waypoint",
			"gateway.istio.io/managed": "istio.io-mesh-controller"},
		// Istio's ingress gateway template (kube-gateway.yaml).
		{"sidecar.istio.io/inject": "false", "gateway.networking.k8s.io/gateway-name": "ingress",
			"gateway.istio.io/managed": "istio.io-gateway-controller"},
		// ztunnel's and istiod's pods.
		{"app": "ztunnel", DataplaneModeLabel: "none"},
		{"app": "istiod", DataplaneModeLabel: "none"},
	}
	annotations := []map[string]string{
		nil,
		{SidecarStatusAnnotation: `{"containers":["istio-proxy"]}`},
		{SidecarStatusAnnotation: ""},
		{RedirectionAnnotation: "enabled"},
		{"sidecar.istio.io/inject": "false"},
		{"kubernetes.io/config.mirror": "6c1a5e0e0b2e4c3f9d1e8a7b6c5d4e3f"},
	}
	phases := []corev1.PodPhase{corev1.PodRunning, corev1.PodPending, corev1.PodUnknown, corev1.PodSucceeded, corev1.PodFailed}
	n := 0
	for _, nsName := range []string{"shop", "istio-system", "kube-system"} {
		for _, nl := range nsLabels {
			ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: nsName, Labels: nl}}
			for _, pl := range podLabels {
				for _, an := range annotations {
					for _, host := range []bool{false, true} {
						for _, ph := range phases {
							pod := newPod(inNamespace(nsName), phase(ph))
							pod.Labels, pod.Annotations, pod.Spec.HostNetwork = pl, an, host
							want := istioEnrolls(t, exclude, ns, pod)
							d := Decide(cfg, ns, pod, nil)
							if d.Enrolled != want {
								t.Errorf("namespace %s %v, pod labels %v, annotations %v, hostNetwork %v, phase %s: enrolled %v (%s); Istio: %v",
									nsName, nl, pl, an, host, ph, d.Enrolled, d.Reason, want)
							}
							n++
						}
					}
				}
			}
		}
	}
	t.Log(fmt.Sprintf("%d combinations", n))
}
