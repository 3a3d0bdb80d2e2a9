package istiotest

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	kjson "sigs.k8s.io/json"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/source/xds"
	"github.com/redirector-mesh/redirector/test/kubetest"
	"github.com/redirector-mesh/redirector/test/xdstest"
)

// TestPolicyDifferential applies the same random PeerAuthentications and
// AuthorizationPolicies to a real API server and compares, for every pod,
// port and peer, the agent's two readings of them:
//
//   - the file and Kubernetes sources': the objects as read back from the
//     API server, decided by policy.EffectiveMode and policy.Authorize;
//   - istiod's: what istiod sends a ztunnel for them (Authorization
//     resources and each workload's policy keys), translated by the xDS
//     source and decided by policy.CompiledSet.
//
// Where the first admits what the second refuses, a cluster using the
// Kubernetes source lets through what Istio refuses (a policy bypass);
// the other way round it refuses what Istio admits (an outage). Both fail
// the test, except the divergences documented as deliberately stricter
// than ztunnel, which the generator does not write.
//
// POLICYDIFF_SEED and POLICYDIFF_ROUNDS explore further.
func TestPolicyDifferential(t *testing.T) {
	seed := uint64(1)
	if s := os.Getenv("POLICYDIFF_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	rounds := 3
	if s := os.Getenv("POLICYDIFF_ROUNDS"); s != "" {
		rounds, _ = strconv.Atoi(s)
	}
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	d := startDiff(t)
	ctx, cs, dyn := context.Background(), d.cs, d.dyn

	var pas []policy.PeerAuthentication
	var aps []policy.AuthorizationPolicy
	const nsPerRound, podsPerNS = 8, 3
	for round := range rounds {
		g := &gen{rng: rng, round: round}
		// The mesh level: replaced each round.
		if round > 0 {
			for _, kind := range []string{"peerauthentications", "authorizationpolicies"} {
				list, err := dyn.Resource(diffGVR(kind)).Namespace(Namespace).List(ctx, metav1.ListOptions{})
				if err != nil {
					t.Fatal(err)
				}
				for _, o := range list.Items {
					if err := dyn.Resource(diffGVR(kind)).Namespace(Namespace).Delete(ctx, o.GetName(), metav1.DeleteOptions{}); err != nil {
						t.Fatal(err)
					}
				}
			}
			pas = slices.DeleteFunc(pas, func(p policy.PeerAuthentication) bool { return p.Namespace == Namespace })
			aps = slices.DeleteFunc(aps, func(p policy.AuthorizationPolicy) bool { return p.Namespace == Namespace })
		}
		if rng.IntN(4) > 0 {
			pa := policy.PeerAuthentication{Meta: policy.Meta{Namespace: Namespace, Name: fmt.Sprintf("mesh-%d", round)},
				Spec: policy.PeerAuthenticationSpec{MTLS: &policy.MTLS{Mode: g.mode()}}}
			if p, ok := createPolicy(t, dyn, "peerauthentications", pa.Meta, pa.Spec); ok {
				pas = append(pas, p.(policy.PeerAuthentication))
			}
		}
		for i := range rng.IntN(3) {
			ap := g.authz(Namespace, fmt.Sprintf("root-%d-%d", round, i))
			if p, ok := createPolicy(t, dyn, "authorizationpolicies", ap.Meta, ap.Spec); ok {
				aps = append(aps, p.(policy.AuthorizationPolicy))
			}
		}
		var pods []diffPod
		for n := range nsPerRound {
			ns := fmt.Sprintf("r%dd%d", round, n)
			if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns,
				Labels: map[string]string{"istio.io/dataplane-mode": "ambient"}}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			for i := range rng.IntN(3) {
				pa := g.peerAuthn(ns, fmt.Sprintf("pa-%d", i))
				if p, ok := createPolicy(t, dyn, "peerauthentications", pa.Meta, pa.Spec); ok {
					pas = append(pas, p.(policy.PeerAuthentication))
				}
				time.Sleep(1100 * time.Millisecond) // distinct creation times: the oldest wins
			}
			for i := range rng.IntN(4) {
				ap := g.authz(ns, fmt.Sprintf("ap-%d", i))
				if p, ok := createPolicy(t, dyn, "authorizationpolicies", ap.Meta, ap.Spec); ok {
					aps = append(aps, p.(policy.AuthorizationPolicy))
				}
			}
			for i := range podsPerNS {
				p := CreatePod(t, cs, ns, fmt.Sprintf("p%d", i), fmt.Sprintf("sa%d", rng.IntN(2)), "node2", fmt.Sprintf("10.%d.%d.%d", 100+round, n, 10+i))
				p.Annotations = map[string]string{"ambient.istio.io/redirection": "enabled"}
				p.Labels = g.labels()
				if _, err := cs.CoreV1().Pods(ns).Update(ctx, p, metav1.UpdateOptions{}); err != nil {
					t.Fatal(err)
				}
				pods = append(pods, diffPod{ns: ns, name: p.Name, labels: p.Labels, addr: netip.MustParseAddr(p.Status.PodIP)})
			}
		}

		want := map[string]bool{}
		for _, ap := range aps {
			if a := ap.Spec.Action; (a == "" || a == policy.ActionAllow || a == policy.ActionDeny) && ap.Spec.TargetRef == nil && len(ap.Spec.TargetRefs) == 0 && !ap.DryRun() {
				want[ap.Namespace+"/"+ap.Name] = true
			}
		}
		last := d.settle(t, pods, want, 3*time.Second)
		bad := compare(t, pods, g.peers(), pas, aps, last)
		if len(bad) > 0 {
			// Not a slow istiod?
			last = d.settle(t, pods, want, 10*time.Second)
			bad = compare(t, pods, g.peers(), pas, aps, last)
		}
		if len(bad) > 0 {
			t.Errorf("round %d (seed %d): %d divergences; first ones:\n%s", round, seed, len(bad), strings.Join(bad[:min(len(bad), 12)], "\n"))
			dumpRound(t, round, pas, aps, last)
		}
	}
}

