package netnstest

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

var sampleLine = regexp.MustCompile(`^(\w+)\{(.*)\} (\S+)$`)
var labelPair = regexp.MustCompile(`(\w+)="((?:[^"\\]|\\.)*)"`)

// series returns the label sets of name's samples in a scrape.
func series(text, name string) []map[string]string {
	var out []map[string]string
	for _, line := range strings.Split(text, "\n") {
		m := sampleLine.FindStringSubmatch(line)
		if m == nil || m[1] != name {
			continue
		}
		l := map[string]string{}
		for _, p := range labelPair.FindAllStringSubmatch(m[2], -1) {
			l[p[1]] = p[2]
		}
		out = append(out, l)
	}
	return out
}

// ztunnelLabels are the label names of ztunnel's istio_tcp_* series
// (CommonTrafficLabels with locality, src/proxy/metrics.rs).
var ztunnelLabels = []string{"reporter",
	"source_workload", "source_canonical_service", "source_canonical_revision", "source_workload_namespace",
	"source_principal", "source_app", "source_version", "source_cluster",
	"destination_service", "destination_service_namespace", "destination_service_name",
	"destination_workload", "destination_canonical_service", "destination_canonical_revision", "destination_workload_namespace",
	"destination_principal", "destination_app", "destination_version", "destination_cluster",
	"request_protocol", "response_flags", "connection_security_policy",
	"source_region", "source_zone", "destination_region", "destination_zone"}

