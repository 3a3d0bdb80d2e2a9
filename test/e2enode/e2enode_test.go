//go:build e2enode && linux

package e2enode

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const (
	release   = "redirector"
	releaseNS = "istio-system"
	// What the cluster's resolver (ServeClusterDNS) answers: a decoy for the Service's name,
	// which only a pod outside the mesh may get, and a name outside the mesh.
	dnsDecoy       = "192.0.2.99"
	dnsOutsideName = "outside.test"
	dnsOutsideAddr = "192.0.2.7"
	meshNS         = "mesh"
	outsideNS      = "outside"
	imageTag       = "e2e"
	marker         = "e2enode-plaintext-marker" // the app image's index.html
	redirection    = "ambient.istio.io/redirection"
	podTimeout     = 2 * time.Minute
)

var repoRoot = func() string {
	wd, _ := os.Getwd()
	return filepath.Join(wd, "..", "..")
}()

// Reserves at the end of `go test -timeout`: the test's own context ends cleanupReserve
// before it, so a stuck step fails and t.Cleanup stops the node; if that does not return
// either, the watchdog in TestMain stops the nodes and exits watchdogReserve before it. (At
// the timeout itself the testing package panics and runs no clean-up at all.)
const (
	cleanupReserve  = 2 * time.Minute
	watchdogReserve = 45 * time.Second
)

// TestMain stops every node on SIGINT/SIGTERM (the testing package runs no t.Cleanup then)
// and shortly before `go test -timeout` expires.
func TestMain(m *testing.M) {
	flag.Parse()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		s := <-sig
		log.Printf("e2enode: %v: stopping the nodes", s)
		StopAll(log.Printf)
		removeInputs()
		os.Exit(130)
	}()
	if f := flag.Lookup("test.timeout"); f != nil {
		if d, err := time.ParseDuration(f.Value.String()); err == nil && d > 2*watchdogReserve {
			time.AfterFunc(d-watchdogReserve, func() {
				fmt.Printf("e2enode: -timeout %v is %v away: stopping the nodes and failing\n", d, watchdogReserve)
				StopAll(log.Printf)
				removeInputs()
				fmt.Println("FAIL: e2enode watchdog")
				os.Exit(1)
			})
		}
	}
	code := m.Run()
	removeInputs()
	os.Exit(code)
}

// testContext is t.Context() ending cleanupReserve before the test's deadline (-timeout),
// so every command and wait given it gives up while the clean-up still has time.
func testContext(t *testing.T) context.Context {
	ctx := t.Context()
	if d, ok := t.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, d.Add(-cleanupReserve))
		t.Cleanup(cancel)
	}
	return ctx
}

