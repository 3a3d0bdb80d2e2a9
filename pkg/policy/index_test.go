package policy

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"
)

func denyNobody(name, ns string, scope Scope, action Action) *Compiled {
	return &Compiled{Name: name, Namespace: ns, Scope: scope, Action: action,
		Groups: []Group{{Clauses: []Clause{{Matches: []Match{{Principals: []StringMatch{{Value: "nobody"}}}}}}}}}
}

var (
	indexDst = Target{Namespace: "tenant", Port: 80, Addr: netip.MustParseAddr("10.0.0.1")}
	indexSrc = Peer{Addr: netip.MustParseAddr("10.0.0.2"), Authenticated: true, Principal: "cluster.local/ns/a/sa/b"}
)

// TestIndexedDecisionCostIndependentOfPolicies: a pod selected by 2000
// ALLOW policies of its namespace, in a mesh of 200k more policies in
// other namespaces, costs what its own policies cost per connection.
// Before the index, every selected key was looked for in every policy and
// every policy's key in the selected list: the product, about half a
// second of CPU per connection to that pod here (a second at 10k
// selected among 10k), and 2.4 ms per connection to any pod for the 200k
// alone; and a refusal's reason named all of them (32 KB).
func TestIndexedDecisionCostIndependentOfPolicies(t *testing.T) {
	const own, others, conns = 2000, 200000, 20
	var ps []*Compiled
	var selected []string
	for i := range others {
		ps = append(ps, denyNobody(fmt.Sprintf("p%06d", i), fmt.Sprintf("other%03d", i%500), ScopeNamespace, ActionDeny))
	}
	for i := range own {
		p := denyNobody(fmt.Sprintf("own%05d", i), "tenant", ScopeWorkloadSelector, ActionAllow)
		ps = append(ps, p)
		selected = append(selected, p.Key())
	}
	SortCompiled(ps)
	set := &CompiledSet{Synced: true, Policies: ps, Selected: map[string][]string{"tenant/pod": selected}}
	x := NewIndex(set, nil, nil, "")
	start := time.Now()
	for i := range conns {
		v := x.Authorize(indexDst, "tenant/pod", indexSrc)
		if v.Allowed {
			t.Fatalf("allowed: %+v", v)
		}
		if len(v.Reason) > 1024 {
			t.Fatalf("reason of %d bytes: %.200s...", len(v.Reason), v.Reason)
		}
		// Some 0.3 ms each here (the 2000 selected policies themselves);
		// about half a second each before.
		if took := time.Since(start); took > time.Second {
			t.Fatalf("%d connections to a pod of %d policies among %d took %v", i+1, own, own+others, took)
		}
	}

	// A pod of a namespace without policies: nothing to walk.
	dst := indexDst
	dst.Namespace = "quiet"
	start = time.Now()
	for range 1000 {
		if v := x.Authorize(dst, "quiet/pod", indexSrc); !v.Allowed {
			t.Fatalf("refused: %+v", v)
		}
	}
	// About a microsecond each; 2.4 ms before.
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Errorf("1000 connections to a pod of no policy among %d took %v (%v each)", own+others, took, took/1000)
	}
}

