package xds

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/emptypb"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/redirector-mesh/redirector/internal/promtest"
	"github.com/redirector-mesh/redirector/internal/syncbuf"
	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/policy"
)

// fakeADS is an in-process delta ADS server the test drives stream by
// stream.
type fakeADS struct {
	discoveryv3.UnimplementedAggregatedDiscoveryServiceServer
	streams chan *fakeStream
}

type fakeStream struct {
	discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesServer
	end chan error
}

func (f *fakeADS) DeltaAggregatedResources(s discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	st := &fakeStream{AggregatedDiscoveryService_DeltaAggregatedResourcesServer: s, end: make(chan error)}
	select {
	case f.streams <- st:
	case <-s.Context().Done():
		return s.Context().Err()
	}
	select {
	case err := <-st.end:
		return err
	case <-s.Context().Done():
		return s.Context().Err()
	}
}

type harness struct {
	t       *testing.T
	ads     *fakeADS
	updates chan *Snapshot
	metrics *Metrics
}

func startClient(t *testing.T, mod func(*Config)) *harness {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	ads := &fakeADS{streams: make(chan *fakeStream)}
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(srv, ads)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("passthrough:///fake", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return runClient(t, ads, conn, mod)
}

// runClient runs a client on conn to ads until the test ends.
func runClient(t *testing.T, ads *fakeADS, conn grpc.ClientConnInterface, mod func(*Config)) *harness {
	t.Helper()
	h := &harness{t: t, ads: ads, updates: make(chan *Snapshot, 16), metrics: NewMetrics(nil)}
	cfg := Config{
		Conn:       conn,
		Node:       Node{IP: netip.MustParseAddr("10.0.0.9"), PodName: "redirector-abc", PodNamespace: "istio-system", NodeName: "node-a", ClusterID: "Kubernetes"},
		Token:      func() (string, error) { return "tok", nil },
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond,
		Metrics: h.metrics,
	}
	if mod != nil {
		mod(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Run(ctx, func(s *Snapshot) { h.updates <- s })
	}()
	t.Cleanup(func() { cancel(); <-done })
	return h
}

// accept waits for the next stream and reads its two subscriptions.
func (h *harness) accept() (*fakeStream, []*discoveryv3.DeltaDiscoveryRequest) {
	h.t.Helper()
	var st *fakeStream
	select {
	case st = <-h.ads.streams:
	case <-time.After(10 * time.Second):
		h.t.Fatal("the client opened no stream")
	}
	var subs []*discoveryv3.DeltaDiscoveryRequest
	for range 2 {
		req, err := st.Recv()
		if err != nil {
			h.t.Fatal(err)
		}
		subs = append(subs, req)
	}
	return st, subs
}

func (h *harness) next() *Snapshot {
	h.t.Helper()
	select {
	case s := <-h.updates:
		return s
	case <-time.After(10 * time.Second):
		h.t.Fatal("no snapshot")
		return nil
	}
}

func send(t *testing.T, st *fakeStream, typ, nonce string, removed []string, res ...*discoveryv3.Resource) *discoveryv3.DeltaDiscoveryRequest {
	t.Helper()
	if err := st.Send(&discoveryv3.DeltaDiscoveryResponse{TypeUrl: typ, Nonce: nonce, Resources: res, RemovedResources: removed}); err != nil {
		t.Fatal(err)
	}
	ack, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if ack.GetResponseNonce() != nonce || ack.GetTypeUrl() != typ {
		t.Fatalf("answer to %s: nonce %q type %q", nonce, ack.GetResponseNonce(), ack.GetTypeUrl())
	}
	return ack
}

func resource(t *testing.T, name, version, typ string, m proto.Message) *discoveryv3.Resource {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return &discoveryv3.Resource{Name: name, Version: version, Resource: &anypb.Any{TypeUrl: typ, Value: b}}
}

func wlAddr(uid, name string, ip string, services map[string]*workloadapi.PortList, policies ...string) *workloadapi.Address {
	return &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: &workloadapi.Workload{
		Uid: uid, Name: name, Namespace: "shop", Addresses: [][]byte{netip.MustParseAddr(ip).AsSlice()},
		TunnelProtocol: workloadapi.TunnelProtocol_HBONE, TrustDomain: "cluster.local", ServiceAccount: "web",
		Node: "node-a", CanonicalName: "web", CanonicalRevision: "v1", Services: services, AuthorizationPolicies: policies,
	}}}
}

func svcAddr(name, vip string, port, target uint32) *workloadapi.Address {
	return &workloadapi.Address{Type: &workloadapi.Address_Service{Service: &workloadapi.Service{
		Name: name, Namespace: "shop", Hostname: name + ".shop.svc.cluster.local",
		Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr(vip).AsSlice()}},
		Ports:     []*workloadapi.Port{{ServicePort: port, TargetPort: target, AppProtocol: workloadapi.AppProtocol_HTTP2}},
	}}}
}

func strictAuthz() *security.Authorization {
	return &security.Authorization{Name: "istio_converted_static_strict", Namespace: "istio-system", Scope: security.Scope_WORKLOAD_SELECTOR, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{NotPrincipals: []*security.StringMatch{{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}}}}}}}}}
}