// script runs one of the hack/ scripts and returns the last line of its output (a folder).
func script(ctx context.Context, t *testing.T, name string, args ...string) string {
	t.Helper()
	dir, err := scriptErr(ctx, name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func scriptErr(ctx context.Context, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "bash", append([]string{filepath.Join(repoRoot, "hack", name)}, args...)...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%s: %w", name, err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1], nil
}

// TestRealNode installs the chart on a real kubelet + containerd node and checks the mesh
// end to end. The steps share one node (bringing one up costs about a minute) and run in
// order: each needs the state the previous one left.
func TestRealNode(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root: namespaces, cgroups, containerd, kubelet")
	}
	start := time.Now()
	ctx := testContext(t)
	bins, images := nodeInputs(ctx, t)
	t.Logf("binaries and images ready after %v", time.Since(start).Round(time.Millisecond))
	host := readHostState(t)
	n, err := StartNode(ctx, t.Logf, bins, images, imageTag)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			dumpNode(t, n)
		}
		holdOnFailure(t, n)
		if err := n.Stop(t.Logf); err != nil {
			t.Errorf("stop node: %v", err)
		}
		checkClean(t, n, host)
	})
	t.Logf("node up after %v (cold or warm: see docs/e2e-node.md)", time.Since(start).Round(time.Millisecond))

	kubectl := func(t *testing.T, args ...string) string {
		t.Helper()
		return mustKubectl(ctx, t, n, args...)
	}
	apply := func(t *testing.T, name, manifest string) {
		t.Helper()
		mustApply(ctx, t, n, name, manifest)
	}

	// The cluster's DNS (kube-dns's part, played by dnsmasq).
	dnsLog, err := n.ServeClusterDNS(map[string]string{
		"server." + meshNS + ".svc.cluster.local": dnsDecoy,
		dnsOutsideName: dnsOutsideAddr,
	})
	if err != nil {
		t.Fatal(err)
	}

	// What a user has before installing, and a pod in the mesh's namespace already running.
	prepareCluster(ctx, t, n)
	apply(t, "early", serverPod(meshNS, "early", nil))
	apply(t, "outsider", clientPod(outsideNS, "outsider", nil))
	waitReady(t, n, meshNS, "early")
	waitReady(t, n, outsideNS, "outsider")

	// wget fetches url from inside a pod (podGet).
	wget := func(ns, pod, url string) (string, error) { return podGet(ctx, n, ns, pod, url) }

	// The node's own pod network, before any mesh: plain HTTP between two pods.
	if _, err := wget(outsideNS, "outsider", "http://"+podIP(t, n, meshNS, "early")+":8080/"); err != nil {
		t.Fatalf("pod to pod before the mesh: %v", err)
	}

	// The chart, as a user installs it.
	chart := filepath.Join(repoRoot, "manifests", "charts", "redirector")
	helmStart := time.Now()
	// The chart exactly as it renders: unprivileged agent and node-setup containers. (They
	// once needed to be privileged here: the agent wrote the pods' sysctls through its own
	// /proc/sys, which the runtime mounts read-only; it now writes them through PROC_DIR.)
	// The kubelet's pods are below its cgroupRoot, the node's own here, not at the top of
	// the hierarchy: the agent finds their cgroup above its own (hostProbePodCgroup empty).
	helmInstall(ctx, t, n)
	// helm --wait and the agent pod's readiness agree (surge rollout, maxUnavailable 0).
	if err := waitFor(ctx, podTimeout, "agent pod Ready", func() error {
		if agentPodOrEmpty(n) == "" {
			return fmt.Errorf("no ready agent pod")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("helm install to agent Ready took %v", time.Since(helmStart).Round(time.Millisecond))
	// The kubelet, the bridge plugin and the agent have all done their set-up by now.
	checkRootNet(t, host.rootNet, "with the node and the agent running")

	t.Run("CNIChained", func(t *testing.T) {
		types := conflistTypes(t, n)
		if want := []string{"bridge", "portmap", "redirector-cni"}; !slices.Equal(types, want) {
			t.Fatalf("conflist plugins %v, want %v", types, want)
		}
		if _, err := os.Stat(n.Root("/opt/cni/bin/redirector-cni")); err != nil {
			t.Fatalf("plugin binary not installed: %v", err)
		}
	})

	t.Run("ExistingPodFound", func(t *testing.T) {
		waitAnnotated(t, n, meshNS, "early", true)
	})

	apply(t, "server", serverPod(meshNS, "server", nil)+"---\n"+service(meshNS, "server"))
	apply(t, "client", clientPod(meshNS, "client", nil))
	apply(t, "optout", clientPod(meshNS, "optout", map[string]string{"istio.io/dataplane-mode": "none"}))
	apply(t, "plain", serverPod(outsideNS, "plain", nil)) // a server outside the mesh
	for _, p := range [][2]string{{meshNS, "server"}, {meshNS, "client"}, {meshNS, "optout"}, {outsideNS, "outsider"}, {outsideNS, "plain"}} {
		waitReady(t, n, p[0], p[1])
	}
	serverIP := podIP(t, n, meshNS, "server")
	clientIP := podIP(t, n, meshNS, "client")
	svc, err := n.Client.CoreV1().Services(meshNS).Get(ctx, "server", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitServiceEndpoint(ctx, t, n, meshNS, "server", serverIP)
	waitAgentSees(ctx, t, n, serverIP, svc.Spec.ClusterIP)

	t.Run("NewPodsEnrolledAtCNIAdd", func(t *testing.T) {
		// The annotation is written when the pod is enrolled; for a pod created after the
		// agent that is at CNI ADD, before its containers start, so it is there by Ready.
		for _, p := range []string{"server", "client"} {
			waitAnnotated(t, n, meshNS, p, true)
		}
		// The plugin's ADD reached the agent, which enrolled the pod then (before its
		// containers started), not a later scan.
		logs, err := n.Kubectl(ctx, "-n", releaseNS, "logs", agentPod(t, n), "-c", "agent")
		if err != nil {
			t.Fatal(err)
		}
		for p, want := range map[string]string{meshNS + "/server": "true", meshNS + "/client": "true", meshNS + "/optout": "false"} {
			re := regexp.MustCompile(`msg="CNI event handled".* command=ADD pod=` + regexp.QuoteMeta(p) + ` .*enrolled=` + want)
			if !re.MatchString(logs) {
				t.Errorf("no CNI ADD for %s with enrolled=%s in the agent's log", p, want)
			}
		}
		for _, p := range [][2]string{{meshNS, "optout"}, {outsideNS, "outsider"}} {
			pod, err := n.Client.CoreV1().Pods(p[0]).Get(ctx, p[1], metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if v, ok := pod.Annotations[redirection]; ok {
				t.Errorf("%s/%s is not in the mesh but carries %s=%s", p[0], p[1], redirection, v)
			}
		}
	})

	t.Run("Meshed", func(t *testing.T) {
		s, err := n.Sniff(marker)
		if err != nil {
			t.Fatal(err)
		}
		for _, url := range []string{
			fmt.Sprintf("http://%s:8080/cgi-bin/ip", serverIP),
			fmt.Sprintf("http://%s/cgi-bin/ip", svc.Spec.ClusterIP), // Service VIP, no kube-proxy
		} {
			out, err := wget(meshNS, "client", url)
			if err != nil {
				t.Fatalf("client -> %s: %v", url, err)
			}
			if got := remoteAddr(out); got != clientIP {
				t.Errorf("%s: server saw %q, want the client's pod IP %s", url, got, clientIP)
			}
		}
		for _, url := range []string{"http://" + serverIP + ":8080/", "http://" + svc.Spec.ClusterIP + "/"} {
			out, err := wget(meshNS, "client", url)
			if err != nil || !strings.Contains(out, marker) {
				t.Fatalf("client -> %s: %q, %v", url, out, err)
			}
		}
		hits, ports := s.Stop()
		t.Logf("data frames by port: %v", ports)
		if hits != 0 {
			t.Errorf("the marker crossed the pod bridge in plaintext %d times", hits)
		}
		if ports[15008] == 0 {
			t.Errorf("no HBONE (15008) traffic on the pod bridge: %v", ports)
		}
		// Local routing reaches the pods' sockets under the kubelet's cgroups: the
		// chart mounts the host's cgroup hierarchy, and the app sockets of the
		// connections above were routed over lo to the agent.
		if routed, err := agentCounter(ctx, n, `redirector_bpf_packets_total{reason="sock_routed_local"}`); err != nil || routed == 0 {
			t.Errorf("sock_routed_local = %d, %v: no app socket was routed over lo", routed, err)
		}
	})

	// Istio ambient's DNS capture, on by default. The cluster's DNS is a real resolver
	// (dnsmasq, at the address the kubelet writes into pods' resolv.conf) that knows a decoy
	// address for the Service's name: a meshed pod gets the Service's own address from the
	// agent in the pod, an opted-out pod the decoy from the resolver; a name outside the mesh
	// is forwarded by the agent from the pod's own address.
	t.Run("DNSCaptured", func(t *testing.T) {
		nslookup := func(pod string, args ...string) (string, error) {
			ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			return n.Kubectl(ctx, append([]string{"-n", meshNS, "exec", pod, "--", "nslookup", "-type=a"}, args...)...)
		}
		resolv, err := n.Kubectl(ctx, "-n", meshNS, "exec", "client", "--", "cat", "/etc/resolv.conf")
		if err != nil || !strings.Contains(resolv, "nameserver "+clusterDNS) {
			t.Fatalf("the kubelet gave the pod resolv.conf %q (%v), want nameserver %s", resolv, err, clusterDNS)
		}
		svcName := "server." + meshNS + ".svc.cluster.local"
		for _, name := range []string{svcName, "server." + meshNS} {
			out, err := nslookup("client", name)
			if err != nil || !strings.Contains(out, svc.Spec.ClusterIP) || strings.Contains(out, dnsDecoy) {
				t.Errorf("nslookup %s in the meshed client: %q, %v; want the Service's address %s from the agent", name, out, err, svc.Spec.ClusterIP)
			}
		}
		if out, err := nslookup("client", dnsOutsideName); err != nil || !strings.Contains(out, dnsOutsideAddr) {
			t.Errorf("nslookup %s in the meshed client: %q, %v; want %s, forwarded to the cluster's resolver", dnsOutsideName, out, err, dnsOutsideAddr)
		}
		if out, err := nslookup("optout", svcName); err != nil || !strings.Contains(out, dnsDecoy) {
			t.Errorf("nslookup %s in the opted-out pod: %q, %v; want the resolver's decoy %s (no capture)", svcName, out, err, dnsDecoy)
		}
		log, err := os.ReadFile(dnsLog)
		if err != nil {
			t.Fatal(err)
		}
		if want := "query[A] " + dnsOutsideName + " from " + clientIP; !strings.Contains(string(log), want) {
			t.Errorf("the cluster's resolver did not log %q (forwarded from the client's own address):\n%s", want, log)
		}
		if want := "query[A] " + svcName + " from " + clientIP; strings.Contains(string(log), want) {
			t.Errorf("the meshed client's query for the Service reached the cluster's resolver (%q)", want)
		}
		if got, err := agentCounter(ctx, n, `redirector_bpf_packets_total{reason="in_assign_dns"}`); err != nil || got == 0 {
			t.Errorf("in_assign_dns = %d, %v: no query was assigned to the agent's DNS socket", got, err)
		}
		if t.Failed() {
			logs, _ := n.Kubectl(ctx, "-n", releaseNS, "logs", agentPod(t, n), "-c", "agent")
			for _, line := range strings.Split(logs, "\n") {
				if strings.Contains(strings.ToLower(line), "dns") {
					t.Logf("agent: %s", line)
				}
			}
		}
	})

	t.Run("StrictRefusesPlaintextProbesPass", func(t *testing.T) {
		// The kubelet's HTTP probes have been running all along: a few more periods.
		strictRefusesPlaintextProbesPass(ctx, t, n, serverIP, 12*time.Second)
	})

	// Day one for an operator coming from istio-cni + ztunnel (dayone_test.go).
	plainIP := podIP(t, n, outsideNS, "plain")
	t.Run("InitContainerMeshed", func(t *testing.T) { initContainerMeshed(ctx, t, n, serverIP) })
	t.Run("SandboxRecreated", func(t *testing.T) { sandboxRecreated(ctx, t, n, clientIP) })
	t.Run("OptOutLive", func(t *testing.T) { optOutLive(ctx, t, n, serverIP, plainIP) })
	t.Run("HostNetworkUntouched", func(t *testing.T) { hostNetworkUntouched(ctx, t, n, serverIP, clientIP, plainIP) })

	t.Run("AgentRestart", func(t *testing.T) {
		s, err := n.Sniff(marker)
		if err != nil {
			t.Fatal(err)
		}
		old := agentPod(t, n)
		kubectl(t, "-n", releaseNS, "delete", "pod", old, "--wait=false")
		// Requests go on while the agent is away; each either fails or is meshed.
		deadline := time.Now().Add(podTimeout)
		var ok, failed int
		for time.Now().Before(deadline) {
			out, err := wget(meshNS, "client", "http://"+serverIP+":8080/")
			if err == nil && strings.Contains(out, marker) {
				ok++
				if cur := agentPodOrEmpty(n); cur != "" && cur != old && ok >= 3 {
					break
				}
			} else {
				failed++
			}
			time.Sleep(time.Second)
		}
		hits, ports := s.Stop()
		t.Logf("during the restart: %d requests answered, %d failed; frames by port %v", ok, failed, ports)
		if cur := agentPodOrEmpty(n); cur == "" || cur == old {
			t.Fatalf("the kubelet did not bring a new agent pod up (old %s, now %q)", old, cur)
		}
		if hits != 0 {
			t.Errorf("plaintext leaked %d times during the agent's restart", hits)
		}
		// The new pod's mount-bpffs found the node's bpffs: one mount, not a second one
		// stacked over the first (whose pins would then outlive an uninstall).
		if got := bpffsMounts(t, n); got != 1 {
			t.Errorf("%d bpffs mounts on the node's /sys/fs/bpf after the restart, want 1", got)
		}
		// After the restart, the same checks as Meshed.
		s, err = n.Sniff(marker)
		if err != nil {
			t.Fatal(err)
		}
		if out, err := wget(meshNS, "client", "http://"+serverIP+":8080/cgi-bin/ip"); err != nil || remoteAddr(out) != clientIP {
			t.Errorf("after the restart: %q, %v", out, err)
		}
		if hits, ports := s.Stop(); hits != 0 || ports[15008] == 0 {
			t.Errorf("after the restart: plaintext frames %d, frames by port %v", hits, ports)
		}
	})

	t.Run("HelmUpgrade", func(t *testing.T) {
		// A new image tag (the same content under another name, as a rebuild would be):
		// the chart's surge rollout starts the new agent next to the old one, which hands
		// over; requests go on all along.
		if err := n.TagImage(ctx, "localhost/redirector:"+imageTag, "localhost/redirector:"+imageTag+"-next"); err != nil {
			t.Fatal(err)
		}
		s, err := n.Sniff(marker)
		if err != nil {
			t.Fatal(err)
		}
		old := agentPod(t, n)
		// Requests back to back from inside the client pod (hundreds a second, where one
		// kubectl exec per request made a few): a connection lost in the hand-over shows.
		load, err := startPodLoad(ctx, n, meshNS, "client", serverIP+":8080", marker)
		if err != nil {
			t.Fatal(err)
		}
		// The old agent's log goes with its pod; kept here for a failure's report.
		oldLog := make(chan string, 1)
		go func() {
			out, _ := n.Kubectl(ctx, "-n", releaseNS, "logs", "-f", old)
			oldLog <- out
		}()
		out, err := n.Helm(ctx, "upgrade", release, chart, "-n", releaseNS, "--reuse-values",
			"--set", "image.tag="+imageTag+"-next", "--wait", "--timeout=3m")
		if err == nil {
			err = waitFor(ctx, podTimeout, "the upgraded agent alone", func() error {
				pods, err := n.Client.CoreV1().Pods(releaseNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=redirector,app.kubernetes.io/instance=" + release})
				if err != nil {
					return err
				}
				if len(pods.Items) != 1 || pods.Items[0].Name == old || !podReady(&pods.Items[0]) ||
					!strings.HasSuffix(pods.Items[0].Spec.Containers[0].Image, imageTag+"-next") {
					return fmt.Errorf("%d agent pods", len(pods.Items))
				}
				return nil
			})
		}
		time.Sleep(2 * time.Second) // a few requests through the new agent alone
		r, loadErr := load.stop(ctx)
		hits, ports := s.Stop()
		if err != nil {
			t.Fatalf("helm upgrade: %v\n%s", err, out)
		}
		if loadErr != nil {
			t.Fatalf("requests during the upgrade: %v", loadErr)
		}
		t.Logf("during the upgrade: %d requests answered, %d failed; frames by port %v", r.ok, len(r.failed), ports)
		if len(r.failed) > 0 || r.ok < 100 {
			t.Errorf("%d requests failed during the upgrade (%d answered), want none failed and 100 answered: %v", len(r.failed), r.ok, r.failed)
			select {
			case l := <-oldLog:
				t.Logf("--- the old agent's log (%s) without access lines, its last 80:\n%s", old, logExcerpt(withoutAccessLines(l), 80))
			case <-time.After(5 * time.Second):
				t.Logf("--- the old agent's log (%s): not ended 5 s after the upgrade", old)
			}
		}
		if hits != 0 {
			t.Errorf("plaintext leaked %d times during the upgrade", hits)
		}
		// The surge pod took the pods' listeners from the old one over the chart's hand-over
		// socket (the host directory both mount), not by waiting for the old one to exit.
		if logs, err := n.Kubectl(ctx, "-n", releaseNS, "logs", agentPod(t, n), "-c", "agent"); err != nil {
			t.Errorf("the new agent's log: %v", err)
		} else if !strings.Contains(logs, "pod listeners taken over from the predecessor") || strings.Contains(logs, "pod ports held by another process") {
			t.Errorf("the new agent did not take the pods' listeners over from the old one; its log without access lines:\n%s", logExcerpt(withoutAccessLines(logs), 80))
		}
		if got := bpffsMounts(t, n); got != 1 {
			t.Errorf("%d bpffs mounts on the node's /sys/fs/bpf after the upgrade, want 1", got)
		}
	})

	if os.Getenv("E2ENODE_STARTUP") != "" {
		t.Run("StartupTime", func(t *testing.T) { startupTime(t, n, apply) })
	}

	t.Run("Uninstall", func(t *testing.T) {
		before := map[string]string{}
		for _, p := range []string{"server", "client"} {
			pod, err := n.Client.CoreV1().Pods(meshNS).Get(ctx, p, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			before[p] = string(pod.UID)
		}
		// The agent pod's logs vanish with it: follow them, to show on failure.
		agent := agentPod(t, n)
		for _, c := range []string{"node-setup", "agent"} {
			f := filepath.Join(n.Dir, "uninstall-"+c+".log")
			out, err := os.Create(f)
			if err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command("nsenter", "--net=/run/netns/"+n.Name, "--", filepath.Join(n.Bins, "kubectl"),
				"--kubeconfig", n.Kubeconfig, "-n", releaseNS, "logs", "-f", agent, "-c", c, "--tail=5")
			cmd.Stdout, cmd.Stderr = out, out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
				out.Close()
				if t.Failed() {
					b, _ := os.ReadFile(f)
					t.Logf("--- %s log during the uninstall:\n%s", c, b)
				}
			}()
		}
		if out, err := n.Helm(ctx, "uninstall", release, "-n", releaseNS, "--wait", "--timeout=3m"); err != nil {
			t.Fatalf("helm uninstall: %v\n%s", err, out)
		}
		// Helm returns once the DaemonSet is deleted; its pods terminate after that, the agent
		// draining and node-setup cleaning the node up as they stop.
		if err := waitFor(ctx, podTimeout, "agent pods gone", func() error {
			return agentPodsGone(n, "")
		}); err != nil {
			t.Fatal(err)
		}
		if types := conflistTypes(t, n); !slices.Equal(types, []string{"bridge", "portmap"}) {
			t.Errorf("conflist after uninstall: %v, want the original bridge, portmap", types)
		}
		if _, err := os.Stat(n.Root("/opt/cni/bin/redirector-cni")); err == nil {
			t.Errorf("redirector-cni binary left in /opt/cni/bin")
		}
		if entries, err := os.ReadDir(n.Root("/sys/fs/bpf/redirector")); err == nil && len(entries) > 0 {
			t.Errorf("pins left under /sys/fs/bpf/redirector: %d entries", len(entries))
		}
		for p, uid := range before {
			pod, err := n.Client.CoreV1().Pods(meshNS).Get(ctx, p, metav1.GetOptions{})
			if err != nil || string(pod.UID) != uid || !podReady(pod) {
				t.Errorf("pod %s did not keep running through the uninstall: %v", p, err)
			}
		}
		// Redirection is gone: plain HTTP between the pods again, and the sniffer sees the
		// marker now (so its silence in the meshed checks means something).
		if out, err := wget(meshNS, "client", "http://"+serverIP+":8080/cgi-bin/ip"); err != nil || remoteAddr(out) != clientIP {
			t.Errorf("after uninstall: %q, %v", out, err)
		}
		s, err := n.Sniff(marker)
		if err != nil {
			t.Fatal(err)
		}
		out, err := wget(meshNS, "client", "http://"+serverIP+":8080/")
		hits, ports := s.Stop()
		if err != nil || !strings.Contains(out, marker) {
			t.Errorf("plain request after uninstall: %q, %v", out, err)
		}
		// HBONE between these two pods; other pods' connections may still be on the wire (the
		// kernel retransmitting a closed tunnel socket's last data to a pod deleted earlier).
		if hbone := s.FramesBetween(clientIP, serverIP, 15008); hits == 0 || hbone != 0 {
			t.Errorf("after uninstall the sniffer saw the plaintext marker %d times and %d HBONE frames between the client and the server; want some and none (connections on 15008: %s; all frames by port %v)",
				hits, hbone, s.FlowsOn(15008), ports)
		}
	})
}

// nodeInputs builds (once per test binary) the node's binaries and the images.
func nodeInputs(ctx context.Context, t *testing.T) (bins, images string) {
	t.Helper()
	inputsOnce.Do(func() {
		// The pid in the name lets SweepStale remove it if this process dies unstopped.
		dir, err := os.MkdirTemp("", fmt.Sprintf("e2enode-images-%d-", os.Getpid()))
		if err != nil {
			inputsErr = err
			return
		}
		inputsMu.Lock()
		inputsDir = dir
		inputsMu.Unlock()
		if inputs.bins, inputsErr = scriptErr(ctx, "node-binaries.sh"); inputsErr != nil {
			return
		}
		inputs.images, inputsErr = scriptErr(ctx, "build-image.sh", filepath.Join(dir, "images"), imageTag)
	})
	if inputsErr != nil {
		t.Fatal(inputsErr)
	}
	return inputs.bins, inputs.images
}

var (
	inputsOnce sync.Once
	inputs     struct{ bins, images string }
	inputsMu   sync.Mutex
	inputsDir  string // removed by TestMain
	inputsErr  error
)

// removeInputs removes the images' folder (at the end, on a signal, from the watchdog).
func removeInputs() {
	inputsMu.Lock()
	defer inputsMu.Unlock()
	if inputsDir != "" {
		_ = os.RemoveAll(inputsDir)
		inputsDir = ""
	}
}

// dumpNode logs what shows why a test on n failed: the daemons' logs, the pods, the agents'.
func dumpNode(t *testing.T, n *Node) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	procs := []string{"kubelet", "containerd"}
	if n.control == nil {
		procs = append(procs, "kube-apiserver")
		if out, err := n.Kubectl(ctx, "get", "pods", "-A", "-o", "wide"); err == nil {
			t.Logf("--- pods:\n%s", out)
		}
		if out, err := n.Kubectl(ctx, "-n", releaseNS, "logs", "-l", "app.kubernetes.io/name=redirector", "--all-containers", "--prefix", "--tail=40"); err == nil {
			t.Logf("--- agent logs:\n%s", out)
		}
	}
	for _, p := range procs {
		t.Logf("--- end of %s's %s log:\n%s", n.Name, p, n.LogTail(p, 40))
	}
	if dir, err := n.SaveArtifacts(ctx, filepath.Join(artifactsDir(), n.Name)); err != nil {
		t.Logf("saving %s's logs: %v", n.Name, err)
	} else {
		t.Logf("--- %s's daemon, pod and container logs and the cluster's events: %s", n.Name, dir)
	}
}

// artifactsDir is where a failed test leaves its nodes' logs: $E2ENODE_ARTIFACTS, or
// bin/e2e-node-artifacts.
func artifactsDir() string {
	if d := os.Getenv("E2ENODE_ARTIFACTS"); d != "" {
		return d
	}
	return filepath.Join(repoRoot, "bin", "e2e-node-artifacts")
}

// holdOnFailure keeps a failed test's node for a look, as E2ENODE_HOLD says.
func holdOnFailure(t *testing.T, n *Node) {
	if d, err := time.ParseDuration(os.Getenv("E2ENODE_HOLD")); err == nil && t.Failed() {
		t.Logf("E2ENODE_HOLD: node %s kept for %v; KUBECONFIG=%s, ip netns exec %s ...", n.Name, d, n.Kubeconfig, n.Name)
		time.Sleep(d)
	}
}

func mustKubectl(ctx context.Context, t *testing.T, n *Node, args ...string) string {
	t.Helper()
	out, err := n.Kubectl(ctx, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// waitCRDsEstablished waits until the API server serves each CRD. It polls the
// condition rather than running kubectl wait, which fails at once ("accessor
// error: <nil>") on a CRD whose status the API server has not written yet.
func waitCRDsEstablished(ctx context.Context, t *testing.T, n *Node, names ...string) {
	t.Helper()
	for _, name := range names {
		err := waitFor(ctx, time.Minute, "CRD "+name+" established", func() error {
			out, err := n.Kubectl(ctx, "get", "crd", name, "-o", `jsonpath={.status.conditions[?(@.type=="Established")].status}`)
			if err != nil {
				return err
			}
			if strings.TrimSpace(out) != "True" {
				return fmt.Errorf("Established is %q", strings.TrimSpace(out))
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}

func mustApply(ctx context.Context, t *testing.T, n *Node, name, manifest string) {
	t.Helper()
	f := filepath.Join(n.Dir, name+".yaml")
	if err := os.WriteFile(f, []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	mustKubectl(ctx, t, n, "apply", "-f", f)
}

// prepareCluster makes what a user has before installing: Istio's policy CRDs (for STRICT),
// the release namespace with the file CA of the standalone profile, a namespace in the mesh
// and a namespace outside it.
func prepareCluster(ctx context.Context, t *testing.T, n *Node) {
	t.Helper()
	kubectl := func(args ...string) { mustKubectl(ctx, t, n, args...) }
	for _, f := range []string{"crd-peerauthentication.yaml", "crd-authorizationpolicy.yaml"} {
		kubectl("apply", "-f", filepath.Join(repoRoot, "pkg/source/kubernetes/testdata", f))
	}
	waitCRDsEstablished(ctx, t, n, "peerauthentications.security.istio.io")
	kubectl("create", "namespace", releaseNS)
	redirector := filepath.Join(n.Dir, "redirector")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", redirector, filepath.Join(repoRoot, "cmd", "redirector")).CombinedOutput(); err != nil {
		t.Fatalf("build redirector: %v: %s", err, out)
	}
	caDir := filepath.Join(n.Dir, "ca")
	if out, err := exec.CommandContext(ctx, redirector, "ca", "init", "--dir", caDir, "--trust-domain", "cluster.local").CombinedOutput(); err != nil {
		t.Fatalf("redirector ca init: %v: %s", err, out)
	}
	kubectl("-n", releaseNS, "create", "secret", "generic", "redirector-ca", "--from-file="+caDir)
	kubectl("create", "namespace", meshNS)
	kubectl("label", "namespace", meshNS, "istio.io/dataplane-mode=ambient")
	kubectl("create", "namespace", outsideNS)
}

// helmInstall installs the chart as a user does: the standalone profile, STRICT mTLS, the
// locally built image, and waits for it.
func helmInstall(ctx context.Context, t *testing.T, n *Node) {
	t.Helper()
	chart := filepath.Join(repoRoot, "manifests", "charts", "redirector")
	if out, err := n.Helm(ctx, "install", release, chart, "-n", releaseNS,
		"--set", "profile=standalone", "--set", "meshMTLSMode=STRICT",
		"--set", "image.repository=localhost/redirector", "--set", "image.tag="+imageTag,
		"--set", "image.pullPolicy=Never", "--wait", "--timeout=3m"); err != nil {
		t.Fatalf("helm install: %v\n%s", err, out)
	}
}

// withoutAccessLines drops an agent log's access lines (one per connection), which
// would bury its warnings and errors under a load.
func withoutAccessLines(log string) string {
	var kept []string
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, " scope=access ") {
			kept = append(kept, line)
		}
	}
	return strings.Join(kept, "\n")
}

// podLoad is a loop of HTTP requests running inside a pod (startPodLoad).
type podLoad struct {
	stopFile string
	exec     func(ctx context.Context, args ...string) (string, error)
	done     chan loadResult
}

type loadResult struct {
	out string
	err error
}

// loadTally is what a podLoad saw: requests answered with the marker, and
// each failure with its time and what came back instead.
type loadTally struct {
	ok     int
	failed []string
}

// startPodLoad sends HTTP/1.0 requests to hostport from inside pod, one
// after another, until stop: each is a new connection (busybox nc), so a
// connection lost at any moment of the run is one failed request.
func startPodLoad(ctx context.Context, n *Node, ns, pod, hostport, marker string) (*podLoad, error) {
	host, port, ok := strings.Cut(hostport, ":")
	if !ok {
		return nil, fmt.Errorf("load target %q: want host:port", hostport)
	}
	l := &podLoad{stopFile: "/tmp/load-stop", done: make(chan loadResult, 1)}
	l.exec = func(ctx context.Context, args ...string) (string, error) {
		return n.Kubectl(ctx, append([]string{"-n", ns, "exec", pod, "--"}, args...)...)
	}
	if _, err := l.exec(ctx, "sh", "-c", "mkdir -p /tmp && rm -f "+l.stopFile); err != nil {
		return nil, fmt.Errorf("prepare the load in %s/%s: %w", ns, pod, err)
	}
	script := fmt.Sprintf(`ok=0
while [ ! -e %[1]s ]; do
	out=$(printf 'GET / HTTP/1.0\r\nHost: %[2]s\r\n\r\n' | nc -w 5 %[2]s %[3]s 2>&1)
	case "$out" in
	*%[4]s*) ok=$((ok+1)) ;;
	*) echo "failed at $(date +%%T): $(printf '%%s' "$out" | head -c 160 | tr '\r\n' '  ')" ;;
	esac
done
echo "answered $ok"`, l.stopFile, host, port, marker)
	go func() {
		out, err := l.exec(ctx, "sh", "-c", script)
		l.done <- loadResult{out, err}
	}()
	return l, nil
}

// stop ends the loop and returns its tally.
func (l *podLoad) stop(ctx context.Context) (loadTally, error) {
	var t loadTally
	if _, err := l.exec(ctx, "touch", l.stopFile); err != nil {
		return t, fmt.Errorf("stop the load: %w", err)
	}
	var r loadResult
	select {
	case r = <-l.done:
	case <-time.After(30 * time.Second):
		return t, fmt.Errorf("the load did not stop within 30 s of its stop file")
	}
	if r.err != nil {
		return t, fmt.Errorf("the load: %w (output %q)", r.err, r.out)
	}
	answered := false
	for _, line := range strings.Split(strings.TrimSpace(r.out), "\n") {
		switch {
		case strings.HasPrefix(line, "answered "):
			var err error
			if t.ok, err = strconv.Atoi(strings.TrimPrefix(line, "answered ")); err != nil {
				return t, fmt.Errorf("the load's tally %q: %w", line, err)
			}
			answered = true
		case line != "":
			t.failed = append(t.failed, line)
		}
	}
	if !answered {
		return t, fmt.Errorf("the load printed no tally: %q", r.out)
	}
	return t, nil
}

// podGet fetches url from inside a pod and returns the body. It speaks HTTP/1.0 through
// busybox nc: Debian's static busybox wget crashes in glibc's static getaddrinfo.
func podGet(ctx context.Context, n *Node, ns, pod, url string) (string, error) {
	hostport, path, _ := strings.Cut(strings.TrimPrefix(url, "http://"), "/")
	host, port, ok := strings.Cut(hostport, ":")
	if !ok {
		port = "80"
	}
	req := fmt.Sprintf(`printf 'GET /%s HTTP/1.0\r\nHost: %s\r\n\r\n' | nc -w 5 %s %s`, path, host, host, port)
	// nc gives up after 5 idle seconds; the exec itself (API server, kubelet, runtime) gets 30.
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := n.Kubectl(ctx, "-n", ns, "exec", pod, "--", "sh", "-c", req)
	if err != nil {
		return "", err
	}
	status, body, ok := strings.Cut(out, "\r\n\r\n")
	if !ok || !strings.Contains(status, " 200 ") {
		return "", fmt.Errorf("GET %s from %s/%s: %q", url, ns, pod, out)
	}
	return body, nil
}

// waitServiceEndpoint waits until the cluster lists ip as a ready endpoint of Service ns/name.
// The EndpointSlice controller can trail a pod's Ready condition by seconds (it retries with
// backoff when its own cache is behind), and no agent can route a Service VIP to an endpoint the
// cluster has not published yet: a request to the VIP before then is refused, as it should be.
func waitServiceEndpoint(ctx context.Context, t *testing.T, n *Node, ns, name, ip string) {
	t.Helper()
	err := waitFor(ctx, podTimeout, fmt.Sprintf("%s as a ready endpoint of Service %s/%s", ip, ns, name), func() error {
		list, err := n.Client.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + name})
		if err != nil {
			return err
		}
		for _, s := range list.Items {
			for _, e := range s.Endpoints {
				// A nil Ready is an unknown state, which consumers are to read as ready.
				if (e.Conditions.Ready == nil || *e.Conditions.Ready) && slices.Contains(e.Addresses, ip) {
					return nil
				}
			}
		}
		return fmt.Errorf("%d EndpointSlices, none with %s ready", len(list.Items), ip)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// strictRefusesPlaintextProbesPass checks the mesh's STRICT on the server pod: the outside
// pod's plaintext is refused, and after settle (probe periods) the server is still Ready with
// no restart, so the kubelet's HTTP probes passed through the probe SNAT.
func strictRefusesPlaintextProbesPass(ctx context.Context, t *testing.T, n *Node, serverIP string, settle time.Duration) {
	t.Helper()
	if out, err := podGet(ctx, n, outsideNS, "outsider", "http://"+serverIP+":8080/"); err == nil {
		t.Errorf("plaintext from outside the mesh reached the server under STRICT: %q", out)
	}
	time.Sleep(settle)
	pod, err := n.Client.CoreV1().Pods(meshNS).Get(ctx, "server", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !podReady(pod) || pod.Status.ContainerStatuses[0].RestartCount != 0 {
		t.Errorf("server under STRICT: ready=%v restarts=%d (the kubelet's probes must pass)", podReady(pod), pod.Status.ContainerStatuses[0].RestartCount)
	}
}

// onNode puts a pod on a given node (no scheduling).
func onNode(pod, node string) string {
	return strings.Replace(pod, "\nspec:\n", "\nspec:\n  nodeName: "+node+"\n", 1)
}

// startupTime measures apply -> Ready of a pod in and out of the mesh, median of 10 each.
func startupTime(t *testing.T, n *Node, apply func(t *testing.T, name, manifest string)) {
	const runs = 10
	for _, ns := range []string{meshNS, outsideNS} {
		var d []time.Duration
		for i := range runs {
			name := fmt.Sprintf("startup-%d", i)
			t0 := time.Now()
			apply(t, ns+"-"+name, serverPod(ns, name, nil))
			waitReady(t, n, ns, name)
			d = append(d, time.Since(t0))
			if _, err := n.Kubectl(t.Context(), "-n", ns, "delete", "pod", name, "--wait=false"); err != nil {
				t.Fatal(err)
			}
		}
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		t.Logf("STARTUP %s: apply -> Ready median %v (min %v, max %v, n=%d)", ns, ((d[runs/2-1] + d[runs/2]) / 2).Round(time.Millisecond),
			d[0].Round(time.Millisecond), d[runs-1].Round(time.Millisecond), runs)
		// Each failed probe costs a probe period before Ready: say how many there were.
		events, err := n.Client.CoreV1().Events(ns).List(t.Context(), metav1.ListOptions{FieldSelector: "reason=Unhealthy"})
		if err != nil {
			t.Fatal(err)
		}
		failed, example := 0, ""
		for _, e := range events.Items {
			if strings.HasPrefix(e.InvolvedObject.Name, "startup-") {
				failed += int(max(e.Count, 1))
				example = e.Message
			}
		}
		t.Logf("STARTUP %s: %d failed probes during start-up (last: %q)", ns, failed, example)
	}
}

// remoteAddr is the client address the server's CGI printed, without the brackets and
// IPv4-mapped prefix of busybox httpd's dual-stack socket.
func remoteAddr(out string) string {
	a := strings.Trim(strings.TrimSpace(out), "[]")
	return strings.TrimPrefix(a, "::ffff:")
}

func labels(extra map[string]string) string {
	var b strings.Builder
	for k, v := range extra {
		fmt.Fprintf(&b, "\n    %s: %q", k, v)
	}
	return b.String()
}

// serverPod is busybox httpd with HTTP readiness and liveness probes: under STRICT they pass
// only through the agent's probe SNAT.
func serverPod(ns, name string, extra map[string]string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %s
  namespace: %s
  labels:
    app: %s%s
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: %s
    imagePullPolicy: Never
    ports: [{containerPort: 8080}]
    readinessProbe:
      httpGet: {path: /healthz, port: 8080}
      periodSeconds: 1
    livenessProbe:
      httpGet: {path: /healthz, port: 8080}
      periodSeconds: 2
      failureThreshold: 2
`, name, ns, name, labels(extra), AppImage)
}

func clientPod(ns, name string, extra map[string]string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %s
  namespace: %s
  labels:
    app: %s%s
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: %s
    imagePullPolicy: Never
    command: [/bin/sleep, "100000"]
`, name, ns, name, labels(extra), AppImage)
}

func service(ns, name string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata:
  name: %s
  namespace: %s
spec:
  selector: {app: %s}
  ports: [{port: 80, targetPort: 8080}]
`, name, ns, name)
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func waitReady(t *testing.T, n *Node, ns, name string) {
	t.Helper()
	if err := waitFor(t.Context(), podTimeout, ns+"/"+name+" Ready", func() error {
		p, err := n.Client.CoreV1().Pods(ns).Get(t.Context(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !podReady(p) {
			return fmt.Errorf("phase %s", p.Status.Phase)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// waitAnnotated waits until the pod carries the redirection annotation (want) or not.
func waitAnnotated(t *testing.T, n *Node, ns, name string, want bool) {
	t.Helper()
	what := ns + "/" + name + " annotated"
	if !want {
		what = ns + "/" + name + " without " + redirection
	}
	if err := waitFor(t.Context(), time.Minute, what, func() error {
		p, err := n.Client.CoreV1().Pods(ns).Get(t.Context(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		v, ok := p.Annotations[redirection]
		if want && v != "enabled" || !want && ok {
			return fmt.Errorf("%s=%q", redirection, v)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

func podIP(t *testing.T, n *Node, ns, name string) string {
	t.Helper()
	p, err := n.Client.CoreV1().Pods(ns).Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p.Status.PodIP
}

// agentPodOrEmpty is the name of a ready agent pod of the release, or "".
func agentPodOrEmpty(n *Node) string { return agentPodOn(n, "") }

func agentPod(t *testing.T, n *Node) string {
	t.Helper()
	p := agentPodOrEmpty(n)
	if p == "" {
		t.Fatal("no ready agent pod")
	}
	return p
}

// bpffsMounts counts the bpffs mounts on /sys/fs/bpf in the node's mount namespace.
func bpffsMounts(t *testing.T, n *Node) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", n.holder.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	count := 0
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == "/sys/fs/bpf" && strings.Contains(line, " - bpf ") {
			count++
		}
	}
	return count
}

func conflistTypes(t *testing.T, n *Node) []string {
	t.Helper()
	b, err := os.ReadFile(n.Root("/etc/cni/net.d/10-bridge.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(b, &list); err != nil {
		t.Fatalf("conflist: %v\n%s", err, b)
	}
	var types []string
	for _, p := range list.Plugins {
		types = append(types, p.Type)
	}
	return types
}

// agentCounter reads one series of the node agent's metrics (hostNetwork, METRICS_ADDR
// :15020) from inside the node's network namespace.
func agentCounter(ctx context.Context, n *Node, series string) (uint64, error) {
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: n.DialContext}}
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:15020/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return uint64(f), err
		}
	}
	return 0, fmt.Errorf("no %s in the agent's metrics", series)
}

// waitAgentSees waits until n's agent (its admin config dump, from inside the node's network
// namespace) lists the workload at ip as enrolled (HBONE) and, if vip is not "", the Service
// at vip with ip as a healthy endpoint. The agent learns pods and EndpointSlices by its own
// watch, a moment after the test read them from the API server; a request sent before then
// would be judged against what the agent did not know yet.
func waitAgentSees(ctx context.Context, t *testing.T, n *Node, ip, vip string) {
	t.Helper()
	what := fmt.Sprintf("%s's agent to know %s as a meshed workload", n.Name, ip)
	if vip != "" {
		what += " and an endpoint of " + vip
	}
	err := waitFor(ctx, podTimeout, what, func() error {
		var dump struct {
			Workloads []dumpWorkload `json:"workloads"`
			Services  []dumpService  `json:"services"`
		}
		if err := agentAdminGet(ctx, n, "/config_dump", &dump); err != nil {
			return err
		}
		if !slices.ContainsFunc(dump.Workloads, func(w dumpWorkload) bool {
			return w.Protocol == "HBONE" && slices.Contains(w.WorkloadIPs, ip)
		}) {
			return fmt.Errorf("no HBONE workload with address %s", ip)
		}
		if vip == "" {
			return nil
		}
		for _, s := range dump.Services {
			if !slices.ContainsFunc(s.VIPs, func(v string) bool { return strings.HasSuffix(v, "/"+vip) }) {
				continue
			}
			for _, e := range s.Endpoints {
				if strings.HasSuffix(e.Address, "/"+ip) && e.Status == "Healthy" {
					return nil
				}
			}
			return fmt.Errorf("the Service at %s has no healthy endpoint %s", vip, ip)
		}
		return fmt.Errorf("no Service at %s", vip)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// dumpWorkload and dumpService are the parts of the agent's config dump (ztunnel's shape) that
// waitAgentSees reads.
type dumpWorkload struct {
	WorkloadIPs []string `json:"workloadIps"`
	Protocol    string   `json:"protocol"` // HBONE when enrolled
}

type dumpService struct {
	VIPs      []string `json:"vips"` // network/ip
	Endpoints map[string]struct {
		Address string `json:"address"` // network/ip
		Status  string `json:"status"`
	} `json:"endpoints"`
}

// agentAdminGet decodes the JSON the node agent's admin endpoint (hostNetwork, ADMIN_ADDR
// 127.0.0.1:15000) serves at path, from inside the node's network namespace.
func agentAdminGet(ctx context.Context, n *Node, path string, into any) error {
	body, err := getInNode(ctx, n, "http://127.0.0.1:15000"+path, 5*time.Second)
	if err != nil {
		return fmt.Errorf("agent admin: %w", err)
	}
	return json.Unmarshal(body, into)
}

// getInNode GETs url from inside n's network namespace and returns the body of a 200 answer
// (at most 64 MiB), or an error naming the status and the start of the body.
func getInNode(ctx context.Context, n *Node, url string, timeout time.Duration) ([]byte, error) {
	hc := &http.Client{Timeout: timeout, Transport: &http.Transport{DialContext: n.DialContext}}
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %.512s", url, resp.Status, body)
	}
	return body, nil
}
