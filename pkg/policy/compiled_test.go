package policy

import (
	"net/netip"
	"strings"
	"testing"
)

func TestAuthorizeCompiled(t *testing.T) {
	plaintext := Match{NotPrincipals: []StringMatch{{Kind: MatchPresence}}}
	strict := &Compiled{Name: "istio_converted_static_strict", Namespace: "istio-system", Scope: ScopeWorkloadSelector, Action: ActionDeny,
		Groups: []Group{{Clauses: []Clause{{Matches: []Match{plaintext}}}}}}
	// ALLOW from shop/web, or from 10.9.0.0/16, to port 8080 only.
	allowWeb := &Compiled{Name: "allow-web", Namespace: "shop", Scope: ScopeNamespace, Action: ActionAllow,
		Groups: []Group{{Clauses: []Clause{
			{Matches: []Match{{DestinationPorts: []uint16{8080}}}},
			{Matches: []Match{
				{ServiceAccounts: []ServiceAccountRef{{Namespace: "shop", Name: "web"}}},
				{SourceIPs: []netip.Prefix{netip.MustParsePrefix("10.9.0.0/16")}},
			}},
		}}}}
	denyDevNS := &Compiled{Name: "deny-dev", Namespace: "istio-system", Scope: ScopeGlobal, Action: ActionDeny,
		Groups: []Group{{Clauses: []Clause{{Matches: []Match{{Namespaces: []StringMatch{{Kind: MatchPrefix, Value: "dev-"}}}}}}}}}
	dryDenyAll := &Compiled{Name: "dry", Namespace: "shop", Scope: ScopeNamespace, Action: ActionDeny, DryRun: true, Groups: []Group{{}}}
	allowNothing := &Compiled{Name: "allow-nothing", Namespace: "other", Scope: ScopeNamespace, Action: ActionAllow}

	web := Peer{Authenticated: true, Principal: "spiffe://cluster.local/ns/shop/sa/web", Addr: netip.MustParseAddr("10.1.0.1")}
	db := Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/db", Addr: netip.MustParseAddr("10.1.0.2")}
	dev := Peer{Authenticated: true, Principal: "cluster.local/ns/dev-a/sa/web", Addr: netip.MustParseAddr("10.9.0.3")}
	plain := Peer{Addr: netip.MustParseAddr("10.9.0.4")}
	all := []*Compiled{strict, allowWeb, denyDevNS, dryDenyAll, allowNothing}

	for _, tc := range []struct {
		name     string
		ps       []*Compiled
		ns       string
		port     uint16
		selected []string
		src      Peer
		allowed  bool
	}{
		{"no policy", nil, "shop", 8080, nil, plain, true},
		{"strict selected: plaintext denied", all, "shop", 8080, []string{strict.Key()}, plain, false},
		{"strict not selected: plaintext from allowed range", all, "shop", 8080, nil, plain, true},
		{"allow by service account", all, "shop", 8080, []string{strict.Key()}, web, true},
		{"allow needs both clauses: wrong port", all, "shop", 9090, nil, web, false},
		{"allow: no source clause matches", all, "shop", 8080, nil, db, false},
		{"global deny by namespace prefix wins", all, "shop", 8080, nil, dev, false},
		{"namespace scope only in its namespace", []*Compiled{allowWeb}, "pay", 9090, nil, db, true},
		{"allow without groups admits nothing", all, "other", 80, nil, web, false},
		{"dry run not enforced", []*Compiled{dryDenyAll}, "shop", 80, nil, db, true},
		{"empty group matches all", []*Compiled{{Name: "x", Namespace: "shop", Scope: ScopeNamespace, Action: ActionDeny, Groups: []Group{{}}}}, "shop", 80, nil, web, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := AuthorizeCompiled(tc.ps, Target{Namespace: tc.ns, Port: tc.port}, tc.selected, tc.src)
			if v.Allowed != tc.allowed {
				t.Errorf("allowed = %v (%s), want %v", v.Allowed, v.Reason, tc.allowed)
			}
		})
	}
}

func TestCompiledSetFailsClosedUntilSynced(t *testing.T) {
	var s CompiledSet
	if v := s.Authorize(Target{Namespace: "shop"}, "shop/web", Peer{}); v.Allowed {
		t.Fatal("allowed before the control plane answered")
	}
	s.Synced = true
	if v := s.Authorize(Target{Namespace: "shop"}, "shop/web", Peer{}); !v.Allowed {
		t.Fatalf("denied with no policies: %s", v.Reason)
	}
}