func TestClientSubscribesAsZtunnelAndTranslates(t *testing.T) {
	h := startClient(t, nil)
	st, subs := h.accept()
	md, _ := metadata.FromIncomingContext(st.Context())
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer tok" {
		t.Errorf("authorization header %q", got)
	}
	if got := md.Get("clusterid"); len(got) != 1 || got[0] != "Kubernetes" {
		t.Errorf("ClusterID header %q", got)
	}
	if subs[0].GetTypeUrl() != TypeAddress || subs[1].GetTypeUrl() != TypeAuthorization {
		t.Fatalf("subscribed to %s, %s", subs[0].GetTypeUrl(), subs[1].GetTypeUrl())
	}
	node := subs[0].GetNode()
	if want := "ztunnel~10.0.0.9~redirector-abc.istio-system~istio-system.svc.cluster.local"; node.GetId() != want {
		t.Errorf("node id %q, want %q", node.GetId(), want)
	}
	meta := node.GetMetadata().GetFields()
	for k, want := range map[string]string{"NAME": "redirector-abc", "NAMESPACE": "istio-system", "INSTANCE_IPS": "10.0.0.9", "NODE_NAME": "node-a", "CLUSTER_ID": "Kubernetes", "ISTIO_VERSION": DefaultIstioVersion} {
		if got := meta[k].GetStringValue(); got != want {
			t.Errorf("metadata %s = %q, want %q", k, got, want)
		}
	}

	svcKey := "shop/web.shop.svc.cluster.local"
	ack := send(t, st, TypeAddress, "n1", nil,
		resource(t, "Kubernetes//Pod/shop/web-1", "v1", TypeAddress, wlAddr("Kubernetes//Pod/shop/web-1", "web-1", "10.1.0.5",
			map[string]*workloadapi.PortList{svcKey: {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}}}, "istio-system/istio_converted_static_strict")),
		resource(t, svcKey, "v1", TypeAddress, svcAddr("web", "10.96.0.10", 80, 0)))
	if ack.GetErrorDetail() != nil {
		t.Fatalf("NACK: %v", ack.GetErrorDetail())
	}
	select {
	case <-h.updates:
		t.Fatal("a snapshot before Authorization answered would run without policies")
	case <-time.After(100 * time.Millisecond):
	}
	send(t, st, TypeAuthorization, "n2", nil, resource(t, "istio-system/istio_converted_static_strict", "v1", TypeAuthorization, strictAuthz()))
	s := h.next()

	if len(s.Workloads) != 1 || len(s.Services) != 1 || len(s.Policies) != 1 {
		t.Fatalf("snapshot: %d workloads, %d services, %d policies", len(s.Workloads), len(s.Services), len(s.Policies))
	}
	w := s.Workloads[0]
	if w.Identity() != "spiffe://cluster.local/ns/shop/sa/web" || !w.Enrolled || w.Node != "node-a" || w.CanonicalRevision != "v1" || w.Addrs[0] != netip.MustParseAddr("10.1.0.5") {
		t.Errorf("workload %+v", w)
	}
	svc := s.Services[0]
	if svc.VIPs[0] != netip.MustParseAddr("10.96.0.10") || svc.Ports[0].AppProtocol != "HTTP2" || len(svc.Endpoints) != 1 {
		t.Fatalf("service %+v", svc)
	}
	if ep := svc.Endpoints[0]; ep.Addr != netip.MustParseAddr("10.1.0.5") || ep.Ports["80"] != 8080 || ep.Workload == nil {
		t.Errorf("endpoint %+v: want 10.1.0.5 serving port 80 on 8080", ep)
	}
	p := s.Policies[0]
	dst := policy.Target{Namespace: "shop", Port: 8080}
	if v := policy.AuthorizeCompiled(s.Policies, dst, w.Policies, policy.Peer{Addr: netip.MustParseAddr("10.1.0.7")}); v.Allowed {
		t.Errorf("plaintext under %s allowed: %s", p.Key(), v.Reason)
	}
	if v := policy.AuthorizeCompiled(s.Policies, dst, w.Policies, policy.Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/db"}); !v.Allowed {
		t.Errorf("mTLS under %s denied: %s", p.Key(), v.Reason)
	}
	expectMetric(t, h.metrics, `redirector_xds_resources{type="Address"}`, 2)
}

func TestClientNacksOnlyTheBadResource(t *testing.T) {
	h := startClient(t, nil)
	st, _ := h.accept()
	bad := wlAddr("Kubernetes//Pod/shop/bad", "bad", "10.1.0.6", nil)
	bad.GetWorkload().Addresses = [][]byte{{10, 1, 0}}
	ack := send(t, st, TypeAddress, "n1", nil,
		resource(t, "Kubernetes//Pod/shop/good", "v1", TypeAddress, wlAddr("Kubernetes//Pod/shop/good", "good", "10.1.0.5", nil)),
		resource(t, "Kubernetes//Pod/shop/bad", "v1", TypeAddress, bad))
	msg := ack.GetErrorDetail().GetMessage()
	if !strings.Contains(msg, "Kubernetes//Pod/shop/bad") || !strings.Contains(msg, "3 bytes") || strings.Contains(msg, "good") {
		t.Fatalf("NACK error_detail %q: want the bad resource and why, not the good one", msg)
	}
	badPolicy := strictAuthz()
	badPolicy.Name = "broken"
	badPolicy.Groups[0].Rules[0].Matches[0].NotPrincipals[0].MatchType = nil
	ack = send(t, st, TypeAuthorization, "n2", nil, resource(t, "istio-system/broken", "v1", TypeAuthorization, badPolicy))
	if msg := ack.GetErrorDetail().GetMessage(); !strings.Contains(msg, "istio-system/broken") || !strings.Contains(msg, "not_principals") {
		t.Fatalf("NACK error_detail %q", msg)
	}
	s := h.next()
	if len(s.Workloads) != 1 || s.Workloads[0].Name != "good" {
		t.Fatalf("want only the good workload applied, got %d workloads", len(s.Workloads))
	}
	// The broken DENY is held fail-closed: it denies everything it selects.
	if len(s.Policies) != 1 || s.Policies[0].Key() != "istio-system/broken" {
		t.Fatalf("policies %v, want the broken one held fail-closed", s.Policies)
	}
	if v := policy.AuthorizeCompiled(s.Policies, policy.Target{Namespace: "shop"}, []string{"istio-system/broken"}, policy.Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/web"}); v.Allowed {
		t.Errorf("a broken DENY policy let mTLS through: %s", v.Reason)
	}
	expectMetric(t, h.metrics, `redirector_xds_nacks_total{type="Address"}`, 1)
	expectMetric(t, h.metrics, `redirector_xds_rejected_resources_total{reason="invalid",type="Authorization"}`, 1)
}

