package dashboard

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/prometheus/promql/parser"
)

// istioZtunnelDashboard is Istio's own ztunnel dashboard, from the
// istio.io/istio version test/istiotools pins. go mod download fetches the
// module when the cache lacks it (istiod's build, hack/istio-binaries.sh,
// may have come from the binary cache).
func istioZtunnelDashboard(t *testing.T) string {
	t.Helper()
	cmd := exec.Command("go", "mod", "download", "-json", "istio.io/istio")
	cmd.Dir = "../istiotools"
	cmd.Env = append(cmd.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go mod download istio.io/istio (pinned by test/istiotools): %v\n%s", err, out)
	}
	var mod struct{ Dir, Error string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("go mod download istio.io/istio: no module directory (%v; %s)", err, mod.Error)
	}
	return filepath.Join(mod.Dir, "manifests/addons/dashboards/ztunnel-dashboard.gen.json")
}

// istioOnlyMetrics are the series Istio's ztunnel dashboard reads that the
// agent does not have, each for a reason.
var istioOnlyMetrics = map[string]string{
	"process_open_fds": "", // client_golang's process collector, registered in cmd/redirector
}

// TestIstioZtunnelDashboardMetrics: every series Istio's ztunnel dashboard
// selects, but the kubelet's container_* and the few istioOnlyMetrics,
// is one the agent defines, so the dashboard's panels (versions, workload
// manager, connections, bytes, sockets) read the agent. Before,
// istio_build, workload_manager_active_proxy_count and
// workload_manager_pending_proxy_count were missing: the "Ztunnel
// Versions" and "Workload Manager" panels were empty; so were
// istio_xds_message_total and istio_xds_connection_terminations_total,
// and with them the "XDS Pushes" and "XDS Connections" panels.
func TestIstioZtunnelDashboardMetrics(t *testing.T) {
	path := istioZtunnelDashboard(t)
	src := agentSources(t)
	p := parser.NewParser(parser.Options{})
	seen := map[string]bool{}
	for _, pn := range loadPanelsFrom(t, path) {
		for _, tg := range pn.Targets {
			expr, err := p.ParseExpr(query(t, tg.Expr))
			if err != nil {
				t.Errorf("panel %q: %q: %v", pn.Title, tg.Expr, err)
				continue
			}
			for _, name := range metricNames(expr) {
				if _, skip := istioOnlyMetrics[name]; skip || seen[name] || strings.HasPrefix(name, "container_") {
					continue
				}
				seen[name] = true
				if !strings.Contains(src, `"`+name+`"`) {
					t.Errorf("Istio's ztunnel dashboard panel %q selects %s, which the agent does not define", pn.Title, name)
				}
			}
		}
	}
	if len(seen) < 5 {
		t.Errorf("only %d metrics checked in %s", len(seen), path)
	}
}
