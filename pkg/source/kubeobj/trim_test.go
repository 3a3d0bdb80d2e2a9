package kubeobj

import (
	"reflect"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/redirector-mesh/redirector/pkg/selection"
)

// fullPod is a pod with every field a real one has that matters here, and
// many that do not.
func fullPod() *corev1.Pod {
	yes, no := true, false
	kata := "kata"
	p := pod("shop", "reviews-v2-5b8d7c9f6-x2x9q", "node-a", "10.0.0.5", "fd00::5")
	p.GenerateName = "reviews-v2-5b8d7c9f6-"
	p.ResourceVersion = "42"
	p.Labels = map[string]string{"app": "reviews", "version": "v2", "pod-template-hash": "5b8d7c9f6",
		"service.istio.io/canonical-revision": "v2"}
	p.Annotations = map[string]string{
		"kubectl.kubernetes.io/last-applied-configuration": `{"big":"blob"}`,
		"prometheus.io/scrape":                             "true",
		selection.RedirectionAnnotation:                    "enabled",
		selection.BypassInboundAnnotation:                  "true",
		selection.DNSCaptureAnnotation:                     "false",
	}
	p.OwnerReferences = []metav1.OwnerReference{
		{APIVersion: "v1", Kind: "ConfigMap", Name: "not-the-controller", Controller: &no},
		{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "reviews-v2-5b8d7c9f6", UID: "rs-uid", Controller: &yes, BlockOwnerDeletion: &yes},
	}
	p.Finalizers = []string{"example.com/keep"}
	p.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubelet", Operation: metav1.ManagedFieldsOperationUpdate}}
	p.Spec.ServiceAccountName = "reviews"
	p.Spec.RuntimeClassName = &kata
	p.Spec.Volumes = []corev1.Volume{{Name: "token"}}
	p.Spec.InitContainers = []corev1.Container{
		{Name: "init", Image: "init:1", Ports: []corev1.ContainerPort{{Name: "setup", ContainerPort: 7000}}}, // runs to completion: no target
		{Name: "side", Image: "side:1", RestartPolicy: new(corev1.ContainerRestartPolicyAlways), Ports: []corev1.ContainerPort{{ContainerPort: 1}, {Name: "admin", ContainerPort: 9000, Protocol: corev1.ProtocolTCP}}},
	}
	p.Spec.Containers = []corev1.Container{
		{Name: "app", Image: "app:1", Command: []string{"/app"}, Env: []corev1.EnvVar{{Name: "A", Value: "b"}},
			Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, HostPort: 80}, {ContainerPort: 9090}}},
		{Name: "noports", Image: "side:1"},
		{Name: "other", Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8081}}},
	}
	p.Spec.Tolerations = []corev1.Toleration{{Key: "k", Operator: corev1.TolerationOpExists}}
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "app", Ready: true, ImageID: "sha256:abc"}}
	p.Status.HostIP = "192.0.2.1"
	return &p
}

