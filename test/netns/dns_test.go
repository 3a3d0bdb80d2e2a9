package netnstest

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/syncbuf"
)

// dnsDocs is a Service reviews in namespace mesh at 10.96.0.20, served by
// server's app on 8080.
func dnsDocs(server *Pod) string {
	return `apiVersion: v1
kind: Service
metadata: {name: reviews, namespace: mesh}
spec:
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20]
  ports:
  - {name: http, port: 9080, targetPort: 8080}
---
` + readyEndpointSlice("reviews", server.IPv4)
}

// startDnsmasq runs dnsmasq, a real resolver, in p's namespace as the
// cluster's DNS: it knows outside.test and nothing of the mesh, and logs
// every query it is asked.
func startDnsmasq(t *testing.T, p *Pod) *syncbuf.Buffer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	log := &syncbuf.Buffer{}
	cmd := Command(ctx, p.Path(), "dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts", "--pid-file=",
		"--bind-interfaces", "--listen-address="+p.IPv4.String(), "--port=53", "--user=root", "--log-queries", "--log-facility=-",
		"--address=/outside.test/192.0.2.7", "--address=/reviews.mesh.svc.cluster.local/192.0.2.99")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatalf("start dnsmasq (the Makefile's deps install it): %v", err)
	}
	t.Cleanup(func() { cancel(); _ = cmd.Wait() })
	return log
}

// dig asks resolver for name's A records from p, with extra options (+tcp),
// and returns the answer's addresses, one per line.
func dig(p *Pod, resolver, name string, extra ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	args := append([]string{"+short", "+time=2", "+tries=1", "@" + resolver, name, "A"}, extra...)
	out, err := Exec(ctx, p.Path(), "dig", args...)
	if err != nil {
		return "", fmt.Errorf("dig %s @%s %v: %w: %s", name, resolver, extra, err, out)
	}
	return strings.TrimSpace(string(out)), nil
}

// TestDNSCapture: ambient DNS capture, as istio-cni's with ztunnel's proxy.
// An enrolled pod's queries to any resolver, over UDP and over TCP, are
// answered by its node's agent for names of the mesh (a Service's VIP,
// which then carries a meshed connection) and forwarded from the pod's
// namespace to the upstream resolver (dnsmasq, in a pod of the test) for
// the rest. A pod annotated ambient.istio.io/dns-capture=false asks the
// resolver itself, which answers the mesh's name with its own address.
func TestDNSCapture(t *testing.T) {
	var client, optOut, server, resolver *Pod
	args := []string{"--dns-upstreams", ""} // the resolver's address, set once it has one
	ms := newMeshWith(t, args, func(tp *Topology, m *Manifest) {
		client, optOut = tp.Nodes[0].AddPod("client"), tp.Nodes[0].AddPod("optout")
		server, resolver = tp.Nodes[1].AddPod("server"), tp.Nodes[1].AddPod("coredns")
		args[1] = resolver.IPv4.String()
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("kube-system").
			Pod(client, "mesh", "client-sa").Pod(server, "mesh", "server-sa").Pod(resolver, "kube-system", "coredns").
			Raw(podDoc(optOut, "mesh", "optout-sa", "  annotations: {ambient.istio.io/dns-capture: \"false\"}\n", nil)).
			Raw(dnsDocs(server))
	})
	HTTPApp(t, server, 8080, "reviews")
	queries := startDnsmasq(t, resolver)
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	Eventually(t, 10*time.Second, func() error {
		if n := strings.Count(ms.agents[0].Log(), "pod enrolled"); n < 2 {
			return fmt.Errorf("%d of 2 pods of node 1 enrolled", n)
		}
		return nil
	})
	ns := resolver.IPv4.String()

	// A name of the mesh, over UDP and TCP, whichever resolver the pod
	// asks: the agent answers, and dnsmasq never hears of it.
	for _, tc := range []struct{ name, resolver string }{
		{"udp, the cluster's resolver", ns},
		{"udp, another resolver", "10.96.0.10"},
		{"tcp", ns},
	} {
		extra := []string{}
		if strings.HasPrefix(tc.name, "tcp") {
			extra = append(extra, "+tcp")
		}
		var got string
		Eventually(t, 10*time.Second, func() (err error) {
			got, err = dig(client, tc.resolver, "reviews.mesh.svc.cluster.local", extra...)
			return err
		})
		if got != "10.96.0.20" {
			t.Errorf("%s: reviews.mesh.svc.cluster.local is %q, want the Service's VIP 10.96.0.20", tc.name, got)
		}
	}
	if strings.Contains(queries.String(), "reviews.mesh") {
		t.Errorf("the upstream resolver was asked for the mesh's name:\n%s", queries.String())
	}
	// The answer carries a connection through the mesh.
	if out, err := Curl(client, "http://10.96.0.20:9080/"); err != nil || !strings.Contains(out, "reviews") {
		t.Errorf("curl to the VIP the agent answered: %q, %v", out, err)
	}

	// Names outside the mesh are forwarded, over UDP and TCP, from the
	// pod's own address.
	for _, extra := range [][]string{nil, {"+tcp"}} {
		got, err := dig(client, ns, "outside.test", extra...)
		if err != nil || got != "192.0.2.7" {
			t.Errorf("outside.test %v: %q, %v; want dnsmasq's 192.0.2.7", extra, got, err)
		}
	}
	if got, err := dig(client, "10.96.0.10", "outside.test"); err != nil || got != "192.0.2.7" {
		t.Errorf("outside.test asked of a resolver that does not exist: %q, %v; want the upstream's answer 192.0.2.7", got, err)
	}
	if !strings.Contains(queries.String(), "outside.test from "+client.IPv4.String()) {
		t.Errorf("dnsmasq did not see the forwarded query come from the client pod %s:\n%s", client.IPv4, queries.String())
	}

	// A pod that opted out asks dnsmasq itself.
	if got, err := dig(optOut, ns, "reviews.mesh.svc.cluster.local"); err != nil || got != "192.0.2.99" {
		t.Errorf("the opted-out pod got %q, %v; want dnsmasq's own 192.0.2.99", got, err)
	}
	if _, err := dig(optOut, "10.96.0.10", "outside.test"); err == nil {
		t.Errorf("the opted-out pod's query to an address no resolver has was answered")
	}

	text := scrape(t, ms.agents[0], "http://127.0.0.1:15020/metrics")
	if n := metricSum(text, "istio_dns_requests_total", `request_protocol="udp"`); n < 3 {
		t.Errorf("istio_dns_requests_total{udp} = %v, want at least 3", n)
	}
	if n := metricSum(text, "istio_dns_requests_total", `request_protocol="tcp"`); n < 2 {
		t.Errorf("istio_dns_requests_total{tcp} = %v, want at least 2", n)
	}
	if n := metricSum(text, "istio_dns_upstream_requests_total"); n < 3 {
		t.Errorf("istio_dns_upstream_requests_total = %v, want at least 3", n)
	}
}

