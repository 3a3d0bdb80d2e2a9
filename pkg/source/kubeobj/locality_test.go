package kubeobj

import (
	"fmt"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestTrafficDistribution: a Service's trafficDistribution, which
// kube-proxy honours for unmeshed pods and istiod turns into a routing
// preference for ztunnel, was ignored by the Kubernetes and file sources:
// a meshed pod's connections to a PreferClose service crossed zones. Now
// it gives the Routing istiod would send (field first, then the Service's
// annotation, then its namespace's); pods take their node's locality; an
// unknown annotation value is an error naming it, the service staying
// without a preference; internalTrafficPolicy: Local keeps its node-only
// rule. The trimmed objects the Kubernetes source caches translate alike.
func TestTrafficDistribution(t *testing.T) {
	closeScopes := []workload.Scope{workload.ScopeNetwork, workload.ScopeRegion, workload.ScopeZone}
	nodeScopes := append(closeScopes[:3:3], workload.ScopeSubzone, workload.ScopeNode)
	plainNS := corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{selection.DataplaneModeLabel: "ambient"}}}
	annotatedNS := plainNS
	annotatedNS.Annotations = map[string]string{TrafficDistributionAnnotation: "PreferSameNode", "other": "x"}
	svc := func(name string, field string, annotation string) corev1.Service {
		s := corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: name},
			Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.10", Ports: []corev1.ServicePort{{Name: "http", Port: 80}}}}
		if field != "" {
			s.Spec.TrafficDistribution = &field
		}
		if annotation != "" {
			s.Annotations = map[string]string{TrafficDistributionAnnotation: annotation}
		}
		return s
	}
	local := svc("local", "PreferClose", "")
	local.Spec.InternalTrafficPolicy = new(corev1.ServiceInternalTrafficPolicyLocal)
	for _, tc := range []struct {
		name    string
		ns      corev1.Namespace
		svc     corev1.Service
		want    *workload.Routing
		wantErr string
	}{
		{"none", plainNS, svc("web", "", ""), nil, ""},
		{"PreferClose", plainNS, svc("web", "PreferClose", ""), &workload.Routing{Scopes: closeScopes}, ""},
		{"PreferSameZone", plainNS, svc("web", "PreferSameZone", ""), &workload.Routing{Scopes: closeScopes}, ""},
		{"PreferSameNode", plainNS, svc("web", "PreferSameNode", ""), &workload.Routing{Scopes: nodeScopes}, ""},
		{"the field over the annotation", plainNS, svc("web", "PreferClose", "PreferSameNode"), &workload.Routing{Scopes: closeScopes}, ""},
		{"annotation, any case", plainNS, svc("web", "", "preferclose"), &workload.Routing{Scopes: closeScopes}, ""},
		{"namespace annotation", annotatedNS, svc("web", "", ""), &workload.Routing{Scopes: nodeScopes}, ""},
		{"the Service's annotation over its namespace's", annotatedNS, svc("web", "", "PreferClose"), &workload.Routing{Scopes: closeScopes}, ""},
		{"unknown annotation", plainNS, svc("web", "", "Nearby"), nil, `annotation networking.istio.io/traffic-distribution "Nearby" is not a traffic distribution`},
		{"unknown namespace annotation", corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Annotations: map[string]string{TrafficDistributionAnnotation: "x"}}}, svc("web", "", ""), nil, `namespace shop's annotation`},
		{"internalTrafficPolicy: Local", plainNS, local, nil, ""},
		// A newer API server's value istiod does not know: istiod reads the
		// annotations instead.
		{"a field value not known, then the namespace's annotation", annotatedNS, svc("web", "PreferSameRegion", ""), &workload.Routing{Scopes: nodeScopes}, ""},
		{"a field value not known, then nothing", plainNS, svc("web", "PreferSameRegion", ""), nil, ""},
	} {
		objs := Objects{Namespaces: []corev1.Namespace{tc.ns}, Services: []corev1.Service{tc.svc}}
		trimmed := Objects{Namespaces: []corev1.Namespace{*TrimNamespace(&tc.ns)}, Services: []corev1.Service{*TrimService(&tc.svc)}}
		for which, o := range map[string]Objects{"full": objs, "trimmed": trimmed} {
			snap, errs := Translate(o, selection.Config{})
			if len(snap.Services) != 1 {
				t.Fatalf("%s (%s): %d services, want the one kept", tc.name, which, len(snap.Services))
			}
			if got := snap.Services[0].Routing; !reflect.DeepEqual(got, tc.want) {
				t.Errorf("%s (%s): routing %+v, want %+v", tc.name, which, got, tc.want)
			}
			if tc.wantErr == "" && len(errs) > 0 || tc.wantErr != "" && (len(errs) != 1 || !strings.Contains(errs[0].Error(), tc.wantErr)) {
				t.Errorf("%s (%s): errors %v, want %q", tc.name, which, errs, tc.wantErr)
			}
		}
	}

	node := corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: map[string]string{
		corev1.LabelTopologyRegion: "eu-west", corev1.LabelTopologyZone: "eu-west-1a", SubzoneLabel: "rack7", "kubernetes.io/os": "linux"}}}
	pod := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web-1", UID: "u1"}, Spec: corev1.PodSpec{NodeName: "node-a"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.0.0.5", PodIPs: []corev1.PodIP{{IP: "10.0.0.5"}}}}
	elsewhere := pod
	elsewhere.Name, elsewhere.UID, elsewhere.Spec.NodeName = "web-2", "u2", "node-unknown"
	elsewhere.Status.PodIP, elsewhere.Status.PodIPs = "10.0.0.6", []corev1.PodIP{{IP: "10.0.0.6"}}
	trimmedMeta := TrimNodeMeta(&metav1.PartialObjectMetadata{ObjectMeta: node.ObjectMeta})
	if len(trimmedMeta.Labels) != 3 {
		t.Errorf("TrimNodeMeta kept labels %v, want the three locality labels", trimmedMeta.Labels)
	}
	for which, n := range map[string]corev1.Node{"full": node, "trimmed": {ObjectMeta: trimmedMeta.ObjectMeta}} {
		snap, _ := Translate(Objects{Namespaces: []corev1.Namespace{plainNS}, Pods: []corev1.Pod{pod, elsewhere}, Nodes: []corev1.Node{n}}, selection.Config{})
		if w := snap.Workloads[0]; w.Region != "eu-west" || w.Zone != "eu-west-1a" || w.Subzone != "rack7" {
			t.Errorf("%s node: pod locality %q/%q/%q, want eu-west/eu-west-1a/rack7", which, w.Region, w.Zone, w.Subzone)
		}
		if w := snap.Workloads[1]; w.Region != "" || w.Zone != "" || w.Subzone != "" {
			t.Errorf("pod on a node not known: locality %q/%q/%q, want none", w.Region, w.Zone, w.Subzone)
		}
	}
}

