// Package netnstest builds simulated Kubernetes nodes and pods out of network
// namespaces, for privileged tests and the demo. Nothing it creates has a
// route to the machine's real interfaces: nodes meet on a bridge inside a
// "fabric" namespace of their own, pods hang off a bridge in their node.
//
// Layout for node i (1-based) and its pod j, with S the topology's slot:
//
//	fabric ns:  bridge rdfab, node uplinks enslaved
//	node ns:    uplink 192.168.100.i/24, fd00:100::i/64; bridge rdbr 10.S.i.1/24, fd00:S:i::1/64
//	pod ns:     eth0 10.S.i.(j+1)/24, fd00:S:i::(j+1)/64; default routes via the node bridge
//
// The slot S (100..163) is held with a lock file for the topology's life, so
// tests running at the same time in other packages never share a pod
// address: agents find a pod's namespace by its address.
//
// Every namespace, and so every link in it, is deleted in t.Cleanup, also when
// the test fails.
package netnstest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// TB is what the harness needs of a test: testing.TB satisfies it, and so
// does the demo's runner, which is why the harness does not ask for more.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
	Logf(format string, args ...any)
	Skip(args ...any)
	Cleanup(func())
	TempDir() string
	Failed() bool
}

// NetNSDir is where iproute2 keeps named network namespaces.
const NetNSDir = "/var/run/netns"

// Topology is a set of simulated nodes joined by a fabric bridge.
type Topology struct {
	t      TB
	prefix string
	fabric string
	slot   int

	mu    sync.Mutex
	Nodes []*Node
}

// Node is a simulated node: its own network namespace, forwarding on.
type Node struct {
	topo  *Topology
	Index int
	Name  string // namespace name
	IPv4  netip.Addr
	IPv6  netip.Addr
	pods  int
	Pods  []*Pod
}

// Pod is a simulated pod: a network namespace with eth0 on its node's bridge.
type Pod struct {
	Node *Node
	Name string // short name given by the test
	NS   string // namespace name
	IPv4 netip.Addr
	IPv6 netip.Addr
	// HostVeth is the node-side end of the pod's eth0.
	HostVeth string
}

// Path is the pod's network namespace file.
func (p *Pod) Path() string { return filepath.Join(NetNSDir, p.NS) }

// Path is the node's network namespace file.
func (n *Node) Path() string { return filepath.Join(NetNSDir, n.Name) }

// Addrs returns the pod's addresses.
func (p *Pod) Addrs() []netip.Addr { return []netip.Addr{p.IPv4, p.IPv6} }

// New creates the fabric and the given number of nodes.
func New(t TB, nodes int) *Topology {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	tp := &Topology{t: t, prefix: fmt.Sprintf("rd%04x", rand.IntN(0xffff))}
	tp.fabric = tp.prefix + "-fabric"
	tp.slot = takeSlot(t)
	t.Cleanup(tp.cleanup)
	tp.addNS(tp.fabric)
	tp.ip(tp.fabric, "link", "add", "rdfab", "type", "bridge")
	tp.ip(tp.fabric, "link", "set", "rdfab", "up")
	for i := 1; i <= nodes; i++ {
		tp.addNode(i)
	}
	// Every node routes every other node's pod subnet via that node.
	for _, n := range tp.Nodes {
		for _, m := range tp.Nodes {
			if n == m {
				continue
			}
			tp.ip(n.Name, "route", "add", m.Subnet4(), "via", m.IPv4.String())
			tp.ip(n.Name, "-6", "route", "add", m.Subnet6(), "via", m.IPv6.String())
		}
	}
	return tp
}

// Prefix is unique to this topology; use it to name anything else the test
// creates (pin roots, files) so that parallel tests never collide.
func (tp *Topology) Prefix() string { return tp.prefix }