// TestUpgradeAnswersDNS: while the client node's agent is upgraded (a new
// agent next to the old, which then drains and exits), the client's
// captured DNS queries are answered throughout, names of the mesh and
// forwarded ones alike: the new agent takes the pod's DNS socket from the
// old one in the hand-over, queue and all, and both answer what they read
// while they overlap.
func TestUpgradeAnswersDNS(t *testing.T) {
	var client, server, resolver *Pod
	args := []string{"--dns-upstreams", ""}
	ms := newMeshWith(t, args, func(tp *Topology, m *Manifest) {
		client = tp.Nodes[0].AddPod("client")
		server, resolver = tp.Nodes[1].AddPod("server"), tp.Nodes[1].AddPod("coredns")
		args[1] = resolver.IPv4.String()
		m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("kube-system").
			Pod(client, "mesh", "client-sa").Pod(server, "mesh", "server-sa").Pod(resolver, "kube-system", "coredns").
			Raw(dnsDocs(server))
	})
	startDnsmasq(t, resolver)
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	ns := resolver.IPv4.String()
	Eventually(t, 10*time.Second, func() error { _, err := dig(client, ns, "reviews.mesh.svc.cluster.local"); return err })

	var mu sync.Mutex
	var asked int
	var failures []string
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			name, want := "reviews.mesh.svc.cluster.local", "10.96.0.20"
			if i%2 == 1 {
				name, want = "outside.test", "192.0.2.7"
			}
			got, err := dig(client, ns, name)
			mu.Lock()
			asked++
			if err != nil || got != want {
				failures = append(failures, fmt.Sprintf("%s: %q, %v", name, got, err))
			}
			mu.Unlock()
		}
	}()
	// Each phase lasts until some queries were asked in it (a loaded
	// machine's dig takes longer than an idle one's): before, while both
	// agents answer, and with the new agent alone.
	askedMore := func(phase string, n int) {
		t.Helper()
		mu.Lock()
		from := asked
		mu.Unlock()
		Eventually(t, 30*time.Second, func() error {
			mu.Lock()
			defer mu.Unlock()
			if asked < from+n {
				return fmt.Errorf("%d queries asked %s, want %d", asked-from, phase, n)
			}
			return nil
		})
	}
	askedMore("before the upgrade", 5)
	old := ms.agents[0]
	next := StartAgent(t, old.Node, AgentOptions{Binary: redirectorBin(), Manifest: ms.manifest, CADir: ms.caDir, BPFRoot: old.BPFRoot,
		Args: append([]string{"--metrics-addr", ":25020", "--readiness-addr", ":25021", "--admin-addr", "127.0.0.1:25000"}, args...)})
	Eventually(t, 20*time.Second, func() error {
		_, err := curlOK(old.Node.Path(), "http://127.0.0.1:25021/healthz/ready")
		return err
	})
	askedMore("while both agents answer", 5)
	if err := old.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	askedMore("of the new agent alone", 5)
	close(stop)
	<-done
	mu.Lock()
	defer mu.Unlock()
	t.Logf("%d queries through the upgrade, %d failed", asked, len(failures))
	if len(failures) > 0 {
		t.Errorf("%d of %d queries failed through the upgrade (want none): %v", len(failures), asked, failures)
	}
	if n := metricSum(scrape(t, next, "http://127.0.0.1:25020/metrics"), "istio_dns_requests_total"); n == 0 {
		t.Error("the new agent answered no query")
	}
}
