package netnstest

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/redirector-mesh/redirector/test/istiotest"
)

// TestIstiodXDSTrafficDistribution runs three nodes' agents against a real
// istiod and kube-apiserver. Nodes 1 and 2 are in zone-a, node 3 in zone-b
// (their topology labels, which istiod turns into each workload's
// locality), and a Service with trafficDistribution: PreferClose has an
// endpoint on nodes 2 and 3. istiod sends it as load_balancing FAILOVER by
// network, region and zone, as it does for ztunnel:
//   - a client on node 1 reaches only the endpoint in its own zone; before,
//     the agent balanced over both, and half its connections crossed zones;
//   - when that endpoint stops taking connections, the next zone's serves
//     (failover, not refusal);
//   - the service's preference is in the agent's config dump as ztunnel
//     writes it, and each workload's locality with it.
func TestIstiodXDSTrafficDistribution(t *testing.T) {
	cp := istiotest.StartControlPlane(t)
	cluster, cs, istiod := cp.Cluster, cp.Client, cp.Istiod
	ctx := context.Background()

	tp := New(t, 3)
	client, near, far := tp.Nodes[0].AddPod("client"), tp.Nodes[1].AddPod("near"), tp.Nodes[2].AddPod("far")
	for i, zone := range []string{"zone-a", "zone-a", "zone-b"} {
		if _, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("node%d", i+1),
			Labels: map[string]string{corev1.LabelTopologyRegion: "region-1", corev1.LabelTopologyZone: zone}}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	createNamespace(t, cs, "mesh", map[string]string{"istio.io/dataplane-mode": "ambient"})
	istiotest.CreatePod(t, cs, "mesh", "client", "client-sa", "node1", client.IPv4.String(), client.IPv6.String())
	for _, p := range []struct {
		pod  *Pod
		node string
	}{{near, "node2"}, {far, "node3"}} {
		created := istiotest.CreatePod(t, cs, "mesh", p.pod.Name, "server-sa", p.node, p.pod.IPv4.String(), p.pod.IPv6.String())
		labelReady(t, cs, created, map[string]string{"app": "server"})
	}
	if _, err := cs.CoreV1().Services("mesh").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "server"},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "server"}, ClusterIP: "10.96.0.60",
			TrafficDistribution: ptr(corev1.ServiceTrafficDistributionPreferClose),
			Ports:               []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	agents := startXDSAgents(t, tp, cluster, istiod, istiotest.AgentAccount)
	waitEnrolled(t, agents[0].BPFRoot, 30*time.Second, "mesh/client")
	waitEnrolled(t, agents[1].BPFRoot, 30*time.Second, "mesh/near")
	waitEnrolled(t, agents[2].BPFRoot, 30*time.Second, "mesh/far")
	nearApp := HTTPApp(t, near, 8080, "near")
	HTTPApp(t, far, 8080, "far")

	const vip = "http://10.96.0.60:80/"
	answers := func(n int) (map[string]int, error) {
		got := map[string]int{}
		for range n {
			out, err := Curl(client, vip)
			if err != nil {
				return got, err
			}
			got[strings.Fields(out)[0]]++
		}
		return got, nil
	}
	// Both endpoints known and ready first (one answer each way would
	// do), then every connection stays in the zone.
	Eventually(t, 60*time.Second, func() error {
		out, err := CurlFrom(agents[0].Node.Path(), "http://127.0.0.1:15000/config_dump")
		if err != nil {
			return err
		}
		var dump struct {
			Services []struct {
				Name         string
				LoadBalancer *struct {
					RoutingPreferences []string
					Mode               string
				}
			}
			Workloads []struct {
				Name     string
				Locality *struct{ Region, Zone string }
			}
		}
		if err := json.Unmarshal([]byte(out), &dump); err != nil {
			return fmt.Errorf("config dump: %v", err)
		}
		lb := "no service"
		for _, s := range dump.Services {
			if s.Name == "server" {
				lb = fmt.Sprintf("%+v", s.LoadBalancer)
			}
		}
		if want := "&{RoutingPreferences:[Network Region Zone] Mode:Failover}"; lb != want {
			return fmt.Errorf("node 1's config dump: the service's loadBalancer is %s, want %s", lb, want)
		}
		for _, w := range dump.Workloads {
			if w.Name == "far" && (w.Locality == nil || w.Locality.Zone != "zone-b") {
				return fmt.Errorf("node 1's config dump: far's locality %+v, want zone-b", w.Locality)
			}
		}
		got, err := answers(1)
		if err == nil && got["near"] != 1 {
			err = fmt.Errorf("answers %v", got)
		}
		return err
	})
	got, err := answers(12)
	if err != nil || got["near"] != 12 {
		t.Fatalf("PreferClose: 12 connections from zone-a answered %v (error %v), want all by near, the zone's endpoint", got, err)
	}

	// The zone's endpoint stops taking connections: the next zone's
	// serves, on the same connection attempt.
	nearApp.Close()
	got, err = answers(6)
	if err != nil || got["far"] != 6 {
		t.Fatalf("zone-a's endpoint down: 6 connections answered %v (error %v), want all by far", got, err)
	}
}