// TestTrimmedTranslatesAlike: whatever the selection rules and the
// translation read survives NewCompactPod, TrimNamespace, TrimService and
// TrimEndpointSlice, so the Kubernetes source, which caches only trimmed
// objects, translates every object as it would the full one.
func TestTrimmedTranslatesAlike(t *testing.T) {
	now := metav1.NewTime(time.Unix(1700000000, 0))
	nsAmbient := ambientNamespace("shop")
	nsAmbient.Labels["team"] = "a"
	nsAmbient.Annotations = map[string]string{"note": "x"}
	nsPlain := corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{"team": "a"}}}
	handlers := map[string]string{"kata": "kata-qemu"}
	lookup := func(c string) (string, bool) { h, ok := handlers[c]; return h, ok }

	variants := map[string]func(p *corev1.Pod){
		"as is":            func(*corev1.Pod) {},
		"sidecar":          func(p *corev1.Pod) { p.Annotations[selection.SidecarStatusAnnotation] = "{}" },
		"label none":       func(p *corev1.Pod) { p.Labels[selection.DataplaneModeLabel] = "none" },
		"label ambient":    func(p *corev1.Pod) { p.Labels[selection.DataplaneModeLabel] = "ambient" },
		"host network":     func(p *corev1.Pod) { p.Spec.HostNetwork = true },
		"terminating":      func(p *corev1.Pod) { p.DeletionTimestamp = &now },
		"succeeded":        func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded },
		"pending, no IP":   func(p *corev1.Pod) { p.Status.Phase, p.Status.PodIP, p.Status.PodIPs = corev1.PodPending, "", nil },
		"podIP only":       func(p *corev1.Pod) { p.Status.PodIPs = nil },
		"bad IP":           func(p *corev1.Pod) { p.Status.PodIPs[0].IP = "127.0.0.1" },
		"unknown class":    func(p *corev1.Pod) { p.Spec.RuntimeClassName = new("gvisor") },
		"no annotations":   func(p *corev1.Pod) { p.Annotations = nil },
		"workload label":   func(p *corev1.Pod) { p.Labels["service.istio.io/workload-name"] = "named" },
		"cronjob":          func(p *corev1.Pod) { p.OwnerReferences[1].Kind, p.OwnerReferences[1].Name = "Job", "backup-28391040" },
		"no generate name": func(p *corev1.Pod) { p.GenerateName = "" },
		"mirror pod":       func(p *corev1.Pod) { p.Annotations[MirrorPodAnnotation] = "6c1a5e0e0b2e4c3f9d1e8a7b6c5d4e3f" },
	}
	for _, cfg := range []selection.Config{{}, {ExcludeNamespaces: []string{"shop"}}, {SkipRuntimeClasses: []string{"kata-qemu"}}, {SkipRuntimeClasses: []string{"runc"}}} {
		for _, ns := range []*corev1.Namespace{&nsAmbient, &nsPlain, nil} {
			for name, change := range variants {
				full := fullPod()
				change(full)
				trimmedNS := ns
				if ns != nil {
					trimmedNS = TrimNamespace(ns)
				}
				compact := NewCompactPod(full)
				want, wantErr := Pod(cfg, ns, full, lookup)
				got, gotErr := Pod(cfg, trimmedNS, compact.Pod(), lookup)
				if !reflect.DeepEqual(got, want) || !reflect.DeepEqual(gotErr, wantErr) {
					t.Errorf("%s, %+v, namespace labels %v: trimmed pod gives\n%+v, %v\nfull pod gives\n%+v, %v",
						name, cfg, ns != nil && ns.Labels != nil, got, gotErr, want, wantErr)
				}
				if again := NewCompactPod(compact.Pod()); !reflect.DeepEqual(again, compact) {
					t.Errorf("%s: compacting a compacted pod changed it:\n%+v\n%+v", name, again, compact)
				}
				if cp := compact.DeepCopyObject(); !reflect.DeepEqual(cp, compact) {
					t.Errorf("%s: DeepCopyObject = %+v, want %+v", name, cp, compact)
				}
			}
		}
	}

	compact := NewCompactPod(fullPod())
	if compact.ManagedFields != nil || compact.Finalizers != nil || len(compact.NamedPorts) != 2 || len(compact.Annotations) != 3 ||
		len(compact.OwnerReferences) != 1 || compact.OwnerReferences[0].UID != "" {
		t.Errorf("NewCompactPod kept what translation does not read: %+v", compact)
	}

	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web", Labels: map[string]string{"a": "b"}, Annotations: map[string]string{"c": "d"}},
		Spec: corev1.ServiceSpec{
			ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10", "fd00:96::10"}, Selector: map[string]string{"app": "web"},
			Ports: []corev1.ServicePort{
				{Name: "http", Port: 80, TargetPort: intstr.FromString("http"), AppProtocol: new("http"), NodePort: 30080},
				{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP, TargetPort: intstr.FromInt32(5353)},
			},
			SessionAffinity:       corev1.ServiceAffinityClientIP,
			InternalTrafficPolicy: new(corev1.ServiceInternalTrafficPolicyLocal),
		},
	}
	wantSvc, wantErr := Service(svc)
	if !wantSvc.NodeLocal {
		t.Error("a service with internalTrafficPolicy: Local is not NodeLocal")
	}
	gotSvc, gotErr := Service(TrimService(svc))
	if !reflect.DeepEqual(gotSvc, wantSvc) || !reflect.DeepEqual(gotErr, wantErr) {
		t.Errorf("trimmed service gives %+v, %v; full %+v, %v", gotSvc, gotErr, wantSvc, wantErr)
	}

	ready, notReady := true, false
	es := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web-1",
			Labels: map[string]string{discoveryv1.LabelServiceName: "web", "endpointslice.kubernetes.io/managed-by": "x"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{
			{Addresses: []string{"10.0.0.5", "10.0.0.55"}, Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &ready},
				NodeName: new("node-a"), TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: "shop", Name: "web-1", UID: "u-1", ResourceVersion: "9"}},
			{Addresses: []string{"10.0.0.6"}, Conditions: discoveryv1.EndpointConditions{Ready: &notReady}},
			{Addresses: []string{"10.0.0.7"}},
			{Addresses: []string{"bad"}},
			{},
		},
		Ports: []discoveryv1.EndpointPort{{Name: new("http"), Port: new(int32(8080))}},
	}
	trimmedES := TrimEndpointSlice(es)
	if SliceService(trimmedES) != SliceService(es) {
		t.Errorf("trimmed slice belongs to %s, full to %s", SliceService(trimmedES), SliceService(es))
	}
	wantEps, wantErrs := Endpoints([]*discoveryv1.EndpointSlice{es})
	gotEps, gotErrs := Endpoints([]*discoveryv1.EndpointSlice{trimmedES})
	if !reflect.DeepEqual(gotEps, wantEps) || !reflect.DeepEqual(gotErrs, wantErrs) {
		t.Errorf("trimmed slice gives %+v, %v; full %+v, %v", gotEps, gotErrs, wantEps, wantErrs)
	}
	if r := trimmedES.Endpoints[0].TargetRef; r == nil || *r != (corev1.ObjectReference{Kind: "Pod", Name: "web-1"}) || len(trimmedES.Labels) != 1 {
		t.Errorf("TrimEndpointSlice kept what translation does not read, or lost the pod it names: %+v", trimmedES)
	}
	// The pod an endpoint names, in the slice's namespace when its
	// reference names none: the directory tells an endpoint of a pod it
	// has not seen yet from one of no pod.
	if len(gotEps) == 0 || gotEps[0].PodNamespace != "shop" || gotEps[0].PodName != "web-1" || gotEps[1].PodName != "" {
		t.Errorf("endpoints name pods %+v, want shop/web-1 for the first and none for the second", gotEps)
	}
}

