package kubernetes

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

func mustUnstructured(t *testing.T, manifest string) *unstructured.Unstructured {
	t.Helper()
	u := &unstructured.Unstructured{}
	if err := yaml.Unmarshal([]byte(manifest), &u.Object); err != nil {
		t.Fatal(err)
	}
	return u
}

func TestDecodePortLevelMTLS(t *testing.T) {
	u := mustUnstructured(t, `
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {namespace: ns, name: pa}
spec:
  selector: {matchLabels: {app: web}}
  mtls: {mode: STRICT}
  portLevelMtls: {"8080": {mode: DISABLE}}
`)
	pa, err := decode[policy.PeerAuthentication](u)
	if err != nil {
		t.Fatal(err)
	}
	if pa.Namespace != "ns" || pa.Spec.MTLS.Mode != policy.ModeStrict || pa.Unrecognized != "" ||
		pa.Spec.PortLevelMTLS[8080].Mode != policy.ModeDisable || pa.Spec.Selector.MatchLabels["app"] != "web" {
		t.Errorf("decoded %+v", pa)
	}
	if leftOut, err := checkSpec[policy.PeerAuthenticationSpec](u); leftOut || err != nil {
		t.Errorf("checkSpec = %v, %v; want false, nil", leftOut, err)
	}
}

// A field the policy types do not know is dropped in decoding; checkSpec must say so, since
// a rule without one of its conditions matches more than its author meant.
func TestCheckSpecReportsIgnoredFields(t *testing.T) {
	u := mustUnstructured(t, `
spec:
  action: ALLOW
  rules:
  - to:
    - operation: {ports: ["80"], methods: [GET], portRange: "80-90"}
`)
	leftOut, err := checkSpec[policy.AuthorizationPolicySpec](u)
	if leftOut || err == nil || !strings.Contains(err.Error(), "portRange") {
		t.Errorf("checkSpec = %v, %v; want false and an error naming portRange", leftOut, err)
	}
}

// TestDecodeUnknownFieldFailsClosed: a field the policy types do not know (a newer Istio's)
// is dropped by decoding, which would widen an ALLOW rule; the decoded policy is marked and
// fails closed instead of admitting more than written.
func TestDecodeUnknownFieldFailsClosed(t *testing.T) {
	u := mustUnstructured(t, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: shop, name: web-from-blue}
spec:
  rules:
  - from: [{source: {principals: ["*"], sourceLabels: {tier: blue}}}]
`)
	ap, err := decode[policy.AuthorizationPolicy](u)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(ap.Unrecognized, "sourceLabels") {
		t.Errorf("Unrecognized = %q, want it to name sourceLabels", ap.Unrecognized)
	}
	peer := policy.Peer{Principal: "cluster.local/ns/other/sa/x", Namespace: "other", Authenticated: true}
	if v := policy.Authorize([]policy.AuthorizationPolicy{*ap}, "", policy.Target{Namespace: "shop", Port: 80}, peer); v.Allowed {
		t.Errorf("allowed by a policy with an unknown field: %+v", v)
	}

	known := mustUnstructured(t, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: shop, name: ext, annotations: {istio.io/dry-run: "true"}}
spec:
  action: CUSTOM
  provider: {name: ext-authz}
  rules: [{from: [{source: {trustDomains: [cluster.local]}}]}]
`)
	ap, err = decode[policy.AuthorizationPolicy](known)
	if err != nil || ap.Unrecognized != "" || ap.Spec.Provider == nil || !ap.DryRun() {
		t.Errorf("decode = %+v, %v; want the provider and dry-run read, nothing unrecognized", ap, err)
	}
}