// diffEnv is an API server, istiod, and the xDS source's client of it as
// a node agent.
type diffEnv struct {
	cs    kubernetes.Interface
	dyn   dynamic.Interface
	snaps <-chan *xds.Snapshot
	last  *xds.Snapshot
}

func startDiff(t *testing.T) *diffEnv {
	cluster := kubetest.Start(t)
	istiod := Start(t, cluster, Options{TrustedNodeAccounts: []string{agentAccount}})
	cs, dyn := diffClients(t, cluster)

	token := AgentToken(t, cs, agentAccount, "node1", Audience)
	snaps := xdstest.Watch(t, istiod.Addr, istiod.RootCertFile, token,
		xds.Node{IP: netip.MustParseAddr("127.0.0.1"), PodName: "redirector-node1", PodNamespace: Namespace, NodeName: "node1", ClusterID: ClusterID})
	return &diffEnv{cs: cs, dyn: dyn, snaps: snaps}
}

// settle waits until the snapshot has every pod and every policy key in
// want, then until istiod has been quiet for quiet, and returns the last.
func (d *diffEnv) settle(t *testing.T, pods []diffPod, want map[string]bool, quiet time.Duration) *xds.Snapshot {
	t.Helper()
	ready := func(s *xds.Snapshot) bool {
		if s == nil {
			return false
		}
		have := map[string]bool{}
		for _, w := range s.Workloads {
			have[w.Namespace+"/"+w.Name] = true
		}
		for _, p := range s.Policies {
			have[p.Key()] = true
		}
		for _, p := range pods {
			if !have[p.ns+"/"+p.name] {
				return false
			}
		}
		for k := range want {
			if !have[k] {
				return false
			}
		}
		return true
	}
	deadline := time.After(180 * time.Second)
	for !ready(d.last) {
		select {
		case d.last = <-d.snaps:
		case <-deadline:
			t.Fatalf("istiod did not send every pod and policy")
		}
	}
	for {
		select {
		case d.last = <-d.snaps:
		case <-time.After(quiet):
			return d.last
		}
	}
}

