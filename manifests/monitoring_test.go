package manifests

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// podMonitorAPI is what a cluster with the prometheus-operator CRDs serves.
const podMonitorAPI = "monitoring.coreos.com/v1/PodMonitor"

// podMonitor is the part of monitoring.coreos.com/v1 PodMonitor the chart writes; unknown
// fields fail the strict decode.
type podMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		NamespaceSelector struct {
			MatchNames []string `json:"matchNames"`
		} `json:"namespaceSelector"`
		Selector            metav1.LabelSelector `json:"selector"`
		PodMetricsEndpoints []struct {
			Port        string `json:"port"`
			Path        string `json:"path"`
			Interval    string `json:"interval"`
			Relabelings []struct {
				SourceLabels []string `json:"sourceLabels"`
				TargetLabel  string   `json:"targetLabel"`
				Regex        string   `json:"regex"`
				Replacement  string   `json:"replacement"`
				Action       string   `json:"action"`
			} `json:"relabelings"`
		} `json:"podMetricsEndpoints"`
	} `json:"spec"`
}

// addConfigMap puts a ConfigMap in its slot: the dashboards' or the agent's settings.
func (r *rendered) addConfigMap(doc string) error {
	var cm *corev1.ConfigMap
	if err := strictNew(doc, &cm); err != nil {
		return err
	}
	slot := &r.ConfigMap
	if strings.HasSuffix(cm.Name, "-dashboards") {
		slot = &r.Dashboards
	}
	if *slot != nil {
		return fmt.Errorf("second ConfigMap %s in the chart", cm.Name)
	}
	*slot = cm
	return nil
}

// TestMonitoringOffByDefault: no PodMonitor (the CRD may not exist) and no dashboard
// unless asked for, in every profile.
func TestMonitoringOffByDefault(t *testing.T) {
	for _, p := range profiles(t) {
		r := mustRender(t, renderOpts{set: []string{"profile=" + p}, apiVersions: []string{peerAuthnAPI, podMonitorAPI}})
		if r.PodMonitor != nil || r.Dashboards != nil {
			t.Errorf("profile %s renders monitoring objects by default", p)
		}
	}
}

func TestPodMonitor(t *testing.T) {
	r := mustRender(t, renderOpts{set: []string{"monitoring.podMonitor.enabled=true", "monitoring.podMonitor.labels.release=kube-prometheus-stack",
		"monitoring.podMonitor.interval=30s"}, apiVersions: []string{podMonitorAPI}})
	pm := r.PodMonitor
	if pm == nil {
		t.Fatalf("no PodMonitor:\n%s", r.Manifest)
	}
	if pm.Namespace != releaseNamespace || pm.Labels["release"] != "kube-prometheus-stack" || pm.Labels["app.kubernetes.io/name"] != "redirector" {
		t.Errorf("PodMonitor metadata %+v", pm.ObjectMeta)
	}
	// It selects exactly the DaemonSet's pods, in the release namespace.
	if got, want := pm.Spec.Selector.MatchLabels, r.DaemonSet.Spec.Selector.MatchLabels; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("PodMonitor selects %v, the DaemonSet's pods are %v", got, want)
	}
	if fmt.Sprint(pm.Spec.NamespaceSelector.MatchNames) != "["+releaseNamespace+"]" {
		t.Errorf("namespaceSelector %v", pm.Spec.NamespaceSelector.MatchNames)
	}
	if len(pm.Spec.PodMetricsEndpoints) != 1 {
		t.Fatalf("endpoints %+v", pm.Spec.PodMetricsEndpoints)
	}
	ep := pm.Spec.PodMetricsEndpoints[0]
	if ep.Path != "/metrics" || ep.Interval != "30s" {
		t.Errorf("endpoint %+v", ep)
	}
	// The agent declares no ports (a surge rollout): the target is the agent
	// container's, its address the pod's with METRICS_ADDR's port.
	port := strings.TrimPrefix(r.ConfigMap.Data["METRICS_ADDR"], ":")
	var keepsAgent, v4, v6 bool
	for _, rl := range ep.Relabelings {
		switch {
		case rl.Action == "keep" && rl.Regex == "agent" && slices.Equal(rl.SourceLabels, []string{"__meta_kubernetes_pod_container_name"}):
			keepsAgent = true
		case rl.TargetLabel == "__address__" && rl.Replacement == "${1}:"+port:
			v4 = true
		case rl.TargetLabel == "__address__" && rl.Replacement == "[${1}]:"+port:
			v6 = true
		}
	}
	if ep.Port != "" || !keepsAgent || !v4 || !v6 {
		t.Errorf("endpoint %+v: want no named port, the agent container kept and the address set to the pod IP with port %s (IPv4 and IPv6)", ep, port)
	}

	// Without the CRDs the install fails saying so, instead of at apply time.
	if _, err := render(t, renderOpts{set: []string{"monitoring.podMonitor.enabled=true"}}); err == nil || !strings.Contains(err.Error(), "install the prometheus-operator CRDs") {
		t.Errorf("PodMonitor without its CRD: %v", err)
	}
}

// TestDashboardConfigMap: the dashboard ships as a ConfigMap with the Grafana sidecar's
// label, holding the chart's dashboards/redirector.json unchanged.
func TestDashboardConfigMap(t *testing.T) {
	r := mustRender(t, renderOpts{set: []string{"monitoring.dashboard.enabled=true", "monitoring.dashboard.annotations.grafana_folder=Istio",
		"monitoring.dashboard.namespace=monitoring"}})
	cm := r.Dashboards
	if cm == nil {
		t.Fatalf("no dashboard ConfigMap:\n%s", r.Manifest)
	}
	if cm.Labels["grafana_dashboard"] != "1" || cm.Annotations["grafana_folder"] != "Istio" || cm.Namespace != "monitoring" {
		t.Errorf("dashboard ConfigMap metadata %+v", cm.ObjectMeta)
	}
	want, err := os.ReadFile(filepath.Join(chartDir, "dashboards", "redirector.json"))
	if err != nil {
		t.Fatal(err)
	}
	if got := cm.Data["redirector.json"]; got != strings.TrimRight(string(want), "\n") {
		t.Errorf("the ConfigMap's redirector.json differs from dashboards/redirector.json")
	}
	var d struct {
		UID    string `json:"uid"`
		Panels []struct {
			Type    string `json:"type"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal([]byte(cm.Data["redirector.json"]), &d); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	exprs := 0
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			if strings.TrimSpace(tg.Expr) != "" {
				exprs++
			}
		}
	}
	if d.UID == "" || exprs == 0 {
		t.Errorf("dashboard uid %q, %d queries", d.UID, exprs)
	}
	// The agent's settings ConfigMap is still the one the DaemonSet reads.
	if r.ConfigMap == nil || r.ConfigMap.Name == cm.Name {
		t.Errorf("settings ConfigMap %v", r.ConfigMap)
	}
	// Labels set on the command line add to the sidecar's label.
	r = mustRender(t, renderOpts{valuesYAML: "monitoring: {dashboard: {enabled: true, labels: {team: mesh}}}\n"})
	if l := r.Dashboards.Labels; l["grafana_dashboard"] != "1" || l["team"] != "mesh" {
		t.Errorf("labels %v", l)
	}
}
