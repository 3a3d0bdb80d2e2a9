package dashboard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/textparse"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/storage"
	"github.com/prometheus/prometheus/util/teststorage"

	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// dashboardPath is the chart's dashboard, the one the ConfigMap ships.
const dashboardPath = "../../manifests/charts/redirector/dashboards/redirector.json"

// rateInterval stands in for Grafana's $__rate_interval: wide enough to hold
// every scrape the test takes.
const rateInterval = "5m"

// bin holds the freshly built agent binaries.
var bin string

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if os.Geteuid() == 0 {
		dir, err := os.MkdirTemp("", "redirector-dashboard-bin")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		// Built in the root module, with its go.sum: this module's holds
		// only what the test itself imports.
		build := exec.Command("go", "build", "-o", dir+"/", "./cmd/...")
		build.Dir = "../.."
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "go build: %v: %s\n", err, out)
			return 1
		}
		bin = dir
	}
	return m.Run()
}

// panel is one dashboard panel with the row it sits under.
type panel struct {
	Row     string
	Title   string `json:"title"`
	Type    string `json:"type"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a collapsed row's
}

func loadPanels(t *testing.T) []panel { return loadPanelsFrom(t, dashboardPath) }

// loadPanelsFrom reads the panels of the Grafana dashboard at path.
func loadPanelsFrom(t *testing.T, dashboardPath string) []panel {
	t.Helper()
	b, err := os.ReadFile(dashboardPath)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []panel `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardPath, err)
	}
	var out []panel
	row := ""
	for _, p := range d.Panels {
		if p.Type == "row" {
			row = p.Title
			for _, c := range p.Panels {
				c.Row = row
				out = append(out, c)
			}
			continue
		}
		p.Row = row
		out = append(out, p)
	}
	return out
}

// query is a panel's expression with Grafana's variables filled in.
func query(t *testing.T, expr string) string {
	t.Helper()
	q := strings.ReplaceAll(expr, "$__rate_interval", rateInterval)
	if strings.Contains(q, "$") {
		t.Errorf("%q uses a Grafana variable this test does not fill in", expr)
	}
	return q
}

// TestDashboardQueriesParse: every expression is valid PromQL, and every
// metric it selects is one the agent defines (a renamed metric fails here,
// not silently as an empty panel).
func TestDashboardQueriesParse(t *testing.T) {
	src := agentSources(t)
	p := parser.NewParser(parser.Options{})
	n := 0
	for _, pn := range loadPanels(t) {
		for _, tg := range pn.Targets {
			n++
			expr, err := p.ParseExpr(query(t, tg.Expr))
			if err != nil {
				t.Errorf("panel %q: %q: %v", pn.Title, tg.Expr, err)
				continue
			}
			for _, name := range metricNames(expr) {
				if !strings.Contains(src, `"`+name+`"`) {
					t.Errorf("panel %q selects %s, which the agent does not define", pn.Title, name)
				}
			}
		}
	}
	if n < 20 {
		t.Errorf("only %d queries in the dashboard", n)
	}
}

// agentSources is the text of the root module's non-test Go files under
// pkg/ and cmd/, where every metric is named.
func agentSources(t *testing.T) string {
	t.Helper()
	var sb strings.Builder
	for _, dir := range []string{"../../pkg", "../../cmd"} {
		err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			b, err := os.ReadFile(path)
			sb.Write(b)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return sb.String()
}

func metricNames(e parser.Expr) []string {
	var names []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			names = append(names, vs.Name)
		}
		return nil
	})
	return names
}

// grouping returns the labels of a top-level "sum by (...)" and the like.
func grouping(e parser.Expr) []string {
	for {
		switch x := e.(type) {
		case *parser.ParenExpr:
			e = x.Expr
		case *parser.AggregateExpr:
			if x.Without {
				return nil
			}
			return x.Grouping
		default:
			return nil
		}
	}
}

