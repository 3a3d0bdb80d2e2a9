package admin

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

func TestZtunnelCertificates(t *testing.T) {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	nb, na := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC), time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(0xabcdef), NotBefore: nb, NotAfter: na}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	p := string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	got := ZtunnelCertificates([]CertRow{
		{Identity: "spiffe://cluster.local/ns/a/sa/b", State: "valid", Chain: []ChainCert{{PEM: p}}},
		{Identity: "spiffe://cluster.local/ns/a/sa/c", State: "pending"},
		{Identity: "spiffe://cluster.local/ns/a/sa/d", State: "failing", LastError: "istiod unreachable"},
	}, nil)
	if len(got) != 3 || got[0].State != "Available" || got[1].State != "Initializing" || got[2].State != "Unavailable: istiod unreachable" {
		t.Fatalf("states: %+v", got)
	}
	c := got[0].CertChain[0]
	// istioctl reads the serial in base 10 and the times as RFC 3339.
	if c.SerialNumber != "11259375" || c.ValidFrom != "2026-12-01T10:00:00Z" || c.ExpirationTime != "2026-12-02T10:00:00Z" {
		t.Errorf("cert %+v", c)
	}
}

func TestZtunnelPolicies(t *testing.T) {
	ap := policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: "mesh", Name: "p"},
		Spec: policy.AuthorizationPolicySpec{Action: policy.ActionDeny, Rules: []policy.Rule{{
			From: []policy.From{{Source: &policy.Source{Principals: []string{"*", "cluster.local/ns/x/*", "*/sa/y", "exact"}}}},
			To:   []policy.To{{Operation: &policy.Operation{Ports: []string{"9091"}}}},
			When: []policy.Condition{{Key: "source.ip", Values: []string{"10.0.0.0/8"}}},
		}}}}
	waypoint := ap
	waypoint.Name, waypoint.Spec.TargetRef = "w", &policy.PolicyTargetReference{Kind: "Gateway", Name: "wp"}
	global := policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: "istio-system", Name: "g"}}
	dryRun := global
	dryRun.Name, dryRun.Annotations = "dry", map[string]string{policy.DryRunAnnotation: "true"}
	noLabels := global
	noLabels.Name, noLabels.Namespace, noLabels.Spec.Selector = "empty-selector", "mesh", &policy.WorkloadSelector{}
	got := ZtunnelPolicies([]policy.AuthorizationPolicy{ap, waypoint, global, dryRun, noLabels}, "istio-system")
	if len(got) != 3 || got[0].Action != "Deny" || got[0].Scope != "Namespace" || got[1].Scope != "Global" || got[1].Action != "Allow" ||
		got[0].DryRun || got[1].DryRun || got[2].Name != "dry" || !got[2].DryRun {
		t.Fatalf("want mesh/p, istio-system/g and the dry run marked; waypoint and label-less ALLOW left out: %+v", got)
	}
	b, _ := json.Marshal(got[0].Rules)
	want := `[[[{"principals":[{"Presence":{}},{"Prefix":"cluster.local/ns/x/"},{"Suffix":"/sa/y"},{"Exact":"exact"}]}],[{"destinationPorts":[9091]}],[{"sourceIps":["10.0.0.0/8"]}]]]`
	if string(b) != want {
		t.Errorf("rules\n got %s\nwant %s", b, want)
	}

	set := &policy.CompiledSet{Synced: true, Policies: []*policy.Compiled{{Name: "c", Namespace: "mesh", Scope: policy.ScopeWorkloadSelector, Action: policy.ActionAllow,
		Groups: []policy.Group{{Clauses: []policy.Clause{{Matches: []policy.Match{{NotPrincipals: []policy.StringMatch{{Kind: policy.MatchPresence}}}}}}}}}}}
	cg := ZtunnelCompiledPolicies(set)
	b, _ = json.Marshal(cg)
	if !strings.Contains(string(b), `"scope":"WorkloadSelector","action":"Allow","rules":[[[{"notPrincipals":[{"Presence":{}}]}]]]`) {
		t.Errorf("compiled: %s", b)
	}
	set.Policies[0].DryRun = true
	if b, _ = json.Marshal(ZtunnelCompiledPolicies(set)); !strings.Contains(string(b), `"dryRun":true`) {
		t.Errorf("compiled dry run not marked: %s", b)
	}
}
