package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

const strictPolicy = `apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: shop}
spec:
  mtls: {mode: STRICT}`

const serviceVIP = "10.96.0.20"

// cluster is the demo's simulated cluster.
type cluster struct {
	topo                                *netnstest.Topology
	frontend, backend, legacy, outsider *netnstest.Pod
	manifest                            string
	agents                              []*netnstest.Agent
}

func (c *cluster) write(r *netnstest.Runner, strict bool) {
	m := (&netnstest.Manifest{}).
		Namespace("shop", "istio.io/dataplane-mode=ambient").
		Namespace("plain").
		Pod(c.frontend, "shop", "frontend", "app=frontend").
		Pod(c.backend, "shop", "backend", "app=backend").
		Pod(c.legacy, "shop", "legacy", "app=legacy", "istio.io/dataplane-mode=none").
		Pod(c.outsider, "plain", "default", "app=outsider").
		Raw(fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: backend, namespace: shop}
spec:
  clusterIP: %s
  selector: {app: backend}
  ports: [{name: http, port: 80, targetPort: http}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: backend-1, namespace: shop, labels: {kubernetes.io/service-name: backend}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [%q], conditions: {ready: true}}]`, serviceVIP, c.backend.IPv4))
	if strict {
		m.Raw(strictPolicy)
	}
	if err := m.Write(c.manifest); err != nil {
		r.Fatalf("write manifests: %v", err)
	}
}

func run(r *netnstest.Runner, redirector string, verbose bool) {
	start := time.Now()
	if _, err := os.Stat(redirector); err != nil {
		r.Fatalf("redirector binary: %v (build it with make build, or pass --bin)", err)
	}
	step("building a two-node cluster out of network namespaces")
	c := &cluster{topo: netnstest.New(r, 2)}
	n1, n2 := c.topo.Nodes[0], c.topo.Nodes[1]
	c.frontend, c.legacy = n1.AddPod("frontend"), n1.AddPod("legacy")
	c.backend, c.outsider = n2.AddPod("backend"), n2.AddPod("outsider")
	dir := r.TempDir()
	c.manifest = filepath.Join(dir, "cluster.yaml")
	c.write(r, false)
	fmt.Printf("  node1: shop/frontend %s, shop/legacy %s (opted out: istio.io/dataplane-mode=none)\n", c.frontend.IPv4, c.legacy.IPv4)
	fmt.Printf("  node2: shop/backend  %s, plain/outsider %s (namespace not in the mesh)\n", c.backend.IPv4, c.outsider.IPv4)
	fmt.Printf("  namespace shop is labelled istio.io/dataplane-mode=ambient; service shop/backend is %s:80\n", serviceVIP)
	fmt.Printf("  (network namespaces %s-*)\n", c.topo.Prefix())

	step("creating the mesh CA and starting one agent per node")
	ca := filepath.Join(dir, "ca")
	if out, err := exec.Command(redirector, "ca", "init", "--dir", ca).CombinedOutput(); err != nil {
		r.Fatalf("ca init: %v: %s", err, out)
	}
	for _, n := range c.topo.Nodes {
		c.agents = append(c.agents, netnstest.StartAgent(r, n, netnstest.AgentOptions{Binary: redirector, Manifest: c.manifest, CADir: ca}))
	}
	for _, a := range c.agents {
		a.WaitLog(r, "pod enrolled", 15*time.Second)
	}
	for _, p := range []*netnstest.Pod{c.backend, c.legacy} {
		netnstest.HTTPApp(r, p, 8080, p.Name)
	}
	waitReady(r, c.frontend, netnstest.URL(c.backend.IPv4, 8080))
	fmt.Println("  both agents ready: frontend and backend enrolled, legacy and outsider left alone")

	step("traffic, PeerAuthentication PERMISSIVE (the default)")
	flows := []flow{
		{"shop/frontend -> shop/backend", c.frontend.Path(), netnstest.URL(c.backend.IPv4, 8080), "mTLS (HBONE)"},
		{"shop/frontend -> shop/backend [IPv6]", c.frontend.Path(), netnstest.URL(c.backend.IPv6, 8080), "mTLS (HBONE)"},
		{"shop/frontend -> service backend", c.frontend.Path(), "http://" + serviceVIP + "/", "mTLS (HBONE), endpoint picked by the tunnel"},
		{"shop/frontend -> shop/legacy", c.frontend.Path(), netnstest.URL(c.legacy.IPv4, 8080), "captured, plain TCP (legacy is not meshed)"},
		{"plain/outsider -> shop/backend", c.outsider.Path(), netnstest.URL(c.backend.IPv4, 8080), "plaintext, accepted (PERMISSIVE)"},
	}
	runFlows(flows)

	step("applying PeerAuthentication STRICT to namespace shop")
	c.write(r, true)
	netnstest.WaitRefused(r, c.outsider, netnstest.URL(c.backend.IPv4, 8080), 15*time.Second)
	runFlows([]flow{
		{"shop/frontend -> shop/backend", c.frontend.Path(), netnstest.URL(c.backend.IPv4, 8080), "mTLS (HBONE)"},
		{"plain/outsider -> shop/backend", c.outsider.Path(), netnstest.URL(c.backend.IPv4, 8080), "refused: plaintext under STRICT"},
		{"node2 (kubelet probe) -> shop/backend", n2.Path(), netnstest.URL(c.backend.IPv4, 8080), "passes: probe SNAT to 169.254.7.127"},
	})

	step("what the agents report")
	showMetrics(r, c.agents[1], "node2 (backend's agent), reporter=destination")
	showAccessLog(c.agents[1], "node2 (backend's agent)")
	showInspect(r, redirector, c.agents[0])
	fmt.Printf("\ndemo finished in %s\n", time.Since(start).Round(100*time.Millisecond))
	if verbose {
		for _, a := range c.agents {
			fmt.Printf("\n--- agent %s log ---\n%s", a.Node.Name, a.Log())
		}
	}
}

func step(s string) { fmt.Printf("\n== %s\n", s) }

type flow struct{ name, from, url, expect string }

func runFlows(flows []flow) {
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  FLOW\tRESULT\tAPP SAW CLIENT\tEXPECTED PATH")
	for _, f := range flows {
		out, err := netnstest.CurlFrom(f.from, f.url)
		result, peer := "ok", "-"
		if err != nil {
			result = "refused"
		} else if i := strings.Index(out, "peer="); i >= 0 {
			peer = strings.TrimSpace(out[i+len("peer="):])
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", f.name, result, peer, f.expect)
	}
	tw.Flush()
}

func waitReady(r *netnstest.Runner, from *netnstest.Pod, url string) {
	deadline := time.Now().Add(15 * time.Second)
	for {
		if _, err := netnstest.Curl(from, url); err == nil {
			return
		} else if time.Now().After(deadline) {
			r.Fatalf("mesh not ready: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

var sample = regexp.MustCompile(`^(istio_tcp_connections_opened_total|redirector_bpf_pod_connections_total|redirector_policy_denials_total|redirector_bpf_fail_closed_drops_total)(\{.*\})? (\S+)$`)

// showMetrics prints the interesting samples of an agent's /metrics.
// showAccessLog prints the agent's access log lines of refused
// connections (response_flags DENY) and its last completed one.
func showAccessLog(a *netnstest.Agent, title string) {
	var denied, done string
	deadline := time.Now().Add(2 * time.Second) // lines are flushed every 100 ms
	for denied == "" && time.Now().Before(deadline) {
		for _, line := range strings.Split(a.Log(), "\n") {
			switch {
			case strings.Contains(line, `msg="connection complete"`) && strings.Contains(line, "response_flags=DENY"):
				denied = line
			case strings.Contains(line, `msg="connection complete"`):
				done = line
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	fmt.Printf("\n  access log of %s (ztunnel's fields):\n", title)
	for _, l := range []string{done, denied} {
		if l != "" {
			fmt.Printf("    %s\n", l)
		}
	}
}

func showMetrics(r *netnstest.Runner, a *netnstest.Agent, title string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := netnstest.Exec(ctx, a.Node.Path(), "curl", "-sS", "http://127.0.0.1:15020/metrics")
	if err != nil {
		r.Fatalf("scrape %s: %v", a.Node.Name, err)
	}
	fmt.Printf("  metrics of %s:\n", title)
	var lines []string
	for _, line := range strings.Split(string(out), "\n") {
		m := sample.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		lines = append(lines, "    "+m[1]+short(m[2])+" "+m[3])
	}
	sort.Strings(lines)
	fmt.Println(strings.Join(lines, "\n"))
}

var keep = regexp.MustCompile(`(reporter|source_workload|source_principal|destination_workload|destination_principal|connection_security_policy|response_flags|reason|pod|direction)="[^"]*"`)

// short keeps the labels a reader needs out of Istio's long label sets.
func short(labels string) string {
	if labels == "" {
		return ""
	}
	return "{" + strings.Join(keep.FindAllString(labels, -1), ",") + "}"
}

func showInspect(r *netnstest.Runner, redirector string, a *netnstest.Agent) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := netnstest.Exec(ctx, a.Node.Path(), redirector, "inspect", "pods", "--bpf-root", a.BPFRoot)
	if err != nil {
		r.Fatalf("inspect: %v", err)
	}
	fmt.Printf("\n  redirector inspect pods (node1, read from the pinned BPF maps):\n")
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fmt.Println("    " + line)
	}
}
