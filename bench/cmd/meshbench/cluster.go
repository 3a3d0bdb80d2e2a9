package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// Ports the server pods serve on.
const (
	iperfPort  = 5201
	fortioPort = 8080
	echoPort   = 7000
)

// hbone is the agents' tunnel port, whatever the application's.
func hbone(int) int { return 15008 }

// variant is one path from a client pod to a server pod.
type variant struct {
	Name   string
	Desc   string
	client *netnstest.Pod
	server netip.Addr
	// proxies are the processes that carry this path's traffic (agents,
	// relay); their CPU time is charged to the variant.
	proxies []int
	meshed  bool
	// names name the proxies in per-proxy figures (default: node<N> for
	// the agents, relay otherwise).
	names []string
	// logs are the variant's relay processes, whose standard error a
	// failed test quotes.
	logs []*child
	// serverPod and tunnelPort are where the relay pair's server side runs
	// and the port of its relay-to-relay connection for an application
	// port, for the hop breakdown (hops.go); nil where the path has no relay
	// pair.
	serverPod  *netnstest.Pod
	tunnelPort func(appPort int) int
}

// cluster is the simulated cluster every variant lives in:
//
//	node1: client, local (mesh); dclient, cclient, tclient (not enrolled)
//	node2: server (mesh), sserver (namespace "strict": STRICT mTLS), plain (not enrolled)
//
// direct: dclient -> plain; meshed cross-node: client -> server; meshed
// same-node: client -> local; capture-only: cclient (eBPF capture by this
// process's own loader) -> relay -> plain; iptables TPROXY: tclient
// (iptables in its namespace) -> relay -> plain; peer-stunnel: dclient ->
// stunnel in dclient -> mutual TLS -> stunnel in plain -> plain (peer.go);
// peer-haproxy the same with HAProxy, plain-pair with HAProxy and no TLS.
type cluster struct {
	cfg      config
	topo     *netnstest.Topology
	agents   []*netnstest.Agent
	agentPID []int // by node index - 1
	manifest *netnstest.Manifest
	manPath  string

	client, local, server, sserver, plain *netnstest.Pod
	variants                              []*variant
	late                                  int // pods added for the enrollment test
}

func (c *cluster) variant(name string) *variant {
	for _, v := range c.variants {
		if v.Name == name {
			return v
		}
	}
	return nil
}

