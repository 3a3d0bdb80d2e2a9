package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/redirector-mesh/redirector/pkg/cni"
	"github.com/redirector-mesh/redirector/pkg/cni/cnitest"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// The chain tests run the real reference plugins and this plugin through
// libcni, as a container runtime does, against the fake agent. Everything
// network-facing happens in a throwaway "node" namespace: cnidriver (libcni)
// runs there under nsenter, so the bridge and host veth ends the plugins
// create never touch the machine's own namespace, and deleting the node
// namespace in cleanup removes them even when a test fails half-way.

// EnvPluginsDir names a folder holding bridge, ptp, loopback, host-local and
// cnidriver (as hack/cni-plugins.sh builds them); when set, nothing is built.
const EnvPluginsDir = "REDIRECTOR_CNI_PLUGINS_BIN"

// chainBins are built once per test binary.
var chainBins struct {
	once      sync.Once
	err       error
	pluginDir string // reference plugins and cnidriver
	ownDir    string // redirector-cni, built from this package
}

func TestMain(m *testing.M) {
	code := m.Run()
	if chainBins.ownDir != "" {
		os.RemoveAll(chainBins.ownDir)
	}
	os.Exit(code)
}

func buildChainBins() error {
	dir := os.Getenv(EnvPluginsDir)
	if dir == "" {
		script, err := findUp(filepath.Join("hack", "cni-plugins.sh"))
		if err != nil {
			return fmt.Errorf("find hack/cni-plugins.sh: %w (or set %s)", err, EnvPluginsDir)
		}
		var stdout, stderr bytes.Buffer
		cmd := exec.Command("bash", script)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s: %w: %s", script, err, stderr.Bytes())
		}
		dir = strings.TrimSpace(stdout.String())
	}
	for _, name := range []string{"bridge", "ptp", "loopback", "host-local", "cnidriver"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			return fmt.Errorf("reference plugin %s: %w", name, err)
		}
	}
	own, err := os.MkdirTemp("", "redirector-cni-bin")
	if err != nil {
		return err
	}
	chainBins.pluginDir, chainBins.ownDir = dir, own
	out, err := exec.Command("go", "build", "-o", filepath.Join(own, "redirector-cni"), ".").CombinedOutput()
	if err != nil {
		return fmt.Errorf("go build redirector-cni: %w: %s", err, out)
	}
	return nil
}

// findUp finds rel in the working directory (go test sets it to the package)
// or one of its parents.
func findUp(rel string) (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if p := filepath.Join(dir, rel); fileExists(p) {
			return p, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("not inside the redirector repository")
		}
		dir = parent
	}
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// node is a simulated node: a named network namespace that runs the chain,
// with its own CNI cache, IPAM data, agent socket and selection hint.
type node struct {
	t      *testing.T
	prefix string
	name   string // network namespace of the node
	dir    string // cache, IPAM data, conflists
	sock   string
	hint   string
}

func newNode(t *testing.T) *node {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces and runs the bridge and ptp plugins")
	}
	if testing.Short() {
		t.Skip("-short: the chain test builds the reference CNI plugins")
	}
	chainBins.once.Do(func() { chainBins.err = buildChainBins() })
	if chainBins.err != nil {
		t.Fatal(chainBins.err)
	}
	n := &node{t: t, prefix: fmt.Sprintf("rdcni%04x", rand.IntN(0xffff)), dir: t.TempDir(), sock: cnitest.SocketPath(t)}
	n.name = n.prefix + "-node"
	n.hint = filepath.Join(filepath.Dir(n.sock), "ambient-namespaces.json")
	t.Cleanup(n.cleanup)
	n.addNS(n.name)
	return n
}

func (n *node) path() string { return filepath.Join(netnstest.NetNSDir, n.name) }

func (n *node) addNS(name string) {
	n.t.Helper()
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		n.t.Fatalf("ip netns add %s: %v: %s", name, err, out)
	}
	if out, err := exec.Command("ip", "-n", name, "link", "set", "lo", "up").CombinedOutput(); err != nil {
		n.t.Fatalf("ip -n %s link set lo up: %v: %s", name, err, out)
	}
}

// cleanup deletes every namespace this node created, which takes the bridge
// and all veth pairs with it. IPAM data and the CNI cache live in t.TempDir.
func (n *node) cleanup() {
	out, _ := exec.Command("ip", "netns", "list").Output()
	for line := range strings.SplitSeq(string(out), "\n") {
		name, _, _ := strings.Cut(strings.TrimSpace(line), " ")
		if strings.HasPrefix(name, n.prefix+"-") {
			if o, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
				n.t.Logf("cleanup: ip netns del %s: %v: %s", name, err, o)
			}
		}
	}
}

// pod is a sandbox as the runtime sees it: a namespace and a container id.
type pod struct {
	namespace, name, uid string
	netns                string // network namespace name
	id                   string
}