// compare decides every pod, port and peer both ways and returns the
// divergences.
func compare(t *testing.T, pods []diffPod, peers []policy.Peer, pas []policy.PeerAuthentication, aps []policy.AuthorizationPolicy, last *xds.Snapshot) []string {
	t.Helper()
	var decided, allowed int
	defer func() {
		t.Logf("%d decisions, %d allowed both ways, %d policies from istiod", decided, allowed, len(last.Policies))
	}()
	set := &policy.CompiledSet{Synced: true, Policies: last.Policies, Selected: map[string][]string{}, Unresolved: last.Unresolved}
	for _, w := range last.Workloads {
		set.Selected[w.Namespace+"/"+w.Name] = w.Policies
	}
	var bad []string
	for _, p := range pods {
		for _, port := range []uint16{80, 8080, 9090} {
			for _, src := range peers {
				dst := policy.Target{Namespace: p.ns, Labels: p.labels, Port: port, Addr: p.addr}
				ours := policy.Authorize(aps, "", dst, src)
				if !src.Authenticated {
					if m := policy.EffectiveMode(pas, "", p.ns, p.labels, port); m.Strict() {
						ours = policy.Verdict{Reason: "STRICT: " + m.Source}
					}
				}
				// As ztunnel decides: a policy a workload lists but
				// istiod never sent is skipped (CompiledSet.Authorize
				// refuses instead, which is no bypass).
				istio := policy.AuthorizeCompiled(set.Policies, dst, set.Selected[p.ns+"/"+p.name], src)
				switch v := set.Authorize(dst, p.ns+"/"+p.name, src); {
				case v.Allowed && !istio.Allowed:
					bad = append(bad, fmt.Sprintf("CompiledSet admits what its policies refuse: %s/%s port %d from %q: %s", p.ns, p.name, port, src.Principal, v.Reason))
				case !v.Allowed && istio.Allowed && src.Authenticated:
					bad = append(bad, fmt.Sprintf("CompiledSet refuses an mTLS peer ztunnel admits: %s/%s port %d from %q: %s", p.ns, p.name, port, src.Principal, v.Reason))
				}
				decided++
				if ours.Allowed == istio.Allowed {
					if ours.Allowed {
						allowed++
					}
					continue
				}
				kind := "BYPASS (ours admits, istiod's refuses)"
				if !ours.Allowed {
					if missing(set, p) {
						// istiod lists a converted PeerAuthentication it
						// never sends (a STRICT port under a PERMISSIVE
						// workload policy and a STRICT mesh), so ztunnel
						// admits plaintext to that STRICT port: refusing
						// it is no outage.
						continue
					}
					kind = "outage (ours refuses, istiod's admits)"
				}
				bad = append(bad, fmt.Sprintf("%s: %s/%s %v labels %v port %d from %q@%s auth=%v:\n  ours:   %s\n  istiod: %s\n  selected %v",
					kind, p.ns, p.name, p.addr, p.labels, port, src.Principal, src.Addr, src.Authenticated, ours.Reason, istio.Reason, set.Selected[p.ns+"/"+p.name]))
			}
		}
	}
	return bad
}

// missing reports whether p's workload lists a policy istiod did not send.
func missing(set *policy.CompiledSet, p diffPod) bool {
	for _, k := range set.Selected[p.ns+"/"+p.name] {
		if !slices.ContainsFunc(set.Policies, func(c *policy.Compiled) bool { return c.Key() == k }) {
			return true
		}
	}
	return false
}

type diffPod struct {
	ns, name string
	labels   map[string]string
	addr     netip.Addr
}

func diffFind(s *xds.Snapshot, ns, name string) *xds.Workload {
	for _, w := range s.Workloads {
		if w.Namespace == ns && w.Name == name {
			return w
		}
	}
	return nil
}

