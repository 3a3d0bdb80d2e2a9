package netnstest

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/source/xds"
	"github.com/redirector-mesh/redirector/test/istiotest"
	"github.com/redirector-mesh/redirector/test/kubetest"
	"github.com/redirector-mesh/redirector/test/xdstest"
)

// TestIstiodXDSClient runs the xDS source's client against a real istiod
// (built from the istio.io/istio module) and a real kube-apiserver, as a
// node agent with its istio-ca token:
//
//   - istiod serves it as a ztunnel: workloads with identity, node,
//     canonical name and HBONE, a Service and a ServiceEntry with their VIPs,
//     port maps and endpoints;
//   - a STRICT PeerAuthentication and an ALLOW AuthorizationPolicy arrive as
//     compiled Authorization and decide as they should (plaintext denied,
//     the allowed identity admitted on its port, others not);
//   - istiod stopped: no snapshot is delivered, the last state stays;
//     a pod created meanwhile arrives once istiod is back, on the resumed
//     stream, with what was already held still there.
func TestIstiodXDSClient(t *testing.T) {
	cp := istiotest.StartControlPlane(t)
	cs, istiod := cp.Client, cp.Istiod
	ctx := context.Background()

	createNamespace(t, cs, "mesh", map[string]string{"istio.io/dataplane-mode": "ambient"})
	// Pods an agent enrolled carry ambient.istio.io/redirection=enabled;
	// istiod then describes them as HBONE peers.
	for _, p := range []*corev1.Pod{
		istiotest.CreatePod(t, cs, "mesh", "client", "client-sa", "node1", "10.244.1.5"),
		istiotest.CreatePod(t, cs, "mesh", "server", "server-sa", "node2", "10.244.2.5"),
	} {
		p.Annotations = map[string]string{"ambient.istio.io/redirection": "enabled"}
		if p.Name == "server" {
			p.Labels = map[string]string{"app": "server", "service.istio.io/canonical-revision": "v7"}
		}
		if _, err := cs.CoreV1().Pods("mesh").Update(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cs.CoreV1().Services("mesh").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "server"},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "server"}, ClusterIP: "10.96.0.50",
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), AppProtocol: ptr("http")}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	dyn := cp.Dynamic
	apply(t, dyn, "networking.istio.io", "v1", "serviceentries", "mesh", "external", map[string]any{
		"hosts": []any{"db.example.com"}, "addresses": []any{"240.1.1.1"}, "resolution": "STATIC",
		"ports":     []any{map[string]any{"number": int64(5432), "name": "tcp", "protocol": "TCP", "targetPort": int64(15432)}},
		"endpoints": []any{map[string]any{"address": "10.244.2.5"}},
	})

	token := istiotest.AgentToken(t, cs, istiotest.AgentAccount, "node1", istiotest.Audience)
	snaps := xdstest.Watch(t, istiod.Addr, istiod.RootCertFile, token,
		xds.Node{IP: netip.MustParseAddr("127.0.0.1"), PodName: "redirector-node1", PodNamespace: istiotest.Namespace, NodeName: "node1", ClusterID: istiotest.ClusterID})

	var last *xds.Snapshot
	waitFor := func(what string, ok func(*xds.Snapshot) error) {
		t.Helper()
		deadline := time.After(60 * time.Second)
		var err error = fmt.Errorf("no snapshot")
		for {
			if last != nil {
				if err = ok(last); err == nil {
					return
				}
			}
			select {
			case last = <-snaps:
			case <-deadline:
				t.Fatalf("%s: %v", what, err)
			}
		}
	}

	waitFor("workloads and services from istiod", func(s *xds.Snapshot) error {
		srv := findWorkload(s, "server")
		if srv == nil || findWorkload(s, "client") == nil {
			return fmt.Errorf("%d workloads, no client and server", len(s.Workloads))
		}
		if got := srv.Identity(); got != "spiffe://cluster.local/ns/mesh/sa/server-sa" || !srv.Enrolled || srv.Node != "node2" || srv.CanonicalName != "server" || srv.CanonicalRevision != "v7" {
			return fmt.Errorf("server workload %s HBONE=%v node %q canonical %s/%s", got, srv.Enrolled, srv.Node, srv.CanonicalName, srv.CanonicalRevision)
		}
		svc := findService(s, "server.mesh.svc.cluster.local")
		if svc == nil || len(svc.VIPs) != 1 || svc.VIPs[0] != netip.MustParseAddr("10.96.0.50") || len(svc.Endpoints) != 1 || svc.Endpoints[0].Ports["80"] != 8080 {
			return fmt.Errorf("service server: %+v", svc)
		}
		if len(svc.Ports) != 1 || svc.Ports[0].AppProtocol != "HTTP11" {
			return fmt.Errorf("service server ports %+v, want 80 with app protocol HTTP11", svc.Ports)
		}
		se := findService(s, "db.example.com")
		if se == nil || len(se.VIPs) != 1 || se.VIPs[0] != netip.MustParseAddr("240.1.1.1") {
			return fmt.Errorf("service entry: %+v", se)
		}
		return nil
	})
	t.Logf("istiod sent %d workloads, %d services, %d policies", len(last.Workloads), len(last.Services), len(last.Policies))

	// STRICT for the namespace, and only client-sa may reach the server's 8080.
	apply(t, dyn, "security.istio.io", "v1", "peerauthentications", "mesh", "strict", map[string]any{"mtls": map[string]any{"mode": "STRICT"}})
	apply(t, dyn, "security.istio.io", "v1", "authorizationpolicies", "mesh", "allow-client", map[string]any{
		"selector": map[string]any{"matchLabels": map[string]any{"app": "server"}},
		"action":   "ALLOW",
		"rules": []any{map[string]any{
			"from": []any{map[string]any{"source": map[string]any{"principals": []any{"cluster.local/ns/mesh/sa/client-sa"}}}},
			"to":   []any{map[string]any{"operation": map[string]any{"ports": []any{"8080"}}}},
		}},
	})
	clientID := policy.Peer{Authenticated: true, Principal: "cluster.local/ns/mesh/sa/client-sa", Addr: netip.MustParseAddr("10.244.1.5")}
	otherID := policy.Peer{Authenticated: true, Principal: "cluster.local/ns/mesh/sa/other", Addr: netip.MustParseAddr("10.244.1.6")}
	plain := policy.Peer{Addr: netip.MustParseAddr("10.244.1.5")}
	waitFor("policies from istiod enforced", func(s *xds.Snapshot) error {
		srv := findWorkload(s, "server")
		dst := policy.Target{Namespace: "mesh", Port: 8080, Addr: netip.MustParseAddr("10.244.2.5")}
		for _, c := range []struct {
			name string
			src  policy.Peer
			port uint16
			want bool
		}{{"client-sa", clientID, 8080, true}, {"other", otherID, 8080, false}, {"plaintext", plain, 8080, false}, {"client-sa on 9090", clientID, 9090, false}} {
			dst.Port = c.port
			if v := policy.AuthorizeCompiled(s.Policies, dst, srv.Policies, c.src); v.Allowed != c.want {
				return fmt.Errorf("%s: allowed=%v (%s), want %v; server selects %v, %d policies", c.name, v.Allowed, v.Reason, c.want, srv.Policies, len(s.Policies))
			}
		}
		return nil
	})
	var keys []string
	for _, p := range last.Policies {
		keys = append(keys, p.Key()+"("+p.Scope.String()+","+string(p.Action)+")")
	}
	t.Logf("compiled policies: %s", strings.Join(keys, " "))

	// istiod away: the last state stays, no snapshot is delivered.
	held := len(last.Workloads)
	istiod.Stop()
	istiotest.CreatePod(t, cs, "mesh", "late", "late-sa", "node1", "10.244.1.9")
	select {
	case s := <-snaps:
		t.Fatalf("a snapshot (%d workloads) while istiod is away", len(s.Workloads))
	case <-time.After(2 * time.Second):
	}
	istiod.Restart(t)
	waitFor("the pod created while istiod was away", func(s *xds.Snapshot) error {
		if findWorkload(s, "late") == nil || findWorkload(s, "server") == nil || len(s.Workloads) != held+1 {
			return fmt.Errorf("%d workloads (had %d)", len(s.Workloads), held)
		}
		if len(s.Policies) == 0 {
			return fmt.Errorf("policies lost on resume")
		}
		return nil
	})
}