func TestClientBoundsResources(t *testing.T) {
	h := startClient(t, func(c *Config) { c.MaxResources = 1 })
	st, _ := h.accept()
	ack := send(t, st, TypeAddress, "n1", nil,
		resource(t, "a", "v1", TypeAddress, wlAddr("a", "a", "10.1.0.5", nil)),
		resource(t, "b", "v1", TypeAddress, wlAddr("b", "b", "10.1.0.6", nil)))
	if msg := ack.GetErrorDetail().GetMessage(); !strings.Contains(msg, "over the limit of 1") {
		t.Fatalf("NACK %q", msg)
	}
	// An update of a held name is not a new one.
	if ack := send(t, st, TypeAddress, "n2", nil, resource(t, "a", "v2", TypeAddress, wlAddr("a", "a", "10.1.0.7", nil))); ack.GetErrorDetail() != nil {
		t.Fatalf("update of a held resource NACKed: %v", ack.GetErrorDetail())
	}
	expectMetric(t, h.metrics, `redirector_xds_rejected_resources_total{reason="limit",type="Address"}`, 1)
}

func TestClientBoundsBytes(t *testing.T) {
	one := resource(t, "a", "v1", TypeAddress, wlAddr("a", "a", "10.1.0.5", nil))
	size, err := charge(one.GetResource().GetValue(), addressDesc, DefaultMaxResourceMessages)
	if err != nil {
		t.Fatal(err)
	}
	h := startClient(t, func(c *Config) { c.MaxTypeBytes = size + 10 })
	st, _ := h.accept()
	ack := send(t, st, TypeAddress, "n1", nil, one, resource(t, "b", "v1", TypeAddress, wlAddr("b", "b", "10.1.0.6", nil)))
	if msg := ack.GetErrorDetail().GetMessage(); !strings.Contains(msg, "b: over the limit of") || !strings.Contains(msg, "bytes") {
		t.Fatalf("NACK %q", msg)
	}
	// What is held is counted, name and version included.
	expectMetric(t, h.metrics, `redirector_xds_resource_bytes{type="Address"}`, float64(size+len("a")+len("v1")))
	// Removing a resource frees its bytes.
	if ack := send(t, st, TypeAddress, "n2", []string{"a"}, resource(t, "b", "v1", TypeAddress, wlAddr("b", "b", "10.1.0.6", nil))); ack.GetErrorDetail() != nil {
		t.Fatalf("NACK after a removal made room: %v", ack.GetErrorDetail())
	}
}

// TestClientResumesWithoutDrop: after the stream breaks the client keeps
// its state (no empty snapshot), tells istiod what it holds, and applies
// only what changed.
func TestClientResumesWithoutDrop(t *testing.T) {
	h := startClient(t, nil)
	st, _ := h.accept()
	send(t, st, TypeAddress, "n1", nil,
		resource(t, "a", "v1", TypeAddress, wlAddr("a", "a", "10.1.0.5", nil)),
		resource(t, "b", "v1", TypeAddress, wlAddr("b", "b", "10.1.0.6", nil)))
	send(t, st, TypeAuthorization, "n2", nil)
	if s := h.next(); len(s.Workloads) != 2 {
		t.Fatalf("%d workloads", len(s.Workloads))
	}
	st.end <- nil // istiod goes away

	st, subs := h.accept()
	if got := subs[0].GetInitialResourceVersions(); len(got) != 2 || got["a"] != "v1" || got["b"] != "v1" {
		t.Fatalf("initial_resource_versions %v, want a and b at v1", got)
	}
	if subs[0].GetNode().GetId() == "" {
		t.Error("the first request of a new stream carries no node")
	}
	select {
	case s := <-h.updates:
		t.Fatalf("a snapshot (%d workloads) while reconnecting", len(s.Workloads))
	default:
	}
	send(t, st, TypeAddress, "n3", []string{"b"})
	if s := h.next(); len(s.Workloads) != 1 || s.Workloads[0].Name != "a" {
		t.Fatalf("after resume: %d workloads", len(s.Workloads))
	}
	expectMetric(t, h.metrics, `redirector_xds_connects_total{result="ok"}`, 2)
}

