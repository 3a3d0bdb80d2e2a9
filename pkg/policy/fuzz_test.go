package policy

import (
	"maps"
	"net/netip"
	"testing"

	"sigs.k8s.io/yaml"
)

// Seed corpora live in testdata/fuzz/<FuzzName>; `go test` replays them.

var (
	denyAll  = AuthorizationPolicy{Spec: AuthorizationPolicySpec{Action: ActionDeny, Rules: []Rule{{}}}}
	allowAll = AuthorizationPolicy{Spec: AuthorizationPolicySpec{Action: ActionAllow, Rules: []Rule{{}}}}
)

// checkInvariants asserts what must hold for any policy set: a verdict
// always has a reason, the same question gets the same answer, a DENY of
// everything always denies, and an ALLOW of everything never turns an
// allowed connection into a denied one.
func checkInvariants(t *testing.T, aps []AuthorizationPolicy, dst Target, src Peer) Verdict {
	t.Helper()
	v := Authorize(aps, "", dst, src)
	if v.Reason == "" {
		t.Fatalf("empty reason: %+v", v)
	}
	if again := Authorize(aps, "", dst, src); again != v {
		t.Fatalf("not deterministic: %+v then %+v", v, again)
	}
	d := denyAll
	d.Namespace = dst.Namespace
	if w := Authorize(append(aps[:len(aps):len(aps)], d), "", dst, src); w.Allowed {
		t.Fatalf("allowed despite a deny-all policy: %+v", w)
	}
	a := allowAll
	a.Namespace = dst.Namespace
	if w := Authorize(append(aps[:len(aps):len(aps)], a), "", dst, src); v.Allowed && !w.Allowed {
		t.Fatalf("adding allow-all denied an allowed connection: %+v then %+v", v, w)
	}
	return v
}

func FuzzAuthorize(f *testing.F) {
	f.Add("cluster.local/ns/shop/sa/web", "shop", "10.0.0.5", true, uint16(5432), "cluster.local/ns/shop/*", "10.0.0.0/24", "5432", "ALLOW")
	f.Add("", "", "fd00::1", false, uint16(80), "*", "fd00::/64", "80", "DENY")
	f.Fuzz(func(t *testing.T, principal, namespace, srcIP string, authenticated bool, port uint16, pattern, block, portStr, action string) {
		addr, _ := netip.ParseAddr(srcIP)
		src := Peer{Principal: principal, Namespace: namespace, Addr: addr, Authenticated: authenticated}
		dst := Target{Namespace: "shop", Labels: map[string]string{"app": "db"}, Port: port, Addr: netip.MustParseAddr("10.1.0.7")}
		ap := AuthorizationPolicy{Spec: AuthorizationPolicySpec{
			Action: Action(action),
			Rules: []Rule{
				{
					From: []From{{Source: &Source{Principals: []string{pattern}, IPBlocks: []string{block}}}},
					To:   []To{{Operation: &Operation{Ports: []string{portStr}}}},
				},
				{
					From: []From{{Source: &Source{NotNamespaces: []string{pattern}, NotIPBlocks: []string{block}}}},
					When: []Condition{{Key: "destination.port", NotValues: []string{portStr}}},
				},
			},
		}}
		ap.Namespace, ap.Name = "shop", "fuzz"
		checkInvariants(t, []AuthorizationPolicy{ap}, dst, src)

		// A lone ALLOW that needs a principal never admits an
		// unauthenticated peer through its first rule; isolate that rule.
		first := ap
		first.Spec.Rules = ap.Spec.Rules[:1]
		if (action == "" || action == string(ActionAllow)) && !authenticated {
			if w := Authorize([]AuthorizationPolicy{first}, "", dst, src); w.Allowed {
				t.Fatalf("unauthenticated peer admitted by principals %q: %+v", pattern, w)
			}
		}
	})
}

func FuzzParsePolicyYAML(f *testing.F) {
	f.Add([]byte("metadata: {name: a, namespace: shop}\nspec: {rules: [{}]}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		var ap AuthorizationPolicy
		if err := yaml.Unmarshal(data, &ap); err == nil {
			verr := Validate(ap)
			dst := Target{Namespace: ap.Namespace, Port: 5432, Addr: netip.MustParseAddr("10.1.0.7")}
			if ap.Spec.Selector != nil {
				dst.Labels = maps.Clone(ap.Spec.Selector.MatchLabels)
			}
			applies := !notEnforced(&ap) && appliesTo(&ap, DefaultRootNamespace, dst)
			for _, src := range []Peer{
				{Principal: "cluster.local/ns/shop/sa/web", Namespace: "shop", Addr: netip.MustParseAddr("10.0.0.5"), Authenticated: true},
				{Addr: netip.MustParseAddr("fd00::5")},
			} {
				v := checkInvariants(t, []AuthorizationPolicy{ap}, dst, src)
				if verr != nil && applies && v.Allowed {
					switch ap.Spec.Action {
					case ActionAudit, ActionCustom:
					default:
						t.Fatalf("invalid policy (%v) let a connection through: %+v", verr, v)
					}
				}
			}
		}

		var pa PeerAuthentication
		if err := yaml.Unmarshal(data, &pa); err == nil {
			_ = ValidatePA(pa)
			var labels map[string]string
			if pa.Spec.Selector != nil {
				labels = pa.Spec.Selector.MatchLabels
			}
			for _, port := range []uint16{80, 5432} {
				switch d := EffectiveMode([]PeerAuthentication{pa}, "", pa.Namespace, labels, port); d.Mode {
				case ModeStrict, ModePermissive, ModeDisable:
				default:
					t.Fatalf("effective mode %q is not enforceable (%s)", d.Mode, d.Source)
				}
			}
		}
	})
}