func dumpRound(t *testing.T, round int, pas []policy.PeerAuthentication, aps []policy.AuthorizationPolicy, s *xds.Snapshot) {
	t.Helper()
	prefix := fmt.Sprintf("r%dd", round)
	for _, pa := range pas {
		if pa.Namespace == Namespace || strings.HasPrefix(pa.Namespace, prefix) {
			b, _ := json.Marshal(pa.Spec)
			t.Logf("PA %s/%s %s: %s", pa.Namespace, pa.Name, pa.CreationTimestamp.Format(time.TimeOnly), b)
		}
	}
	for _, ap := range aps {
		if ap.Namespace == Namespace || strings.HasPrefix(ap.Namespace, prefix) {
			b, _ := json.Marshal(ap.Spec)
			t.Logf("AP %s/%s: %s", ap.Namespace, ap.Name, b)
		}
	}
	for _, p := range s.Policies {
		if p.Namespace == Namespace || strings.HasPrefix(p.Namespace, prefix) {
			b, _ := json.Marshal(p)
			t.Logf("compiled %s: %s", p.Key(), b)
		}
	}
}

func diffGVR(resource string) schema.GroupVersionResource {
	return schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: resource}
}

// diffClients are clients of c that are not throttled (client-go's
// default is 5 requests a second), to make hundreds of objects.
func diffClients(t *testing.T, c *kubetest.Cluster) (kubernetes.Interface, dynamic.Interface) {
	t.Helper()
	rc, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	rc.QPS, rc.Burst = 1000, 1000
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	d, err := dynamic.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	return cs, d
}

// createPolicy creates the object and returns it as the Kubernetes source
// decodes what the API server holds; ok is false if the API server
// refused it (the generator wrote what Istio's schema rejects).
func createPolicy(t *testing.T, d dynamic.Interface, resource string, meta policy.Meta, spec any) (any, bool) {
	t.Helper()
	p, refused, err := createPolicyErr(d, resource, meta, spec)
	if err != nil {
		t.Fatal(err)
	}
	if refused != nil {
		t.Logf("refused by the API server (left out): %v", refused)
		return nil, false
	}
	return p, true
}

// createPolicyErr is createPolicy for any goroutine: refused is the API
// server's refusal, err anything else.
func createPolicyErr(d dynamic.Interface, resource string, meta policy.Meta, spec any) (p any, refused, err error) {
	b, err := json.Marshal(spec)
	if err != nil {
		return nil, nil, err
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, nil, err
	}
	kind := map[string]string{"peerauthentications": "PeerAuthentication", "authorizationpolicies": "AuthorizationPolicy"}[resource]
	obj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "security.istio.io/v1", "kind": kind,
		"metadata": map[string]any{"name": meta.Name, "namespace": meta.Namespace, "annotations": toAny(meta.Annotations)}, "spec": m}}
	got, err := d.Resource(diffGVR(resource)).Namespace(meta.Namespace).Create(context.Background(), obj, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("%s %s/%s %s: %w", kind, meta.Namespace, meta.Name, b, err), nil
	}
	raw, err := got.MarshalJSON()
	if err != nil {
		return nil, nil, err
	}
	if resource == "peerauthentications" {
		var pa policy.PeerAuthentication
		err = kjson.UnmarshalCaseSensitivePreserveInts(raw, &pa)
		return pa, nil, err
	}
	var ap policy.AuthorizationPolicy
	err = kjson.UnmarshalCaseSensitivePreserveInts(raw, &ap)
	return ap, nil, err
}

func toAny(m map[string]string) map[string]any {
	out := map[string]any{}
	for k, v := range m {
		out[k] = v
	}
	return out
}

// gen writes random policies from small pools of values, so that they
// overlap the pods and peers often.
type gen struct {
	rng   *rand.Rand
	round int
}

func (g *gen) pick(vals ...string) string { return vals[g.rng.IntN(len(vals))] }