func (p *pod) path() string { return filepath.Join(netnstest.NetNSDir, p.netns) }

func (p *pod) cniArgs() string {
	return fmt.Sprintf("IgnoreUnknown=1;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_INFRA_CONTAINER_ID=%s;K8S_POD_UID=%s",
		p.namespace, p.name, p.id, p.uid)
}

func (n *node) newPod(namespace, name string) *pod {
	n.t.Helper()
	p := &pod{namespace: namespace, name: name, uid: fmt.Sprintf("uid-%s-%s", namespace, name),
		netns: fmt.Sprintf("%s-%s-%s", n.prefix, namespace, name), id: fmt.Sprintf("%x", rand.Uint64())}
	n.addNS(p.netns)
	return p
}

// network is one conflist: a main plugin with host-local, redirector-cni last.
type network struct {
	name, file string
	subnet     netip.Prefix
	dataDir    string // host-local's leases
}

// bridgeNetwork is bridge + host-local in CNI 1.1.0.
func (n *node) bridgeNetwork() *network {
	return n.writeNetwork("rd-bridge", "1.1.0", netip.MustParsePrefix("10.244.7.0/24"), func(ipam map[string]any) map[string]any {
		ipam["ranges"] = [][]map[string]string{{{"subnet": "10.244.7.0/24"}}}
		return map[string]any{"type": "bridge", "bridge": "rdcni0", "isGateway": true, "ipMasq": false, "ipam": ipam}
	})
}

// ptpNetwork is ptp + host-local in CNI 0.4.0, so prevResult crosses a
// version conversion on its way.
func (n *node) ptpNetwork() *network {
	return n.writeNetwork("rd-ptp", "0.4.0", netip.MustParsePrefix("10.244.8.0/24"), func(ipam map[string]any) map[string]any {
		ipam["subnet"] = "10.244.8.0/24"
		return map[string]any{"type": "ptp", "ipMasq": false, "ipam": ipam}
	})
}

func (n *node) writeNetwork(name, version string, subnet netip.Prefix, main func(ipam map[string]any) map[string]any) *network {
	n.t.Helper()
	nw := &network{name: name, subnet: subnet, dataDir: filepath.Join(n.dir, "ipam"), file: filepath.Join(n.dir, name+".conflist")}
	ipam := map[string]any{"type": "host-local", "dataDir": nw.dataDir, "routes": []map[string]string{{"dst": "0.0.0.0/0"}}}
	list := map[string]any{"cniVersion": version, "name": name, "plugins": []any{
		main(ipam),
		map[string]any{"type": "redirector-cni", "agentSocket": n.sock, "selectionHint": n.hint},
	}}
	data, err := json.MarshalIndent(list, "", "  ")
	if err != nil {
		n.t.Fatal(err)
	}
	if err := os.WriteFile(nw.file, data, 0o644); err != nil {
		n.t.Fatal(err)
	}
	return nw
}

// run runs cnidriver in the node namespace; it returns stdout and, on
// failure, an error carrying stderr (libcni quotes the plugin's message).
func (n *node) run(op string, nw *network, p *pod) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := netnstest.Command(ctx, n.path(), filepath.Join(chainBins.pluginDir, "cnidriver"),
		"-op", op, "-conflist", nw.file,
		"-path", chainBins.pluginDir+string(os.PathListSeparator)+chainBins.ownDir,
		"-cachedir", filepath.Join(n.dir, "cache"),
		"-netns", p.path(), "-id", p.id, "-ifname", "eth0", "-args", p.cniArgs())
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("%s %s for %s/%s: %w: %s", op, nw.name, p.namespace, p.name, err, strings.TrimSpace(stderr.String()))
	}
	if stderr.Len() > 0 {
		n.t.Logf("%s %s for %s/%s: stderr: %s", op, nw.name, p.namespace, p.name, stderr.Bytes())
	}
	return stdout.Bytes(), nil
}

func (n *node) add(nw *network, p *pod) (*types100.Result, error) {
	out, err := n.run("add", nw, p)
	if err != nil {
		return nil, err
	}
	res := &types100.Result{}
	if err := json.Unmarshal(out, res); err != nil {
		return nil, fmt.Errorf("decode the chain's result: %w: %s", err, out)
	}
	return res, nil
}

func (n *node) del(nw *network, p *pod) {
	n.t.Helper()
	if _, err := n.run("del", nw, p); err != nil {
		n.t.Errorf("DEL must not fail: %v", err)
	}
}