// buildCluster creates the namespaces, the agents, the servers and the
// capture setups, and checks every variant carries an echo.
func buildCluster(ctx context.Context, r *netnstest.Runner, cfg config) (*cluster, error) {
	nodes := 2
	if cfg.alt() {
		nodes = 4 // nodes 3 and 4 run the alternative agents
	}
	c := &cluster{cfg: cfg, topo: netnstest.New(r, nodes)}
	n1, n2 := c.topo.Nodes[0], c.topo.Nodes[1]
	c.client, c.local = n1.AddPod("client"), n1.AddPod("local")
	dclient, cclient, tclient := n1.AddPod("dclient"), n1.AddPod("cclient"), n1.AddPod("tclient")
	c.server, c.sserver, c.plain = n2.AddPod("server"), n2.AddPod("sserver"), n2.AddPod("plain")
	var aclient, aserver *netnstest.Pod
	clients, servers := []*netnstest.Pod{c.client, dclient, cclient, tclient}, []*netnstest.Pod{c.server, c.local, c.plain}
	if cfg.alt() {
		aclient, aserver = c.topo.Nodes[2].AddPod("aclient"), c.topo.Nodes[3].AddPod("aserver")
		clients, servers = append(clients, aclient), append(servers, aserver)
	}
	for _, p := range clients {
		if err := clientSysctls(ctx, p.Path()); err != nil {
			return nil, err
		}
	}
	// Before any socket exists: a socket takes its namespace's algorithm when it is made.
	for _, n := range c.topo.Nodes {
		paths := []string{n.Path()}
		for _, p := range n.Pods {
			paths = append(paths, p.Path())
		}
		for _, path := range paths {
			if err := setCongestion(ctx, path, cfg.Congestion); err != nil {
				return nil, err
			}
		}
	}

	// Servers first, so nothing races their start.
	for _, p := range servers {
		if err := startServers(ctx, r, cfg, p, true); err != nil {
			return nil, err
		}
	}
	if err := startServers(ctx, r, cfg, c.sserver, false); err != nil {
		return nil, err
	}

	// The mesh: the real agents, fed by a manifest file.
	dir := r.TempDir()
	c.manPath = filepath.Join(dir, "cluster.yaml")
	c.manifest = (&netnstest.Manifest{}).
		Namespace("mesh", "istio.io/dataplane-mode=ambient").
		Namespace("strict", "istio.io/dataplane-mode=ambient").
		Pod(c.client, "mesh", "client-sa", "app=client").
		Pod(c.local, "mesh", "server-sa", "app=local").
		Pod(c.server, "mesh", "server-sa", "app=server").
		Pod(c.sserver, "strict", "server-sa", "app=sserver").
		Raw(`apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: strict}
spec:
  mtls: {mode: STRICT}`)
	if cfg.alt() {
		c.manifest.Pod(aclient, "mesh", "client-sa", "app=aclient").Pod(aserver, "mesh", "server-sa", "app=aserver")
	}
	if err := c.manifest.Write(c.manPath); err != nil {
		return nil, fmt.Errorf("write manifest: %w", err)
	}
	bin := filepath.Join(cfg.Bin, "redirector")
	caDir := filepath.Join(dir, "ca")
	if out, err := exec.Command(bin, "ca", "init", "--dir", caDir).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("redirector ca init: %w: %s", err, out)
	}
	var altPID []int
	for i, n := range c.topo.Nodes {
		b, env := bin, cfg.AgentEnv
		if i >= 2 {
			b, env = cfg.altBinary(), append(append([]string{}, cfg.AgentEnv...), cfg.AltAgentEnv...)
		}
		a := netnstest.StartAgent(r, n, netnstest.AgentOptions{Binary: b, Manifest: c.manPath, CADir: caDir,
			BPFRoot: filepath.Join(dir, "bpf-"+n.Name), Env: env,
			// The harness asks for debug logs; per-connection logging
			// would be part of what we measure. The last flag wins.
			Args: []string{"--log-level", "info", fmt.Sprintf("--sockops-acceleration=%v", cfg.Sockops)}})
		want := 2 // pods per node
		if i >= 2 {
			want = 1
		}
		if err := waitEnrolled(ctx, a, want, 20*time.Second); err != nil {
			return nil, err
		}
		pid, err := agentPID(a.BPFRoot)
		if err != nil {
			return nil, err
		}
		if i >= 2 {
			altPID = append(altPID, pid)
			continue
		}
		c.agents = append(c.agents, a)
		c.agentPID = append(c.agentPID, pid)
	}

	capRelay, err := setupCaptureOnly(ctx, r, cclient)
	if err != nil {
		return nil, fmt.Errorf("capture-only: %w", err)
	}
	tpRelay, err := setupTPROXY(ctx, r, tclient)
	if err != nil {
		return nil, fmt.Errorf("iptables TPROXY: %w", err)
	}

	peerDir := filepath.Join(dir, "peer")
	if err := os.MkdirAll(peerDir, 0o700); err != nil {
		return nil, err
	}
	pc, err := makePeerCerts(peerDir, c.plain.IPv4)
	if err != nil {
		return nil, err
	}
	peers := map[string][]*child{}
	for _, kind := range relayPairs {
		if peers[kind.variant], err = setupPeer(ctx, r, kind, pc, peerDir, dclient, c.plain); err != nil {
			return nil, err
		}
	}
	peerVariant := func(kind peerRelay, desc string) *variant {
		ch := peers[kind.variant]
		return &variant{Name: kind.variant, Desc: desc, client: dclient, server: kind.local,
			proxies: []int{ch[0].Pid(), ch[1].Pid()}, names: []string{"client", "server"}, logs: ch,
			serverPod: c.plain, tunnelPort: kind.hopPort}
	}

	c.variants = []*variant{
		{Name: "direct", Desc: "no mesh: client and server pods not enrolled, cross-node", client: dclient, server: c.plain.IPv4},
		{Name: "meshed-cross", Desc: "HBONE between the two nodes' agents", client: c.client, server: c.server.IPv4,
			proxies: c.agentPID, meshed: true, serverPod: c.server, tunnelPort: hbone},
		{Name: "meshed-same", Desc: "HBONE, client and server pods on one node (one agent)", client: c.client, server: c.local.IPv4,
			proxies: c.agentPID[:1], meshed: true, serverPod: c.local, tunnelPort: hbone},
		{Name: "capture-only", Desc: "the eBPF capture (pkg/loader) into a plain Go TCP relay in the client pod, no TLS", client: cclient,
			server: c.plain.IPv4, proxies: []int{capRelay.Pid()}, logs: []*child{capRelay}},
		{Name: "iptables-tproxy", Desc: "iptables mangle TPROXY capture into the same relay", client: tclient,
			server: c.plain.IPv4, proxies: []int{tpRelay.Pid()}, logs: []*child{tpRelay}},
		peerVariant(stunnelPeer, "a pair of stunnel4 relays (OpenSSL, mutual TLS 1.3, AES-128-GCM) in the direct variant's pods; the client dials its pod's stunnel"),
		peerVariant(haproxyPeer, "the same with a pair of HAProxy 2.6 (event loop, OpenSSL) in TCP mode"),
		peerVariant(plainPair, "peer-haproxy without TLS: two user-space hops and nothing else, the floor under any relay pair"),
	}
	if cfg.alt() {
		c.variants = append(c.variants, &variant{Name: altVariant, Desc: "meshed-cross with other agents (" + cfg.altDesc() + ") on nodes 3 and 4",
			client: aclient, server: aserver.IPv4, proxies: altPID, meshed: true, names: []string{"node3", "node4"},
			serverPod: aserver, tunnelPort: hbone})
	}
	for _, v := range c.variants {
		if err := c.checkPath(ctx, v); err != nil {
			return nil, err
		}
	}
	// Prove each path is what it claims: the relays carried the checks, and
	// the meshed client reaches a server that accepts only mTLS.
	for _, x := range []struct {
		v     *variant
		relay *child
	}{{c.variant("capture-only"), capRelay}, {c.variant("iptables-tproxy"), tpRelay}} {
		before, err := relayedCount(ctx, x.relay)
		if err != nil {
			return nil, err
		}
		if err := c.checkPath(ctx, x.v); err != nil {
			return nil, err
		}
		if after, err := relayedCount(ctx, x.relay); err != nil || after <= before {
			return nil, fmt.Errorf("variant %s: the relay carried no connection (%d before, %d after; %v): the capture does not work",
				x.v.Name, before, after, err)
		}
	}
	for _, kind := range relayPairs {
		if !kind.tls {
			continue
		}
		if err := checkPeerTLS(ctx, kind, pc, dclient, c.plain.IPv4); err != nil {
			return nil, err
		}
	}
	strict := &variant{Name: "meshed client to STRICT server", client: c.client, server: c.sserver.IPv4}
	if err := c.checkPath(ctx, strict); err != nil {
		return nil, err
	}
	return c, nil
}

