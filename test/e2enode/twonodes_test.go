//go:build e2enode && linux

package e2enode

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestTwoNodes runs the mesh across two real nodes: a worker node (its own network and mount
// namespaces, cgroups, containerd state and kubelet root-dir) joins the first node's control
// plane, the chart puts an agent on each, and a client on the worker talks to a server on the
// first node through both agents: HBONE between the nodes, never plaintext on either.
func TestTwoNodes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root: namespaces, cgroups, containerd, kubelet")
	}
	start := time.Now()
	ctx := testContext(t)
	bins, images := nodeInputs(ctx, t)
	host := readHostState(t)
	a, err := StartNode(ctx, t.Logf, bins, images, imageTag)
	if err != nil {
		t.Fatal(err)
	}
	var b *Node
	t.Cleanup(func() {
		nodes := []*Node{a}
		if b != nil {
			nodes = []*Node{b, a} // the worker first: a restores the global sysctls
		}
		if t.Failed() {
			for _, n := range nodes {
				dumpNode(t, n)
			}
		}
		holdOnFailure(t, a)
		for _, n := range nodes {
			if err := n.Stop(t.Logf); err != nil {
				t.Errorf("stop node %s: %v", n.Name, err)
			}
		}
		for _, n := range nodes {
			checkClean(t, n, host)
		}
	})
	if b, err = a.AddNode(ctx, t.Logf); err != nil {
		t.Fatal(err)
	}
	t.Logf("nodes %s (control plane) and %s up after %v", a.Name, b.Name, time.Since(start).Round(time.Millisecond))

	prepareCluster(ctx, t, a)
	helmInstall(ctx, t, a)
	// One ready agent on each node.
	if err := waitFor(ctx, podTimeout, "an agent on each node", func() error {
		for _, n := range []*Node{a, b} {
			if agentPodOn(a, n.Name) == "" {
				return fmt.Errorf("no ready agent pod on %s", n.Name)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	checkRootNet(t, host.rootNet, "with two nodes and their agents running")
	for _, n := range []*Node{a, b} {
		if types := conflistTypes(t, n); !slices.Equal(types, []string{"bridge", "portmap", "redirector-cni"}) {
			t.Errorf("%s: conflist plugins %v, want bridge, portmap, redirector-cni", n.Name, types)
		}
	}

	apply := func(name, manifest string) { mustApply(ctx, t, a, name, manifest) }
	apply("server", onNode(serverPod(meshNS, "server", nil), a.Name)+"---\n"+service(meshNS, "server"))
	apply("client", onNode(clientPod(meshNS, "client", nil), b.Name))
	apply("outsider", onNode(clientPod(outsideNS, "outsider", nil), b.Name))
	for _, p := range [][2]string{{meshNS, "server"}, {meshNS, "client"}, {outsideNS, "outsider"}} {
		waitReady(t, a, p[0], p[1])
	}
	for _, p := range []string{"server", "client"} {
		waitAnnotated(t, a, meshNS, p, true)
	}
	serverIP, clientIP := podIP(t, a, meshNS, "server"), podIP(t, a, meshNS, "client")
	svc, err := a.Client.CoreV1().Services(meshNS).Get(ctx, "server", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitServiceEndpoint(ctx, t, a, meshNS, "server", serverIP)
	// The client's agent, on the worker, learns the server and its Service by its own watch.
	waitAgentSees(ctx, t, b, serverIP, svc.Spec.ClusterIP)
	get := func(ns, pod, url string) (string, error) { return podGet(ctx, a, ns, pod, url) }

	t.Run("MeshedAcrossNodes", func(t *testing.T) {
		sa, err := a.Sniff(marker)
		if err != nil {
			t.Fatal(err)
		}
		sb, err := b.Sniff(marker)
		if err != nil {
			sa.Stop()
			t.Fatal(err)
		}
		for _, url := range []string{
			fmt.Sprintf("http://%s:8080/cgi-bin/ip", serverIP),
			fmt.Sprintf("http://%s/cgi-bin/ip", svc.Spec.ClusterIP), // Service VIP, no kube-proxy
		} {
			out, err := get(meshNS, "client", url)
			if err != nil {
				t.Errorf("client on %s -> %s on %s: %v", b.Name, url, a.Name, err)
				continue
			}
			if got := remoteAddr(out); got != clientIP {
				t.Errorf("%s: server saw %q, want the client's pod IP %s", url, got, clientIP)
			}
		}
		if out, err := get(meshNS, "client", "http://"+serverIP+":8080/"); err != nil || !strings.Contains(out, marker) {
			t.Errorf("client -> server page: %q, %v", out, err)
		}
		for _, c := range []struct {
			n *Node
			s *Sniffer
		}{{a, sa}, {b, sb}} {
			hits, ports := c.s.Stop()
			t.Logf("%s: data frames by port %v", c.n.Name, ports)
			if hits != 0 {
				t.Errorf("the marker crossed %s's links in plaintext %d times", c.n.Name, hits)
			}
			if ports[15008] == 0 {
				t.Errorf("no HBONE (15008) traffic on %s: %v", c.n.Name, ports)
			}
		}
	})

	t.Run("StrictRefusesPlaintextAcrossNodes", func(t *testing.T) {
		if out, err := get(outsideNS, "outsider", "http://"+serverIP+":8080/"); err == nil {
			t.Errorf("plaintext from outside the mesh on %s reached the server on %s under STRICT: %q", b.Name, a.Name, out)
		}
	})

	t.Run("Uninstall", func(t *testing.T) {
		if out, err := a.Helm(ctx, "uninstall", release, "-n", releaseNS, "--wait", "--timeout=3m"); err != nil {
			t.Fatalf("helm uninstall: %v\n%s", err, out)
		}
		if err := waitFor(ctx, podTimeout, "agent pods gone", func() error {
			return agentPodsGone(a, "")
		}); err != nil {
			t.Fatal(err)
		}
		for _, n := range []*Node{a, b} {
			if types := conflistTypes(t, n); !slices.Equal(types, []string{"bridge", "portmap"}) {
				t.Errorf("%s: conflist after uninstall %v, want the original bridge, portmap", n.Name, types)
			}
		}
		// Plain HTTP across the nodes again, and both sniffers see the marker now (so their
		// silence above means something).
		sa, err := a.Sniff(marker)
		if err != nil {
			t.Fatal(err)
		}
		sb, err := b.Sniff(marker)
		if err != nil {
			sa.Stop()
			t.Fatal(err)
		}
		out, err := get(meshNS, "client", "http://"+serverIP+":8080/")
		hitsA, _ := sa.Stop()
		hitsB, _ := sb.Stop()
		if err != nil || !strings.Contains(out, marker) {
			t.Errorf("plain request across the nodes after uninstall: %q, %v", out, err)
		}
		// HBONE between these two pods (other connections may still be on the wire, as in
		// TestRealNode's Uninstall).
		hboneA, hboneB := sa.FramesBetween(clientIP, serverIP, 15008), sb.FramesBetween(clientIP, serverIP, 15008)
		if hitsA == 0 || hitsB == 0 || hboneA != 0 || hboneB != 0 {
			t.Errorf("after uninstall: marker seen %d/%d times and HBONE frames between the client and the server %d/%d on %s/%s; want some and none (connections on 15008: %s / %s)",
				hitsA, hitsB, hboneA, hboneB, a.Name, b.Name, sa.FlowsOn(15008), sb.FlowsOn(15008))
		}
	})
}

// agentPodOn is the name of the ready agent pod on node (any node if
// ""), or "".
func agentPodOn(n *Node, node string) string {
	pods, err := agentPodsOn(n, node)
	if err != nil {
		return ""
	}
	for _, p := range pods {
		if p.DeletionTimestamp == nil && podReady(&p) {
			return p.Name
		}
	}
	return ""
}

// agentPodsOn lists the release's agent pods on node ("" for any node), terminating ones too.
func agentPodsOn(n *Node, node string) ([]corev1.Pod, error) {
	opts := metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=redirector,app.kubernetes.io/instance=" + release}
	if node != "" {
		opts.FieldSelector = "spec.nodeName=" + node
	}
	pods, err := n.Client.CoreV1().Pods(releaseNS).List(context.Background(), opts)
	if err != nil {
		return nil, err
	}
	return pods.Items, nil
}

// agentPodsGone fails while any agent pod of the release is on node, terminating or not: a
// terminating agent still drains its connections and cleans the node up, so a check of the node
// after an uninstall has to wait for its pod to be gone from the API, which the kubelet does
// once the pod's containers have stopped.
func agentPodsGone(n *Node, node string) error {
	pods, err := agentPodsOn(n, node)
	if err != nil {
		return err
	}
	if len(pods) > 0 {
		state := "running"
		if pods[0].DeletionTimestamp != nil {
			state = "terminating"
		}
		return fmt.Errorf("agent pod %s still on %s (%s)", pods[0].Name, pods[0].Spec.NodeName, state)
	}
	return nil
}