// TestClientWaitsForPolicies: the first snapshot came FirstSyncGrace
// after Address even if Authorization had not answered, with no policies:
// the policy set then admitted everything, plaintext under STRICT
// included, until istiod's policies arrived (or for ever, were they never
// to). istiod answers every subscription, even with nothing, so the first
// snapshot now waits for every type; until then inbound stays refused.
func TestClientWaitsForPolicies(t *testing.T) {
	h := startClient(t, func(c *Config) { c.FirstSyncGrace = 50 * time.Millisecond })
	st, _ := h.accept()
	send(t, st, TypeAddress, "n1", nil, resource(t, "a", "v1", TypeAddress, wlAddr("a", "a", "10.1.0.5", nil)))
	select {
	case s := <-h.updates:
		t.Fatalf("a snapshot (%d policies) before istiod's policies arrived", len(s.Policies))
	case <-time.After(300 * time.Millisecond):
	}
	send(t, st, TypeAuthorization, "n2", nil, resource(t, "istio-system/istio_converted_static_strict", "v1", TypeAuthorization, strictAuthz()))
	if s := h.next(); len(s.Workloads) != 1 || len(s.Policies) != 1 {
		t.Fatalf("%d workloads, %d policies", len(s.Workloads), len(s.Policies))
	}
}