// sandboxIPs are the result's addresses on interfaces inside the pod.
func sandboxIPs(t *testing.T, res *types100.Result) []netip.Prefix {
	t.Helper()
	var out []netip.Prefix
	for _, ipc := range res.IPs {
		if ipc.Interface == nil || res.Interfaces[*ipc.Interface].Sandbox == "" {
			continue
		}
		a, _ := netip.AddrFromSlice(ipc.Address.IP)
		ones, _ := ipc.Address.Mask.Size()
		out = append(out, netip.PrefixFrom(a.Unmap(), ones))
	}
	return out
}

// leases lists the addresses host-local has handed out on nw.
func leases(t *testing.T, nw *network) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(nw.dataDir, nw.name))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if _, err := netip.ParseAddr(e.Name()); err == nil {
			out = append(out, e.Name())
		}
	}
	return out
}

func podAddrs(t *testing.T, p *pod) string {
	t.Helper()
	out, err := exec.Command("ip", "-n", p.netns, "-o", "addr", "show").CombinedOutput()
	if err != nil {
		t.Fatalf("ip -n %s addr show: %v: %s", p.netns, err, out)
	}
	return string(out)
}

// TestChainEnrollsThroughAgent runs ADD, CHECK and DEL through each chain
// with the agent up: the agent hears of the pod with the namespace path and
// the address host-local gave it, before the runtime would start it.
func TestChainEnrollsThroughAgent(t *testing.T) {
	n := newNode(t)
	agent := &cnitest.Agent{}
	cnitest.Serve(t, n.sock, agent)
	// The hint says "refuse" for shop: it must not matter while the agent answers.
	if err := cni.WriteSelectionHint(n.hint, []string{"shop"}, nil); err != nil {
		t.Fatal(err)
	}

	for _, nw := range []*network{n.bridgeNetwork(), n.ptpNetwork()} {
		t.Run(nw.name, func(t *testing.T) {
			agent.Reset()
			p := n.newPod("shop", "web-"+nw.name)
			res, err := n.add(nw, p)
			if err != nil {
				t.Fatal(err)
			}
			ips := sandboxIPs(t, res)
			if len(ips) != 1 || !nw.subnet.Contains(ips[0].Addr()) {
				t.Fatalf("chain result has pod addresses %v, want one in %v", ips, nw.subnet)
			}
			if got := podAddrs(t, p); !strings.Contains(got, "eth0") || !strings.Contains(got, ips[0].String()) {
				t.Errorf("pod namespace lacks eth0 with %v:\n%s", ips[0], got)
			}
			want := cni.PodEvent{Command: cni.CommandAdd, PodName: p.name, PodNamespace: "shop", PodUID: p.uid,
				ContainerID: p.id, NetNS: p.path(), IfName: "eth0", IPs: ips}
			if evs := agent.Events(); len(evs) != 1 || !reflect.DeepEqual(evs[0], want) {
				t.Errorf("agent events after ADD:\n%+v\nwant exactly\n%+v", evs, want)
			}

			agent.Reset()
			if _, err := n.run("check", nw, p); err != nil {
				t.Errorf("CHECK: %v", err)
			}
			if evs := agent.Events(); len(evs) != 1 || evs[0].Command != cni.CommandCheck || evs[0].NetNS != p.path() {
				t.Errorf("agent events after CHECK: %+v", evs)
			}

			agent.Reset()
			n.del(nw, p)
			evs := agent.Events()
			if len(evs) != 1 || evs[0].Command != cni.CommandDel || evs[0].PodName != p.name ||
				evs[0].PodNamespace != "shop" || evs[0].ContainerID != p.id {
				t.Errorf("agent events after DEL: %+v, want one DEL for %s", evs, p.name)
			}
			if strings.Contains(podAddrs(t, p), "eth0") {
				t.Error("eth0 still in the pod after DEL")
			}
			if l := leases(t, nw); len(l) != 0 {
				t.Errorf("host-local leases after DEL: %v", l)
			}
		})
	}
}

// TestChainAgentRefuses: an agent that cannot enroll a selected pod fails
// the runtime's ADD with its reason; the runtime's DEL then cleans up.
func TestChainAgentRefuses(t *testing.T) {
	n := newNode(t)
	agent := &cnitest.Agent{Answer: func(ev cni.PodEvent) (cni.Response, error) {
		if ev.Command == cni.CommandAdd {
			return cni.Response{Reason: "namespace shop is ambient"}, errors.New("attach programs to eth0: operation not permitted")
		}
		return cni.Response{}, nil
	}}
	cnitest.Serve(t, n.sock, agent)
	nw := n.bridgeNetwork()
	p := n.newPod("shop", "web")
	_, err := n.add(nw, p)
	if err == nil || !strings.Contains(err.Error(), "redirector agent refused ADD for pod shop/web: attach programs to eth0: operation not permitted") {
		t.Fatalf("ADD: err = %v, want the agent's refusal", err)
	}
	n.del(nw, p)
	if l := leases(t, nw); len(l) != 0 {
		t.Errorf("host-local leases after DEL: %v", l)
	}
}

