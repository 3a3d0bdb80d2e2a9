package netnstest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/maps"
)

// cniPluginsDir builds (or finds, by content hash) the reference CNI plugins
// and the libcni driver.
func cniPluginsDir(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("bash", "../../hack/cni-plugins.sh").Output()
	if err != nil {
		t.Fatalf("hack/cni-plugins.sh: %v", err)
	}
	return strings.TrimSpace(string(out))
}

// pendingPod is a pod as the API has it when the runtime calls CNI ADD:
// scheduled, no address yet.
func pendingPod(name, ns, uid string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: %s, uid: %s}
spec: {nodeName: node1, containers: [{name: app, image: app}]}
status: {phase: Pending}`, name, ns, uid)
}

// runtime runs the CNI chain for pod sandboxes the way a container runtime
// does, from inside the node's namespace.
type runtime struct {
	t        *testing.T
	node     *Node
	conflist string
	path     string
	cache    string
	prefix   string
}

func (r *runtime) run(op, pod, ns string) (string, error) {
	netnsName := r.prefix + "-cni-" + pod
	if op == "add" {
		if out, err := exec.Command("ip", "netns", "add", netnsName).CombinedOutput(); err != nil {
			r.t.Fatalf("ip netns add: %v %s", err, out)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := Exec(ctx, r.node.Path(), filepath.Join(strings.Split(r.path, ":")[0], "cnidriver"), "-op", op,
		"-conflist", r.conflist, "-path", r.path, "-cachedir", r.cache, "-netns", filepath.Join(NetNSDir, netnsName),
		"-id", "ctr-"+pod, "-ifname", "eth0", "-args", fmt.Sprintf("IgnoreUnknown=1;K8S_POD_NAME=%s;K8S_POD_NAMESPACE=%s;K8S_POD_UID=uid-%s", pod, ns, pod))
	return string(out), err
}

func TestCNIChainEnrollsPods(t *testing.T) {
	plugins := cniPluginsDir(t)
	for i, variant := range []struct{ name, plugin string }{
		{"bridge", `{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipam": {"type": "host-local", "ranges": [[{"subnet": "%s"}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "%s"}}`},
		{"ptp", `{"type": "ptp", "ipam": {"type": "host-local", "ranges": [[{"subnet": "%s"}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "%s"}}`},
	} {
		t.Run(variant.name, func(t *testing.T) {
			tp := New(t, 1)
			node := tp.Nodes[0]
			server := node.AddPod("server")
			HTTPApp(t, server, 8080, "server")
			dir := t.TempDir()
			sockDir, err := os.MkdirTemp("/run", "rdcni")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(sockDir) })
			sock := filepath.Join(sockDir, "cni.sock")
			subnet := fmt.Sprintf("10.%d.%d.0/24", node.PodAddr4(1).As4()[1], 50+i)
			conflist := filepath.Join(dir, "net.conflist")
			conf := fmt.Sprintf(`{"cniVersion": "1.0.0", "name": "k8s", "plugins": [%s, {"type": "redirector-cni", "agentSocket": %q}]}`,
				fmt.Sprintf(variant.plugin, subnet, filepath.Join(dir, "ipam")), sock)
			if err := os.WriteFile(conflist, []byte(conf), 0o644); err != nil {
				t.Fatal(err)
			}
			rt := &runtime{t: t, node: node, conflist: conflist, path: plugins + ":" + bin, cache: filepath.Join(dir, "cache"), prefix: tp.Prefix()}

			manifest, ca := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "ca")
			m := (&Manifest{}).Namespace("shop", "istio.io/dataplane-mode=ambient").Namespace("plain").
				Raw(pendingPod("client", "shop", "uid-client")).Raw(pendingPod("other", "plain", "uid-other")).
				Raw(pendingPod("late", "shop", "uid-late")).Pod(server, "plain", "default")
			if err := m.Write(manifest); err != nil {
				t.Fatal(err)
			}
			initCA(t, ca)
			ag := StartAgent(t, node, AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca, Args: []string{"--cni-socket", sock}})
			ag.WaitLog(t, "agent started", 10*time.Second)
			Eventually(t, 5*time.Second, func() error { _, err := os.Stat(sock); return err })

			// ADD returns only once the pod is redirected: no wait after it.
			if out, err := rt.run("add", "client", "shop"); err != nil {
				t.Fatalf("CNI ADD of a selected pod: %v\n%s", err, out)
			}
			if got, err := enrolledNames(ag.BPFRoot); err != nil || got["shop/client"] == 0 {
				t.Fatalf("right after ADD, enrolled pods are %v (%v), want shop/client", got, err)
			}
			if out, err := rt.run("add", "other", "plain"); err != nil {
				t.Fatalf("CNI ADD of an unselected pod: %v\n%s", err, out)
			}
			// The pod's traffic is captured (counted by the pod's programs) and works.
			clientNS := filepath.Join(NetNSDir, tp.Prefix()+"-cni-client")
			if out, err := CurlFrom(clientNS, URL(server.IPv4, 8080)); err != nil || !strings.Contains(out, "server peer=") {
				t.Fatalf("curl from the CNI pod: %q %v", out, err)
			}
			mp, err := maps.OpenPinned(ag.BPFRoot)
			if err != nil {
				t.Fatal(err)
			}
			counters, _ := mp.AllCounters()
			mp.Close()
			var outbound uint64
			for _, c := range counters {
				outbound += c.OutboundConns
			}
			if outbound == 0 {
				t.Errorf("the CNI pod's connection was not captured: counters %v", counters)
			}
			if out, err := rt.run("check", "client", "shop"); err != nil {
				t.Errorf("CHECK: %v\n%s", err, out)
			}
			if out, err := rt.run("del", "client", "shop"); err != nil {
				t.Errorf("DEL: %v\n%s", err, out)
			}

			// Agent down: a selected pod's ADD fails with the message, an
			// unselected one's succeeds.
			ag.Kill()
			out, err := rt.run("add", "late", "shop")
			if err == nil || !strings.Contains(out, "refusing to start it unmeshed") {
				t.Errorf("ADD of a selected pod with the agent down: %v\n%s", err, out)
			}
			if out, err := rt.run("del", "other", "plain"); err != nil {
				t.Errorf("DEL with the agent down must succeed: %v\n%s", err, out)
			}
		})
	}
}