func findWorkload(s *xds.Snapshot, name string) *xds.Workload {
	for _, w := range s.Workloads {
		if w.Name == name && w.Namespace == "mesh" {
			return w
		}
	}
	return nil
}

func findService(s *xds.Snapshot, hostname string) *xds.Service {
	for _, svc := range s.Services {
		if svc.Hostname == hostname {
			return svc
		}
	}
	return nil
}

func ptr[T any](v T) *T { return &v }

// apply creates an Istio object of group/version/resource.
func apply(t *testing.T, d dynamic.Interface, group, version, resource, ns, name string, spec map[string]any) {
	t.Helper()
	kinds := map[string]string{"serviceentries": "ServiceEntry", "peerauthentications": "PeerAuthentication", "authorizationpolicies": "AuthorizationPolicy"}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": group + "/" + version, "kind": kinds[resource],
		"metadata": map[string]any{"name": name, "namespace": ns}, "spec": spec,
	}}
	if _, err := d.Resource(schema.GroupVersionResource{Group: group, Version: version, Resource: resource}).Namespace(ns).Create(context.Background(), obj, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create %s %s/%s: %v", kinds[resource], ns, name, err)
	}
}

// TestIstiodXDSAgents runs two nodes' agents with --source xds against a
// real istiod and kube-apiserver: pods are enrolled from each node's own
// pod watch, identities, peers and policies come from istiod; meshed
// traffic works, also to a Service VIP and a ServiceEntry VIP; a STRICT PeerAuthentication and an ALLOW
// AuthorizationPolicy applied to the API server reach the agents through
// istiod and are enforced; with istiod stopped the last state holds and
// traffic continues; a policy removed while it was away stops applying
// once it is back; a policy the agent cannot apply is NACKed with the
// reason, the rest stays applied, and the bad policy fails closed. The
// client's DNS is captured: its agent answers the Service's names and the
// ServiceEntry hosts, one of them at the address istiod allocated.
func TestIstiodXDSAgents(t *testing.T) {
	cp := istiotest.StartControlPlane(t)
	cluster, cs, istiod := cp.Cluster, cp.Client, cp.Istiod
	ctx := context.Background()

	tp := New(t, 2)
	client, other, plain := tp.Nodes[0].AddPod("client"), tp.Nodes[0].AddPod("other"), tp.Nodes[0].AddPod("plain")
	server := tp.Nodes[1].AddPod("server")
	for name, labels := range map[string]map[string]string{"mesh": {"istio.io/dataplane-mode": "ambient"}, "outside": nil} {
		createNamespace(t, cs, name, labels)
	}
	istiotest.CreatePod(t, cs, "mesh", "client", "client-sa", "node1", client.IPv4.String(), client.IPv6.String())
	istiotest.CreatePod(t, cs, "mesh", "other", "other-sa", "node1", other.IPv4.String(), other.IPv6.String())
	istiotest.CreatePod(t, cs, "outside", "plain", "plain-sa", "node1", plain.IPv4.String(), plain.IPv6.String())
	istiotest.CreatePod(t, cs, "mesh", "server", "server-sa", "node2", server.IPv4.String(), server.IPv6.String())

	agents := startXDSAgents(t, tp, cluster, istiod, istiotest.AgentAccount)
	node1, node2 := agents[0], agents[1]
	waitEnrolled(t, node1.BPFRoot, 30*time.Second, "mesh/client", "mesh/other")
	waitEnrolled(t, node2.BPFRoot, 30*time.Second, "mesh/server")
	// Ready only with istiod's state (policies known).
	for _, a := range agents {
		Eventually(t, 30*time.Second, func() error {
			out, err := Exec(ctx, a.Node.Path(), "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:15021/healthz/ready")
			if err != nil {
				return err
			}
			if code := strings.TrimSpace(string(out)); code != "200" {
				return fmt.Errorf("%s readiness %s", a.Node.Name, code)
			}
			return nil
		})
	}

	HTTPApp(t, server, 8080, "server")
	url := URL(server.IPv4, 8080)
	// Meshed: node 2 sees client-sa's identity, which it learns from the
	// HBONE handshake once istiod told node 1 the server takes HBONE.
	clientID := "spiffe://cluster.local/ns/mesh/sa/client-sa"
	Eventually(t, 30*time.Second, func() error {
		out, err := Curl(client, url)
		if err == nil && !strings.Contains(out, "server peer="+client.IPv4.String()) {
			err = fmt.Errorf("answer %q", out)
		}
		if err == nil && !strings.Contains(node2.Log(), clientID) {
			err = fmt.Errorf("node 2 has not seen %s yet (plaintext?)", clientID)
		}
		return err
	})
	if _, err := Curl(plain, url); err != nil {
		t.Fatalf("plaintext to the server before any policy: %v", err)
	}

	// A Service VIP and a ServiceEntry VIP, both known only from istiod,
	// reach the server through the tunnel on its target port.
	srvPod, err := cs.CoreV1().Pods("mesh").Get(ctx, "server", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	labelReady(t, cs, srvPod, map[string]string{"app": "server"})
	if _, err := cs.CoreV1().Services("mesh").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "server"},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "server"}, ClusterIP: "10.96.0.50",
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	dyn := cp.Dynamic
	apply(t, dyn, "networking.istio.io", "v1", "serviceentries", "mesh", "external", map[string]any{
		"hosts": []any{"db.example.com"}, "addresses": []any{"10.97.0.1"}, "resolution": "STATIC",
		"ports":            []any{map[string]any{"number": int64(5432), "name": "tcp", "protocol": "TCP", "targetPort": int64(8080)}},
		"workloadSelector": map[string]any{"labels": map[string]any{"app": "server"}},
	})
	apply(t, dyn, "networking.istio.io", "v1", "serviceentries", "mesh", "auto", map[string]any{
		"hosts": []any{"api.example.com"}, "resolution": "STATIC",
		"ports":            []any{map[string]any{"number": int64(80), "name": "http", "protocol": "HTTP", "targetPort": int64(8080)}},
		"workloadSelector": map[string]any{"labels": map[string]any{"app": "server"}},
	})
	for _, vip := range []string{"http://10.96.0.50:80/", "http://10.97.0.1:5432/"} {
		Eventually(t, 30*time.Second, func() error {
			out, err := Curl(client, vip)
			if err == nil && !strings.Contains(out, "server peer="+client.IPv4.String()) {
				err = fmt.Errorf("%s answered %q", vip, out)
			}
			return err
		})
	}
	// DNS capture: the client's queries, to a resolver that does not
	// exist, are answered by its agent from istiod's state: the Service by
	// its full and short names, a ServiceEntry host by its address, and
	// one without addresses by the one istiod allocated for it.
	for name, want := range map[string]string{"server.mesh.svc.cluster.local": "10.96.0.50", "server": "10.96.0.50", "db.example.com": "10.97.0.1"} {
		Eventually(t, 30*time.Second, func() error {
			got, err := dig(client, "10.96.0.10", name)
			if err == nil && got != want {
				err = fmt.Errorf("%s is %q, want %s", name, got, want)
			}
			return err
		})
	}
	var allocated string
	Eventually(t, 30*time.Second, func() (err error) {
		if allocated, err = dig(client, "10.96.0.10", "api.example.com"); err == nil && allocated == "" {
			err = fmt.Errorf("api.example.com has no address yet")
		}
		return err
	})
	t.Logf("api.example.com: the agent answered %s, the address istiod allocated", allocated)
	if out, err := Curl(client, "http://"+allocated+":80/"); err != nil || !strings.Contains(out, "server peer="+client.IPv4.String()) {
		t.Errorf("api.example.com at the address istiod allocated, %s: %q, %v", allocated, out, err)
	}

	apply(t, dyn, "security.istio.io", "v1", "peerauthentications", "mesh", "strict", map[string]any{"mtls": map[string]any{"mode": "STRICT"}})
	apply(t, dyn, "security.istio.io", "v1", "authorizationpolicies", "mesh", "allow-client", map[string]any{
		"action": "ALLOW",
		"rules": []any{map[string]any{
			"from": []any{map[string]any{"source": map[string]any{"principals": []any{"cluster.local/ns/mesh/sa/client-sa"}}}},
			"to":   []any{map[string]any{"operation": map[string]any{"ports": []any{"8080"}}}},
		}},
	})
	enforced := func(otherAllowed bool) error {
		if _, err := Curl(client, url); err != nil {
			return fmt.Errorf("client-sa denied: %v", err)
		}
		if out, err := Curl(plain, url); err == nil {
			return fmt.Errorf("plaintext got through STRICT: %q", out)
		}
		if out, err := Curl(other, url); (err == nil) != otherAllowed {
			return fmt.Errorf("other-sa: answer %q, error %v; want allowed=%v", out, err, otherAllowed)
		}
		return nil
	}
	Eventually(t, 30*time.Second, func() error { return enforced(false) })

	// istiod away: the last state holds.
	istiod.Stop()
	node1.WaitLog(t, "keeping the last state", 15*time.Second)
	if err := enforced(false); err != nil {
		t.Fatalf("istiod down: %v", err)
	}
	// Removed while istiod is away; applies once it is back.
	if err := dyn.Resource(schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: "authorizationpolicies"}).
		Namespace("mesh").Delete(ctx, "allow-client", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := enforced(false); err != nil {
		t.Fatalf("istiod down, policy deleted in the API: %v", err)
	}
	istiod.Restart(t)
	Eventually(t, 60*time.Second, func() error { return enforced(true) })
	if v := metric(t, node2, `redirector_xds_connects_total{result="ok"}`); v < 2 {
		t.Errorf("xds connects counted %v, want >= 2", v)
	}
	// ztunnel's series, which Istio's dashboard reads: istiod's pushes by
	// type, and the stream it ended when it went away.
	if v := metric(t, node2, `istio_xds_message_total{url="`+xds.TypeAddress+`"}`); v < 2 {
		t.Errorf("istio_xds_message_total for Address %v, want >= 2 (one per stream)", v)
	}
	ended := 0.0
	for _, reason := range []string{"Reconnect", "Complete", "Error"} {
		ended += metric(t, node2, `istio_xds_connection_terminations_total{reason="`+reason+`"}`)
	}
	if ended < 1 {
		t.Error("istio_xds_connection_terminations_total counts no open stream ended, though istiod went away")
	}

	// A policy the agent cannot apply as written (port 0, which istiod
	// passes on): NACKed with the reason, the rest stays applied (STRICT),
	// and the bad ALLOW is held fail-closed: it admits nothing.
	apply(t, dyn, "security.istio.io", "v1", "authorizationpolicies", "mesh", "bad-port", map[string]any{
		"action": "ALLOW",
		"rules":  []any{map[string]any{"to": []any{map[string]any{"operation": map[string]any{"ports": []any{"0"}}}}}},
	})
	node2.WaitLog(t, "mesh/bad-port: authorization mesh/bad-port: group 0 rule 0 match 0: destination_ports: port 0 out of range", 30*time.Second)
	if v := metric(t, node2, `redirector_xds_nacks_total{type="Authorization"}`); v < 1 {
		t.Errorf("Authorization NACKs counted %v, want >= 1", v)
	}
	Eventually(t, 30*time.Second, func() error {
		for _, p := range []*Pod{client, other, plain} {
			if out, err := Curl(p, url); err == nil {
				return fmt.Errorf("%s got through a fail-closed ALLOW: %q", p.Name, out)
			}
		}
		return nil
	})
}

