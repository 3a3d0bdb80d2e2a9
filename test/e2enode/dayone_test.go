//go:build e2enode && linux

package e2enode

// Scenarios an operator moving from istio-cni + ztunnel meets on the first day: an init
// container that talks to the mesh, a pod sandbox the kubelet recreates, a pod or namespace
// opted out (and in) while its pods run, a hostNetwork pod in a meshed namespace. Each runs
// on TestRealNode's node, after Meshed, and removes its pods when done.

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const (
	pinRoot = "/sys/fs/bpf/redirector" // the chart's bpfRoot
	// dataplaneMode is Istio ambient's label, on a namespace or (overriding it) a pod.
	dataplaneMode = "istio.io/dataplane-mode"
	// hostNetPort is where the hostNetwork pod's httpd listens in the node's namespace.
	hostNetPort = "18080"
	// hostProbeSNATIP is the chart's hostProbeSNAT.ipv4, Istio's default.
	hostProbeSNATIP = "169.254.7.127"
)

// initContainerMeshed: an init container of a meshed pod reaches a STRICT server on its first
// try, over HBONE. Istio ambient enrolls a pod at CNI ADD, before any container starts; an
// agent that enrolled it later (a watch, a scan) would leave the init container in plaintext,
// refused under STRICT.
func initContainerMeshed(ctx context.Context, t *testing.T, n *Node, serverIP string) {
	s, err := n.Sniff(marker)
	if err != nil {
		t.Fatal(err)
	}
	// One attempt each, no retry: the first connection the pod makes must be meshed.
	fetch := fmt.Sprintf(`set -e
for path in cgi-bin/ip ""; do
	out=$(printf 'GET /%%s HTTP/1.0\r\n\r\n' "$path" | nc -w 5 %[1]s 8080)
	case "$out" in
	*" 200 "*) printf '%%s\n' "$out" | tail -n 1 ;;
	*) echo "GET /$path failed: $out"; exit 1 ;;
	esac
done`, serverIP)
	mustApply(ctx, t, n, "initclient", fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: initclient
  namespace: %s
spec:
  terminationGracePeriodSeconds: 1
  restartPolicy: Never
  initContainers:
  - name: fetch
    image: %[2]s
    imagePullPolicy: Never
    command: [/bin/sh, -c, %[3]q]
  containers:
  - name: app
    image: %[2]s
    imagePullPolicy: Never
    command: [/bin/sleep, "100000"]
`, meshNS, AppImage, fetch))
	defer deletePod(ctx, t, n, meshNS, "initclient")
	phase := waitRunningOrFailed(ctx, t, n, meshNS, "initclient")
	hits, ports := s.Stop()
	logs, err := n.Kubectl(ctx, "-n", meshNS, "logs", "initclient", "-c", "fetch")
	if phase != corev1.PodRunning {
		t.Fatalf("the init container failed (pod %s): the pod's first connections were not meshed; its log: %q (%v)", phase, logs, err)
	}
	ip := podIP(t, n, meshNS, "initclient")
	lines := strings.Split(strings.TrimSpace(logs), "\n")
	if err != nil || len(lines) < 2 || remoteAddr(lines[0]) != ip || !strings.Contains(logs, marker) {
		t.Errorf("the init container's log %q (%v): want the server to see %s, then its page", logs, err, ip)
	}
	t.Logf("while the init container ran: data frames by port %v", ports)
	if hits != 0 {
		t.Errorf("the init container's request crossed the bridge in plaintext %d times", hits)
	}
	if s.Frames(serverIP, 15008) == 0 {
		t.Errorf("no HBONE frames of the server's %s:15008 while the init container ran: %v", serverIP, ports)
	}
	requireCNIAdd(ctx, t, n, meshNS+"/initclient", true)
	waitAnnotated(t, n, meshNS, "initclient", true)
}

// sandboxRecreated kills a meshed pod's sandbox (its pause process) as a node under memory
// pressure or a runtime restart does. The kubelet makes a new sandbox, with a new network
// namespace, and runs CNI ADD again: the pod must be meshed there (HBONE, STRICT, its probes
// through the host-probe SNAT on the new veth), and nothing of the old namespace may stay in
// the agent's maps, pins or held links.
func sandboxRecreated(ctx context.Context, t *testing.T, n *Node, clientIP string) {
	const name = "resandbox"
	mustApply(ctx, t, n, name, serverPod(meshNS, name, nil))
	defer deletePod(ctx, t, n, meshNS, name)
	waitReady(t, n, meshNS, name)
	waitAnnotated(t, n, meshNS, name, true)
	old := enrolledPod(ctx, t, n, name)
	oldIno, err := inodeOf(n.Root(nodePath(old.NetNS)))
	if err != nil {
		t.Fatalf("the pod's network namespace %s: %v", old.NetNS, err)
	}
	pod, err := n.Client.CoreV1().Pods(meshNS).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pause, err := sandboxPid(string(pod.UID))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pause, syscall.SIGKILL); err != nil {
		t.Fatalf("kill the sandbox's pause process %d: %v", pause, err)
	}
	t.Logf("killed pause %d of %s/%s (netns %s, inode %d, address %v)", pause, meshNS, name, old.NetNS, oldIno, old.Addresses)

	var cur podRow
	if err := waitFor(ctx, podTimeout, "the pod enrolled in a new sandbox", func() error {
		p, err := n.Client.CoreV1().Pods(meshNS).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !podReady(p) {
			return fmt.Errorf("not ready")
		}
		row, err := inspectPod(ctx, n, name)
		if err != nil {
			return err
		}
		if row.NetNS == old.NetNS {
			return fmt.Errorf("still attached in the old namespace %s", old.NetNS)
		}
		if len(row.Addresses) != 1 || row.Addresses[0] != p.Status.PodIP {
			return fmt.Errorf("attached with %v, the pod has %s", row.Addresses, p.Status.PodIP)
		}
		cur = row
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	newIP := cur.Addresses[0]
	t.Logf("new sandbox: netns %s, address %s", cur.NetNS, newIP)
	// The runtime removes the old namespace once the kubelet stopped the old sandbox.
	if err := waitFor(ctx, time.Minute, "the old sandbox's namespace gone", func() error {
		if _, err := os.Stat(n.Root(nodePath(old.NetNS))); err == nil {
			return fmt.Errorf("%s still there", old.NetNS)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}

	// Meshed in the new namespace: inbound and outbound over HBONE, STRICT refuses plaintext,
	// the kubelet's probes pass. The client's request is routed by the agent's view of the
	// pod, which may trail the pinned record and the API server's status: wait for it.
	waitAgentSees(ctx, t, n, newIP, "")
	s, err := n.Sniff(marker)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := podGet(ctx, n, meshNS, "client", "http://"+newIP+":8080/cgi-bin/ip"); err != nil || remoteAddr(out) != clientIP {
		t.Errorf("client -> the recreated pod: %q, %v; want it to see %s", out, err, clientIP)
	}
	if out, err := podGet(ctx, n, meshNS, name, "http://"+podIP(t, n, meshNS, "server")+":8080/cgi-bin/ip"); err != nil || remoteAddr(out) != newIP {
		t.Errorf("the recreated pod -> server: %q, %v; want the server to see %s", out, err, newIP)
	}
	hits, ports := s.Stop()
	if hits != 0 || s.Frames(newIP, 15008) == 0 {
		t.Errorf("to and from the recreated pod: plaintext frames %d, HBONE frames of %s:15008 %d (all frames by port %v); want none and HBONE", hits, newIP, s.Frames(newIP, 15008), ports)
	}
	if out, err := podGet(ctx, n, outsideNS, "outsider", "http://"+newIP+":8080/"); err == nil {
		t.Errorf("plaintext from outside the mesh reached the recreated pod under STRICT: %q", out)
	}
	time.Sleep(6 * time.Second) // a few probe periods
	if p, err := n.Client.CoreV1().Pods(meshNS).Get(ctx, name, metav1.GetOptions{}); err != nil || !podReady(p) {
		t.Errorf("the recreated pod is not Ready (%v): its probes fail through the new veth", err)
	}

	// Nothing of the old sandbox: one record of the pod, no entry for the old namespace or
	// (if it changed) the old address, as many pin directories, netns entries, host veths and
	// held links as enrolled pods.
	checkNoLeftovers(ctx, t, n, cur.ID, oldIno, old.Addresses, newIP)
}

// checkNoLeftovers compares the agent's pinned state with its enrolled pods after pod id's
// sandbox was recreated: no trace of the old namespace (inode oldIno) or old addresses.
func checkNoLeftovers(ctx context.Context, t *testing.T, n *Node, id uint32, oldIno uint64, oldAddrs []string, newIP string) {
	t.Helper()
	// The old namespace's record goes when the loader attaches the pod afresh; allow the
	// reconciler a moment for what follows (host veth map, held links).
	err := waitFor(ctx, 30*time.Second, "the agent's state to match its enrolled pods", func() error {
		pods, err := inspectPods(ctx, n)
		if err != nil {
			return err
		}
		rows, err := inspectMapRows(ctx, n)
		if err != nil {
			return err
		}
		var problems []string
		netnsEntries := 0
		for _, r := range rows {
			switch r.Map {
			case "rd_pod_netns":
				netnsEntries++
				if r.Key == fmt.Sprintf("netns:[%d]", oldIno) {
					problems = append(problems, "rd_pod_netns still has the old namespace: "+r.Value)
				}
			case "rd_pods":
				for _, a := range oldAddrs {
					if a != newIP && r.Key == a {
						problems = append(problems, "rd_pods still has the old address "+a+": "+r.Value)
					}
				}
			}
		}
		if netnsEntries != len(pods) {
			problems = append(problems, fmt.Sprintf("%d rd_pod_netns entries for %d enrolled pods", netnsEntries, len(pods)))
		}
		dirs, err := os.ReadDir(n.Root(pinRoot + "/pods"))
		if err != nil {
			return err
		}
		if len(dirs) != len(pods) {
			problems = append(problems, fmt.Sprintf("%d pod pin directories for %d enrolled pods", len(dirs), len(pods)))
		}
		veths, err := probeVeths(ctx, n)
		if err != nil {
			return err
		}
		owned := 0
		for _, pid := range veths {
			if pid == id {
				owned++
			}
		}
		if owned != 1 || len(veths) != len(pods) {
			problems = append(problems, fmt.Sprintf("rd_probe_veths: %d host veths of the pod (want 1), %d in all for %d enrolled pods", owned, len(veths), len(pods)))
		}
		held, err := agentCounter(ctx, n, "redirector_held_links")
		if err != nil {
			return err
		}
		if held != uint64(2*len(pods)) {
			problems = append(problems, fmt.Sprintf("%d held links for %d enrolled pods", held, len(pods)))
		}
		if enrolled, err := agentCounter(ctx, n, "redirector_enrolled_pods"); err != nil || enrolled != uint64(len(pods)) {
			problems = append(problems, fmt.Sprintf("redirector_enrolled_pods %d (%v), %d pinned pod records", enrolled, err, len(pods)))
		}
		if len(problems) > 0 {
			return fmt.Errorf("%s", strings.Join(problems, "; "))
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
}

// optOutLive flips a running pod out of the mesh and back with its own label, then takes its
// namespace's label away: each time the agent unenrolls (or enrolls) the pod while it runs.
// Out of the mesh it reaches a server outside the mesh in plaintext and is refused by the
// STRICT one; back in, its traffic is HBONE again.
func optOutLive(ctx context.Context, t *testing.T, n *Node, serverIP, plainIP string) {
	const ns, name = "dayone", "flip"
	mustKubectl(ctx, t, n, "create", "namespace", ns)
	mustKubectl(ctx, t, n, "label", "namespace", ns, dataplaneMode+"=ambient")
	defer func() {
		if _, err := n.Kubectl(ctx, "delete", "namespace", ns, "--wait=false"); err != nil {
			t.Errorf("delete namespace %s: %v", ns, err)
		}
	}()
	mustApply(ctx, t, n, name, clientPod(ns, name, nil))
	waitReady(t, n, ns, name)
	waitAnnotated(t, n, ns, name, true)
	ip := podIP(t, n, ns, name)
	checkMeshed(ctx, t, n, ns, name, serverIP, ip, "enrolled by its namespace")

	mustKubectl(ctx, t, n, "-n", ns, "label", "pod", name, dataplaneMode+"=none")
	waitUnenrolled(ctx, t, n, ns, name)
	checkPlain(ctx, t, n, ns, name, serverIP, plainIP, ip, "opted out by its own label")

	mustKubectl(ctx, t, n, "-n", ns, "label", "pod", name, dataplaneMode+"-")
	waitAnnotated(t, n, ns, name, true)
	waitEnrolled(ctx, t, n, name)
	checkMeshed(ctx, t, n, ns, name, serverIP, ip, "its opt-out label removed")

	mustKubectl(ctx, t, n, "label", "namespace", ns, dataplaneMode+"-")
	waitUnenrolled(ctx, t, n, ns, name)
	checkPlain(ctx, t, n, ns, name, serverIP, plainIP, ip, "its namespace's label removed")
}

// checkMeshed: the pod reaches the STRICT server over HBONE, the server seeing the pod's address.
func checkMeshed(ctx context.Context, t *testing.T, n *Node, ns, pod, serverIP, ip, when string) {
	t.Helper()
	s, err := n.Sniff(marker)
	if err != nil {
		t.Fatal(err)
	}
	out, err := podGet(ctx, n, ns, pod, "http://"+serverIP+":8080/cgi-bin/ip")
	page, pageErr := podGet(ctx, n, ns, pod, "http://"+serverIP+":8080/")
	hits, ports := s.Stop()
	if err != nil || remoteAddr(out) != ip || pageErr != nil || !strings.Contains(page, marker) {
		t.Errorf("%s/%s (%s) -> the STRICT server: %q, %v; %v; want it meshed, the server seeing %s", ns, pod, when, out, err, pageErr, ip)
	}
	if hbone := s.Frames(serverIP, 15008); hits != 0 || hbone == 0 {
		t.Errorf("%s/%s (%s): plaintext frames %d, HBONE frames to the server %d (all frames by port %v); want none and HBONE", ns, pod, when, hits, hbone, ports)
	}
}

// checkPlain: the pod is outside the mesh: the STRICT server refuses it, the plain server
// answers it in plaintext with no HBONE on the wire.
func checkPlain(ctx context.Context, t *testing.T, n *Node, ns, pod, serverIP, plainIP, ip, when string) {
	t.Helper()
	if out, err := podGet(ctx, n, ns, pod, "http://"+serverIP+":8080/"); err == nil {
		t.Errorf("%s/%s (%s) reached the STRICT server: %q; want it refused as plaintext", ns, pod, when, out)
	}
	s, err := n.Sniff(marker)
	if err != nil {
		t.Fatal(err)
	}
	out, err := podGet(ctx, n, ns, pod, "http://"+plainIP+":8080/cgi-bin/ip")
	page, pageErr := podGet(ctx, n, ns, pod, "http://"+plainIP+":8080/")
	hits, ports := s.Stop()
	if err != nil || remoteAddr(out) != ip || pageErr != nil || !strings.Contains(page, marker) {
		t.Errorf("%s/%s (%s) -> the server outside the mesh: %q, %v; %v", ns, pod, when, out, err, pageErr)
	}
	if hits == 0 || s.Frames(plainIP, 8080) == 0 || s.Frames(plainIP, 15008) != 0 || s.Frames(ip, 15008) != 0 {
		t.Errorf("%s/%s (%s) -> the server outside the mesh: plaintext frames %d, frames of %s:8080 %d, of %s:15008 %d, of %s:15008 %d (all by port %v); want plaintext, no HBONE",
			ns, pod, when, hits, plainIP, s.Frames(plainIP, 8080), plainIP, s.Frames(plainIP, 15008), ip, s.Frames(ip, 15008), ports)
	}
}

// hostNetworkUntouched: a hostNetwork pod in a meshed namespace shares the node's network
// namespace. It is never enrolled (no CNI ADD, no annotation, no pinned record), a meshed pod
// reaches its server in plaintext (it is no workload of the mesh), and its own connections
// leave with the node's address, in plaintext; to a meshed pod they are the node's, as a
// kubelet probe's (the host-probe SNAT, as Istio's).
func hostNetworkUntouched(ctx context.Context, t *testing.T, n *Node, serverIP, clientIP, plainIP string) {
	const name = "hostnet"
	before, err := inspectPods(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	mustApply(ctx, t, n, name, fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %[1]s
  namespace: %[2]s
  labels:
    app: %[1]s
spec:
  terminationGracePeriodSeconds: 1
  hostNetwork: true
  containers:
  - name: app
    image: %[3]s
    imagePullPolicy: Never
    command: [/bin/httpd, -f, -p, "%[4]s", -h, /www]
    readinessProbe:
      httpGet: {path: /healthz, port: %[4]s}
      periodSeconds: 1
`, name, meshNS, AppImage, hostNetPort))
	defer deletePod(ctx, t, n, meshNS, name)
	waitReady(t, n, meshNS, name)
	// Give a (wrong) enrollment the time one takes.
	time.Sleep(3 * time.Second)
	pod, err := n.Client.CoreV1().Pods(meshNS).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := pod.Annotations[redirection]; ok {
		t.Errorf("the hostNetwork pod carries %s=%s", redirection, v)
	}
	if pod.Status.PodIP != n.IP {
		t.Errorf("the hostNetwork pod's address %s, want the node's %s", pod.Status.PodIP, n.IP)
	}
	after, err := inspectPods(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	// (The previous scenarios' pods may still be leaving: only new records count.)
	for _, r := range after {
		isNew := !slices.ContainsFunc(before, func(b podRow) bool { return b.ID == r.ID && b.Name == r.Name })
		if r.Name == name || slices.Contains(r.Addresses, n.IP) || isNew {
			t.Errorf("the agent enrolled the hostNetwork pod (or something else meanwhile): %+v", r)
		}
	}
	if logs, err := n.Kubectl(ctx, "-n", releaseNS, "logs", agentPod(t, n), "-c", "agent"); err != nil {
		t.Error(err)
	} else if l := grepLines(withoutAccessLines(logs), meshNS+"/"+name); l != "" {
		// No CNI event, no enrollment, no error: the pod is none of the agent's business.
		t.Errorf("the agent logged the hostNetwork pod:\n%s", l)
	}

	s, err := n.Sniff(marker)
	if err != nil {
		t.Fatal(err)
	}
	// A meshed client -> the hostNetwork pod's server: a destination outside the mesh.
	url := "http://" + n.IP + ":" + hostNetPort
	out, err := podGet(ctx, n, meshNS, "client", url+"/cgi-bin/ip")
	page, pageErr := podGet(ctx, n, meshNS, "client", url+"/")
	// The hostNetwork pod -> a server outside the mesh, from the node's address.
	fromHost, hostErr := podGet(ctx, n, meshNS, name, "http://"+plainIP+":8080/cgi-bin/ip")
	hits, ports := s.Stop()
	if err != nil || remoteAddr(out) != clientIP || pageErr != nil || !strings.Contains(page, marker) {
		t.Errorf("meshed client -> the hostNetwork pod's server: %q, %v; %v; want it answered, seeing %s", out, err, pageErr, clientIP)
	}
	// The node's stack sends from its address on the pods' bridge.
	gateway := netip.MustParsePrefix(n.PodCIDR).Addr().Next().String()
	if hostErr != nil || remoteAddr(fromHost) != gateway {
		t.Errorf("the hostNetwork pod -> a server outside the mesh: %q, %v; want it answered, seeing the node's bridge address %s", fromHost, hostErr, gateway)
	}
	// To a meshed pod, a hostNetwork pod's connection comes from the node's namespace, as a
	// kubelet probe does, but from a process below the kubelet's pods' cgroup (which the
	// agent found above its own, below this node's cgroup root): it is not taken for a probe (Istio's
	// --socket-exists rule would SNAT it past STRICT), so STRICT refuses its plaintext, as
	// it would from another node. The kubelet's own probes pass with the setting on
	// (StrictRefusesPlaintextProbesPass).
	notProbe, _ := agentCounter(ctx, n, `redirector_bpf_packets_total{reason="host_pod_not_probe"}`)
	if out, err := podGet(ctx, n, meshNS, name, "http://"+serverIP+":8080/cgi-bin/ip"); err == nil {
		t.Errorf("the hostNetwork pod -> the meshed server under STRICT: answered %q, want refused (a hostNetwork pod is no kubelet probe)", out)
	}
	if after, err := agentCounter(ctx, n, `redirector_bpf_packets_total{reason="host_pod_not_probe"}`); err != nil || after <= notProbe {
		t.Errorf("host_pod_not_probe %d -> %d (%v): the hostNetwork pod's SYN was not told apart from a probe", notProbe, after, err)
	}
	t.Logf("hostNetwork pod's traffic: plaintext frames %d, frames by port %v", hits, ports)
	if hits == 0 || s.Frames(n.IP, 18080) == 0 || s.Frames(plainIP, 8080) == 0 {
		t.Errorf("plaintext frames %d, frames of the hostNetwork server %d, of the plain server %d: want both connections on the wire in plaintext",
			hits, s.Frames(n.IP, 18080), s.Frames(plainIP, 8080))
	}
	for _, a := range []string{n.IP, gateway, plainIP} {
		if f := s.Frames(a, 15008); f != 0 {
			t.Errorf("%d HBONE frames of %s:15008: the hostNetwork pod's traffic went through the mesh", f, a)
		}
	}
}