func (tp *Topology) addNode(i int) {
	n := &Node{topo: tp, Index: i, Name: fmt.Sprintf("%s-node%d", tp.prefix, i),
		IPv4: netip.MustParseAddr(fmt.Sprintf("192.168.100.%d", i)),
		IPv6: netip.MustParseAddr(fmt.Sprintf("fd00:100::%d", i))}
	tp.addNS(n.Name)
	up := fmt.Sprintf("%sn%d", tp.prefix, i) // fabric side
	tp.ip(tp.fabric, "link", "add", up, "type", "veth", "peer", "name", "uplink", "netns", n.Name)
	tp.ip(tp.fabric, "link", "set", up, "master", "rdfab", "up")
	tp.ip(n.Name, "addr", "add", n.IPv4.String()+"/24", "dev", "uplink")
	tp.ip(n.Name, "addr", "add", n.IPv6.String()+"/64", "dev", "uplink", "nodad")
	tp.ip(n.Name, "link", "set", "uplink", "up")
	// A fixed address: a bridge without one takes its lowest port's, so a
	// new pod could change the gateway's MAC under the other pods, whose
	// off-node packets then go nowhere until their neighbor entry expires.
	tp.ip(n.Name, "link", "add", "rdbr", "address", n.BridgeMAC().String(), "type", "bridge")
	tp.ip(n.Name, "addr", "add", n.PodAddr4(1).String()+"/24", "dev", "rdbr")
	tp.ip(n.Name, "addr", "add", n.PodAddr6(1).String()+"/64", "dev", "rdbr", "nodad")
	tp.ip(n.Name, "link", "set", "rdbr", "up")
	// Forwarding only inside the namespaces this test created.
	tp.sysctl(n.Name, "net.ipv4.ip_forward", "1")
	tp.sysctl(n.Name, "net.ipv6.conf.all.forwarding", "1")
	tp.mu.Lock()
	tp.Nodes = append(tp.Nodes, n)
	tp.mu.Unlock()
}

// AddPod creates a pod on the node. The pod is not enrolled in anything.
func (n *Node) AddPod(name string) *Pod {
	tp := n.topo
	tp.t.Helper()
	tp.mu.Lock()
	n.pods++
	j := n.pods
	tp.mu.Unlock()
	p := &Pod{Node: n, Name: name, NS: fmt.Sprintf("%s-n%d-%s", tp.prefix, n.Index, name),
		IPv4:     n.PodAddr4(j + 1),
		IPv6:     n.PodAddr6(j + 1),
		HostVeth: fmt.Sprintf("veth%dp%d", n.Index, j)}
	tp.addNS(p.NS)
	n.wirePod(p)
	tp.mu.Lock()
	n.Pods = append(n.Pods, p)
	tp.mu.Unlock()
	return p
}

// RecreatePod destroys p's namespace and makes a new one under the same
// name (so at the same path), wired to the node's bridge with p's
// addresses and routes: a pod re-created in a new sandbox that a runtime
// names by the pod, a /proc/<pid>/ns/net whose pid came round again, or
// another pod given a dead pod's path. The old namespace lives on while
// something holds it; only its path is taken from it. It is held here until
// the new one exists, so the new one gets another inode number: the kernel
// hands a freed namespace's number to the next new one, and a namespace at
// the same path with the same number is one the agent cannot tell from the
// old (see docs/architecture.md, Known gaps of 7 December: transitions).
func (n *Node) RecreatePod(p *Pod) {
	tp := n.topo
	tp.t.Helper()
	old, err := os.Open(p.Path())
	if err != nil {
		tp.t.Fatalf("hold the namespace of %s: %v", p.NS, err)
	}
	defer old.Close()
	if out, err := exec.Command("ip", "netns", "del", p.NS).CombinedOutput(); err != nil {
		tp.t.Fatalf("ip netns del %s: %v: %s", p.NS, err, out)
	}
	tp.addNS(p.NS)
	tp.mu.Lock()
	n.pods++
	p.HostVeth = fmt.Sprintf("veth%dp%d", n.Index, n.pods) // a number no pod has
	tp.mu.Unlock()
	n.wirePod(p)
}

// wirePod joins p's namespace to the node's bridge over a veth (p.HostVeth
// on the node, eth0 in the pod) with p's addresses and default routes.
func (n *Node) wirePod(p *Pod) {
	tp := n.topo
	tp.t.Helper()
	tp.ip(n.Name, "link", "add", p.HostVeth, "type", "veth", "peer", "name", "eth0", "netns", p.NS)
	tp.ip(n.Name, "link", "set", p.HostVeth, "master", "rdbr", "up")
	tp.ip(p.NS, "addr", "add", p.IPv4.String()+"/24", "dev", "eth0")
	tp.ip(p.NS, "addr", "add", p.IPv6.String()+"/64", "dev", "eth0", "nodad")
	tp.ip(p.NS, "link", "set", "eth0", "up")
	tp.ip(p.NS, "route", "add", "default", "via", n.Gateway4().String())
	tp.ip(p.NS, "-6", "route", "add", "default", "via", n.Gateway6().String())
}

// PodAddr4 is host number h in the node's pod subnet (1 is the node's bridge).
func (n *Node) PodAddr4(h int) netip.Addr {
	return netip.MustParseAddr(fmt.Sprintf("10.%d.%d.%d", n.topo.slot, n.Index, h))
}