// TestDecodeUnknownFieldPeerAuthnIsStrict: a PeerAuthentication with a field the types do not
// know (here a selector-narrowing one a newer Istio could add) would, with the field dropped,
// relax more workloads than written; the decoded policy is marked and read as STRICT
// (TestDecodePortLevelMTLS shows a policy of known fields is not marked).
func TestDecodeUnknownFieldPeerAuthnIsStrict(t *testing.T) {
	u := mustUnstructured(t, `
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {namespace: shop, name: legacy-only}
spec:
  mtls: {mode: PERMISSIVE}
  targetRef: {kind: Service, name: legacy}
`)
	pa, err := decode[policy.PeerAuthentication](u)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(pa.Unrecognized, "targetRef") {
		t.Errorf("Unrecognized = %q, want it to name targetRef", pa.Unrecognized)
	}
	if d := policy.EffectiveMode([]policy.PeerAuthentication{*pa}, "", "shop", map[string]string{"app": "web"}, 80); !d.Strict() {
		t.Errorf("mode under a policy with an unknown field: %+v, want STRICT", d)
	}

}

func TestCheckSpecLeavesOutUndecodable(t *testing.T) {
	u := mustUnstructured(t, `
spec:
  action: [ALLOW]
`)
	if leftOut, err := checkSpec[policy.AuthorizationPolicySpec](u); !leftOut || err == nil {
		t.Errorf("checkSpec = %v, %v; want true and an error", leftOut, err)
	}
	if _, err := decode[policy.AuthorizationPolicy](u); err == nil {
		t.Error("decode succeeded, want an error")
	}
}

// TestDecodeObjectsNeverFailOpen: a policy that stops converting keeps its last version that
// did; one that never converted is a stand-in that fails closed (DENY everything it selects,
// STRICT); the memory of last versions forgets deleted objects.
func TestDecodeObjectsNeverFailOpen(t *testing.T) {
	withUID := func(u *unstructured.Unstructured, uid string) *unstructured.Unstructured {
		u.SetUID(types.UID(uid))
		return u
	}
	goodDeny := withUID(mustUnstructured(t, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: shop, name: deny-evil}
spec:
  selector: {matchLabels: {app: web}}
  action: DENY
  rules: [{from: [{source: {principals: [cluster.local/ns/evil/sa/x]}}]}]
`), "u1")
	brokenDeny := withUID(mustUnstructured(t, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: shop, name: deny-evil}
spec:
  selector: {matchLabels: {app: web}}
  action: DENY
  rules: "not a list"
`), "u1")
	neverGood := withUID(mustUnstructured(t, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: shop, name: allow-some}
spec:
  selector: {matchLabels: {app: db}}
  action: 7
`), "u2")

	authz, last := decodeObjects[policy.AuthorizationPolicy]([]any{goodDeny}, nil, failClosedAuthz)
	if len(authz) != 1 || last["u1"] == nil {
		t.Fatalf("good policy: %d out, lastGood %v", len(authz), last)
	}
	authz, last = decodeObjects[policy.AuthorizationPolicy]([]any{brokenDeny, neverGood}, last, failClosedAuthz)
	if len(authz) != 2 {
		t.Fatalf("%d policies out of 2 objects: one was left out", len(authz))
	}
	if r := authz[0].Spec.Rules; authz[0].Name != "deny-evil" || len(r) != 1 || r[0].From[0].Source.Principals[0] != "cluster.local/ns/evil/sa/x" {
		t.Errorf("deny-evil = %+v, want its last good version", authz[0])
	}
	stand := authz[1]
	if stand.Name != "allow-some" || stand.Spec.Selector == nil || stand.Spec.Selector.MatchLabels["app"] != "db" {
		t.Errorf("stand-in %+v lost its name or selector", stand)
	}
	values := make([]policy.AuthorizationPolicy, len(authz))
	for i, ap := range authz {
		values[i] = *ap
	}
	anyone := policy.Peer{Principal: "cluster.local/ns/shop/sa/friend", Authenticated: true}
	if v := policy.Authorize(values, "", policy.Target{Namespace: "shop", Labels: map[string]string{"app": "db"}, Port: 5432}, anyone); v.Allowed {
		t.Errorf("the stand-in of a policy that never converted allowed a connection: %+v", v)
	}
	if v := policy.Authorize(values, "", policy.Target{Namespace: "shop", Labels: map[string]string{"app": "web"}, Port: 80}, anyone); !v.Allowed {
		t.Errorf("web (not selected by the stand-in, not denied by deny-evil) refused: %+v", v)
	}

	// Deleted: forgotten, so a new object that reuses nothing gets no stale version.
	if _, last = decodeObjects[policy.AuthorizationPolicy]([]any{neverGood}, last, failClosedAuthz); len(last) != 0 {
		t.Errorf("lastGood keeps %v after deny-evil was deleted", last)
	}

	brokenPA := withUID(mustUnstructured(t, `
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {namespace: shop, name: default}
spec:
  mtls: "PERMISSIVE"
`), "u3")
	pas, _ := decodeObjects[policy.PeerAuthentication]([]any{brokenPA}, nil, failClosedPeerAuthn)
	if len(pas) != 1 {
		t.Fatalf("%d PeerAuthentications, want the stand-in", len(pas))
	}
	if d := policy.EffectiveMode([]policy.PeerAuthentication{*pas[0]}, "", "shop", nil, 80); d.Mode != policy.ModeStrict {
		t.Errorf("a PeerAuthentication that never converted gives %+v, want STRICT", d)
	}
}

// TestDecodeFieldNamesCaseSensitive: a policy field in another case than
// the API's ("Rules") is a field the types do not know, as for Istio and the
// API server, and fails closed; encoding/json took it for "rules".
func TestDecodeFieldNamesCaseSensitive(t *testing.T) {
	u := mustUnstructured(t, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: shop, name: web}
spec:
  Rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/front"]}}]}]
`)
	ap, err := decode[policy.AuthorizationPolicy](u)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(ap.Unrecognized, `"Rules"`) || len(ap.Spec.Rules) != 0 {
		t.Errorf("Unrecognized = %q, rules %+v; want Rules named, not read as rules", ap.Unrecognized, ap.Spec.Rules)
	}
}