// labelReady gives pod labels and marks it ready, as a kubelet would say:
// istiod marks a pod that is not ready UNHEALTHY, and services skip it.
func labelReady(t *testing.T, cs kubernetes.Interface, pod *corev1.Pod, labels map[string]string) {
	t.Helper()
	ctx := context.Background()
	pod.Labels = labels
	updated, err := cs.CoreV1().Pods(pod.Namespace).Update(ctx, pod, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	updated.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	if _, err := cs.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, updated, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// createNamespace creates namespace name with labels in the API server.
func createNamespace(t *testing.T, cs kubernetes.Interface, name string, labels map[string]string) {
	t.Helper()
	if _, err := cs.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// startXDSAgents starts an agent with --source xds on every node of tp,
// each with its own node's token for account, and waits for their streams
// to istiod to open.
func startXDSAgents(t *testing.T, tp *Topology, cluster *kubetest.Cluster, istiod *istiotest.Istiod, account string) []*Agent {
	t.Helper()
	cs := cluster.Client(t)
	var agents []*Agent
	for _, n := range tp.Nodes {
		token := istiotest.AgentToken(t, cs, account, fmt.Sprintf("node%d", n.Index), istiotest.Audience)
		agents = append(agents, startXDSAgent(t, n, cluster, istiod, token))
	}
	for _, a := range agents {
		a.WaitLog(t, "xds stream to istiod open", 30*time.Second)
	}
	return agents
}

// startXDSAgent starts an agent with --source xds on node n, reaching the
// API server and istiod through loopback forwards and asking for
// certificates with token (an istiotest.AgentAccount token bound to n).
func startXDSAgent(t *testing.T, n *Node, cluster *kubetest.Cluster, istiod *istiotest.Istiod, token string) *Agent {
	t.Helper()
	forwardLoopback(t, n.Path(), cluster.Config.Host)
	forwardLoopback(t, n.Path(), "grpc://"+istiod.Addr)
	node := fmt.Sprintf("node%d", n.Index)
	return StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Args: []string{
		"--source", "xds", "--kubeconfig", cluster.Kubeconfig,
		"--ca-address", istiod.Addr, "--ca-token-file", token, "--ca-root-cert", istiod.RootCertFile, "--cluster-id", istiotest.ClusterID,
		"--pod-name", "redirector-" + node, "--pod-namespace", istiotest.Namespace, "--instance-ip", "127.0.0.1",
	}})
}

// TestIstiodXDSEnrollsWithoutIstiod: with istiod down when the agents
// start, pods are still enrolled (from each node's own pod watch), but
// inbound connections are refused, outbound ones to other nodes' pods too
// (not sent in plaintext), and the agents are not ready until istiod's
// state arrives; then traffic flows.
func TestIstiodXDSEnrollsWithoutIstiod(t *testing.T) {
	cp := istiotest.StartControlPlane(t)
	cluster, cs, istiod := cp.Cluster, cp.Client, cp.Istiod
	ctx := context.Background()

	tp := New(t, 2)
	client, server := tp.Nodes[0].AddPod("client"), tp.Nodes[1].AddPod("server")
	createNamespace(t, cs, "mesh", map[string]string{"istio.io/dataplane-mode": "ambient"})
	istiotest.CreatePod(t, cs, "mesh", "client", "client-sa", "node1", client.IPv4.String(), client.IPv6.String())
	istiotest.CreatePod(t, cs, "mesh", "server", "server-sa", "node2", server.IPv4.String(), server.IPv6.String())
	var tokens []string
	for _, n := range tp.Nodes {
		tokens = append(tokens, istiotest.AgentToken(t, cs, istiotest.AgentAccount, fmt.Sprintf("node%d", n.Index), istiotest.Audience))
	}
	istiod.Stop()

	var agents []*Agent
	for i, n := range tp.Nodes {
		agents = append(agents, startXDSAgent(t, n, cluster, istiod, tokens[i]))
	}
	waitEnrolled(t, agents[0].BPFRoot, 30*time.Second, "mesh/client")
	waitEnrolled(t, agents[1].BPFRoot, 30*time.Second, "mesh/server")
	HTTPApp(t, server, 8080, "server")
	url := URL(server.IPv4, 8080)
	readiness := func(a *Agent) string {
		out, _ := Exec(ctx, a.Node.Path(), "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:15021/healthz/ready")
		return strings.TrimSpace(string(out))
	}
	if out, err := Curl(client, url); err == nil {
		t.Errorf("a connection got in before istiod's policies were known: %q", out)
	}
	// Refused on the client's node already: until istiod answered, the server's address was no
	// workload's there, and the connection left in plaintext (the server's node refused it).
	if log := agents[0].Log(); !strings.Contains(log, "outbound refused: the control plane has not answered yet") {
		t.Errorf("the client's agent did not refuse its outbound connection before istiod answered; its log:\n%s", log)
	}
	for _, a := range agents {
		if code := readiness(a); code == "200" {
			t.Errorf("%s ready without istiod's state", a.Node.Name)
		}
	}

	istiod.Restart(t)
	for _, a := range agents {
		Eventually(t, 60*time.Second, func() error {
			if code := readiness(a); code != "200" {
				return fmt.Errorf("%s readiness %s", a.Node.Name, code)
			}
			return nil
		})
	}
	Eventually(t, 30*time.Second, func() error { _, err := Curl(client, url); return err })
}
