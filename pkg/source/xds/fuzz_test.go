package xds

import (
	"net/netip"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

// addFuzzSeeds adds each message, marshalled, to f's corpus.
func addFuzzSeeds(f *testing.F, msgs ...proto.Message) {
	f.Helper()
	for _, m := range msgs {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
}

// FuzzXDSAddress: whatever istiod sends as an istio.workload.Address,
// translating it does not panic, and gives either a *Workload or a
// *Service, or else an untyped nil with an error that names the workload
// or service (the NACK's message).
func FuzzXDSAddress(f *testing.F) {
	ip := func(s string) []byte { return netip.MustParseAddr(s).AsSlice() }
	dual := wlAddr("Kubernetes//Pod/shop/web-1", "web-1", "10.1.0.5", map[string]*workloadapi.PortList{
		"shop/web.shop.svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}},
	}, "shop/allow-front")
	w := dual.GetWorkload()
	w.Addresses = append(w.Addresses, ip("fd00::5"))
	w.WorkloadName, w.WorkloadType, w.ClusterId, w.Network = "web", workloadapi.WorkloadType_DEPLOYMENT, "Kubernetes", "net-a"
	w.Locality = &workloadapi.Locality{Region: "eu-west", Zone: "eu-west-1a", Subzone: "rack-1"}
	w.Status = workloadapi.WorkloadStatus_HEALTHY
	w.Waypoint = &workloadapi.GatewayAddress{HboneMtlsPort: 15008, Destination: &workloadapi.GatewayAddress_Address{
		Address: &workloadapi.NetworkAddress{Address: ip("10.1.0.9")}}}
	hostNet := wlAddr("Kubernetes//Pod/kube-system/node-exporter", "node-exporter", "192.168.1.10", nil)
	hostNet.GetWorkload().NetworkMode = workloadapi.NetworkMode_HOST_NETWORK
	hostNet.GetWorkload().TunnelProtocol = workloadapi.TunnelProtocol_NONE

	svc := svcAddr("web", "10.96.0.10", 80, 8080)
	s := svc.GetService()
	s.Addresses = append(s.Addresses, &workloadapi.NetworkAddress{Address: ip("fd00:96::10")})
	s.Ports = append(s.Ports, &workloadapi.Port{ServicePort: 443, TargetPort: 0})
	s.IpFamilies = workloadapi.IPFamilies_DUAL
	s.LoadBalancing = &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_FAILOVER, HealthPolicy: workloadapi.LoadBalancing_ALLOW_ALL,
		RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_NETWORK, workloadapi.LoadBalancing_ZONE}}
	s.Waypoint = &workloadapi.GatewayAddress{HboneMtlsPort: 15008, Destination: &workloadapi.GatewayAddress_Hostname{
		Hostname: &workloadapi.NamespacedHostname{Namespace: "shop", Hostname: "waypoint.shop.svc.cluster.local"}}}
	local := svcAddr("dns", "10.96.0.53", 53, 53)
	local.GetService().LoadBalancing = &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_STRICT,
		RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_NODE}}
	entry := &workloadapi.Address{Type: &workloadapi.Address_Service{Service: &workloadapi.Service{
		Name: "ext", Namespace: "shop", Hostname: "ext.example", Visibility: workloadapi.Service_NAMESPACE,
		Addresses:     []*workloadapi.NetworkAddress{{Address: ip("240.240.0.1")}, {Address: ip("203.0.113.0"), Length: proto.Uint32(24)}},
		Ports:         []*workloadapi.Port{{ServicePort: 443, TargetPort: 443, AppProtocol: workloadapi.AppProtocol_HTTP11}},
		LoadBalancing: &workloadapi.LoadBalancing{Mode: workloadapi.LoadBalancing_PASSTHROUGH},
	}}}
	// Rejected: no uid, a link-local address, an unknown visibility.
	noUID := wlAddr("", "web-2", "10.1.0.6", nil)
	metadata := svcAddr("meta", "169.254.169.254", 80, 80)
	hidden := svcAddr("hidden", "10.96.0.11", 80, 80)
	hidden.GetService().Visibility = 7
	addFuzzSeeds(f, dual, hostNet, svc, local, entry, noUID, metadata, hidden, &workloadapi.Address{})

	f.Fuzz(func(t *testing.T, data []byte) {
		var a workloadapi.Address
		if proto.Unmarshal(data, &a) != nil {
			t.Skip("not an istio.workload.Address")
		}
		v, err := translateAddress(&a)
		if err != nil {
			if v != nil {
				t.Fatalf("error %q with a result %#v", err, v)
			}
			if msg := err.Error(); !strings.HasPrefix(msg, "workload ") && !strings.HasPrefix(msg, "service ") && !strings.HasPrefix(msg, "address ") {
				t.Fatalf("error %q names neither a workload nor a service", msg)
			}
			return
		}
		switch v := v.(type) {
		case *Workload:
			if v == nil {
				t.Fatal("a nil *Workload without an error")
			}
		case *Service:
			if v == nil {
				t.Fatal("a nil *Service without an error")
			}
		default:
			t.Fatalf("result %#v (%T) without an error", v, v)
		}
	})
}