// TestDashboardOverRealScrapes: two real agents carry demo-like meshed
// traffic (Deployment-owned pods, a service VIP, direct connections, one
// connection denied by policy); their /metrics are scraped several times
// into a Prometheus TSDB, and Prometheus's own PromQL engine evaluates
// every dashboard expression over it: no errors or warnings, every traffic
// panel and the key health panels non-empty, and every series carries the
// labels the query groups by.
func TestDashboardOverRealScrapes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: real agents in network namespaces")
	}
	ms := startMesh(t)
	db := teststorage.New(t)
	var first, last time.Time
	for i := range 5 {
		ms.traffic(t)
		now := time.Now()
		for _, a := range ms.agents {
			text := scrape(t, a)
			if err := appendScrape(db, text, a.Node.Name, now); err != nil {
				t.Fatalf("scrape of %s: %v", a.Node.Name, err)
			}
		}
		if i == 0 {
			first = now
		}
		last = now
		time.Sleep(2 * time.Second)
	}

	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 50_000_000, Timeout: time.Minute, LookbackDelta: 5 * time.Minute})
	p := parser.NewParser(parser.Options{})
	mustHave := map[string]bool{"Enrolled pods": true, "BPF verdicts by reason": true, "Policy denials": true,
		"Certificate time to expiry": true, "CA requests": true}
	sawEdge := false
	for _, pn := range loadPanels(t) {
		traffic := strings.HasPrefix(pn.Row, "Traffic")
		for i, tg := range pn.Targets {
			qs := query(t, tg.Expr)
			expr, err := p.ParseExpr(qs)
			if err != nil {
				t.Errorf("panel %q: %v", pn.Title, err)
				continue
			}
			q, err := engine.NewRangeQuery(context.Background(), db, nil, qs, first, last, 2*time.Second)
			if err != nil {
				t.Errorf("panel %q: %q: %v", pn.Title, qs, err)
				continue
			}
			res := q.Exec(context.Background())
			q.Close()
			if res.Err != nil {
				t.Errorf("panel %q: %q: %v", pn.Title, qs, res.Err)
				continue
			}
			for _, w := range res.Warnings.AsErrors() {
				t.Errorf("panel %q: %q: %v", pn.Title, qs, w)
			}
			m, err := res.Matrix()
			if err != nil {
				t.Errorf("panel %q: %v", pn.Title, err)
				continue
			}
			if len(m) == 0 && (traffic || (mustHave[pn.Title] && i == 0)) {
				t.Errorf("panel %q (%s): %q returns no series for the test's traffic", pn.Title, pn.Row, qs)
			}
			for _, s := range m {
				for _, l := range grouping(expr) {
					if s.Metric.Get(l) == "" {
						t.Errorf("panel %q: a series lacks %s, which %q groups by: %v", pn.Title, l, qs, s.Metric)
					}
				}
				if s.Metric.Get("source_workload") == "productpage-v1" && s.Metric.Get("destination_workload") == "reviews-v2" {
					sawEdge = true
				}
			}
			t.Logf("panel %q target %d: %d series", pn.Title, i, len(m))
		}
	}
	if !sawEdge {
		t.Error("no panel shows the productpage-v1 → reviews-v2 edge")
	}
}

// appendScrape stores one scrape of the exposition text at ts with the
// job and instance labels a Prometheus scrape adds, read by Prometheus's
// own text parser.
func appendScrape(db storage.Appendable, text, instance string, ts time.Time) error {
	tp, err := textparse.New([]byte(text), "text/plain; version=0.0.4; charset=utf-8", labels.NewSymbolTable(), textparse.ParserOptions{})
	if err != nil {
		return err
	}
	app := db.Appender(context.Background())
	n := 0
	for {
		entry, err := tp.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			_ = app.Rollback()
			return fmt.Errorf("parse: %w", err)
		}
		if entry != textparse.EntrySeries {
			continue
		}
		var lset labels.Labels
		tp.Labels(&lset)
		_, _, v := tp.Series()
		b := labels.NewBuilder(lset)
		b.Set("job", "redirector")
		b.Set("instance", instance)
		if _, err := app.Append(0, b.Labels(), ts.UnixMilli(), v); err != nil {
			_ = app.Rollback()
			return fmt.Errorf("append %s: %w", lset, err)
		}
		n++
	}
	if n == 0 {
		return errors.New("no samples")
	}
	return app.Commit()
}