// TestChainAgentDown: with no agent, the selection hint decides; a pod of an
// ambient namespace is refused with a message naming the socket and the pod,
// any other pod starts, and DEL always succeeds.
func TestChainAgentDown(t *testing.T) {
	n := newNode(t) // no agent is started: the socket does not exist
	if err := cni.WriteSelectionHint(n.hint, []string{"shop"}, []string{"kube-system"}); err != nil {
		t.Fatal(err)
	}
	for _, nw := range []*network{n.bridgeNetwork(), n.ptpNetwork()} {
		t.Run(nw.name, func(t *testing.T) {
			ambient := n.newPod("shop", "web-"+nw.name)
			_, err := n.add(nw, ambient)
			want := fmt.Sprintf("redirector agent unreachable at %s: pod shop/%s would be enrolled in the ambient mesh; refusing to start it unmeshed", n.sock, ambient.name)
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("ADD in an ambient namespace: err = %v\nwant it to contain %q", err, want)
			}
			n.del(nw, ambient)

			other := n.newPod("default", "web-"+nw.name)
			res, err := n.add(nw, other)
			if err != nil {
				t.Fatalf("ADD outside the mesh with the agent down: %v", err)
			}
			if ips := sandboxIPs(t, res); len(ips) != 1 || !strings.Contains(podAddrs(t, other), ips[0].String()) {
				t.Errorf("pod outside the mesh not set up: result addresses %v", ips)
			}
			n.del(nw, other)
			if l := leases(t, nw); len(l) != 0 {
				t.Errorf("host-local leases after DEL: %v", l)
			}
		})
	}
}

// TestVersionCommand runs the built plugin as skel sees it for VERSION.
func TestVersionCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds the plugin")
	}
	chainBins.once.Do(func() { chainBins.err = buildChainBins() })
	if chainBins.err != nil {
		t.Fatal(chainBins.err)
	}
	cmd := exec.Command(filepath.Join(chainBins.ownDir, "redirector-cni"))
	cmd.Env = []string{"CNI_COMMAND=VERSION"}
	cmd.Stdin = strings.NewReader(`{"cniVersion":"1.1.0"}`)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("VERSION: %v: %s", err, out)
	}
	var info struct {
		Supported []string `json:"supportedVersions"`
	}
	if err := json.Unmarshal(out, &info); err != nil {
		t.Fatalf("VERSION output %s: %v", out, err)
	}
	if want := supportedVersions; !reflect.DeepEqual(info.Supported, want) {
		t.Errorf("supported versions = %v, want %v", info.Supported, want)
	}
}

// TestDelNeverFailsBeforeSkel runs the built plugin's DEL with configurations skel
// refuses before any plugin code runs (not JSON, a CNI version it does not
// support, none at all): DEL still exits 0. Before, skel failed such a DEL,
// and the runtime repeats a failed DEL for ever, the pod stuck Terminating.
func TestDelNeverFailsBeforeSkel(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds the plugin")
	}
	chainBins.once.Do(func() { chainBins.err = buildChainBins() })
	if chainBins.err != nil {
		t.Fatal(chainBins.err)
	}
	for _, conf := range []string{`not json`, `{"cniVersion":"0.1.0","name":"n","type":"redirector-cni"}`, `{"name":"n","type":"redirector-cni"}`} {
		cmd := exec.Command(filepath.Join(chainBins.ownDir, "redirector-cni"))
		cmd.Env = []string{"CNI_COMMAND=DEL", "CNI_CONTAINERID=c1", "CNI_NETNS=/nonexistent", "CNI_IFNAME=eth0",
			"CNI_ARGS=K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web", "CNI_PATH=/nonexistent"}
		cmd.Stdin = strings.NewReader(conf)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("DEL with configuration %q: %v: %s", conf, err, out)
		}
	}
}

// TestChainLoopback runs the loopback plugin as runtimes do before the pod
// network, to show the reference plugin set works in this harness.
func TestChainLoopback(t *testing.T) {
	n := newNode(t)
	lo := &network{name: "lo", file: filepath.Join(n.dir, "lo.conflist")}
	if err := os.WriteFile(lo.file, []byte(`{"cniVersion":"1.0.0","name":"lo","plugins":[{"type":"loopback"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	p := n.newPod("default", "lo")
	if out, err := exec.Command("ip", "-n", p.netns, "link", "set", "lo", "down").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if _, err := n.run("add", lo, p); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("ip", "-n", p.netns, "-o", "link", "show", "lo").CombinedOutput()
	if err != nil || !strings.Contains(string(out), ",UP") {
		t.Errorf("lo not up after the loopback plugin: %v: %s", err, out)
	}
	if _, err := n.run("del", lo, p); err != nil {
		t.Errorf("DEL: %v", err)
	}
}
