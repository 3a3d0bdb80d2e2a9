package netnstest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
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
		return istioctlFile(t, istioctl, file, args...)
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

// istioctlFile runs istioctl ztunnel-config args on the config dump in
// file, with no cluster to reach: istioctl must not need one to read a file.
func istioctlFile(t *testing.T, istioctl, file string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, istioctl, append([]string{"ztunnel-config"}, append(args, "--file", file)...)...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+filepath.Join(t.TempDir(), "none"), "HOME="+t.TempDir())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("istioctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// connectionsMesh is the bookinfo mesh with an echo server on the
// server pod's port 8080 and two connections held open from the client
// pod: direct to the server pod's address, and to the reviews VIP.
func connectionsMesh(t *testing.T) (ms *mesh, client, server *Pod, direct, viaVIP net.Conn) {
	t.Helper()
	ms, client, server = newBookinfoMesh(t, "8080")
	for _, a := range ms.agents {
		a.WaitLog(t, "pod enrolled", 10*time.Second)
	}
	ServeTCP(t, server, 8080, func(c net.Conn) { io.Copy(c, c) })
	direct = openEcho(t, client, netip.AddrPortFrom(server.IPv4, 8080))
	viaVIP = openEcho(t, client, netip.MustParseAddrPort("10.96.0.20:9080"))
	return ms, client, server, direct, viaVIP
}

// TestConfigDumpConnections: the dump's workloadState lists each served
// pod's open connections as ztunnel's connection manager dumps them
// (inbound: src, originalDst the service host or null, actualDst,
// protocol; outbound: src, originalDst, actualDst, protocol), which is
// what istioctl ztunnel-config connections reads (TestIstioctlConnections
// runs it). Before, workloadState had no connections.
func TestConfigDumpConnections(t *testing.T) {
	ms, client, server, direct, viaVIP := connectionsMesh(t)
	type conn struct{ Src, OriginalDst, ActualDst, Protocol string }
	type state struct {
		State       string
		Connections *struct{ Inbound, Outbound []conn }
		Info        struct{ Name string }
	}
	connsOf := func(a *Agent, pod string) *struct{ Inbound, Outbound []conn } {
		var dump struct {
			WorkloadState map[string]state `json:"workloadState"`
		}
		if err := json.Unmarshal([]byte(scrape(t, a, "http://127.0.0.1:15000/config_dump")), &dump); err != nil {
			t.Fatal(err)
		}
		for _, s := range dump.WorkloadState {
			if s.Info.Name == pod {
				if s.State != "Up" || s.Connections == nil {
					t.Fatalf("workloadState of %s: %+v, want Up with connections", pod, s)
				}
				return s.Connections
			}
		}
		t.Fatalf("workloadState lacks %s: %+v", pod, dump.WorkloadState)
		return nil
	}
	hbone := netip.AddrPortFrom(server.IPv4, 15008).String()
	out := connsOf(ms.agents[0], client.Name)
	for _, want := range []conn{
		{direct.LocalAddr().String(), netip.AddrPortFrom(server.IPv4, 8080).String(), hbone, "HBONE"},
		{viaVIP.LocalAddr().String(), "10.96.0.20:9080", hbone, "HBONE"},
	} {
		if !slices.Contains(out.Outbound, want) {
			t.Errorf("client's outbound connections %+v lack %+v", out.Outbound, want)
		}
	}
	in := connsOf(ms.agents[1], server.Name)
	if len(in.Inbound) != 2 {
		t.Errorf("server's inbound connections %+v, want 2", in.Inbound)
	}
	for _, c := range in.Inbound {
		if c.OriginalDst != "reviews.mesh.svc.cluster.local" || c.ActualDst != netip.AddrPortFrom(server.IPv4, 8080).String() || c.Protocol != "HBONE" ||
			!strings.HasPrefix(c.Src, client.IPv4.String()+":") {
			t.Errorf("server's inbound connection %+v, want from %s to %s:8080 over HBONE, counted under reviews", c, client.IPv4, server.IPv4)
		}
	}
}

// TestIstioctlConnections: `istioctl ztunnel-config connections` lists the
// connections of TestConfigDumpConnections: on the client's node outbound
// HBONE to the server's HBONE port, the one through the VIP named after
// the service; on the server's node inbound HBONE, named after the
// service (as ztunnel's guess_inbound_service names it). Before, istioctl
// printed only its header.
func TestIstioctlConnections(t *testing.T) {
	istioctl := istioctlBin(t)
	ms, client, server, direct, viaVIP := connectionsMesh(t)
	dumpOf := func(a *Agent) string {
		file := filepath.Join(t.TempDir(), "dump.json")
		if err := os.WriteFile(file, []byte(scrape(t, a, "http://127.0.0.1:15000/config_dump")), 0o644); err != nil {
			t.Fatal(err)
		}
		return file
	}
	row := func(out string, cells ...string) bool {
		return regexp.MustCompile(`(?m)^` + strings.Join(cells, `\s+`) + `(\s|$)`).MatchString(out)
	}
	clientName, serverName := client.Name+".mesh", server.Name+".mesh"
	q := regexp.QuoteMeta
	port := func(c net.Conn) string { return fmt.Sprint(c.LocalAddr().(*net.TCPAddr).Port) }

	out := istioctlFile(t, istioctl, dumpOf(ms.agents[0]), "connections")
	for _, want := range [][]string{
		{"WORKLOAD", "DIRECTION", "LOCAL", "REMOTE", "REMOTE TARGET", "PROTOCOL"},
		{q(clientName), "Outbound", q(clientName + ":" + port(direct)), q(serverName + ":15008"), q(serverName + ":8080"), "HBONE"},
		{q(clientName), "Outbound", q(clientName + ":" + port(viaVIP)), q(serverName + ":15008"), q("reviews.mesh.svc.cluster.local:9080"), "HBONE"},
	} {
		if !row(out, want...) {
			t.Errorf("istioctl ztunnel-config connections on the client's node lacks %v:\n%s", want, out)
		}
	}
	out = istioctlFile(t, istioctl, dumpOf(ms.agents[1]), "connections", "-o", "json")
	for _, want := range []string{`"inbound": [`, `"originalDst": "reviews.mesh.svc.cluster.local"`, `"actualDst": "` + server.IPv4.String() + `:8080"`, `"protocol": "HBONE"`} {
		if !strings.Contains(out, want) {
			t.Errorf("istioctl ztunnel-config connections -o json on the server's node lacks %s:\n%s", want, out)
		}
	}
	out = istioctlFile(t, istioctl, dumpOf(ms.agents[1]), "connections")
	// Both reach port 8080 of a reviews endpoint: the service is named
	// for both, as ztunnel's guess_inbound_service names it.
	inbound := []string{q(serverName), "Inbound", q(serverName + ":8080"), q(clientName) + `:\d+`, q("reviews.mesh.svc.cluster.local"), "HBONE"}
	if n := len(regexp.MustCompile(`(?m)^`+strings.Join(inbound, `\s+`)+`$`).FindAllString(out, -1)); n != 2 {
		t.Errorf("istioctl ztunnel-config connections on the server's node: %d rows %v, want 2:\n%s", n, inbound, out)
	}
}
