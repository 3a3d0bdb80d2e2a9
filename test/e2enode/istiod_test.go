//go:build e2enode && linux

package e2enode

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/test/istiotest"
)

// TestRealNodeIstiod runs the chart as a user of Istio ambient installs it, on a real node: a
// real istiod (pilot-discovery, Istio's CRDs, ambient on) signs the agent's workload
// certificates and sends it the mesh over workload xDS (source=xds), and the agent proves
// itself to istiod with the service account token the real kubelet projects (audience
// istio-ca), bound to its pod, by which istiod's node authorizer lets it ask only for the
// identities of its own node's pods. The cluster's DNS (dnsmasq at the kubelet's clusterDNS)
// resolves istiod's Service name to the node, where istiod listens, as kube-proxy would route it.
func TestRealNodeIstiod(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root: namespaces, cgroups, containerd, kubelet")
	}
	start := time.Now()
	ctx := testContext(t)
	istiodBin, crds := istiotest.Binaries(t)
	bins, images := nodeInputs(ctx, t)
	host := readHostState(t)
	n, err := StartNode(ctx, t.Logf, bins, images, imageTag)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			dumpNode(t, n)
			t.Logf("--- end of istiod's log:\n%s", n.LogTail("istiod", 60))
		}
		holdOnFailure(t, n)
		if err := n.Stop(t.Logf); err != nil {
			t.Errorf("stop node: %v", err)
		}
		checkClean(t, n, host)
	})
	t.Logf("node up after %v", time.Since(start).Round(time.Millisecond))
	kubectl := func(args ...string) string { return mustKubectl(ctx, t, n, args...) }
	apply := func(name, manifest string) { mustApply(ctx, t, n, name, manifest) }

	if _, err := n.ServeClusterDNS(map[string]string{istiotest.ServerName: n.IP}); err != nil {
		t.Fatal(err)
	}
	kubectl("apply", "--server-side", "-f", crds)
	waitCRDsEstablished(ctx, t, n, "peerauthentications.security.istio.io", "authorizationpolicies.security.istio.io")
	kubectl("create", "namespace", releaseNS)
	kubectl("create", "namespace", meshNS)
	kubectl("label", "namespace", meshNS, "istio.io/dataplane-mode=ambient")
	kubectl("create", "namespace", outsideNS)
	// The chart's service account, release redirector: istio-system/redirector.
	if err := n.StartIstiod(istiodBin, releaseNS+"/"+release); err != nil {
		t.Fatal(err)
	}
	if err := waitFor(ctx, 2*time.Minute, "istiod ready and its root published", func() error {
		if err := istiodReady(ctx, n); err != nil {
			return err
		}
		_, err := n.Client.CoreV1().ConfigMaps(releaseNS).Get(ctx, "istio-ca-root-cert", metav1.GetOptions{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("istiod ready after %v", time.Since(start).Round(time.Millisecond))

	chart := filepath.Join(repoRoot, "manifests", "charts", "redirector")
	if out, err := n.Helm(ctx, "install", release, chart, "-n", releaseNS,
		"--set", "source=xds", "--set", "meshMTLSMode=STRICT",
		"--set", "image.repository=localhost/redirector", "--set", "image.tag="+imageTag,
		"--set", "image.pullPolicy=Never", "--wait", "--timeout=3m"); err != nil {
		t.Fatalf("helm install: %v\n%s", err, out)
	}
	t.Logf("helm install done after %v", time.Since(start).Round(time.Millisecond))

	apply("server", serverPod(meshNS, "server", nil)+"---\n"+service(meshNS, "server"))
	apply("client", clientPod(meshNS, "client", nil))
	apply("outsider", clientPod(outsideNS, "outsider", nil))
	for _, p := range [][2]string{{meshNS, "server"}, {meshNS, "client"}, {outsideNS, "outsider"}} {
		waitReady(t, n, p[0], p[1])
	}
	for _, p := range []string{"server", "client"} {
		waitAnnotated(t, n, meshNS, p, true)
	}
	serverIP, clientIP := podIP(t, n, meshNS, "server"), podIP(t, n, meshNS, "client")
	svc, err := n.Client.CoreV1().Services(meshNS).Get(ctx, "server", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitServiceEndpoint(ctx, t, n, meshNS, "server", serverIP)
	get := func(ns, pod, url string) (string, error) { return podGet(ctx, n, ns, pod, url) }

	t.Run("MeshedWithIstiodsCertificates", func(t *testing.T) {
		s, err := n.Sniff(marker)
		if err != nil {
			t.Fatal(err)
		}
		// istiod learns of the Service and its endpoint a moment after the cluster does.
		var out string
		err = waitFor(ctx, time.Minute, "the client reaching the Service's address", func() error {
			out, err = get(meshNS, "client", fmt.Sprintf("http://%s/cgi-bin/ip", svc.Spec.ClusterIP))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		if got := remoteAddr(out); got != clientIP {
			t.Errorf("server saw %q through the Service, want the client's pod IP %s", got, clientIP)
		}
		if out, err := get(meshNS, "client", "http://"+serverIP+":8080/"); err != nil || !strings.Contains(out, marker) {
			t.Errorf("client -> server page: %q, %v", out, err)
		}
		// DNS capture answers from istiod's view of the mesh (the cluster's resolver here knows
		// only istiod's name).
		lookup, err := n.Kubectl(ctx, "-n", meshNS, "exec", "client", "--", "nslookup", "-type=a", "server."+meshNS+".svc.cluster.local")
		if err != nil || !strings.Contains(lookup, svc.Spec.ClusterIP) {
			t.Errorf("nslookup of the Service in the meshed client: %q, %v; want %s from the agent", lookup, err, svc.Spec.ClusterIP)
		}
		hits, ports := s.Stop()
		t.Logf("data frames by port: %v", ports)
		if hits != 0 {
			t.Errorf("the marker crossed the pod bridge in plaintext %d times", hits)
		}
		if ports[15008] == 0 {
			t.Errorf("no HBONE (15008) traffic on the pod bridge: %v", ports)
		}
		for series, want := range map[string]bool{
			"redirector_xds_connected":                                       true,
			"redirector_ca_requests_total":                                   true,
			`redirector_ca_request_failures_total{reason="unauthenticated"}`: false,
		} {
			got, err := agentCounter(ctx, n, series)
			if want && (err != nil || got == 0) {
				t.Errorf("%s = %d, %v: want > 0", series, got, err)
			}
			if !want && err == nil && got != 0 {
				t.Errorf("%s = %d, want 0", series, got)
			}
		}
	})

	t.Run("IstiodsStrictRefusesPlaintextProbesPass", func(t *testing.T) {
		// meshMTLSMode=STRICT is a PeerAuthentication, which istiod translates and sends; it
		// was there before the server started, which became Ready through its probes.
		strictRefusesPlaintextProbesPass(ctx, t, n, serverIP, 0)
	})

	t.Run("Uninstall", func(t *testing.T) {
		if out, err := n.Helm(ctx, "uninstall", release, "-n", releaseNS, "--wait", "--timeout=3m"); err != nil {
			t.Fatalf("helm uninstall: %v\n%s", err, out)
		}
		if err := waitFor(ctx, time.Minute, "plain HTTP between the pods again", func() error {
			_, err := get(meshNS, "client", "http://"+serverIP+":8080/")
			return err
		}); err != nil {
			t.Error(err)
		}
	})
}

// istiodReady asks the node's istiod for /ready.
func istiodReady(ctx context.Context, n *Node) error {
	_, err := getInNode(ctx, n, "http://127.0.0.1:15080/ready", 2*time.Second)
	return err
}
