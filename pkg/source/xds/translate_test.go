package xds

import (
	"net/netip"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

// withUnknownField re-encodes m with an extra field number 99 (a field a
// newer istiod might send), as a varint.
func withUnknownField(t *testing.T, m proto.Message) proto.Message {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	b = protowire.AppendTag(b, 99, protowire.VarintType)
	b = protowire.AppendVarint(b, 1)
	out := m.ProtoReflect().New().Interface()
	if err := proto.Unmarshal(b, out); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestTranslateAuthorizationRejectsWhatItWouldIgnore: a field this
// translator does not know (a newer istiod's, anywhere in the policy) or
// an extension would otherwise be dropped silently, and an ALLOW without
// a condition it cannot read admits more. They are errors, so the policy
// is held fail-closed.
func TestTranslateAuthorizationRejectsWhatItWouldIgnore(t *testing.T) {
	base := func() *security.Authorization {
		return &security.Authorization{Name: "allow-web", Namespace: "shop", Scope: security.Scope_NAMESPACE, Action: security.Action_ALLOW,
			Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
				Principals: []*security.StringMatch{{MatchType: &security.StringMatch_Exact{Exact: "cluster.local/ns/shop/sa/web"}}},
			}}}}}}}
	}
	if _, err := translateAuthorization(base()); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, want string
		mod        func(*security.Authorization) *security.Authorization
	}{
		{"unknown top-level field", "unknown field 99", func(a *security.Authorization) *security.Authorization {
			return withUnknownField(t, a).(*security.Authorization)
		}},
		{"unknown field in a match", "unknown field 99", func(a *security.Authorization) *security.Authorization {
			a.Groups[0].Rules[0].Matches[0] = withUnknownField(t, a.Groups[0].Rules[0].Matches[0]).(*security.Match)
			return a
		}},
		{"unknown field in a string match", "unknown field 99", func(a *security.Authorization) *security.Authorization {
			m := a.Groups[0].Rules[0].Matches[0]
			m.Principals[0] = withUnknownField(t, m.Principals[0]).(*security.StringMatch)
			return a
		}},
		{"policy extension", "extensions", func(a *security.Authorization) *security.Authorization {
			a.Extensions = []*workloadapi.Extension{{Name: "x"}}
			return a
		}},
		{"match extension", "extensions", func(a *security.Authorization) *security.Authorization {
			a.Groups[0].Rules[0].Matches[0].Extensions = []*workloadapi.Extension{{Name: "x"}}
			return a
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := translateAuthorization(tc.mod(base()))
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "shop/allow-web") {
				t.Fatalf("error %v, want one naming the policy and %q", err, tc.want)
			}
		})
	}
}

// TestTranslateMappedPrefixes: an IPv4-mapped IPv6 prefix (::ffff:a.b.c.d,
// length 96 or more) is the IPv4 prefix it carries. Peers' addresses are
// unmapped before matching, so kept as IPv6 it matched no IPv4 peer: a
// DENY of such a range denied nothing.
func TestTranslateMappedPrefixes(t *testing.T) {
	a := &security.Authorization{Name: "deny-range", Namespace: "shop", Scope: security.Scope_NAMESPACE, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
			SourceIps: []*security.Address{{Address: netip.MustParseAddr("::ffff:10.9.0.0").AsSlice(), Length: 112}},
		}}}}}}}
	p, err := translateAuthorization(a)
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Groups[0].Clauses[0].Matches[0].SourceIPs[0]; got != netip.MustParsePrefix("10.9.0.0/16") {
		t.Errorf("prefix %s, want 10.9.0.0/16", got)
	}
	v := policy.AuthorizeCompiled([]*policy.Compiled{p}, policy.Target{Namespace: "shop", Port: 80}, nil, policy.Peer{Addr: netip.MustParseAddr("10.9.1.1")})
	if v.Allowed {
		t.Errorf("a peer in the denied mapped range allowed: %s", v.Reason)
	}

	// In an ALLOW, ztunnel's reading stands: the mapped prefix admits no
	// IPv4 peer (read as IPv4, ::ffff:0:0/96 admitted every one).
	a.Name, a.Action = "allow-mapped", security.Action_ALLOW
	a.Groups[0].Rules[0].Matches[0].SourceIps[0] = &security.Address{Address: netip.MustParseAddr("::ffff:0:0").AsSlice(), Length: 96}
	if p, err = translateAuthorization(a); err != nil {
		t.Fatal(err)
	}
	v = policy.AuthorizeCompiled([]*policy.Compiled{p}, policy.Target{Namespace: "shop", Port: 80}, nil, policy.Peer{Addr: netip.MustParseAddr("10.9.1.1")})
	if v.Allowed {
		t.Errorf("an ALLOW of ::ffff:0:0/96 admitted an IPv4 peer, which ztunnel refuses: %s", v.Reason)
	}
}