// waitRunningOrFailed waits for a restartPolicy Never pod to start its containers or fail.
func waitRunningOrFailed(ctx context.Context, t *testing.T, n *Node, ns, name string) corev1.PodPhase {
	t.Helper()
	var phase corev1.PodPhase
	if err := waitFor(ctx, podTimeout, ns+"/"+name+" Running or Failed", func() error {
		p, err := n.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		phase = p.Status.Phase
		if phase == corev1.PodRunning || phase == corev1.PodFailed || phase == corev1.PodSucceeded {
			return nil
		}
		return fmt.Errorf("phase %s", phase)
	}); err != nil {
		t.Fatal(err)
	}
	return phase
}

// waitUnenrolled waits for the agent to take the annotation off the pod and drop its record.
func waitUnenrolled(ctx context.Context, t *testing.T, n *Node, ns, name string) {
	t.Helper()
	waitAnnotated(t, n, ns, name, false)
	if err := waitFor(ctx, time.Minute, ns+"/"+name+" unenrolled", func() error {
		if _, err := inspectPod(ctx, n, name); err == nil {
			return fmt.Errorf("still enrolled")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// waitEnrolled waits for the pod's pinned record.
func waitEnrolled(ctx context.Context, t *testing.T, n *Node, name string) {
	t.Helper()
	if err := waitFor(ctx, time.Minute, name+" enrolled", func() error {
		_, err := inspectPod(ctx, n, name)
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// requireCNIAdd checks the agent's log for the pod's CNI ADD with the given outcome.
func requireCNIAdd(ctx context.Context, t *testing.T, n *Node, pod string, enrolled bool) {
	t.Helper()
	logs, err := n.Kubectl(ctx, "-n", releaseNS, "logs", agentPod(t, n), "-c", "agent")
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`msg="CNI event handled".* command=ADD pod=` + regexp.QuoteMeta(pod) + ` .*enrolled=` + strconv.FormatBool(enrolled))
	if !re.MatchString(logs) {
		t.Errorf("no CNI ADD for %s with enrolled=%v in the agent's log", pod, enrolled)
	}
}

func deletePod(ctx context.Context, t *testing.T, n *Node, ns, name string) {
	if _, err := n.Kubectl(ctx, "-n", ns, "delete", "pod", name, "--wait=false"); err != nil {
		t.Errorf("delete pod %s/%s: %v", ns, name, err)
	}
}

// inspectPods is `redirector inspect pods` in the node's mount namespace: the agent's pinned
// record of each enrolled pod.
func inspectPods(ctx context.Context, n *Node) ([]podRow, error) {
	var rows []podRow
	return rows, n.inspect(ctx, "pods", &rows)
}

// inspectPod is the record of the pod named name (in any namespace: the names are unique here).
func inspectPod(ctx context.Context, n *Node, name string) (podRow, error) {
	rows, err := inspectPods(ctx, n)
	if err != nil {
		return podRow{}, err
	}
	var found []podRow
	for _, r := range rows {
		if r.Name == name {
			found = append(found, r)
		}
	}
	if len(found) != 1 {
		return podRow{}, fmt.Errorf("%d pinned records of %s", len(found), name)
	}
	return found[0], nil
}

func enrolledPod(ctx context.Context, t *testing.T, n *Node, name string) podRow {
	t.Helper()
	var r podRow
	if err := waitFor(ctx, time.Minute, name+" enrolled", func() (err error) {
		r, err = inspectPod(ctx, n, name)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return r
}

func inspectMapRows(ctx context.Context, n *Node) ([]mapRow, error) {
	var rows []mapRow
	return rows, n.inspect(ctx, "maps", &rows)
}

// podRow and mapRow are the parts of `redirector inspect pods|maps -o json` the tests read.
type podRow struct {
	ID        uint32   `json:"id"`
	Namespace string   `json:"namespace"`
	Name      string   `json:"name"`
	Addresses []string `json:"addresses"`
	NetNS     string   `json:"netns"`
}

type mapRow struct {
	Map   string `json:"map"`
	Key   string `json:"key"`
	Value string `json:"value"`
}

func (n *Node) inspect(ctx context.Context, what string, into any) error {
	out, err := n.inMounts(ctx, filepath.Join(n.Dir, "redirector"), "inspect", what, "-o", "json", "--bpf-root", pinRoot)
	if err != nil {
		return err
	}
	if strings.TrimSpace(out) == "null" {
		return nil
	}
	if err := json.Unmarshal([]byte(out), into); err != nil {
		return fmt.Errorf("redirector inspect %s: %w: %s", what, err, out)
	}
	return nil
}

// inMounts runs a command in the node's mount and network namespaces (its bpffs).
func (n *Node) inMounts(ctx context.Context, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"-t", strconv.Itoa(n.holder.Process.Pid), "-m", "-n", "--", name}, args...)...)
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if e, ok := err.(*exec.ExitError); ok {
			stderr = string(e.Stderr)
		}
		return "", fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, stderr)
	}
	return string(out), nil
}

// probeVeths reads the host-probe map of host veths (host ifindex -> pod id) with bpftool.
func probeVeths(ctx context.Context, n *Node) (map[uint32]uint32, error) {
	out, err := n.inMounts(ctx, "bpftool", "-j", "map", "dump", "pinned", pinRoot+"/rd_probe_veths")
	if err != nil {
		return nil, err
	}
	var entries []struct {
		Key       json.RawMessage `json:"key"`
		Value     json.RawMessage `json:"value"`
		Formatted *struct {
			Key   uint32 `json:"key"`
			Value uint32 `json:"value"`
		} `json:"formatted"`
	}
	if err := json.Unmarshal([]byte(out), &entries); err != nil {
		return nil, fmt.Errorf("bpftool map dump rd_probe_veths: %w: %s", err, out)
	}
	m := map[uint32]uint32{}
	for _, e := range entries {
		if e.Formatted != nil {
			m[e.Formatted.Key] = e.Formatted.Value
			continue
		}
		k, err1 := hexU32(e.Key)
		v, err2 := hexU32(e.Value)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("bpftool map dump rd_probe_veths: entry %s: %s: %v %v", e.Key, e.Value, err1, err2)
		}
		m[k] = v
	}
	return m, nil
}

// hexU32 reads bpftool's byte list (["0x05","0x00","0x00","0x00"]) as a native-endian u32.
func hexU32(raw json.RawMessage) (uint32, error) {
	var bs []string
	if err := json.Unmarshal(raw, &bs); err != nil {
		var v uint32
		return v, json.Unmarshal(raw, &v)
	}
	var b []byte
	for _, s := range bs {
		x, err := hex.DecodeString(strings.TrimPrefix(s, "0x"))
		if err != nil {
			return 0, err
		}
		b = append(b, x...)
	}
	if len(b) != 4 {
		return 0, fmt.Errorf("%d bytes, want 4", len(b))
	}
	return binary.NativeEndian.Uint32(b), nil
}

// sandboxPid finds the pause process of the pod with the given UID: the process named pause
// in the pod's cgroup (cgroupfs driver: pod<uid>).
func sandboxPid(uid string) (int, error) {
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	var found []int
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile(filepath.Join("/proc", p.Name(), "comm"))
		if err != nil || strings.TrimSpace(string(comm)) != "pause" {
			continue
		}
		cg, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cgroup"))
		if err != nil {
			continue
		}
		if strings.Contains(string(cg), "pod"+uid) || strings.Contains(string(cg), "pod"+strings.ReplaceAll(uid, "-", "_")) {
			found = append(found, pid)
		}
	}
	if len(found) != 1 {
		return 0, fmt.Errorf("%d pause processes in the cgroup of pod %s: %v", len(found), uid, found)
	}
	return found[0], nil
}

// nodePath resolves /var/run, an absolute link to /run, which a lookup through Node.Root would
// follow into this process's /run instead of the node's.
func nodePath(p string) string {
	if rest, ok := strings.CutPrefix(p, "/var/run/"); ok {
		return "/run/" + rest
	}
	return p
}

func inodeOf(path string) (uint64, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

func grepLines(log, sub string) string {
	var kept []string
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, sub) {
			kept = append(kept, line)
		}
	}
	return strings.Join(kept, "\n")
}