// PodAddr6 is host number h in the node's IPv6 pod subnet.
func (n *Node) PodAddr6(h int) netip.Addr {
	return netip.MustParseAddr(fmt.Sprintf("fd00:%d:%d::%x", n.topo.slot, n.Index, h))
}

// Gateway4 is the node's address on its pod bridge: what a pod sees as the
// node (and the source of host-originated traffic such as probes).
func (n *Node) Gateway4() netip.Addr { return n.PodAddr4(1) }

// BridgeMAC is the fixed MAC address of the node's pod bridge: where a
// pod's frames to its gateway go.
func (n *Node) BridgeMAC() net.HardwareAddr {
	return net.HardwareAddr{0x02, 0x72, 0x64, byte(n.topo.slot), 0x00, byte(n.Index)}
}

// Gateway6 is Gateway4's IPv6 twin.
func (n *Node) Gateway6() netip.Addr { return n.PodAddr6(1) }

// Subnet4 is the node's IPv4 pod subnet.
func (n *Node) Subnet4() string { return fmt.Sprintf("10.%d.%d.0/24", n.topo.slot, n.Index) }

// Subnet6 is the node's IPv6 pod subnet.
func (n *Node) Subnet6() string { return fmt.Sprintf("fd00:%d:%d::/64", n.topo.slot, n.Index) }

// takeSlot locks one of 64 address slots for the test's life.
func takeSlot(t TB) int {
	t.Helper()
	const dir = "/run/redirector-netnstest"
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatalf("slot dir: %v", err)
	}
	for _, i := range rand.Perm(64) {
		slot := 100 + i
		f, err := os.OpenFile(filepath.Join(dir, fmt.Sprintf("slot-%d", slot)), os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			t.Fatalf("slot file: %v", err)
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
			continue
		}
		t.Cleanup(func() { f.Close() }) // closing releases the lock
		return slot
	}
	t.Fatalf("all 64 address slots of simulated topologies are in use")
	return 0
}

// Pod returns the first pod named name on any node.
func (tp *Topology) Pod(name string) *Pod {
	for _, n := range tp.Nodes {
		for _, p := range n.Pods {
			if p.Name == name {
				return p
			}
		}
	}
	return nil
}

func (tp *Topology) addNS(name string) {
	tp.t.Helper()
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		tp.t.Fatalf("ip netns add %s: %v: %s", name, err, out)
	}
	tp.ip(name, "link", "set", "lo", "up")
}

// AddAddr adds the address prefix (such as 10.0.0.2/32) to the device dev
// of p, as a pod holding another's address would.
func (tp *Topology) AddAddr(p *Pod, prefix, dev string) {
	tp.t.Helper()
	tp.ip(p.NS, "addr", "add", prefix, "dev", dev)
}

func (tp *Topology) ip(ns string, args ...string) {
	tp.t.Helper()
	full := append([]string{"-n", ns}, args...)
	if out, err := exec.Command("ip", full...).CombinedOutput(); err != nil {
		tp.t.Fatalf("ip %s: %v: %s", strings.Join(full, " "), err, out)
	}
}

func (tp *Topology) sysctl(ns, key, value string) {
	tp.t.Helper()
	path := "/proc/sys/" + strings.ReplaceAll(key, ".", "/")
	if _, err := Exec(context.Background(), filepath.Join(NetNSDir, ns), "sh", "-c", "echo "+value+" > "+path); err != nil {
		tp.t.Fatalf("sysctl %s=%s in %s: %v", key, value, ns, err)
	}
}

func (tp *Topology) cleanup() {
	out, _ := exec.Command("ip", "netns", "list").Output()
	for _, line := range strings.Split(string(out), "\n") {
		name, _, _ := strings.Cut(strings.TrimSpace(line), " ")
		if strings.HasPrefix(name, tp.prefix+"-") {
			if o, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
				tp.t.Logf("cleanup: ip netns del %s: %v: %s", name, err, o)
			}
		}
	}
}

// Exec runs a command inside the network namespace at path (and only the
// network namespace: unlike `ip netns exec` it keeps the mounts, so bpffs and
// cgroups stay visible). It returns combined output.
func Exec(ctx context.Context, path string, name string, args ...string) ([]byte, error) {
	cmd := Command(ctx, path, name, args...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("%s %s in %s: %w: %s", name, strings.Join(args, " "), path, err, out)
	}
	return out, nil
}

// Command prepares a command to run inside the network namespace at path.
func Command(ctx context.Context, path, name string, args ...string) *exec.Cmd {
	full := append([]string{"--net=" + path, "--", name}, args...)
	cmd := exec.CommandContext(ctx, "nsenter", full...)
	cmd.WaitDelay = 5 * time.Second
	return cmd
}