// scrape fetches the agent's /metrics from inside its node's namespace.
func scrape(t *testing.T, a *netnstest.Agent) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := netnstest.Exec(ctx, a.Node.Path(), "curl", "-sS", "--max-time", "5", "http://127.0.0.1:15020/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", a.Node.Name, err)
	}
	return string(out)
}

// mesh is the demo-like setup: productpage-v1 on node0 calls reviews-v2
// on node1 through the reviews Service and directly; port 9091 is denied.
type mesh struct {
	agents         []*netnstest.Agent
	client, server *netnstest.Pod
}

func startMesh(t *testing.T) *mesh {
	tp := netnstest.New(t, 2)
	ms := &mesh{client: tp.Nodes[0].AddPod("productpage-v1-6c7d8e-abcde"), server: tp.Nodes[1].AddPod("reviews-v2-5b8d7c-x2x9q")}
	dir := t.TempDir()
	manifest, ca := filepath.Join(dir, "mesh.yaml"), filepath.Join(dir, "ca")
	m := (&netnstest.Manifest{}).Namespace("mesh", "istio.io/dataplane-mode=ambient").
		Raw(netnstest.OwnedPodDoc(ms.client, "mesh", "bookinfo-productpage", "productpage-v1", "6c7d8e", "app=productpage", "version=v1")).
		Raw(netnstest.OwnedPodDoc(ms.server, "mesh", "bookinfo-reviews", "reviews-v2", "5b8d7c", "app=reviews", "version=v2")).
		Raw(fmt.Sprintf(reviewsService, ms.server.IPv4)).Raw(denyPolicy)
	if err := m.Write(manifest); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(filepath.Join(bin, "redirector"), "ca", "init", "--dir", ca).CombinedOutput(); err != nil {
		t.Fatalf("ca init: %v: %s", err, out)
	}
	for _, n := range tp.Nodes {
		ms.agents = append(ms.agents, netnstest.StartAgent(t, n, netnstest.AgentOptions{Binary: filepath.Join(bin, "redirector"), Manifest: manifest, CADir: ca}))
	}
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 15*time.Second)
	}
	netnstest.HTTPApp(t, ms.server, 8080, "reviews")
	return ms
}

// traffic makes one round of the demo's connections: through the VIP,
// directly, and one the policy denies.
func (ms *mesh) traffic(t *testing.T) {
	t.Helper()
	for range 3 {
		netnstest.Eventually(t, 10*time.Second, func() error {
			_, err := netnstest.CurlFrom(ms.client.Path(), "http://10.96.0.20:9080/")
			return err
		})
	}
	netnstest.Eventually(t, 10*time.Second, func() error {
		_, err := netnstest.Curl(ms.client, netnstest.URL(ms.server.IPv4, 8080))
		return err
	})
	if out, err := netnstest.Curl(ms.client, netnstest.URL(ms.server.IPv4, 9091)); err == nil {
		t.Errorf("port 9091 is denied by policy, yet curl got %q", out)
	}
}

const reviewsService = `apiVersion: v1
kind: Service
metadata: {name: reviews, namespace: mesh}
spec:
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20]
  ports:
  - {name: http, port: 9080, targetPort: http}
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

const denyPolicy = `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-9091, namespace: mesh}
spec:
  action: DENY
  rules: [{to: [{operation: {ports: ["9091"]}}]}]`
