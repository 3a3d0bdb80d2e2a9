package tunnel

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/policy"
)

// TestPolicyChangeRecheckCostIndependentOfOtherPolicies: a policy change
// re-decides every open inbound connection, under the lock that orders
// updates. Each decision walks only the policies that can apply to its
// pod, from an index made once per state: before, every connection walked
// every policy of the mesh, and every selected key every policy again, so
// with 200k policies in other namespaces (the xDS source's bound) and 500
// selecting the pod, one change of any tenant's policy held the update
// path for minutes per 1000 open connections (a few seconds per
// connection). Built per connection instead of per state, the index costs
// what the walk did.
func TestPolicyChangeRecheckCostIndependentOfOtherPolicies(t *testing.T) {
	const others, own, conns = 200000, 500, 1000
	tun := newTestTunnel(t, nil)
	server := podObj("mesh", "server", "server", "10.1.0.2", map[string]string{"app": "web"})
	dir := testDir(t, server)
	compiled := func(extra string) *policy.CompiledSet {
		var ps []*policy.Compiled
		var selected []string
		nobody := []policy.Group{{Clauses: []policy.Clause{{Matches: []policy.Match{{Principals: []policy.StringMatch{{Value: "nobody"}}}}}}}}
		for i := range others {
			ps = append(ps, &policy.Compiled{Name: fmt.Sprintf("p%06d", i), Namespace: fmt.Sprintf("tenant%03d", i%500),
				Scope: policy.ScopeNamespace, Action: policy.ActionDeny, Groups: nobody})
		}
		for i := range own {
			p := &policy.Compiled{Name: fmt.Sprintf("own%04d", i), Namespace: "mesh", Scope: policy.ScopeWorkloadSelector,
				Action: policy.ActionDeny, Groups: nobody}
			ps = append(ps, p)
			selected = append(selected, p.Key())
		}
		ps = append(ps, &policy.Compiled{Name: extra, Namespace: "tenant000", Scope: policy.ScopeNamespace, Action: policy.ActionDeny, Groups: nobody})
		policy.SortCompiled(ps)
		return &policy.CompiledSet{Synced: true, Policies: ps, Selected: map[string][]string{"mesh/server": selected}}
	}
	tun.Update(&State{Dir: dir, Compiled: compiled("first")})
	p := testPod(tun, server.Key(), netip.MustParseAddr("10.1.0.2"))
	peer := identity.ID{TrustDomain: "cluster.local", Namespace: "client", ServiceAccount: "client"}
	for i := range conns {
		ic := p.track(netip.MustParseAddrPort("10.1.0.2:8080"), netip.AddrPortFrom(netip.MustParseAddr("10.2.0.1"), uint16(10000+i)), peer, true)
		ic.connected(func() { t.Errorf("connection %d closed: the change denies nothing", i) })
	}

	next := compiled("second") // another tenant's policy changed
	start := time.Now()
	tun.Update(&State{Dir: dir, Compiled: next})
	// Some 0.1 s here, most of it comparing the two sets; minutes before.
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("a policy change re-deciding %d open connections took %v", conns, took)
	}
	st := tun.State()
	if _, why, detail, _ := tun.inboundVerdict(st, p, netip.MustParseAddrPort("10.1.0.2:8080"), netip.MustParseAddr("10.2.0.1"), peer, true); why != "" {
		t.Errorf("refused: %s (%s)", why, detail)
	}
}