// TestDecodeObjectsDecodesOnlyChangedPolicies: every snapshot after a
// policy change decoded every policy of the cluster again (three JSON
// passes each): at 10k policies about a second of the source's goroutine
// per change, during which no pod change reached a snapshot, so a tenant
// rewriting one policy of its own namespace in a loop held back every
// node's enrollments and burnt a core on each. A version already decoded
// (same UID and resourceVersion) is now taken as it was; only changed
// objects are decoded.
func TestDecodeObjectsDecodesOnlyChangedPolicies(t *testing.T) {
	const n = 10000
	objs := make([]any, n)
	for i := range objs {
		u := mustUnstructured(t, fmt.Sprintf(`
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {namespace: ns%d, name: p%d}
spec:
  selector: {matchLabels: {app: web}}
  action: ALLOW
  rules:
  - from: [{source: {principals: [cluster.local/ns/a/sa/b], namespaces: [front, back]}}]
    to: [{operation: {ports: ["8080"]}}]
`, i%100, i))
		u.SetUID(types.UID(fmt.Sprintf("uid-%d", i)))
		u.SetResourceVersion("1")
		objs[i] = u
	}
	first, last := decodeObjects[policy.AuthorizationPolicy](objs, nil, failClosedAuthz)
	if len(first) != n || first[7].Spec.Action != policy.ActionAllow {
		t.Fatalf("%d policies out of %d, #7 %+v", len(first), n, first[7].Spec)
	}
	// One policy changes (a new resourceVersion); the others do not.
	changed := objs[7].(*unstructured.Unstructured).DeepCopy()
	changed.SetResourceVersion("2")
	if err := unstructured.SetNestedField(changed.Object, "DENY", "spec", "action"); err != nil {
		t.Fatal(err)
	}
	objs[7] = changed
	start := time.Now()
	second, _ := decodeObjects[policy.AuthorizationPolicy](objs, last, failClosedAuthz)
	took := time.Since(start)
	t.Logf("%d policies, one changed: %v", n, took)
	if len(second) != n {
		t.Fatalf("%d policies out of %d", len(second), n)
	}
	if second[7] == first[7] || second[7].Spec.Action != policy.ActionDeny {
		t.Errorf("the changed policy was not decoded again: %+v", second[7].Spec)
	}
	again := 0
	for i := range second {
		if i != 7 && second[i] != first[i] {
			again++
		}
	}
	if again > 0 {
		t.Errorf("%d unchanged policies decoded again for one change", again)
	}
}