// TestTranslateWorkloadRejectsMalformedIdentity: the SPIFFE ID is built
// from trust domain, namespace and service account; a separator or an
// empty segment in them makes an ID that names another identity.
func TestTranslateWorkloadRejectsMalformedIdentity(t *testing.T) {
	for _, tc := range []struct {
		field string
		mod   func(*workloadapi.Workload)
	}{
		{"namespace", func(w *workloadapi.Workload) { w.Namespace = "shop/sa/admin/ns/x" }},
		{"service_account", func(w *workloadapi.Workload) { w.ServiceAccount = "web/../admin" }},
		{"trust_domain", func(w *workloadapi.Workload) { w.TrustDomain = "evil.local/ns/prod/sa/admin#" }},
		{"trust_domain", func(w *workloadapi.Workload) { w.TrustDomain = "Cluster.Local" }},
		{"name", func(w *workloadapi.Workload) { w.Name = "a/b" }},
	} {
		x := wlAddr("Kubernetes//Pod/shop/web-1", "web-1", "10.1.0.5", nil).GetWorkload()
		tc.mod(x)
		if _, err := translateWorkload(x); err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: error %v, want one naming the field", tc.field, err)
		}
	}
}

// TestTranslateWorkloadBoundsAddresses: a workload has at most
// MaxWorkloadAddresses addresses (a pod has one per family); more would
// let one resource claim any number of addresses in the directory.
func TestTranslateWorkloadBoundsAddresses(t *testing.T) {
	x := wlAddr("Kubernetes//Pod/shop/web-1", "web-1", "10.1.0.5", nil).GetWorkload()
	for i := range MaxWorkloadAddresses {
		x.Addresses = append(x.Addresses, netip.AddrFrom4([4]byte{10, 3, byte(i >> 8), byte(i)}).AsSlice())
	}
	if _, err := translateWorkload(x); err == nil || !strings.Contains(err.Error(), "addresses") {
		t.Errorf("error %v, want one about too many addresses", err)
	}
}

// TestTranslateRejectsAddressesOfNoOneHost: istiod's addresses were only
// checked for length. A ServiceEntry's VIP at the cloud metadata server
// (link-local) would have every meshed pod's requests to it go to that
// entry's endpoints; a loopback, unspecified, multicast or broadcast
// address means no one host either. Such a workload, service or waypoint
// is rejected (NACKed, the last good version kept).
func TestTranslateRejectsAddressesOfNoOneHost(t *testing.T) {
	for _, bad := range []string{"169.254.169.254", "fe80::1", "127.0.0.1", "::1", "0.0.0.0", "::", "224.0.0.1", "ff02::1", "255.255.255.255", "0.1.2.3", "::ffff:127.0.0.1"} {
		raw := netip.MustParseAddr(bad).AsSlice()
		w := wlAddr("Kubernetes//Pod/shop/web-1", "web-1", "10.1.0.5", nil).GetWorkload()
		w.Addresses = append(w.Addresses, raw)
		if _, err := translateWorkload(w); err == nil || !strings.Contains(err.Error(), "address 1") {
			t.Errorf("workload at %s: error %v", bad, err)
		}
		svc := &workloadapi.Service{Name: "meta", Namespace: "evil", Hostname: "meta.example", Addresses: []*workloadapi.NetworkAddress{{Address: raw}}}
		if _, err := translateService(svc); err == nil || !strings.Contains(err.Error(), "address 0") {
			t.Errorf("service VIP %s: error %v", bad, err)
		}
		w = wlAddr("Kubernetes//Pod/shop/web-1", "web-1", "10.1.0.5", nil).GetWorkload()
		w.Waypoint = &workloadapi.GatewayAddress{Destination: &workloadapi.GatewayAddress_Address{Address: &workloadapi.NetworkAddress{Address: raw}}, HboneMtlsPort: 15008}
		if _, err := translateWorkload(w); err == nil || !strings.Contains(err.Error(), "waypoint") {
			t.Errorf("waypoint at %s: error %v", bad, err)
		}
	}
	svc := &workloadapi.Service{Name: "ext", Namespace: "shop", Hostname: "ext.example",
		Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("240.240.0.1").AsSlice()}}}
	if _, err := translateService(svc); err != nil {
		t.Errorf("an address istiod allocates for a ServiceEntry (240.240/16): %v", err)
	}
}

// TestTranslateWaypointHostnameNeedsNamespace: a waypoint named by host
// name without a namespace was resolved to the first service of that host
// name in any namespace, a tenant's ServiceEntry among them; ztunnel looks
// the exact namespace/hostname up and finds nothing. It is rejected.
func TestTranslateWaypointHostnameNeedsNamespace(t *testing.T) {
	w := wlAddr("Kubernetes//Pod/shop/web-1", "web-1", "10.1.0.5", nil).GetWorkload()
	w.Waypoint = &workloadapi.GatewayAddress{Destination: &workloadapi.GatewayAddress_Hostname{Hostname: &workloadapi.NamespacedHostname{Hostname: "waypoint.shop.svc.cluster.local"}}, HboneMtlsPort: 15008}
	if _, err := translateWorkload(w); err == nil || !strings.Contains(err.Error(), "names no namespace") {
		t.Errorf("waypoint without a namespace: %v", err)
	}
	w.Waypoint.GetHostname().Namespace = "shop"
	if _, err := translateWorkload(w); err != nil {
		t.Errorf("waypoint with its namespace: %v", err)
	}
}