// some picks 1 or 2 values.
func (g *gen) some(vals ...string) []string {
	out := []string{g.pick(vals...)}
	if g.rng.IntN(3) == 0 {
		out = append(out, g.pick(vals...))
	}
	return out
}

func (g *gen) ns(i int) string { return fmt.Sprintf("r%dd%d", g.round, i) }

func (g *gen) mode() policy.MTLSMode {
	return policy.MTLSMode(g.pick("", "UNSET", "STRICT", "STRICT", "PERMISSIVE", "DISABLE"))
}

func (g *gen) labels() map[string]string {
	switch g.rng.IntN(5) {
	case 0:
		return map[string]string{"app": "a"}
	case 1:
		return map[string]string{"app": "b", "tier": "x"}
	case 2:
		return map[string]string{"app": "a", "tier": "x"}
	case 3:
		return map[string]string{"other": "y"}
	}
	return nil
}

func (g *gen) selector() *policy.WorkloadSelector {
	switch g.rng.IntN(5) {
	case 0:
		return &policy.WorkloadSelector{MatchLabels: map[string]string{"app": "a"}}
	case 1:
		return &policy.WorkloadSelector{MatchLabels: map[string]string{"tier": "x"}}
	case 2:
		return &policy.WorkloadSelector{MatchLabels: map[string]string{"app": "b"}}
	}
	return nil
}

func (g *gen) peerAuthn(ns, name string) policy.PeerAuthentication {
	pa := policy.PeerAuthentication{Meta: policy.Meta{Namespace: ns, Name: name}}
	if m := g.mode(); m != "" || g.rng.IntN(2) == 0 {
		pa.Spec.MTLS = &policy.MTLS{Mode: m}
	}
	pa.Spec.Selector = g.selector()
	if pa.Spec.Selector == nil && g.rng.IntN(4) == 0 {
		pa.Spec.Selector = &policy.WorkloadSelector{} // namespace-wide too, but istiod converts against it differently
	}
	if pa.Spec.Selector != nil && len(pa.Spec.Selector.MatchLabels) > 0 && g.rng.IntN(2) == 0 {
		pa.Spec.PortLevelMTLS = map[uint32]policy.MTLS{}
		for range 1 + g.rng.IntN(2) {
			port, _ := strconv.Atoi(g.pick("80", "8080"))
			pa.Spec.PortLevelMTLS[uint32(port)] = policy.MTLS{Mode: policy.MTLSMode(g.pick("UNSET", "STRICT", "PERMISSIVE", "DISABLE"))}
		}
	}
	return pa
}

func (g *gen) authz(ns, name string) policy.AuthorizationPolicy {
	ap := policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: ns, Name: name}}
	ap.Spec.Selector = g.selector()
	ap.Spec.Action = policy.Action(g.pick("", "ALLOW", "ALLOW", "DENY", "DENY", "AUDIT"))
	switch g.rng.IntN(10) {
	case 0:
		if ap.Spec.Action != policy.ActionDeny {
			// Not enforced, as istiod sends it (a DENY one denies in
			// the whole scope here, deliberately stricter).
			ap.Spec.Selector = &policy.WorkloadSelector{}
		}
	case 1:
		ap.Spec.Selector = nil
		ap.Spec.TargetRefs = []policy.PolicyTargetReference{{Kind: "Service", Group: "", Name: "svc"}}
	}
	if g.rng.IntN(12) == 0 {
		ap.Annotations = map[string]string{policy.DryRunAnnotation: "true"}
	}
	for range g.rng.IntN(3) {
		ap.Spec.Rules = append(ap.Spec.Rules, g.rule(ap.Spec.Action == policy.ActionDeny))
	}
	return ap
}