// TestIndexAgreesWithLinear: the index decides as the walks of the whole
// lists do, reason and policy included, over random sets of compiled
// policies (scopes, actions, dry runs, keys listed twice or not held,
// several policies of one key) and of hand-written ones.
func TestIndexAgreesWithLinear(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	nss := []string{"istio-system", "a", "b", "c"}
	principals := []string{"cluster.local/ns/a/sa/x", "cluster.local/ns/b/sa/y"}
	for round := range 300 {
		var ps []*Compiled
		for range r.IntN(12) {
			p := &Compiled{Name: fmt.Sprint("p", r.IntN(6)), Namespace: nss[r.IntN(len(nss))], Scope: Scope(r.IntN(4)),
				Action: []Action{ActionAllow, ActionDeny}[r.IntN(2)], DryRun: r.IntN(5) == 0}
			for range r.IntN(3) {
				p.Groups = append(p.Groups, Group{Clauses: []Clause{{Matches: []Match{{Principals: []StringMatch{{Value: principals[r.IntN(2)]}}}}}}})
			}
			ps = append(ps, p)
		}
		SortCompiled(ps)
		selected := map[string][]string{}
		for _, w := range []string{"a/w", "b/w"} {
			for range r.IntN(5) {
				selected[w] = append(selected[w], fmt.Sprintf("%s/p%d", nss[r.IntN(len(nss))], r.IntN(7)))
			}
		}
		set := &CompiledSet{Synced: true, Policies: ps, Selected: selected}
		var aps []AuthorizationPolicy
		for range r.IntN(10) {
			ap := AuthorizationPolicy{Meta: Meta{Name: fmt.Sprint("h", r.IntN(5)), Namespace: nss[r.IntN(len(nss))]}}
			ap.Spec.Action = []Action{ActionAllow, ActionDeny}[r.IntN(2)]
			if r.IntN(2) == 0 {
				ap.Spec.Rules = []Rule{{From: []From{{Source: &Source{Principals: []string{principals[r.IntN(2)]}}}}}}
			}
			aps = append(aps, ap)
		}
		var pas []PeerAuthentication
		for range r.IntN(6) {
			pa := PeerAuthentication{Meta: Meta{Name: fmt.Sprint("m", r.IntN(4)), Namespace: nss[r.IntN(len(nss))]}}
			pa.Spec.MTLS = &MTLS{Mode: []MTLSMode{ModeStrict, ModePermissive, ModeDisable}[r.IntN(3)]}
			pas = append(pas, pa)
		}
		x := NewIndex(set, nil, nil, "")
		hand := NewIndex(nil, aps, pas, "")
		for _, ns := range []string{"a", "b", "istio-system"} {
			for _, src := range []Peer{{Authenticated: true, Principal: principals[0]}, {Authenticated: true, Principal: principals[1]}, {}} {
				dst := Target{Namespace: ns, Port: 80}
				w := ns + "/w"
				if got, want := x.Authorize(dst, w, src), linearCompiled(set, dst, w, src); got != want {
					t.Fatalf("round %d, compiled, %s from %+v: index %+v, linear %+v", round, w, src, got, want)
				}
				if got, want := hand.Authorize(dst, w, src), Authorize(aps, "", dst, src); got != want {
					t.Fatalf("round %d, hand-written, %s from %+v: index %+v, linear %+v", round, w, src, got, want)
				}
				if got, want := hand.EffectiveMode(ns, nil, 80), EffectiveMode(pas, "", ns, nil, 80); got != want {
					t.Fatalf("round %d, mode of %s: index %+v, linear %+v", round, ns, got, want)
				}
			}
		}
	}
}

// linearCompiled is CompiledSet.Authorize as it read the set before the
// index, a walk of every policy per selected key (the random sets have no
// converted PeerAuthentications, which it leaves out).
func linearCompiled(s *CompiledSet, dst Target, workload string, src Peer) Verdict {
	selected := s.Selected[workload]
	for _, k := range selected {
		held := false
		for _, p := range s.Policies {
			held = held || p.Key() == k
		}
		if !held {
			return Verdict{Reason: "policy " + k + " selects " + workload + " but was not received or not applied (fails closed)", Policy: k}
		}
	}
	return AuthorizeCompiled(s.Policies, dst, selected, src)
}

func BenchmarkNewIndex(b *testing.B) {
	var ps []*Compiled
	for i := range 200000 {
		ps = append(ps, denyNobody(fmt.Sprintf("p%06d", i), fmt.Sprintf("other%03d", i%500), ScopeNamespace, ActionDeny))
	}
	set := &CompiledSet{Synced: true, Policies: ps}
	for b.Loop() {
		NewIndex(set, nil, nil, "")
	}
}
