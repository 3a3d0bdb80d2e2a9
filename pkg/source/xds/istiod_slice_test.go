package xds

import (
	"context"
	"log/slog"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/workload"
	"github.com/redirector-mesh/redirector/test/istiotest"
)

// TestIstiodEndpointSliceRange: what TestMergeRangeKeptOverEndpointSliceAddress
// stands for, with a real istiod: a selector-less Service's hand-made
// EndpointSlice at an address in a ServiceEntry's range is sent as a
// HOST_NETWORK workload, and the range stays.
func TestIstiodEndpointSliceRange(t *testing.T) {
	cp := istiotest.StartControlPlane(t)
	cs := cp.Client
	ctx := context.Background()
	for _, ns := range []string{"shop", "egress"} {
		if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cs.CoreV1().Services("shop").Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "legacy-db"},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.40", Ports: []corev1.ServicePort{{Name: "pg", Port: 5432, TargetPort: intstr.FromInt32(5432)}}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tcp, port, name := corev1.ProtocolTCP, int32(5432), "pg"
	if _, err := cs.DiscoveryV1().EndpointSlices("shop").Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "legacy-db-1", Labels: map[string]string{discoveryv1.LabelServiceName: "legacy-db"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{"203.0.113.5"}}},
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &port, Protocol: &tcp}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	createServiceEntry(t, cp.Dynamic, "egress", "partners", map[string]any{
		"hosts": []any{"partners.example"}, "addresses": []any{"203.0.113.0/24"}, "resolution": "STATIC",
		"ports":     []any{map[string]any{"number": int64(5432), "name": "tcp", "protocol": "TCP"}},
		"endpoints": []any{map[string]any{"address": "198.51.100.7"}}})

	snaps := istiodSnapshots(t, cp)

	deadline := time.After(60 * time.Second)
	for {
		var s *Snapshot
		select {
		case s = <-snaps:
		case <-deadline:
			t.Fatal("istiod sent no workload for the slice's endpoint and no range")
		}
		var slice *Workload
		for _, w := range s.Workloads {
			if strings.Contains(w.UID, "/EndpointSlice/shop/legacy-db-1/") {
				slice = w
			}
		}
		var ranged bool
		for _, svc := range s.Services {
			ranged = ranged || svc.Hostname == "partners.example" && len(svc.CIDRs) == 1
		}
		if slice == nil || !ranged {
			continue
		}
		if !slice.HostNetwork {
			t.Fatalf("the slice's endpoint %+v: istiod no longer marks it HOST_NETWORK", slice)
		}
		snap, errs := merge(webOnNodeA(), s, "node1", selection.Config{}, nil)
		for _, err := range errs {
			if strings.Contains(err.Error(), "203.0.113.0/24") {
				t.Errorf("the egress range was left out: %v", err)
			}
		}
		dir, _ := workload.NewDirectory(snap.Workloads, snap.Services)
		if svc, ok := dir.ServiceByVIPFor(netip.MustParseAddr("203.0.113.9"), "shop"); !ok || svc.Hostname != "partners.example" {
			t.Errorf("203.0.113.9 goes to %v, want the egress entry's range", svc)
		}
		return
	}
}

// createServiceEntry creates the ServiceEntry ns/name with spec, for istiod to send as a
// service (and its endpoints as workloads).
func createServiceEntry(t *testing.T, dyn dynamic.Interface, ns, name string, spec map[string]any) {
	t.Helper()
	se := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
		"metadata": map[string]any{"name": name, "namespace": ns},
		"spec":     spec,
	}}
	gvr := schema.GroupVersionResource{Group: "networking.istio.io", Version: "v1", Resource: "serviceentries"}
	if _, err := dyn.Resource(gvr).Namespace(ns).Create(context.Background(), se, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// istiodSnapshots runs a client of cp's istiod as node1's agent (istiotest.AgentAccount)
// and returns the snapshots it delivers.
func istiodSnapshots(t *testing.T, cp *istiotest.ControlPlane) <-chan *Snapshot {
	t.Helper()
	token := istiotest.AgentToken(t, cp.Client, istiotest.AgentAccount, "node1", istiotest.Audience)
	bundle, err := identity.LoadBundle(cp.Istiod.RootCertFile, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := Dial(cp.Istiod.Addr, "", bundle)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c, err := New(Config{Conn: conn, Token: TokenFile(token), Metrics: NewMetrics(nil), Logger: slog.New(slog.DiscardHandler),
		Node: Node{IP: netip.MustParseAddr("127.0.0.1"), PodName: "redirector-node1", PodNamespace: istiotest.Namespace, NodeName: "node1", ClusterID: istiotest.ClusterID}})
	if err != nil {
		t.Fatal(err)
	}
	snaps := make(chan *Snapshot, 64)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Run(ctx, func(s *Snapshot) {
			select {
			case snaps <- s:
			case <-ctx.Done():
			}
		})
	}()
	t.Cleanup(func() { cancel(); <-done })
	return snaps
}