// TestClientWarnsOfASilentStream: a stream istiod (here a stand-in that
// takes the subscriptions and answers nothing) accepted but never answers
// was waited on with nothing logged past the dial; it is now named once,
// SilentWarn after it opened, and still waited on.
func TestClientWarnsOfASilentStream(t *testing.T) {
	var logs syncbuf.Buffer
	h := startClient(t, func(c *Config) {
		c.SilentWarn = 50 * time.Millisecond
		c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	st, _ := h.accept()
	waitfor.Until(t, "the warning of a silent stream", func() bool {
		return strings.Contains(logs.String(), "has sent no response")
	})
	time.Sleep(150 * time.Millisecond)
	if n := strings.Count(logs.String(), "has sent no response"); n != 1 {
		t.Errorf("warned %d times of one silent stream, want once", n)
	}
	send(t, st, TypeAddress, "n1", nil, resource(t, "a", "v1", TypeAddress, wlAddr("a", "a", "10.1.0.5", nil)))
	send(t, st, TypeAuthorization, "n2", nil)
	if s := h.next(); len(s.Workloads) != 1 {
		t.Fatalf("%d workloads after the late answer, want 1", len(s.Workloads))
	}
}

func expectMetric(t *testing.T, m *Metrics, key string, want float64) {
	t.Helper()
	if got := promtest.Scrape(t, m)[key]; got != want {
		t.Errorf("%s = %v, want %v", key, got, want)
	}
}

// TestClientHoldsUnresolvedPolicies: an Authorization that cannot be held
// even fail-closed (an unknown scope, undecodable, over the limit) was
// dropped, and with it a DENY of unknown reach. It is now listed in the
// snapshot, which makes the policy set refuse everything, until istiod
// removes it or sends a version that applies.
func TestClientHoldsUnresolvedPolicies(t *testing.T) {
	h := startClient(t, func(c *Config) { c.MaxResources = 2 })
	st, _ := h.accept()
	send(t, st, TypeAddress, "n1", nil)
	future := strictAuthz()
	future.Name, future.Scope = "future", security.Scope(7)
	ack := send(t, st, TypeAuthorization, "n2", nil,
		resource(t, "istio-system/future", "v1", TypeAuthorization, future),
		&discoveryv3.Resource{Name: "istio-system/garbage", Version: "v1", Resource: &anypb.Any{TypeUrl: TypeAuthorization, Value: []byte{0xff, 0xff}}})
	if msg := ack.GetErrorDetail().GetMessage(); !strings.Contains(msg, "istio-system/future") || !strings.Contains(msg, "istio-system/garbage") {
		t.Fatalf("NACK %q", msg)
	}
	s := h.next()
	if strings.Join(s.Unresolved, ",") != "istio-system/future,istio-system/garbage" {
		t.Fatalf("unresolved %v", s.Unresolved)
	}
	set := policy.CompiledSet{Synced: true, Policies: s.Policies, Unresolved: s.Unresolved}
	if v := set.Authorize(policy.Target{Namespace: "shop"}, "shop/web", policy.Peer{Authenticated: true, Principal: "cluster.local/ns/shop/sa/web"}); v.Allowed {
		t.Errorf("allowed beside a policy of unknown scope: %s", v.Reason)
	}
	expectMetric(t, h.metrics, `redirector_xds_unresolved_policies`, 2)

	// Fixed by istiod, removed, and one over the limit of 2 held.
	fixed := strictAuthz()
	fixed.Name = "future"
	send(t, st, TypeAuthorization, "n3", []string{"istio-system/garbage"}, resource(t, "istio-system/future", "v2", TypeAuthorization, fixed))
	if s := h.next(); len(s.Unresolved) != 0 || len(s.Policies) != 1 {
		t.Fatalf("unresolved %v, %d policies", s.Unresolved, len(s.Policies))
	}
	b, c := strictAuthz(), strictAuthz()
	b.Namespace, b.Name, c.Namespace, c.Name = "a", "b", "a", "c"
	send(t, st, TypeAuthorization, "n4", nil, resource(t, "a/b", "v1", TypeAuthorization, b), resource(t, "a/c", "v1", TypeAuthorization, c))
	if s := h.next(); strings.Join(s.Unresolved, ",") != "a/c" {
		t.Fatalf("unresolved %v, want the policy over the limit", s.Unresolved)
	}

	// A new stream: istiod sends again what the client does not hold, so
	// the list is rebuilt from its first answer.
	st.end <- nil
	st, _ = h.accept()
	send(t, st, TypeAuthorization, "n5", nil)
	if s := h.next(); len(s.Unresolved) != 0 {
		t.Fatalf("unresolved %v after istiod no longer sends it", s.Unresolved)
	}
}

// TestClientCountsAnUnresolvedPolicyOnce: a policy whose name cannot be
// kept (over MaxNameBytes, or past maxUnresolved) was counted again each
// time istiod resent it, so redirector_xds_unresolved_policies and the
// "(N more)" of every refusal grew with pushes for one policy, and nothing
// could clear them before the next stream. Now such names are kept by hash:
// counted once, and cleared by a removal or a version that applies.
func TestClientCountsAnUnresolvedPolicyOnce(t *testing.T) {
	h := startClient(t, nil)
	st, _ := h.accept()
	send(t, st, TypeAddress, "n1", nil)
	long := "istio-system/" + strings.Repeat("x", MaxNameBytes)
	bad := strictAuthz()
	bad.Name, bad.Scope = long[len("istio-system/"):], security.Scope(7)
	var s *Snapshot
	for _, nonce := range []string{"n2", "n3", "n4", "n5"} {
		send(t, st, TypeAuthorization, nonce, nil, resource(t, long, "v1", TypeAuthorization, bad))
		s = h.next()
	}
	if strings.Join(s.Unresolved, ",") != "(1 more)" {
		t.Errorf("unresolved %v after four pushes of one policy, want (1 more)", s.Unresolved)
	}
	expectMetric(t, h.metrics, `redirector_xds_unresolved_policies`, 1)

	send(t, st, TypeAuthorization, "n6", []string{long})
	if s := h.next(); len(s.Unresolved) != 0 {
		t.Errorf("unresolved %v after istiod removed the policy", s.Unresolved)
	}
	expectMetric(t, h.metrics, `redirector_xds_unresolved_policies`, 0)
}

// TestClientBoundsDecodedSize: an empty nested message is 2 bytes on the
// wire and hundreds once decoded and translated, so the encoded size
// alone bounded nothing (64 MiB of empty matches decode to gigabytes). A
// resource with more than MaxResourceMessages messages is rejected before
// it is decoded, and what is held is charged per message too.
func TestClientBoundsDecodedSize(t *testing.T) {
	h := startClient(t, func(c *Config) { c.MaxResourceMessages = 50 })
	st, _ := h.accept()
	send(t, st, TypeAddress, "n1", nil)
	wide := strictAuthz()
	wide.Name = "wide"
	for range 100 {
		wide.Groups[0].Rules[0].Matches = append(wide.Groups[0].Rules[0].Matches, &security.Match{})
	}
	ack := send(t, st, TypeAuthorization, "n2", nil, resource(t, "istio-system/wide", "v1", TypeAuthorization, wide))
	if msg := ack.GetErrorDetail().GetMessage(); !strings.Contains(msg, "istio-system/wide") || !strings.Contains(msg, "more than 50 messages") {
		t.Fatalf("NACK %q", msg)
	}
	if s := h.next(); len(s.Policies) != 0 || len(s.Unresolved) != 1 {
		t.Fatalf("%d policies, unresolved %v: want the policy rejected and unresolved", len(s.Policies), s.Unresolved)
	}
	expectMetric(t, h.metrics, `redirector_xds_rejected_resources_total{reason="limit",type="Authorization"}`, 1)

	r := resource(t, "istio-system/strict", "v1", TypeAuthorization, strictAuthz())
	want, err := charge(r.GetResource().GetValue(), authorizationDesc, 50)
	if err != nil {
		t.Fatal(err)
	}
	// 5 messages: group, rules, match, string match, empty.
	if n := len(r.GetResource().GetValue()); want != n+resourceOverhead+5*messageOverhead {
		t.Errorf("charged %d for %d bytes", want, n)
	}
}

// TestClientBacksOffFromFlappingStreams: a stream that delivers a
// response and then breaks at once did reset the backoff, so an istiod
// (or a proxy in front of it) failing every stream right after its first
// push drew a reconnect every MinBackoff from every node. Only a stream
// that stayed up for MaxBackoff resets it now.
func TestClientBacksOffFromFlappingStreams(t *testing.T) {
	h := startClient(t, func(c *Config) { c.MinBackoff, c.MaxBackoff = 50*time.Millisecond, 10*time.Second })
	st, _ := h.accept()
	start := time.Now()
	for range 4 {
		send(t, st, TypeAddress, "n", nil)
		st.end <- nil
		st, _ = h.accept()
	}
	// Waits of at least 25, 50, 100 and 200 ms (the delay less up to half).
	if d := time.Since(start); d < 375*time.Millisecond {
		t.Errorf("4 reconnects after flapping streams took %v, want the backoff to grow", d)
	}
}

// TestClientRefusesMisnamedResources: istiod names a workload by its uid,
// a service namespace/hostname and a policy namespace/name. A resource
// held under another name stood beside the one of its own name (two
// versions of one policy, both evaluated) and outlived istiod's removal
// of it. It is now rejected, naming both; a misnamed policy is unresolved
// (its reach is unknown), so inbound connections fail closed.
func TestClientRefusesMisnamedResources(t *testing.T) {
	h := startClient(t, nil)
	st, _ := h.accept()
	ack := send(t, st, TypeAddress, "n1", nil,
		resource(t, "Kubernetes//Pod/shop/web-1", "v1", TypeAddress, wlAddr("Kubernetes//Pod/shop/web-2", "web-2", "10.1.0.5", nil)),
		resource(t, "shop/other.shop.svc.cluster.local", "v1", TypeAddress, svcAddr("web", "10.96.0.10", 80, 0)))
	msg := ack.GetErrorDetail().GetMessage()
	for _, want := range []string{`Kubernetes//Pod/shop/web-1: resource name is not that of its content, "Kubernetes//Pod/shop/web-2"`, `shop/other.shop.svc.cluster.local: resource name is not that of its content, "shop/web.shop.svc.cluster.local"`} {
		if !strings.Contains(msg, want) {
			t.Errorf("NACK %q, want %q", msg, want)
		}
	}
	allow := &security.Authorization{Name: "allow-all", Namespace: "shop", Scope: security.Scope_NAMESPACE, Action: security.Action_ALLOW,
		Groups: []*security.Group{{Rules: []*security.Rules{{}}}}}
	ack = send(t, st, TypeAuthorization, "n2", nil, resource(t, "istio-system/istio_converted_static_strict", "v1", TypeAuthorization, allow))
	if msg := ack.GetErrorDetail().GetMessage(); !strings.Contains(msg, `resource name is not that of its content, "shop/allow-all"`) {
		t.Fatalf("NACK %q", msg)
	}
	s := h.next()
	if len(s.Workloads) != 0 || len(s.Services) != 0 || len(s.Policies) != 0 {
		t.Fatalf("held %d workloads, %d services, %d policies; want none", len(s.Workloads), len(s.Services), len(s.Policies))
	}
	if strings.Join(s.Unresolved, ",") != "istio-system/istio_converted_static_strict" {
		t.Fatalf("unresolved %v, want the misnamed policy", s.Unresolved)
	}
	expectMetric(t, h.metrics, `redirector_xds_rejected_resources_total{reason="invalid",type="Address"}`, 2)
}

// TestClientBoundsNamesAndNacks: resource names and versions were held
// (and sent back on a reconnect) without a bound or a charge, an
// unresolved policy's name was kept whatever its length and quoted in
// every refused connection, and a NACK listed every rejected resource in
// full, in one message and one log line. Names and versions are now
// bounded and charged, the unresolved names listed are bounded, and a
// NACK lists at most maxNackErrors errors of at most maxErrorBytes.
func TestClientBoundsNamesAndNacks(t *testing.T) {
	h := startClient(t, nil)
	st, _ := h.accept()
	send(t, st, TypeAddress, "n1", nil)
	long := "istio-system/" + strings.Repeat("x", MaxNameBytes)
	p := strictAuthz()
	p.Name = long[len("istio-system/"):]
	ack := send(t, st, TypeAuthorization, "n2", nil, resource(t, long, "v1", TypeAuthorization, p))
	if msg := ack.GetErrorDetail().GetMessage(); !strings.Contains(msg, fmt.Sprintf("name of %d bytes", len(long))) || len(msg) > maxErrorBytes*5/4+40 {
		t.Fatalf("NACK of %d bytes %.200q", len(msg), msg)
	}
	if s := h.next(); strings.Join(s.Unresolved, ",") != "(1 more)" {
		t.Fatalf("unresolved %.200q, want the over-long name counted, not kept", s.Unresolved)
	}
	ack = send(t, st, TypeAuthorization, "n3", []string{long}, resource(t, "istio-system/istio_converted_static_strict", strings.Repeat("v", MaxVersionBytes+1), TypeAuthorization, strictAuthz()))
	if msg := ack.GetErrorDetail().GetMessage(); !strings.Contains(msg, fmt.Sprintf("version of %d bytes", MaxVersionBytes+1)) {
		t.Fatalf("NACK %.200q", msg)
	}
	h.next()
	expectMetric(t, h.metrics, `redirector_xds_rejected_resources_total{reason="limit",type="Authorization"}`, 2)

	// Many rejected policies: the NACK and the snapshot list a few.
	var bad []*discoveryv3.Resource
	for i := range 100 {
		bad = append(bad, &discoveryv3.Resource{Name: fmt.Sprintf("istio-system/bad-%03d", i), Resource: &anypb.Any{TypeUrl: TypeAuthorization, Value: []byte{0xff}}})
	}
	ack = send(t, st, TypeAuthorization, "n4", nil, bad...)
	msg := ack.GetErrorDetail().GetMessage()
	if n := strings.Count(msg, "istio-system/bad-"); n != maxNackErrors || !strings.HasSuffix(msg, fmt.Sprintf("and %d more rejected", 100-maxNackErrors)) {
		t.Fatalf("NACK lists %d resources: %.300q", n, msg)
	}
	s := h.next()
	if len(s.Unresolved) != maxListedUnresolved+1 || s.Unresolved[maxListedUnresolved] != fmt.Sprintf("(%d more)", 100-maxListedUnresolved+1) {
		t.Fatalf("unresolved lists %d: %v", len(s.Unresolved), s.Unresolved)
	}
	// The 100 and the policy whose version was too long (the over-long
	// name, kept by hash, went with its removal).
	expectMetric(t, h.metrics, `redirector_xds_unresolved_policies`, 101)

	// The names kept are bounded too (they were by MaxResources, 200k of
	// up to 1 KiB each); the rest are counted.
	bad = bad[:0]
	for i := range maxUnresolved {
		bad = append(bad, &discoveryv3.Resource{Name: fmt.Sprintf("istio-system/more-%04d", i), Resource: &anypb.Any{TypeUrl: TypeAuthorization, Value: []byte{0xff}}})
	}
	send(t, st, TypeAuthorization, "n5", nil, bad...)
	h.next()
	expectMetric(t, h.metrics, `redirector_xds_unresolved_policies`, float64(101+maxUnresolved))
	// Removing every name clears them all, those kept by name and those
	// kept by hash past maxUnresolved.
	var all []string
	for i := range 100 {
		all = append(all, fmt.Sprintf("istio-system/bad-%03d", i))
	}
	for i := range maxUnresolved {
		all = append(all, fmt.Sprintf("istio-system/more-%04d", i))
	}
	send(t, st, TypeAuthorization, "n6", append(all, "istio-system/istio_converted_static_strict"))
	h.next()
	expectMetric(t, h.metrics, `redirector_xds_unresolved_policies`, 0)
}

// TestClientClipsUnknownTypes: a response of a type never subscribed is
// NACKed; its type URL, istiod's text, was echoed whole in the NACK and
// the log line.
func TestClientClipsUnknownTypes(t *testing.T) {
	h := startClient(t, nil)
	st, _ := h.accept()
	typ := "type.googleapis.com/" + strings.Repeat("x", 100_000)
	if err := st.Send(&discoveryv3.DeltaDiscoveryResponse{TypeUrl: typ, Nonce: "n1"}); err != nil {
		t.Fatal(err)
	}
	nack, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if msg := nack.GetErrorDetail().GetMessage(); !strings.HasSuffix(msg, "was not subscribed") || len(msg)+len(nack.GetTypeUrl()) > maxErrorBytes {
		t.Fatalf("NACK of type %d bytes, message %d bytes: %.100q", len(nack.GetTypeUrl()), len(msg), msg)
	}
}

// TestClientChargesNames: a name is held, so it is charged against
// MaxTypeBytes with the value.
func TestClientChargesNames(t *testing.T) {
	name := "Kubernetes//Pod/shop/" + strings.Repeat("w", 900)
	r := resource(t, name, "v1", TypeAddress, wlAddr(name, "w", "10.1.0.5", nil))
	size, err := charge(r.GetResource().GetValue(), addressDesc, DefaultMaxResourceMessages)
	if err != nil {
		t.Fatal(err)
	}
	h := startClient(t, func(c *Config) { c.MaxTypeBytes = size + 100 })
	st, _ := h.accept()
	if msg := send(t, st, TypeAddress, "n1", nil, r).GetErrorDetail().GetMessage(); !strings.Contains(msg, "over the limit of") {
		t.Fatalf("NACK %.200q: want the name charged", msg)
	}
}

// TestClientPacesSnapshots: every response, however small, made a
// snapshot of everything held (O(state): a quarter of a second at 100k
// workloads), so a stream of tiny updates kept a core busy. A burst of
// responses now makes one snapshot, and the last state is in it.
func TestClientPacesSnapshots(t *testing.T) {
	h := startClient(t, func(c *Config) { c.SnapshotGap = 300 * time.Millisecond })
	st, _ := h.accept()
	send(t, st, TypeAuthorization, "a", nil)
	for i := range 10 {
		name := fmt.Sprintf("w%d", i)
		send(t, st, TypeAddress, name, nil, resource(t, name, "v1", TypeAddress, wlAddr(name, name, fmt.Sprintf("10.1.0.%d", i+1), nil)))
	}
	time.Sleep(500 * time.Millisecond)
	var last *Snapshot
	n := len(h.updates)
	for range n {
		last = <-h.updates
	}
	if n > 2 || last == nil || len(last.Workloads) != 10 {
		t.Fatalf("%d snapshots for 11 responses, the last with %v; want one or two, the last with all 10 workloads", n, last)
	}
}

// TestPublisherBacksOffFromCostlySnapshots: after a snapshot that took d
// to build, the next comes no sooner than 3d later, so building takes at
// most a quarter of the time whatever the gap.
func TestPublisherBacksOffFromCostlySnapshots(t *testing.T) {
	p := newPublisher(time.Millisecond)
	p.changed()
	<-p.C()
	start := time.Now()
	p.publish(func() *Snapshot { time.Sleep(20 * time.Millisecond); return &Snapshot{} }, func(*Snapshot) {})
	p.changed()
	<-p.C()
	if d := time.Since(start); d < 80*time.Millisecond {
		t.Errorf("next snapshot due %v after one that took 20ms to build, want 80ms at least", d)
	}
}

// TestClientBoundsResponseFields: gRPC decoded a whole response before
// the client counted anything in it, and a removal of one byte on the wire
// is a string of 16 and more in memory (16 MiB of removals decoded to half
// a GiB). A response with more fields than MaxResources allows is now
// refused before it is decoded: the stream ends, the state held stays.
func TestClientBoundsResponseFields(t *testing.T) {
	var logs syncbuf.Buffer
	h := startClient(t, func(c *Config) {
		c.MaxResources = 10
		c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	st, _ := h.accept()
	send(t, st, TypeAddress, "n1", nil, resource(t, "a", "v1", TypeAddress, wlAddr("a", "a", "10.1.0.5", nil)))
	removed := make([]string, maxResponseFields(10)+1)
	for i := range removed {
		removed[i] = "x"
	}
	if err := st.Send(&discoveryv3.DeltaDiscoveryResponse{TypeUrl: TypeAddress, Nonce: "n2", RemovedResources: removed}); err != nil {
		t.Fatal(err)
	}
	_, subs := h.accept()
	if got := subs[0].GetInitialResourceVersions(); got["a"] != "v1" {
		t.Fatalf("after the refused response the client holds %v, want a at v1", got)
	}
	if want := fmt.Sprintf("more than %d fields in one response", maxResponseFields(10)); !strings.Contains(logs.String(), want) {
		t.Errorf("log %q, want %q", logs.String(), want)
	}
}

// TestClientCountsStreamsAsZtunnel: Istio's ztunnel dashboard reads
// istio_xds_message_total{url} and
// istio_xds_connection_terminations_total{reason}, which the agent did not
// export, so its "XDS Pushes" and "XDS Connections" panels were empty. They
// now count as ztunnel's do, and a type istiod was not asked for makes no
// series of its own.
func TestClientCountsStreamsAsZtunnel(t *testing.T) {
	h := startClient(t, nil)
	st, _ := h.accept()
	st.end <- nil // before any response: the stream never opened

	st, _ = h.accept()
	expectMetric(t, h.metrics, `istio_xds_connection_terminations_total{reason="ConnectionError"}`, 1)
	a := resource(t, "a", "v1", TypeAddress, wlAddr("a", "a", "10.1.0.5", nil))
	b := resource(t, "b", "v1", TypeAddress, wlAddr("b", "b", "10.1.0.6", nil))
	send(t, st, TypeAddress, "n1", nil, a, b)
	send(t, st, TypeAuthorization, "n2", nil)
	send(t, st, "type.googleapis.com/istio.unknown.Thing", "n3", nil)
	expectMetric(t, h.metrics, `istio_xds_message_total{url="`+TypeAddress+`"}`, 1)
	expectMetric(t, h.metrics, `istio_xds_message_total{url="`+TypeAuthorization+`"}`, 1)
	expectMetric(t, h.metrics, `istio_xds_message_bytes_total{url="`+TypeAddress+`"}`, float64(len(a.Resource.Value)+len(b.Resource.Value)))
	for k := range promtest.Scrape(t, h.metrics) {
		if strings.Contains(k, "istio.unknown") {
			t.Errorf("a series for a type istiod was not asked for: %s", k)
		}
	}
	st.end <- nil // istiod closes the stream cleanly

	for _, c := range []struct {
		end    error
		reason string
	}{
		{status.Error(codes.Unavailable, "transport is closing"), "Reconnect"},
		{status.Error(codes.PermissionDenied, "token rejected"), "Error"},
	} {
		st, _ = h.accept()
		send(t, st, TypeAddress, "n", nil)
		st.end <- c.end
	}
	h.accept()
	for reason, want := range map[string]float64{"ConnectionError": 1, "Complete": 1, "Reconnect": 1, "Error": 1} {
		expectMetric(t, h.metrics, `istio_xds_connection_terminations_total{reason="`+reason+`"}`, want)
	}
	expectMetric(t, h.metrics, `istio_xds_message_total{url="`+TypeAddress+`"}`, 3)
}

// TestClientDefaultsTakeAFullPush: istiod sends every Address a node
// holds in one response (the first on a stream, and after a reconnect all
// that changed meanwhile), so the bound on one response must admit as many
// resources as the client holds. A pod of a Deployment, as istiod 1.31
// describes it, is some 460 bytes in a delta response: the 64 MiB bound
// refused the first push of about 145k of them, while MaxResources admits
// 200k, and such a mesh never synced (every node unready, inbound refused,
// a full push asked of istiod at every reconnect). ztunnel takes 200 MiB.
func TestClientDefaultsTakeAFullPush(t *testing.T) {
	pod := &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: &workloadapi.Workload{
		Uid: "Kubernetes//Pod/payments/checkout-frontend-7d4b9c8f6-abcde", Name: "checkout-frontend-7d4b9c8f6-abcde", Namespace: "payments",
		Addresses: [][]byte{netip.MustParseAddr("10.12.34.56").AsSlice()}, TunnelProtocol: workloadapi.TunnelProtocol_HBONE,
		ServiceAccount: "checkout-frontend", Node: "ip-10-0-12-34.us-west-2.compute.internal", CanonicalName: "checkout-frontend", CanonicalRevision: "latest",
		WorkloadName: "checkout-frontend", WorkloadType: workloadapi.WorkloadType_DEPLOYMENT, ClusterId: "Kubernetes",
		Services: map[string]*workloadapi.PortList{"payments/checkout-frontend.payments.svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}}},
		Locality: &workloadapi.Locality{Region: "us-west-2", Zone: "us-west-2a"},
	}}}
	r := resource(t, "Kubernetes//Pod/payments/checkout-frontend-7d4b9c8f6-abcde", "a1b2c3d4e5f60718", TypeAddress, pod)
	one := proto.Size(&discoveryv3.DeltaDiscoveryResponse{Resources: []*discoveryv3.Resource{r}})
	each := proto.Size(&discoveryv3.DeltaDiscoveryResponse{Resources: []*discoveryv3.Resource{r, r}}) - one
	// Room for names half again as long as these.
	if need := DefaultMaxResources * each * 3 / 2; need > DefaultMaxMessageBytes {
		t.Errorf("a push of %d pods of %d bytes (names half again as long) is %d MiB, over DefaultMaxMessageBytes (%d MiB)",
			DefaultMaxResources, each, need>>20, DefaultMaxMessageBytes>>20)
	}
	// And the client holds them: what they are charged fits the bound per type.
	size, err := charge(r.GetResource().GetValue(), addressDesc, DefaultMaxResourceMessages)
	if err != nil {
		t.Fatal(err)
	}
	if held := DefaultMaxResources * (size + len(r.GetName()) + len(r.GetVersion())); held > DefaultMaxTypeBytes {
		t.Errorf("%d pods are charged %d MiB, over DefaultMaxTypeBytes", DefaultMaxResources, held>>20)
	}
}