// TestIstioTelemetry: Deployment-owned pods talk through a service and
// directly; both agents' istio_tcp_* series carry ztunnel's full label set
// with the Deployments as workloads and the service on both reporters; a
// policy denial is DENY on the server side, CONNECT on the client side,
// counted with both workloads and access-logged.
func TestIstioTelemetry(t *testing.T) {
	deny := `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-9091, namespace: mesh}
spec:
  action: DENY
  rules: [{to: [{operation: {ports: ["9091"]}}]}]`
	ms, client, server := newBookinfoMesh(t, "http", deny)
	HTTPApp(t, server, 8080, "reviews")
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	for range 3 {
		Eventually(t, 10*time.Second, func() error { _, err := CurlFrom(client.Path(), "http://10.96.0.20:9080/"); return err })
	}
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
	if out, err := Curl(client, URL(server.IPv4, 9091)); err == nil {
		t.Errorf("port 9091 is denied by policy, yet curl got %q", out)
	}

	want := map[string]string{
		"source_workload": "productpage-v1", "source_canonical_service": "productpage", "source_canonical_revision": "v1",
		"source_workload_namespace": "mesh", "source_principal": "spiffe://cluster.local/ns/mesh/sa/bookinfo-productpage",
		"source_app": "productpage", "source_version": "v1", "source_cluster": "Kubernetes",
		"destination_workload": "reviews-v2", "destination_canonical_service": "reviews", "destination_canonical_revision": "v2",
		"destination_workload_namespace": "mesh", "destination_principal": "spiffe://cluster.local/ns/mesh/sa/bookinfo-reviews",
		"destination_app": "reviews", "destination_version": "v2", "destination_cluster": "Kubernetes",
		"request_protocol": "tcp", "connection_security_policy": "mutual_tls",
	}
	check := func(reporter string, l map[string]string, extra map[string]string) {
		t.Helper()
		for _, n := range ztunnelLabels {
			if _, ok := l[n]; !ok {
				t.Errorf("%s reporter: series lacks %s: %v", reporter, n, l)
			}
		}
		if len(l) != len(ztunnelLabels) {
			t.Errorf("%s reporter: %d labels, want ztunnel's %d: %v", reporter, len(l), len(ztunnelLabels), l)
		}
		for k, v := range want {
			if l[k] != v {
				t.Errorf("%s reporter: %s=%q, want %q", reporter, k, l[k], v)
			}
		}
		for k, v := range extra {
			if l[k] != v {
				t.Errorf("%s reporter: %s=%q, want %q", reporter, k, l[k], v)
			}
		}
	}
	for i, reporter := range []string{"source", "destination"} {
		var text string
		Eventually(t, 10*time.Second, func() error {
			text = scrape(t, ms.agents[i], "http://127.0.0.1:15020/metrics")
			// The source side knows the service only through the VIP (3
			// connections); the destination side names it for the direct
			// connection too (4).
			if n := map[string]float64{"source": 3, "destination": 4}[reporter]; metricSum(text, "istio_tcp_connections_closed_total", `reporter="`+reporter+`"`, `destination_service_name="reviews"`, `response_flags="-"`) < n {
				return fmt.Errorf("%s reporter: fewer than %v closed connections to reviews", reporter, n)
			}
			if metricSum(text, "istio_tcp_connections_closed_total", `reporter="`+reporter+`"`, `response_flags="`+map[string]string{"source": "CONNECT", "destination": "DENY"}[reporter]+`"`) < 1 {
				return fmt.Errorf("%s reporter: the denied connection is not counted", reporter)
			}
			return nil
		})
		found := 0
		for _, name := range []string{"istio_tcp_connections_opened_total", "istio_tcp_connections_closed_total", "istio_tcp_sent_bytes_total", "istio_tcp_received_bytes_total"} {
			for _, l := range series(text, name) {
				if l["reporter"] != reporter {
					continue
				}
				found++
				flag := l["response_flags"]
				switch {
				case flag == "-" && reporter == "source" && l["destination_service"] == "unknown":
					// The direct connection to the pod's address, as
					// ztunnel's source side reports it: no service.
					check(reporter, l, map[string]string{"destination_service_name": "unknown", "destination_service_namespace": "unknown"})
				case flag == "-":
					// Through the VIP, and on the destination side also
					// directly (ztunnel's guess from the pod's services and
					// the target port).
					check(reporter, l, map[string]string{"destination_service": "reviews.mesh.svc.cluster.local",
						"destination_service_name": "reviews", "destination_service_namespace": "mesh"})
				case reporter == "source" && flag == "CONNECT", reporter == "destination" && flag == "DENY":
					check(reporter, l, nil)
				default:
					t.Errorf("%s reporter: unexpected response_flags %q: %v", reporter, flag, l)
				}
			}
		}
		if found == 0 {
			t.Errorf("%s reporter: no istio_tcp_* series", reporter)
		}
	}
	text := scrape(t, ms.agents[1], "http://127.0.0.1:15020/metrics")
	if got := metricSum(text, "redirector_policy_denials_total", `reason="authorization"`, `source_workload="productpage-v1"`, `destination_workload="reviews-v2"`,
		`source_principal="spiffe://cluster.local/ns/mesh/sa/bookinfo-productpage"`); got != 1 {
		t.Errorf("policy denials with both workloads = %v, want 1", got)
	}

	// Access logs: a completed connection at info on both sides, with the
	// same trace id; the denial with its flag and error.
	ms.agents[0].WaitLog(t, "connection complete", 5*time.Second)
	ms.agents[1].WaitLog(t, "response_flags=DENY", 5*time.Second)
	srcLog, dstLog := ms.agents[0].Log(), ms.agents[1].Log()
	for _, want := range []string{"src.workload=productpage-v1-6c7d8e-abcde", "dst.service=reviews.mesh.svc.cluster.local", "direction=outbound", "bytes_sent=", "trace_id="} {
		if !strings.Contains(srcLog, want) {
			t.Errorf("client agent's access log lacks %s", want)
		}
	}
	trace := regexp.MustCompile(`direction=outbound.*trace_id=([0-9a-f]{32})`).FindStringSubmatch(srcLog)
	if trace == nil || !strings.Contains(dstLog, "trace_id="+trace[1]) {
		t.Errorf("the server agent's access log lacks the client's trace id %v", trace)
	}
	if !regexp.MustCompile(`msg="connection complete".*dst.workload=reviews-v2-5b8d7c-x2x9q.*response_flags=DENY.*error="denied by`).MatchString(dstLog) {
		t.Errorf("no access log line for the denied connection:\n%s", dstLog)
	}
}

