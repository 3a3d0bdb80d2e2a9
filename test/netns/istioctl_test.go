package netnstest

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// istioctlBin returns istioctl built from the istio.io/istio version
// test/istiotools pins (hack/istio-binaries.sh istioctl), building it when
// missing; ISTIOCTL names a ready one instead.
func istioctlBin(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("ISTIOCTL"); p != "" {
		return p
	}
	script, err := filepath.Abs("../../hack/istio-binaries.sh")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", script, "istioctl")
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s istioctl: %v", script, err)
	}
	return filepath.Join(strings.TrimSpace(string(out)), "istioctl")
}

// TestIstioctlReadsConfigDump: the real istioctl, built from Istio's
// module, parses the agent's /config_dump with its ztunnel-config commands
// and lists the mesh's workloads, services, policies and certificates.
func TestIstioctlReadsConfigDump(t *testing.T) {
	istioctl := istioctlBin(t)
	deny := `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-bad, namespace: mesh}
spec:
  action: DENY
  rules:
  - from: [{source: {principals: ["cluster.local/ns/mesh/sa/bad"]}}]
    to: [{operation: {ports: ["9091"]}}]`
	ms, client, server := newBookinfoMesh(t, "8080", deny)
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	a := ms.agents[1]
	var dump string
	Eventually(t, 10*time.Second, func() error {
		dump = scrape(t, a, "http://127.0.0.1:15000/config_dump")
		if !strings.Contains(dump, `"state": "Available"`) {
			return fmt.Errorf("the server's certificate is not in the dump yet")
		}
		return nil
	})
	var sections map[string]json.RawMessage
	if err := json.Unmarshal([]byte(dump), &sections); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"workloads", "services", "policies", "certificates", "workloadState", "pods", "certs", "meshPolicies"} {
		if len(sections[s]) == 0 {
			t.Errorf("config dump lacks %s", s)
		}
	}
	file := filepath.Join(t.TempDir(), "dump.json")
	if err := os.WriteFile(file, []byte(dump), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, istioctl, append([]string{"ztunnel-config"}, append(args, "--file", file)...)...)
		// istioctl must not need a cluster to read a file.
		cmd.Env = append(os.Environ(), "KUBECONFIG="+filepath.Join(t.TempDir(), "none"), "HOME="+t.TempDir())
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("istioctl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	row := func(out string, cells ...string) bool {
		re := regexp.MustCompile(`(?m)^` + strings.Join(cells, `\s+`) + `(\s|$)`)
		return re.MatchString(out)
	}

	out := run("workloads")
	for _, want := range [][]string{
		{"NAMESPACE", "POD NAME", "ADDRESS", "NODE", "WAYPOINT", "PROTOCOL"},
		{"mesh", client.Name, regexp.QuoteMeta(client.IPv4.String() + "," + client.IPv6.String()), fmt.Sprint("node", client.Node.Index), "None", "HBONE"},
		{"mesh", server.Name, regexp.QuoteMeta(server.IPv4.String() + "," + server.IPv6.String()), fmt.Sprint("node", server.Node.Index), "None", "HBONE"},
	} {
		if !row(out, want...) {
			t.Errorf("istioctl ztunnel-config workloads lacks the row %v:\n%s", want, out)
		}
	}
	out = run("workloads", "-o", "json")
	for _, want := range []string{`"workloadName": "reviews-v2"`, `"workloadType": "deployment"`, `"canonicalName": "reviews"`, `"canonicalRevision": "v2"`, `"clusterId": "Kubernetes"`} {
		if !strings.Contains(out, want) {
			t.Errorf("istioctl ztunnel-config workloads -o json lacks %s:\n%s", want, out)
		}
	}

	out = run("services")
	if !row(out, "mesh", "reviews", regexp.QuoteMeta("10.96.0.20"), "None", "1/1") {
		t.Errorf("istioctl ztunnel-config services lacks reviews with its VIP and 1/1 endpoints:\n%s", out)
	}

	out = run("policies")
	if !row(out, "mesh", "deny-bad", "Deny", "Namespace") {
		t.Errorf("istioctl ztunnel-config policies lacks deny-bad:\n%s", out)
	}
	out = run("policies", "-o", "json")
	for _, want := range []string{`"Exact": "cluster.local/ns/mesh/sa/bad"`, `9091`} {
		if !strings.Contains(out, want) {
			t.Errorf("istioctl ztunnel-config policies -o json lacks %s:\n%s", want, out)
		}
	}

	out = run("certificates")
	if !row(out, regexp.QuoteMeta("spiffe://cluster.local/ns/mesh/sa/bookinfo-reviews"), "Leaf", "Available", "true") {
		t.Errorf("istioctl ztunnel-config certificates lacks the server's valid leaf:\n%s", out)
	}

	// The friendly local view agrees.
	w, err := Exec(context.Background(), a.Node.Path(), redirectorBin(), "inspect", "workloads")
	if err != nil || !row(string(w), "mesh", server.Name, regexp.QuoteMeta(server.IPv4.String()+","+server.IPv6.String()), fmt.Sprint("node", server.Node.Index),
		"HBONE", "deployment/reviews-v2", "reviews@v2", "bookinfo-reviews") {
		t.Errorf("inspect workloads: %v\n%s", err, w)
	}
	o, err := Exec(context.Background(), a.Node.Path(), redirectorBin(), "inspect", "services")
	if err != nil || !row(string(o), "mesh", "reviews", regexp.QuoteMeta("10.96.0.20"), regexp.QuoteMeta("9080->8080"), regexp.QuoteMeta(server.IPv4.String())) {
		t.Errorf("inspect services: %v\n%s", err, o)
	}
}