func (g *gen) rule(deny bool) policy.Rule {
	var r policy.Rule
	for range g.rng.IntN(3) {
		var s policy.Source
		for range 1 + g.rng.IntN(2) {
			switch g.rng.IntN(9) {
			case 0:
				s.Principals = g.some("cluster.local/ns/"+g.ns(0)+"/sa/sa0", "*", "spiffe://cluster.local/ns/"+g.ns(0)+"/sa/sa0", "cluster.local/ns/"+g.ns(1)+"/*", "*/sa/sa1", "other.td/*")
			case 1:
				s.NotPrincipals = g.some("cluster.local/ns/"+g.ns(0)+"/sa/sa0", "*", "*/sa/sa1")
			case 2:
				s.Namespaces = g.some(g.ns(0), g.ns(1), "*", "r*", "*1")
			case 3:
				s.NotNamespaces = g.some(g.ns(0), g.ns(1), "*")
			case 4, 5:
				if len(s.Principals)+len(s.NotPrincipals)+len(s.Namespaces)+len(s.NotNamespaces) == 0 {
					s.ServiceAccounts = g.some("sa0", "sa1", g.ns(1)+"/sa0")
					if g.rng.IntN(3) == 0 {
						s.NotServiceAccounts = g.some("sa1", g.ns(0)+"/sa1")
					}
				}
			case 6:
				s.IPBlocks = g.some("10.200.0.0/16", "10.200.1.1", "192.168.0.0/16")
			case 7:
				s.NotIPBlocks = g.some("10.200.1.0/24", "192.168.1.1")
			case 8:
				if !deny {
					s.RequestPrincipals = []string{"*"}
				}
			}
		}
		if len(s.ServiceAccounts)+len(s.NotServiceAccounts) > 0 {
			s.Principals, s.NotPrincipals, s.Namespaces, s.NotNamespaces = nil, nil, nil, nil
		}
		if reflectEmpty(s) {
			s.Namespaces = []string{g.ns(0)}
		}
		r.From = append(r.From, policy.From{Source: &s})
	}
	for range g.rng.IntN(3) {
		var o policy.Operation
		switch g.rng.IntN(4) {
		case 0, 1:
			o.Ports = g.some("80", "8080", "9090")
		case 2:
			o.NotPorts = g.some("80", "9090")
		case 3:
			if deny {
				o.Ports = []string{"8080"}
			} else {
				o.Methods = []string{"GET"}
			}
		}
		r.To = append(r.To, policy.To{Operation: &o})
	}
	for range g.rng.IntN(2) {
		var w policy.Condition
		switch g.rng.IntN(7) {
		case 0:
			w = policy.Condition{Key: "source.ip", Values: g.some("10.200.0.0/16", "192.168.1.1")}
			if g.rng.IntN(2) == 0 {
				w.NotValues = []string{"10.200.1.1"}
			}
		case 1:
			w = policy.Condition{Key: "source.namespace", NotValues: g.some(g.ns(0), g.ns(2))}
		case 2:
			w = policy.Condition{Key: "source.principal", Values: g.some("cluster.local/ns/"+g.ns(0)+"/sa/sa0", "*")}
		case 3:
			w = policy.Condition{Key: "destination.port", Values: g.some("80", "8080")}
		case 4:
			w = policy.Condition{Key: "destination.port", NotValues: g.some("9090")}
		case 5:
			w = policy.Condition{Key: "destination.ip", Values: g.some(fmt.Sprintf("10.%d.0.0/16", 100+g.round), fmt.Sprintf("10.%d.1.10", 100+g.round))}
		case 6:
			if deny {
				w = policy.Condition{Key: "destination.ip", NotValues: []string{fmt.Sprintf("10.%d.2.0/24", 100+g.round)}}
			} else {
				w = policy.Condition{Key: "request.headers[x-a]", Values: []string{"b"}}
			}
		}
		r.When = append(r.When, w)
	}
	return r
}

func reflectEmpty(s policy.Source) bool {
	b, _ := json.Marshal(s)
	return string(b) == "{}"
}