// TestCompiledAmbiguousShapesFailClosed: where the compiled form is
// ambiguous (a match with no condition, a rule part with no match), an
// ALLOW reads it as matching nothing and a DENY as matching everything.
// ztunnel skips an empty match; an ALLOW that read it as "everything"
// would admit every peer.
func TestCompiledAmbiguousShapesFailClosed(t *testing.T) {
	peer := Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/web", Addr: netip.MustParseAddr("10.1.0.1")}
	dst := Target{Namespace: "shop", Port: 8080}
	for _, tc := range []struct {
		name    string
		p       *Compiled
		allowed bool
	}{
		{"ALLOW with an empty match admits nothing", &Compiled{Name: "a", Namespace: "shop", Scope: ScopeNamespace, Action: ActionAllow,
			Groups: []Group{{Clauses: []Clause{{Matches: []Match{{}}}}}}}, false},
		{"ALLOW: an empty match beside a real one", &Compiled{Name: "a", Namespace: "shop", Scope: ScopeNamespace, Action: ActionAllow,
			Groups: []Group{{Clauses: []Clause{{Matches: []Match{{}, {DestinationPorts: []uint16{9090}}}}}}}}, false},
		{"ALLOW with an empty clause admits nothing", &Compiled{Name: "a", Namespace: "shop", Scope: ScopeNamespace, Action: ActionAllow,
			Groups: []Group{{Clauses: []Clause{{}}}}}, false},
		{"DENY with an empty match denies", &Compiled{Name: "d", Namespace: "shop", Scope: ScopeNamespace, Action: ActionDeny,
			Groups: []Group{{Clauses: []Clause{{Matches: []Match{{}}}}}}}, false},
		{"DENY with an empty clause denies", &Compiled{Name: "d", Namespace: "shop", Scope: ScopeNamespace, Action: ActionDeny,
			Groups: []Group{{Clauses: []Clause{{}, {Matches: []Match{{DestinationPorts: []uint16{8080}}}}}}}}, false},
		{"ALLOW of an empty rule still admits all", &Compiled{Name: "a", Namespace: "shop", Scope: ScopeNamespace, Action: ActionAllow,
			Groups: []Group{{}}}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if v := AuthorizeCompiled([]*Compiled{tc.p}, dst, nil, peer); v.Allowed != tc.allowed {
				t.Errorf("allowed = %v (%s), want %v", v.Allowed, v.Reason, tc.allowed)
			}
		})
	}
}

// TestCompiledSetFailsClosedOnMissingPolicies: a workload that lists a
// policy the set does not hold (not received, rejected, over a limit),
// a workload whose selection is unknown, and a policy that could not be
// held in any form all deny instead of being skipped.
func TestCompiledSetFailsClosedOnMissingPolicies(t *testing.T) {
	allowAll := &Compiled{Name: "allow", Namespace: "shop", Scope: ScopeNamespace, Action: ActionAllow, Groups: []Group{{}}}
	s := CompiledSet{Synced: true, Policies: []*Compiled{allowAll}, Selected: map[string][]string{"shop/web": {"shop/deny-db"}}}
	dst := Target{Namespace: "shop", Port: 80}
	if v := s.Authorize(dst, "shop/web", Peer{}); v.Allowed || !strings.Contains(v.Reason, "shop/deny-db") {
		t.Errorf("a selected policy that is missing: allowed=%v (%s), want denied naming it", v.Allowed, v.Reason)
	}
	if v := s.Authorize(dst, "shop/other", Peer{}); !v.Allowed {
		t.Errorf("a workload selecting nothing missing: %s", v.Reason)
	}
	s.Unknown = map[string]string{"shop/other": "istiod has not described this pod"}
	if v := s.Authorize(dst, "shop/other", Peer{}); v.Allowed || !strings.Contains(v.Reason, "istiod has not described") {
		t.Errorf("a workload with unknown selection: allowed=%v (%s)", v.Allowed, v.Reason)
	}
	s.Unknown = nil
	s.Unresolved = []string{"pay/broken"}
	if v := s.Authorize(dst, "shop/other", Peer{}); v.Allowed || !strings.Contains(v.Reason, "pay/broken") {
		t.Errorf("an unresolved policy of unknown scope: allowed=%v (%s)", v.Allowed, v.Reason)
	}
}

// TestCompiledSetMissingConvertedPeerAuthn: istiod lists a converted
// PeerAuthentication policy it never sends for some configurations (a
// workload PERMISSIVE with a STRICT port under a STRICT mesh policy), and
// ztunnel skips the missing key. Failing closed refused every connection
// to the pod, mTLS ones too. Such a policy only ever denies peers without
// mTLS: those stay refused, mTLS peers are decided by the rest. istiod
// names it converted_peer_authentication_<name> (its static STRICT policy
// istio_converted_static_strict); until 7 December only names beginning
// istio_converted_ were recognised, so under a real istiod such a pod
// refused mTLS peers all the same (TestPeerAuthnDifferential found it).
func TestCompiledSetMissingConvertedPeerAuthn(t *testing.T) {
	for _, name := range []string{"converted_peer_authentication_", "istio_converted_"} {
		allowAll := &Compiled{Name: "allow", Namespace: "shop", Scope: ScopeNamespace, Action: ActionAllow, Groups: []Group{{}}}
		s := CompiledSet{Synced: true, Policies: []*Compiled{allowAll}, Selected: map[string][]string{
			"shop/web": {"shop/" + name + "web"},
			"shop/db":  {"shop/" + name + "db", "shop/deny-db"},
		}}
		dst := Target{Namespace: "shop", Port: 80}
		mtls := Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/cart", Namespace: "shop"}
		if v := s.Authorize(dst, "shop/web", mtls); !v.Allowed {
			t.Errorf("%s: an mTLS peer refused for a missing converted PeerAuthentication: %s", name, v.Reason)
		}
		if v := s.Authorize(dst, "shop/web", Peer{}); v.Allowed || !strings.Contains(v.Reason, name+"web") {
			t.Errorf("%s: a plaintext peer: allowed=%v (%s), want refused naming the missing policy", name, v.Allowed, v.Reason)
		}
		if v := s.Authorize(dst, "shop/db", mtls); v.Allowed || !strings.Contains(v.Reason, "shop/deny-db") {
			t.Errorf("%s: another missing policy beside it: allowed=%v (%s), want refused naming shop/deny-db", name, v.Allowed, v.Reason)
		}
	}
	// A name that only resembles one is no converted PeerAuthentication.
	s := CompiledSet{Synced: true, Selected: map[string][]string{"shop/web": {"shop/x_converted_peer_authentication_web"}}}
	if v := s.Authorize(Target{Namespace: "shop", Port: 80}, "shop/web", Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/cart"}); v.Allowed {
		t.Errorf("a missing policy of another name skipped: %s", v.Reason)
	}
}
