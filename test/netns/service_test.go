package netnstest

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"
)

const (
	vip4 = "10.96.0.10"
	vip6 = "fd00:10:96::10"
)

func serviceDocs(endpoints ...*Pod) string {
	var eps strings.Builder
	for _, p := range endpoints {
		fmt.Fprintf(&eps, "- addresses: [%q]\n  conditions: {ready: true}\n", p.IPv4)
	}
	return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: web, namespace: mesh}
spec:
  clusterIP: %s
  clusterIPs: [%s, %q]
  ipFamilies: [IPv4, IPv6]
  selector: {app: web}
  ports:
  - {name: http, port: 80, targetPort: http}
  - {name: nothing, port: 81, targetPort: nope}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: mesh
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: http, port: 8080}
endpoints:
%s---
apiVersion: v1
kind: Service
metadata: {name: manual, namespace: mesh}
spec:
  clusterIP: 10.96.0.11
  ports:
  - {name: web, port: 80, targetPort: http}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: manual-1
  namespace: mesh
  labels: {kubernetes.io/service-name: manual}
addressType: IPv4
endpoints:
- addresses: [%q]
`, vip4, vip4, vip6, eps.String(), endpoints[0].IPv4)
}

// TestServiceVIP: a client calls a service VIP backed by three meshed pods
// on two nodes, with STRICT on the servers.
func TestServiceVIP(t *testing.T) {
	strict := strictMesh
	var client, plain, s1, s2, s3 *Pod
	ms := newMesh(t, func(top *Topology, m *Manifest) {
		client, plain = top.Nodes[0].AddPod("client"), top.Nodes[0].AddPod("plain")
		s1, s2, s3 = top.Nodes[0].AddPod("s1"), top.Nodes[1].AddPod("s2"), top.Nodes[1].AddPod("s3")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
			Pod(client, "mesh", "client").Pod(plain, "plain", "default").
			Pod(s1, "mesh", "web", "app=web").Pod(s2, "mesh", "web", "app=web").Pod(s3, "mesh", "web", "app=web").
			Raw(strict).Raw(serviceDocs(s1, s2, s3))
	})
	HTTPApp(t, s1, 8080, "s1")
	HTTPApp(t, s2, 8080, "s2")
	app3 := HTTPApp(t, s3, 8080, "s3")
	ms.agents[0].WaitLog(t, "pod enrolled", 10*time.Second)
	ms.agents[1].WaitLog(t, "pod enrolled", 10*time.Second)

	hits := func(n int, url string) map[string]int {
		t.Helper()
		got := map[string]int{}
		for i := 0; i < n; i++ {
			out, err := Curl(client, url)
			if err != nil {
				t.Fatalf("call %d to %s: %v", i, url, err)
			}
			got[strings.Fields(out)[0]]++
		}
		return got
	}
	stop := Capture(t, client.Node.Path(), "uplink")
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, "http://"+vip4+"/"); return err })
	got := hits(30, "http://"+vip4+"/service-marker-55e1")
	for _, s := range []string{"s1", "s2", "s3"} {
		if got[s] == 0 {
			t.Errorf("endpoint %s got no traffic: %v", s, got)
		}
	}
	// IPv6 VIP, balanced onto the same (IPv4) endpoints.
	if _, err := Curl(client, "http://["+vip6+"]/"); err != nil {
		t.Errorf("IPv6 VIP: %v", err)
	}
	wire := stop()
	if bytes.Contains(wire, []byte("service-marker-55e1")) {
		t.Error("service request seen in plaintext between the nodes")
	}
	// STRICT still holds on the endpoints for plaintext clients.
	if out, err := Curl(plain, URL(s2.IPv4, 8080)); err == nil {
		t.Errorf("plaintext reached a STRICT endpoint: %q", out)
	}
	// A selector-less service with a hand-made slice that names no ports:
	// the named targetPort resolves through the endpoint pod's container ports.
	if out, err := Curl(client, "http://10.96.0.11/"); err != nil || !strings.HasPrefix(out, "s1 ") {
		t.Errorf("named targetPort via container ports: %q %v", out, err)
	}
	// A service port no endpoint serves is refused with a reason.
	if out, err := Curl(client, "http://"+vip4+":81/"); err == nil {
		t.Errorf("port without endpoints answered %q", out)
	}
	ms.agents[0].WaitLog(t, "no ready endpoint serves the port", 2*time.Second)
	if got := metricSum(scrape(t, ms.agents[0], "http://127.0.0.1:15020/metrics"), "redirector_fail_closed_total", `reason="no_endpoint"`); got < 1 {
		t.Errorf("refused service connection not counted: redirector_fail_closed_total{reason=no_endpoint} = %v", got)
	}
	out, err := Exec(t.Context(), ms.agents[0].Node.Path(), redirectorBin(), "inspect", "services")
	if err != nil || !strings.Contains(string(out), vip4) || !strings.Contains(string(out), s2.IPv4.String()) {
		t.Errorf("inspect services: %v\n%s", err, out)
	}

	// s3 leaves the slice: no new connection reaches it after a second.
	m := baseServiceManifest(client, plain, s1, s2, s3, strict).Raw(serviceDocs(s1, s2))
	if err := m.Write(ms.manifest); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if got := hits(20, "http://"+vip4+"/"); got["s3"] != 0 {
		t.Errorf("removed endpoint s3 still got %d of 20 connections", got["s3"])
	}

	// s3's app is down but its endpoint is listed again: the client still
	// succeeds every time; s3 is skipped after failing once. (A pod gone
	// from the source with its sandbox alive is sealed, and refuses what
	// reaches it, see TestDeletedPodSealed.)
	app3.Close()
	m = baseServiceManifest(client, plain, s1, s2, s3, strict).Raw(serviceDocs(s1, s2, s3))
	if err := m.Write(ms.manifest); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	got = hits(20, "http://"+vip4+"/")
	if got["s1"]+got["s2"] != 20 {
		t.Errorf("with a dead endpoint listed, answers were %v", got)
	}
}

func baseServiceManifest(client, plain, s1, s2, s3 *Pod, strict string) *Manifest {
	return (&Manifest{}).Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
		Pod(client, "mesh", "client").Pod(plain, "plain", "default").
		Pod(s1, "mesh", "web", "app=web").Pod(s2, "mesh", "web", "app=web").Pod(s3, "mesh", "web", "app=web").
		Raw(strict)
}