// TestTrimmedKeepsWaypoints: the waypoint rules read Service and namespace
// labels; trimmed objects translate to the same waypoints as full ones.
func TestTrimmedKeepsWaypoints(t *testing.T) {
	full := Objects{
		Namespaces: []corev1.Namespace{{ObjectMeta: metav1.ObjectMeta{Name: "shop",
			Labels: map[string]string{selection.DataplaneModeLabel: "ambient", UseWaypointLabel: "wp", "team": "a"}}}},
		Services: []corev1.Service{
			{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "wp", Labels: map[string]string{WaypointForLabel: "all", GatewayNameLabel: "wp", "x": "y"}}},
			{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web", Labels: map[string]string{"a": "b"}}},
			{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "direct", Labels: map[string]string{UseWaypointLabel: "none"}}},
		},
		Pods: []corev1.Pod{*fullPod()},
	}
	trimmed := Objects{Pods: []corev1.Pod{*NewCompactPod(fullPod()).Pod()}}
	for i := range full.Namespaces {
		trimmed.Namespaces = append(trimmed.Namespaces, *TrimNamespace(&full.Namespaces[i]))
	}
	for i := range full.Services {
		trimmed.Services = append(trimmed.Services, *TrimService(&full.Services[i]))
	}
	want, _ := Translate(full, selection.Config{})
	got, _ := Translate(trimmed, selection.Config{})
	if !reflect.DeepEqual(got, want) {
		t.Errorf("trimmed objects translate to\n%+v\nfull ones to\n%+v", got, want)
	}
	waypoints := 0
	for _, s := range want.Services {
		if s.Waypoint != nil {
			waypoints++
		}
	}
	for _, w := range want.Workloads {
		if w.Waypoint != nil {
			waypoints++
		}
	}
	if waypoints != 2 { // web and the pod; not the waypoint itself, not direct
		t.Errorf("%d objects with a waypoint, want 2 (the test must exercise the rules)", waypoints)
	}
}