// TestTrafficDistributionErrorBounded: the error for an annotation value
// istiod does not know quoted the whole value, and the Kubernetes source
// logs it each time the Service is translated again (each change of its
// EndpointSlices, each of its namespace): a tenant's Service with a value
// of hundreds of kilobytes made every agent log that much per endpoint
// change. The error quotes the value's start only, still naming it.
func TestTrafficDistributionErrorBounded(t *testing.T) {
	value := "Nearby" + strings.Repeat("x", 200_000)
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web", Annotations: map[string]string{TrafficDistributionAnnotation: value}}}
	r, err := Routing(svc, nil)
	if r != nil || err == nil {
		t.Fatalf("routing %+v, error %v; want none and an error", r, err)
	}
	if msg := err.Error(); len(msg) > 512 || !strings.Contains(msg, `"Nearbyxxx`) || !strings.Contains(msg, "shop/web") {
		t.Errorf("error of %d bytes (%.200s...), want under 512 naming the service and the value's start", len(msg), msg)
	}
}

// TestTrimBoundsTrafficDistributionAnnotation: the Kubernetes source
// caches every Service of the cluster on every node, trimmed to what
// translation reads; the traffic-distribution annotation was kept whole,
// so a tenant's Services with values of up to 256 KiB each were held by
// every agent (as policies' annotations were, before trimPolicy). Only
// the value's start, all translation reads of it, is kept; trimmed and
// full objects still translate alike.
func TestTrimBoundsTrafficDistributionAnnotation(t *testing.T) {
	for _, value := range []string{"PreferSameNode", "Nearby" + strings.Repeat("é", 100_000)} {
		svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web", Annotations: map[string]string{TrafficDistributionAnnotation: value}}}
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Annotations: map[string]string{TrafficDistributionAnnotation: value}}}
		ts, tns := TrimService(svc), TrimNamespace(ns)
		if n, m := len(ts.Annotations[TrafficDistributionAnnotation]), len(tns.Annotations[TrafficDistributionAnnotation]); n > 512 || m > 512 {
			t.Errorf("value of %d bytes: trimmed Service keeps %d bytes of it, Namespace %d; want at most 512", len(value), n, m)
		}
		bare := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web"}}
		for name, pair := range map[string][2][2]any{
			"service":   {{svc, (*corev1.Namespace)(nil)}, {ts, (*corev1.Namespace)(nil)}},
			"namespace": {{bare, ns}, {TrimService(bare), tns}},
		} {
			wantR, wantErr := Routing(pair[0][0].(*corev1.Service), pair[0][1].(*corev1.Namespace))
			gotR, gotErr := Routing(pair[1][0].(*corev1.Service), pair[1][1].(*corev1.Namespace))
			if !reflect.DeepEqual(gotR, wantR) || fmt.Sprint(gotErr) != fmt.Sprint(wantErr) {
				t.Errorf("%s annotation of %d bytes: trimmed gives %+v, %v; full %+v, %v", name, len(value), gotR, gotErr, wantR, wantErr)
			}
		}
	}
}