// TestBaggageNamesUnknownClient: the server's agent does not know the
// client pod (its manifest lacks it, as with a client in another cluster);
// its istio_tcp_* series name the client from the baggage the client's
// agent sent, as ztunnel's derived source does.
func TestBaggageNamesUnknownClient(t *testing.T) {
	tp := New(t, 2)
	client := tp.Nodes[0].AddPod("productpage-v1-6c7d8e-abcde")
	server := tp.Nodes[1].AddPod("reviews-v2-5b8d7c-x2x9q")
	clientDoc := OwnedPodDoc(client, "mesh", "bookinfo-productpage", "productpage-v1", "6c7d8e", "app=productpage", "version=v1")
	serverDoc := OwnedPodDoc(server, "mesh", "bookinfo-reviews", "reviews-v2", "5b8d7c", "app=reviews", "version=v2")
	dir := t.TempDir()
	full, partial, ca := filepath.Join(dir, "full.yaml"), filepath.Join(dir, "partial.yaml"), filepath.Join(dir, "ca")
	if err := (&Manifest{}).Namespace("mesh", "istio.io/dataplane-mode=ambient").Raw(clientDoc).Raw(serverDoc).Write(full); err != nil {
		t.Fatal(err)
	}
	if err := (&Manifest{}).Namespace("mesh", "istio.io/dataplane-mode=ambient").Raw(serverDoc).Write(partial); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(redirectorBin(), "ca", "init", "--dir", ca).CombinedOutput(); err != nil {
		t.Fatalf("ca init: %v: %s", err, out)
	}
	agents := []*Agent{
		StartAgent(t, tp.Nodes[0], AgentOptions{Binary: redirectorBin(), Manifest: full, CADir: ca}),
		StartAgent(t, tp.Nodes[1], AgentOptions{Binary: redirectorBin(), Manifest: partial, CADir: ca}),
	}
	for _, a := range agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	HTTPApp(t, server, 8080, "reviews")
	Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })

	var l map[string]string
	Eventually(t, 10*time.Second, func() error {
		for _, s := range series(scrape(t, agents[1], "http://127.0.0.1:15020/metrics"), "istio_tcp_connections_closed_total") {
			if s["reporter"] == "destination" {
				l = s
				return nil
			}
		}
		return fmt.Errorf("no destination series yet")
	})
	for k, v := range map[string]string{
		"source_workload": "productpage-v1", "source_canonical_service": "productpage", "source_canonical_revision": "v1",
		"source_workload_namespace": "mesh", "source_app": "productpage-v1", "source_version": "v1", "source_cluster": "Kubernetes",
		"source_principal": "spiffe://cluster.local/ns/mesh/sa/bookinfo-productpage", "destination_workload": "reviews-v2",
	} {
		if l[k] != v {
			t.Errorf("%s=%q, want %q (from the client's baggage): %v", k, l[k], v, l)
		}
	}
}

// newBookinfoMesh starts two nodes with Deployment-owned pods as bookinfo
// names them, productpage-v1 on node 0 and reviews-v2 on node 1 (both in
// the ambient namespace mesh), the reviews Service at 10.96.0.20:9080 with
// targetPort, and the extra documents.
func newBookinfoMesh(t *testing.T, targetPort string, extra ...string) (ms *mesh, client, server *Pod) {
	t.Helper()
	svc := `apiVersion: v1
kind: Service
metadata: {name: reviews, namespace: mesh}
spec:
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20]
  ports:
  - {name: http, port: 9080, targetPort: %s}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: reviews-abc
  namespace: mesh
  labels: {kubernetes.io/service-name: reviews}
addressType: IPv4
ports:
- {name: http, port: 8080}
endpoints:
- addresses: ["%s"]
  conditions: {ready: true}`
	ms = newMesh(t, func(tp *Topology, m *Manifest) {
		client = tp.Nodes[0].AddPod("productpage-v1-6c7d8e-abcde")
		server = tp.Nodes[1].AddPod("reviews-v2-5b8d7c-x2x9q")
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").
			Raw(OwnedPodDoc(client, "mesh", "bookinfo-productpage", "productpage-v1", "6c7d8e", "app=productpage", "version=v1")).
			Raw(OwnedPodDoc(server, "mesh", "bookinfo-reviews", "reviews-v2", "5b8d7c", "app=reviews", "version=v2")).
			Raw(fmt.Sprintf(svc, targetPort, server.IPv4))
		for _, doc := range extra {
			m.Raw(doc)
		}
	})
	return ms, client, server
}
