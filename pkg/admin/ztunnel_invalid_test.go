package admin

import (
	"encoding/json"
	"net/netip"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

// TestZtunnelPoliciesShowInvalidAsEnforced: an invalid AuthorizationPolicy
// (a field this agent does not know, as a newer Istio's CRD can carry; a
// bad value; an unknown action) is enforced failing closed: an ALLOW
// admits nothing, a DENY or unknown action denies every connection it
// selects. The dump, which istioctl ztunnel-config policies and Kiali
// read, showed an invalid ALLOW's rules as written (admitting the sources
// the agent refuses), an invalid DENY's as written (denying a few sources
// where the agent denies all) and left a policy with an unknown action out
// (no policy listed where every connection is denied). Each is now listed
// as enforced, in ztunnel's terms: an ALLOW with no rule matches nothing,
// a Deny with one rule of no clause matches every connection.
func TestZtunnelPoliciesShowInvalidAsEnforced(t *testing.T) {
	web := &policy.Source{Principals: []string{"cluster.local/ns/mesh/sa/web"}}
	allowNew := policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: "mesh", Name: "allow-newer-field"}, Unrecognized: "spec.rules[0].from[0].source.newField",
		Spec: policy.AuthorizationPolicySpec{Rules: []policy.Rule{{From: []policy.From{{Source: web}}}}}}
	denyBad := policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: "mesh", Name: "deny-bad-block"},
		Spec: policy.AuthorizationPolicySpec{Action: policy.ActionDeny, Rules: []policy.Rule{{From: []policy.From{{Source: &policy.Source{IPBlocks: []string{"10.0.0.0/33"}}}}}}}}
	unknown := policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: "mesh", Name: "reject"},
		Spec: policy.AuthorizationPolicySpec{Action: "REJECT", Rules: []policy.Rule{{From: []policy.From{{Source: web}}}}}}
	audit := policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: "mesh", Name: "audit"}, Spec: policy.AuthorizationPolicySpec{Action: policy.ActionAudit, Rules: []policy.Rule{{}}}}

	dst := policy.Target{Namespace: "mesh", Port: 8080}
	web1 := policy.Peer{Principal: "cluster.local/ns/mesh/sa/web", Authenticated: true, Addr: netip.MustParseAddr("10.1.0.1")}
	other := policy.Peer{Principal: "cluster.local/ns/mesh/sa/other", Authenticated: true, Addr: netip.MustParseAddr("10.2.0.1")}
	for _, tc := range []struct {
		ap         policy.AuthorizationPolicy
		action     string
		rules      string
		webAllowed bool
	}{
		{allowNew, "Allow", `[]`, false},
		{denyBad, "Deny", `[[]]`, false},
		{unknown, "Deny", `[[]]`, false},
	} {
		aps := []policy.AuthorizationPolicy{tc.ap, audit}
		// What the agent enforces.
		if v := policy.Authorize(aps, "istio-system", dst, web1); v.Allowed != tc.webAllowed {
			t.Fatalf("%s: web allowed %v (%s)", tc.ap.Name, v.Allowed, v.Reason)
		}
		if v := policy.Authorize(aps, "istio-system", dst, other); v.Allowed {
			t.Fatalf("%s: other allowed (%s)", tc.ap.Name, v.Reason)
		}
		got := ZtunnelPolicies(aps, "istio-system")
		if len(got) != 1 {
			t.Errorf("%s: %d policies listed, want 1 (AUDIT is not enforced): %+v", tc.ap.Name, len(got), got)
			continue
		}
		rules, _ := json.Marshal(got[0].Rules)
		if got[0].Action != tc.action || string(rules) != tc.rules {
			t.Errorf("%s: listed as %s with rules %s, want %s with rules %s: what is enforced", tc.ap.Name, got[0].Action, rules, tc.action, tc.rules)
		}
	}
}

// TestZtunnelCompiledPoliciesShowAmbiguousShapesAsEnforced: istiod can
// send a match with no condition (when every value of an entry was
// dropped) and a clause with no match; the agent reads both the way that
// can only deny more (policy.Compiled): never matching in an ALLOW, always
// in a DENY. The dump listed them as sent, where an ALLOW rule with an
// empty clause reads, in ztunnel's terms (a clause with no match is a
// match), as admitting every connection, which the agent refuses. They are
// now listed as enforced.
func TestZtunnelCompiledPoliciesShowAmbiguousShapesAsEnforced(t *testing.T) {
	x := policy.Match{Principals: []policy.StringMatch{{Value: "cluster.local/ns/mesh/sa/x"}}}
	y := policy.Match{Principals: []policy.StringMatch{{Value: "cluster.local/ns/mesh/sa/y"}}}
	set := &policy.CompiledSet{Synced: true, Policies: []*policy.Compiled{
		{Name: "allow", Namespace: "mesh", Scope: policy.ScopeNamespace, Action: policy.ActionAllow, Groups: []policy.Group{
			{Clauses: []policy.Clause{{}}},                               // never matches
			{Clauses: []policy.Clause{{Matches: []policy.Match{{}}}}},    // never matches
			{Clauses: []policy.Clause{{Matches: []policy.Match{{}, x}}}}, // x only
		}},
		{Name: "deny", Namespace: "mesh", Scope: policy.ScopeNamespace, Action: policy.ActionDeny, Groups: []policy.Group{
			{Clauses: []policy.Clause{{}, {Matches: []policy.Match{y}}}}, // y
			{Clauses: []policy.Clause{{Matches: []policy.Match{{}, y}}}}, // everything
		}},
	}}
	want := map[string]string{
		"allow": `[[[{"principals":[{"Exact":"cluster.local/ns/mesh/sa/x"}]}]]]`,
		"deny":  `[[[{"principals":[{"Exact":"cluster.local/ns/mesh/sa/y"}]}]],[]]`,
	}
	for _, z := range ZtunnelCompiledPolicies(set) {
		b, _ := json.Marshal(z.Rules)
		if string(b) != want[z.Name] {
			t.Errorf("%s: rules\n got %s\nwant %s", z.Name, b, want[z.Name])
		}
	}
}