// peers are the sources tried against every pod: plaintext ones, and
// identities in the round's namespaces and elsewhere.
func (g *gen) peers() []policy.Peer {
	addrs := []netip.Addr{netip.MustParseAddr("10.200.1.1"), netip.MustParseAddr("10.200.2.2"), netip.MustParseAddr("192.168.1.1")}
	var out []policy.Peer
	for _, a := range addrs {
		out = append(out, policy.Peer{Addr: a})
	}
	for i, p := range []string{
		"cluster.local/ns/" + g.ns(0) + "/sa/sa0", "cluster.local/ns/" + g.ns(0) + "/sa/sa1",
		"cluster.local/ns/" + g.ns(1) + "/sa/sa0", "cluster.local/ns/" + g.ns(1) + "/sa/sa1",
		"cluster.local/ns/" + g.ns(2) + "/sa/sa1", "cluster.local/ns/elsewhere/sa/sa0",
		"other.td/ns/" + g.ns(1) + "/sa/sa1",
	} {
		ns := strings.Split(p, "/")[2]
		out = append(out, policy.Peer{Authenticated: true, Principal: p, Namespace: ns, Addr: addrs[i%len(addrs)]})
	}
	return out
}

// TestPeerAuthnDifferential compares the two readings (see
// TestPolicyDifferential) of combinations of mesh, namespace and workload
// PeerAuthentication modes and two ports' portLevelMtls, for a plaintext
// and an mTLS peer. POLICYDIFF_FULL=1 tries UNSET on ports too (twice the
// namespaces).
func TestPeerAuthnDifferential(t *testing.T) {
	d := startDiff(t)
	ctx := context.Background()
	modes := []string{"", "UNSET", "STRICT", "PERMISSIVE", "DISABLE"} // "": no policy
	workloadModes := append([]string{"-"}, modes...)                  // "-": no workload policy; "": one without mtls
	portModes := []string{"", "STRICT", "PERMISSIVE", "DISABLE"}      // "": no entry for the port
	if os.Getenv("POLICYDIFF_FULL") != "" {
		portModes = append(portModes, "UNSET")
	}
	peers := []policy.Peer{{Addr: netip.MustParseAddr("10.200.1.1")},
		{Authenticated: true, Principal: "cluster.local/ns/x/sa/y", Namespace: "x", Addr: netip.MustParseAddr("10.200.1.2")}}
	var pas []policy.PeerAuthentication
	for round, root := range modes {
		list, err := d.dyn.Resource(diffGVR("peerauthentications")).Namespace(Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range list.Items {
			if err := d.dyn.Resource(diffGVR("peerauthentications")).Namespace(Namespace).Delete(ctx, o.GetName(), metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		pas = slices.DeleteFunc(pas, func(p policy.PeerAuthentication) bool { return p.Namespace == Namespace })
		if root != "" {
			pa := policy.PeerAuthentication{Meta: policy.Meta{Namespace: Namespace, Name: "mesh"}, Spec: policy.PeerAuthenticationSpec{MTLS: &policy.MTLS{Mode: policy.MTLSMode(root)}}}
			p, ok := createPolicy(t, d.dyn, "peerauthentications", pa.Meta, pa.Spec)
			if !ok {
				t.Fatal("mesh PeerAuthentication refused")
			}
			pas = append(pas, p.(policy.PeerAuthentication))
		}
		// One namespace per combination, each with one pod, made by
		// workers (the API server takes them in parallel).
		type combo struct {
			ns       string
			policies []policy.PeerAuthentication
			pod      diffPod
		}
		var combos []combo
		for ni, nsMode := range modes {
			for wi, wMode := range workloadModes {
				for pi, p80 := range portModes {
					for pj, p8080 := range portModes {
						if wMode == "-" && pi+pj > 0 {
							continue
						}
						c := combo{ns: fmt.Sprintf("pa%d-%d-%d-%d-%d", round, ni, wi, pi, pj)}
						if nsMode != "" {
							c.policies = append(c.policies, policy.PeerAuthentication{Meta: policy.Meta{Namespace: c.ns, Name: "ns"},
								Spec: policy.PeerAuthenticationSpec{MTLS: &policy.MTLS{Mode: policy.MTLSMode(nsMode)}}})
						}
						if wMode != "-" {
							pa := policy.PeerAuthentication{Meta: policy.Meta{Namespace: c.ns, Name: "wl"},
								Spec: policy.PeerAuthenticationSpec{Selector: &policy.WorkloadSelector{MatchLabels: map[string]string{"app": "a"}}}}
							if wMode != "" {
								pa.Spec.MTLS = &policy.MTLS{Mode: policy.MTLSMode(wMode)}
							}
							for port, m := range map[uint32]string{80: p80, 8080: p8080} {
								if m == "" {
									continue
								}
								if pa.Spec.PortLevelMTLS == nil {
									pa.Spec.PortLevelMTLS = map[uint32]policy.MTLS{}
								}
								pa.Spec.PortLevelMTLS[port] = policy.MTLS{Mode: policy.MTLSMode(m)}
							}
							c.policies = append(c.policies, pa)
						}
						n := len(combos) + 1
						c.pod = diffPod{ns: c.ns, name: "p0", labels: map[string]string{"app": "a"},
							addr: netip.MustParseAddr(fmt.Sprintf("10.%d.%d.%d", 110+round, n/250, 1+n%250))}
						combos = append(combos, c)
					}
				}
			}
		}
		var (
			mu   sync.Mutex
			wg   sync.WaitGroup
			errs []error
			work = make(chan combo)
		)
		for range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for c := range work {
					err := createNamespace(d.cs, c.ns)
					var made []policy.PeerAuthentication
					for _, pa := range c.policies {
						if err != nil {
							break
						}
						var p any
						var refused error
						p, refused, err = createPolicyErr(d.dyn, "peerauthentications", pa.Meta, pa.Spec)
						err = cmp.Or(err, refused)
						if err == nil {
							made = append(made, p.(policy.PeerAuthentication))
						}
					}
					if err == nil {
						err = createPod(d.cs, c.pod)
					}
					mu.Lock()
					pas = append(pas, made...)
					if err != nil {
						errs = append(errs, err)
					}
					mu.Unlock()
				}
			}()
		}
		for _, c := range combos {
			work <- c
		}
		close(work)
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		pods := make([]diffPod, len(combos))
		for i, c := range combos {
			pods[i] = c.pod
		}
		t.Logf("round %d (mesh %q): %d namespaces", round, root, len(pods))
		last := d.settle(t, pods, nil, 3*time.Second)
		bad := compare(t, pods, peers, pas, nil, last)
		if len(bad) > 0 {
			last = d.settle(t, pods, nil, 10*time.Second) // not a slow istiod?
			bad = compare(t, pods, peers, pas, nil, last)
		}
		if len(bad) > 0 {
			slices.Sort(bad)
			t.Errorf("mesh mode %q: %d divergences:\n%s", root, len(bad), strings.Join(bad[:min(len(bad), 40)], "\n"))
		}
	}
}

// createNamespace makes an ambient namespace.
func createNamespace(cs kubernetes.Interface, ns string) error {
	_, err := cs.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns,
		Labels: map[string]string{"istio.io/dataplane-mode": "ambient"}}}, metav1.CreateOptions{})
	return err
}

// createPod makes p's pod, enrolled (as an agent marks it), running as
// sa0 on node2 at p.addr.
func createPod(cs kubernetes.Interface, p diffPod) error {
	ctx := context.Background()
	if _, err := cs.CoreV1().ServiceAccounts(p.ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "sa0"}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	pod, err := cs.CoreV1().Pods(p.ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: p.ns, Labels: p.labels,
			Annotations: map[string]string{"ambient.istio.io/redirection": "enabled"}},
		Spec: corev1.PodSpec{NodeName: "node2", ServiceAccountName: "sa0", Containers: []corev1.Container{{Name: "app", Image: "app"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: p.addr.String(), PodIPs: []corev1.PodIP{{IP: p.addr.String()}}}
	_, err = cs.CoreV1().Pods(p.ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{})
	return err
}