// clientSysctls lets a client pod open tens of thousands of short
// connections a second without running out of ports: TIME_WAIT reuse and a
// wide ephemeral range, in the pod's own namespace only.
func clientSysctls(ctx context.Context, nsPath string) error {
	_, err := output(ctx, nsPath, 10*time.Second, "sh", "-c",
		"echo 1 > /proc/sys/net/ipv4/tcp_tw_reuse && echo '1024 65000' > /proc/sys/net/ipv4/ip_local_port_range")
	return err
}

// setCongestion sets the namespace's TCP congestion control to algo (its
// own sysctl: the machine's namespace keeps its setting); empty leaves it.
func setCongestion(ctx context.Context, nsPath, algo string) error {
	if algo == "" {
		return nil
	}
	if _, err := output(ctx, nsPath, 10*time.Second, "sysctl", "-qw", "net.ipv4.tcp_congestion_control="+algo); err != nil {
		return fmt.Errorf("congestion control %s in %s: %w", algo, nsPath, err)
	}
	return nil
}

// checkNamespaceDefault tells whether a namespace other than the machine's
// may default to algo: the kernel lets it default only to an algorithm in
// net.ipv4.tcp_allowed_congestion_control (a machine that boots with BBR as
// its default may leave cubic out of that list), and refuses the sysctl with
// a bare EPERM otherwise. The list is the machine's; the suite leaves it be.
func checkNamespaceDefault(algo string) error {
	raw, err := os.ReadFile("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
	if err != nil {
		return err
	}
	allowed := strings.Fields(string(raw))
	if !slices.Contains(allowed, algo) {
		return fmt.Errorf("a network namespace may default only to net.ipv4.tcp_allowed_congestion_control (%s), which lacks %q; "+
			"add it there first (sysctl -w net.ipv4.tcp_allowed_congestion_control=\"%s %s\") and put the list back afterwards",
			strings.Join(allowed, " "), algo, strings.Join(allowed, " "), algo)
	}
	return nil
}

// startServers runs the echo server and, if all, iperf3 and fortio servers
// in the pod.
func startServers(ctx context.Context, r *netnstest.Runner, cfg config, p *netnstest.Pod, all bool) error {
	echo, err := startChild(r, p.Path(), "echo server in "+p.Name, selfPath(), "echo", "-listen", fmt.Sprintf("[::]:%d", echoPort))
	if err != nil {
		return err
	}
	if _, err := echo.waitLine(ctx, "ready", 10*time.Second); err != nil {
		return err
	}
	if !all {
		return nil
	}
	if _, err := startChild(r, p.Path(), "iperf3 server in "+p.Name, "iperf3", "-s", "-p", fmt.Sprint(iperfPort)); err != nil {
		return err
	}
	if _, err := startChild(r, p.Path(), "fortio server in "+p.Name, cfg.Fortio, "server", "-http-port", fmt.Sprint(fortioPort),
		"-grpc-port", "disabled", "-redirect-port", "disabled", "-tcp-port", "disabled", "-udp-port", "disabled",
		"-loglevel", "warning"); err != nil {
		return err
	}
	for _, port := range []int{iperfPort, fortioPort} {
		if err := waitPort(ctx, p.Path(), port, 10*time.Second); err != nil {
			return err
		}
	}
	return nil
}

// waitEnrolled waits until the agent logged n pod enrollments.
func waitEnrolled(ctx context.Context, a *netnstest.Agent, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if strings.Count(a.Log(), `msg="pod enrolled"`) >= n {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("agent on %s enrolled fewer than %d pods within %s:\n%s", a.Node.Name, n, timeout, tail(a.Log(), 3000))
}

// checkPath makes a few round trips through the variant's path, retrying
// while the mesh settles.
func (c *cluster) checkPath(ctx context.Context, v *variant) error {
	var err error
	for range 50 {
		if _, err = runRR(ctx, v, 10, false); err == nil {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("variant %s: no echo through the path: %w", v.Name, err)
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}
