package kubeobj

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

func service(ns, name string, labels map[string]string) corev1.Service {
	return corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80}}}}
}

// istio.io/use-waypoint on a namespace, Service or Pod gives it the waypoint
// (named by its Service) for the traffic the waypoint's
// istio.io/waypoint-for takes, as istiod does.
func TestUseWaypointLabels(t *testing.T) {
	ns := ambientNamespace("shop")
	ns.Labels[UseWaypointLabel] = "waypoint"
	infra := ambientNamespace("infra")
	withLabel := func(p corev1.Pod, kv ...string) corev1.Pod {
		for i := 0; i < len(kv); i += 2 {
			p.Labels[kv[i]] = kv[i+1]
		}
		return p
	}
	objs := Objects{
		Namespaces: []corev1.Namespace{ns, infra},
		Services: []corev1.Service{
			service("shop", "waypoint", map[string]string{GatewayNameLabel: "waypoint"}), // for: service (default)
			service("shop", "pods-wp", map[string]string{WaypointForLabel: "workload"}),
			service("infra", "all-wp", map[string]string{WaypointForLabel: "all"}),
			service("infra", "off-wp", map[string]string{WaypointForLabel: "none"}),
			service("shop", "web", nil), // the namespace's
			service("shop", "opted-out", map[string]string{UseWaypointLabel: "none"}), // none
			service("shop", "cross", map[string]string{UseWaypointLabel: "all-wp", UseWaypointNamespaceLabel: "infra"}),
			service("shop", "to-pods-wp", map[string]string{UseWaypointLabel: "pods-wp"}), // takes no service traffic
			service("shop", "missing", map[string]string{UseWaypointLabel: "nope"}),       // no such waypoint
			service("infra", "off", map[string]string{UseWaypointLabel: "off-wp"}),
		},
		Pods: []corev1.Pod{
			pod("shop", "app", "n1", "10.0.0.1"), // namespace's waypoint is for services only
			withLabel(pod("shop", "reviews", "n1", "10.0.0.2"), UseWaypointLabel, "pods-wp"),
			withLabel(pod("shop", "ratings", "n1", "10.0.0.3"), UseWaypointLabel, "all-wp", UseWaypointNamespaceLabel, "infra"),
			withLabel(pod("shop", "waypoint-6f7b", "n1", "10.0.0.9"), GatewayNameLabel, "waypoint", UseWaypointLabel, "waypoint"),
		},
	}
	snap, errs := Translate(objs, selection.Config{})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	got := map[string]*workload.Waypoint{}
	for _, s := range snap.Services {
		got["svc "+s.String()] = s.Waypoint
	}
	for _, w := range snap.Workloads {
		got["pod "+w.String()] = w.Waypoint
	}
	shopWP := "shop/waypoint.shop.svc.cluster.local"
	for name, want := range map[string]string{
		"svc shop/web":           shopWP,
		"svc shop/waypoint":      "", // the waypoint itself
		"svc shop/opted-out":     "",
		"svc shop/cross":         "infra/all-wp.infra.svc.cluster.local",
		"svc shop/to-pods-wp":    "",
		"svc shop/missing":       "",
		"svc infra/off":          "",
		"pod shop/app":           "",
		"pod shop/reviews":       "shop/pods-wp.shop.svc.cluster.local",
		"pod shop/ratings":       "infra/all-wp.infra.svc.cluster.local",
		"pod shop/waypoint-6f7b": "",
	} {
		wp, ok := got[name]
		if !ok {
			t.Errorf("%s: not translated", name)
			continue
		}
		have := ""
		if wp != nil {
			have = wp.Namespace + "/" + wp.Hostname
			if wp.HBONEPort != 15008 {
				t.Errorf("%s: HBONE port %d, want 15008", name, wp.HBONEPort)
			}
		}
		if have != want {
			t.Errorf("%s: waypoint %q, want %q", name, have, want)
		}
	}
}