// FuzzXDSAuthorization: whatever istiod sends as an
// istio.security.Authorization, translating it does not panic, and gives
// the policy or else nil with an error that names it ("a policy is
// applied exactly or not at all"); and what stands in for a policy that
// fails (failClosed) can only deny more.
func FuzzXDSAuthorization(f *testing.F) {
	exact := func(s string) *security.StringMatch {
		return &security.StringMatch{MatchType: &security.StringMatch_Exact{Exact: s}}
	}
	prefix := func(p string, n uint32) *security.Address {
		return &security.Address{Address: netip.MustParsePrefix(p).Addr().AsSlice(), Length: n}
	}
	allow := &security.Authorization{Name: "allow-front", Namespace: "shop", Scope: security.Scope_WORKLOAD_SELECTOR, Action: security.Action_ALLOW,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
			Principals:       []*security.StringMatch{exact("cluster.local/ns/shop/sa/front"), {MatchType: &security.StringMatch_Prefix{Prefix: "cluster.local/ns/shop/"}}},
			Namespaces:       []*security.StringMatch{{MatchType: &security.StringMatch_Suffix{Suffix: "-prod"}}},
			ServiceAccounts:  []*security.ServiceAccountMatch{{Namespace: "shop", ServiceAccount: "front"}},
			DestinationPorts: []uint32{8080, 8443},
		}}}, {Matches: []*security.Match{{
			SourceIps:           []*security.Address{prefix("10.0.0.0/8", 8), prefix("fd00::/64", 64)},
			NotDestinationPorts: []uint32{9090},
		}}}}}}}
	deny := &security.Authorization{Name: "deny-range", Namespace: "shop", Scope: security.Scope_NAMESPACE, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
			SourceIps:          []*security.Address{prefix("::ffff:10.9.0.0/112", 112)},
			NotSourceIps:       []*security.Address{prefix("10.9.1.0/24", 24)},
			DestinationIps:     []*security.Address{prefix("10.96.0.10/32", 32)},
			NotNamespaces:      []*security.StringMatch{exact("istio-system")},
			NotServiceAccounts: []*security.ServiceAccountMatch{{Namespace: "shop", ServiceAccount: "admin"}},
		}}}}}}}
	// Rejected: an empty string match, a port out of range, no name.
	badMatch := &security.Authorization{Name: "bad", Namespace: "shop", Scope: security.Scope_GLOBAL, Action: security.Action_ALLOW,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{Principals: []*security.StringMatch{{}}, DestinationPorts: []uint32{70000}}}}}}}}
	addFuzzSeeds(f, allow, deny, strictAuthz(), badMatch, &security.Authorization{Namespace: "shop", Action: security.Action_DENY},
		&security.Authorization{Name: "presence", Namespace: "shop", Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
			NotPrincipals: []*security.StringMatch{{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}}}}}}}}})

	f.Fuzz(func(t *testing.T, data []byte) {
		var a security.Authorization
		if proto.Unmarshal(data, &a) != nil {
			t.Skip("not an istio.security.Authorization")
		}
		p, err := translateAuthorization(&a)
		switch {
		case err == nil && p == nil:
			t.Fatal("no policy and no error")
		case err == nil:
			return
		case p != nil:
			t.Fatalf("error %q with a policy %+v", err, p)
		case !strings.HasPrefix(err.Error(), "authorization "+a.GetNamespace()+"/"+a.GetName()+": "):
			t.Fatalf("error %q does not name the policy %s/%s", err, a.GetNamespace(), a.GetName())
		}
		fc := failClosed(&a)
		switch {
		case fc == nil:
		case fc.Action == policy.ActionDeny && (len(fc.Groups) != 1 || len(fc.Groups[0].Clauses) != 0):
			t.Fatalf("fail-closed DENY %+v does not match every connection", fc)
		case fc.Action == policy.ActionAllow && len(fc.Groups) != 0:
			t.Fatalf("fail-closed ALLOW %+v matches something", fc)
		case fc.Action != policy.ActionDeny && fc.Action != policy.ActionAllow:
			t.Fatalf("fail-closed policy %+v is neither DENY nor ALLOW", fc)
		}
	})
}
