package admin

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TestZtunnelPoliciesShowWhatIsEnforced: the policies section says what
// the agent enforces, as istiod converts policies for ztunnel
// (pilot/pkg/serviceregistry/ambient/authorization.go): a source's
// serviceAccounts and notServiceAccounts are ztunnel's serviceAccounts
// matches ({namespace, serviceAccount}, a bare name in the policy's
// namespace), and an ALLOW rule with HTTP-only fields, which never matches,
// is left out (a DENY one keeps its L4 part, as enforced). Before, both
// conversions dropped the service accounts and the HTTP-only ALLOW rule
// was dumped as its L4 part: istioctl ztunnel-config policies -o json
// showed rules admitting any source, which the agent refuses.
func TestZtunnelPoliciesShowWhatIsEnforced(t *testing.T) {
	allowSA := policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: "mesh", Name: "allow-sa"},
		Spec: policy.AuthorizationPolicySpec{Rules: []policy.Rule{
			{From: []policy.From{{Source: &policy.Source{ServiceAccounts: []string{"client", "other/robot"}, NotServiceAccounts: []string{"mesh/bad"}}}}},
			{From: []policy.From{{Source: &policy.Source{Principals: []string{"cluster.local/ns/mesh/sa/web"}}}},
				To: []policy.To{{Operation: &policy.Operation{Methods: []string{"GET"}}}}},
		}}}
	denyL7 := policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: "mesh", Name: "deny-l7"},
		Spec: policy.AuthorizationPolicySpec{Action: policy.ActionDeny, Rules: []policy.Rule{
			{From: []policy.From{{Source: &policy.Source{Principals: []string{"cluster.local/ns/mesh/sa/web"}}}},
				To: []policy.To{{Operation: &policy.Operation{Methods: []string{"DELETE"}}}}},
		}}}
	got := ZtunnelPolicies([]policy.AuthorizationPolicy{allowSA, denyL7}, "istio-system")
	if len(got) != 2 {
		t.Fatalf("%d policies, want 2: %+v", len(got), got)
	}
	b, _ := json.Marshal(got[0].Rules)
	want := `[[[{"serviceAccounts":[{"namespace":"mesh","serviceAccount":"client"},{"namespace":"other","serviceAccount":"robot"}],"notServiceAccounts":[{"namespace":"mesh","serviceAccount":"bad"}]}]]]`
	if string(b) != want {
		t.Errorf("allow-sa rules\n got %s\nwant %s (the HTTP-only rule left out)", b, want)
	}
	if b, _ = json.Marshal(got[1].Rules); !strings.Contains(string(b), `"principals":[{"Exact":"cluster.local/ns/mesh/sa/web"}]`) {
		t.Errorf("deny-l7 rules %s, want its L4 part kept", b)
	}

	set := &policy.CompiledSet{Synced: true, Policies: []*policy.Compiled{{Name: "c", Namespace: "mesh", Scope: policy.ScopeNamespace, Action: policy.ActionAllow,
		Groups: []policy.Group{{Clauses: []policy.Clause{{Matches: []policy.Match{{
			ServiceAccounts:    []policy.ServiceAccountRef{{Namespace: "mesh", Name: "client"}},
			NotServiceAccounts: []policy.ServiceAccountRef{{Namespace: "mesh", Name: "bad"}},
		}}}}}}}}}
	b, _ = json.Marshal(ZtunnelCompiledPolicies(set)[0].Rules)
	if want := `[[[{"serviceAccounts":[{"namespace":"mesh","serviceAccount":"client"}],"notServiceAccounts":[{"namespace":"mesh","serviceAccount":"bad"}]}]]]`; string(b) != want {
		t.Errorf("compiled rules\n got %s\nwant %s", b, want)
	}
}

// TestZtunnelDumpEmptyVersusMissing: fields ztunnel always writes are
// written, and those it leaves out when empty are left out: a policy's
// dryRun (a plain bool in ztunnel's Authorization) is there when false;
// a workload's locality is absent when unknown and, when known, carries
// region, zone and subzone, as ztunnel's Locality does. Before, dryRun was
// missing unless true and an unknown locality was written as {}.
func TestZtunnelDumpEmptyVersusMissing(t *testing.T) {
	b, _ := json.Marshal(ZtunnelPolicies([]policy.AuthorizationPolicy{{Meta: policy.Meta{Namespace: "mesh", Name: "p"}}}, "istio-system"))
	if !strings.Contains(string(b), `"dryRun":false`) {
		t.Errorf("policy without dry run: %s, want \"dryRun\":false", b)
	}
	dir, _ := workload.NewDirectory([]*workload.Workload{
		{Name: "nowhere", Namespace: "mesh", UID: "u1"},
		{Name: "somewhere", Namespace: "mesh", UID: "u2", Region: "eu", Zone: "eu-1"},
	}, nil)
	b, _ = json.Marshal(ZtunnelWorkloads(dir, "Kubernetes", "", "cluster.local"))
	if strings.Contains(string(b), `"locality":{}`) || !strings.Contains(string(b), `"locality":{"region":"eu","zone":"eu-1","subzone":""}`) {
		t.Errorf("workloads %s: want no locality when unknown, region, zone and subzone when known", b)
	}
}