// TestUseWaypointLabelsReadAsIstiod: the labels are read as istiod's
// GetUseWaypoint and fetchWaypointForTarget read them (pilot/pkg/
// serviceregistry/ambient/waypoints.go of the Istio version in go.mod;
// their answers are written out here, the package being too large to
// import): the object's own use-waypoint decides when it is there, empty
// or not, and its own use-waypoint-namespace likewise; and a waypoint has
// no waypoint (fetchWaypointForInstance, the gateway.istio.io/managed
// check of fetchWaypointForService). Until 8 December an empty label
// fell back to the namespace's waypoint, and a waypoint's pods and Service
// took the namespace's other waypoint.
func TestUseWaypointLabelsReadAsIstiod(t *testing.T) {
	ns := ambientNamespace("shop")
	ns.Labels[UseWaypointLabel] = "ns-wp"
	withLabel := func(p corev1.Pod, kv ...string) corev1.Pod {
		for i := 0; i < len(kv); i += 2 {
			p.Labels[kv[i]] = kv[i+1]
		}
		return p
	}
	objs := Objects{
		Namespaces: []corev1.Namespace{ns, ambientNamespace("infra")},
		Services: []corev1.Service{
			// The namespace's waypoint, for all traffic.
			service("shop", "ns-wp", map[string]string{WaypointForLabel: "all", GatewayNameLabel: "ns-wp", GatewayManagedLabel: managedByMeshController}),
			// Another waypoint of the namespace, its Service made by
			// Istio's gateway controller under another name.
			service("shop", "db-wp", map[string]string{WaypointForLabel: "all", GatewayNameLabel: "db-wp", GatewayManagedLabel: managedByMeshController}),
			service("shop", "db-wp-admin", map[string]string{GatewayNameLabel: "db-wp", GatewayManagedLabel: managedByMeshController}),
			service("shop", "eastwest", map[string]string{GatewayManagedLabel: managedByEastWestController}),
			service("shop", "all-wp", map[string]string{WaypointForLabel: "all"}),
			service("infra", "all-wp", map[string]string{WaypointForLabel: "all"}),
			service("shop", "web", nil),
			service("shop", "empty", map[string]string{UseWaypointLabel: ""}),
			service("shop", "empty-ns", map[string]string{UseWaypointLabel: "all-wp", UseWaypointNamespaceLabel: ""}),
			service("shop", "ns-only", map[string]string{UseWaypointNamespaceLabel: "infra"}),
			service("shop", "cross", map[string]string{UseWaypointLabel: "all-wp", UseWaypointNamespaceLabel: "infra"}),
		},
		Pods: []corev1.Pod{
			pod("shop", "app", "n1", "10.0.0.1"),
			withLabel(pod("shop", "empty", "n1", "10.0.0.2"), UseWaypointLabel, ""),
			withLabel(pod("shop", "empty-ns", "n1", "10.0.0.3"), UseWaypointLabel, "all-wp", UseWaypointNamespaceLabel, ""),
			withLabel(pod("shop", "db-wp-5c9d", "n1", "10.0.0.4"), GatewayNameLabel, "db-wp"),
			withLabel(pod("shop", "ns-wp-7f8e", "n1", "10.0.0.5"), GatewayNameLabel, "ns-wp"),
			// Names a gateway that is no Service here: not an instance.
			withLabel(pod("shop", "stray", "n1", "10.0.0.6"), GatewayNameLabel, "gone"),
		},
	}
	snap, errs := Translate(objs, selection.Config{})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	got := map[string]*workload.Waypoint{}
	for _, s := range snap.Services {
		got["svc "+s.String()] = s.Waypoint
	}
	for _, w := range snap.Workloads {
		got["pod "+w.String()] = w.Waypoint
	}
	nsWP := "shop/ns-wp.shop.svc.cluster.local"
	for name, want := range map[string]string{
		"svc shop/web":         nsWP,
		"svc shop/ns-wp":       "",
		"svc shop/db-wp":       "", // a waypoint's Service has none
		"svc shop/db-wp-admin": "", // nor another Service of the waypoint's
		"svc shop/eastwest":    "", // nor an east-west gateway's
		"svc shop/empty":       "", // there, empty: names no waypoint, the namespace's is not taken
		"svc shop/empty-ns":    "", // a namespace label there, empty: no such namespace
		"svc shop/ns-only":     nsWP,
		"svc shop/cross":       "infra/all-wp.infra.svc.cluster.local",
		"pod shop/app":         nsWP,
		"pod shop/empty":       "",
		"pod shop/empty-ns":    "",
		"pod shop/db-wp-5c9d":  "", // an instance of a waypoint has none
		"pod shop/ns-wp-7f8e":  "",
		"pod shop/stray":       nsWP,
	} {
		wp, ok := got[name]
		if !ok {
			t.Errorf("%s: not translated", name)
			continue
		}
		have := ""
		if wp != nil {
			have = wp.Namespace + "/" + wp.Hostname
		}
		if have != want {
			t.Errorf("%s: waypoint %q, want %q (as istiod)", name, have, want)
		}
	}
}
