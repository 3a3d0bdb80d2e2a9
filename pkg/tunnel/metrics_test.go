package tunnel

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// bookinfo builds a directory with reviews-v1 and reviews-v2 (Deployment
// pods of the canonical service reviews), productpage, and the services
// reviews and reviews-v2-only over them.
func bookinfo(t testing.TB) *workload.Directory {
	t.Helper()
	pod := func(name, deploy, ip, version string) *workload.Workload {
		w := podObj("mesh", name, "bookinfo-"+deploy, ip, map[string]string{"app": strings.Split(deploy, "-")[0], "version": version})
		w.WorkloadName, w.WorkloadType = deploy, workload.TypeDeployment
		w.CanonicalName, w.CanonicalRevision = strings.Split(deploy, "-")[0], version
		return w
	}
	svc := func(name string, port, target int32, ips ...string) *workload.Service {
		s := &workload.Service{Namespace: "mesh", Name: name, Hostname: workload.ClusterHostname(name, "mesh"),
			VIPs:  []netip.Addr{netip.MustParseAddr("10.96.0." + fmt.Sprint(port%200))},
			Ports: []workload.ServicePort{{Name: "http", Port: port, Protocol: "TCP"}}}
		for _, ip := range ips {
			s.Endpoints = append(s.Endpoints, workload.Endpoint{Addr: netip.MustParseAddr(ip), Ready: true, Ports: map[string]int32{"http": target}})
		}
		return s
	}
	dir, errs := workload.NewDirectory([]*workload.Workload{
		pod("reviews-v1-7f9c8d-aaaaa", "reviews-v1", "10.1.0.11", "v1"),
		pod("reviews-v2-5b8d7c-bbbbb", "reviews-v2", "10.1.0.12", "v2"),
		pod("productpage-v1-6c7d8e-ccccc", "productpage-v1", "10.1.0.13", "v1"),
	}, []*workload.Service{svc("reviews", 9080, 9080, "10.1.0.11", "10.1.0.12"), svc("reviews-v2-only", 9081, 9080, "10.1.0.12")})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	return dir
}

func mustPod(t *testing.T, dir *workload.Directory, ip string) *workload.Workload {
	t.Helper()
	w, ok := dir.ByAddr(netip.MustParseAddr(ip))
	if !ok {
		t.Fatalf("no pod at %s", ip)
	}
	return w
}

// Both reporters label a connection with ztunnel's full label set: the
// workload is the Deployment, not the canonical service, and the
// destination reporter names the service the client asked for.
func TestIstioLabels(t *testing.T) {
	dir := bookinfo(t)
	pp, rv2 := mustPod(t, dir, "10.1.0.13"), mustPod(t, dir, "10.1.0.12")
	srcID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "bookinfo-productpage-v1"}
	dstID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "bookinfo-reviews-v2"}
	m := NewMetrics(nil)

	// The destination side picks the service from the Forwarded host among
	// the pod's services; without it, the first whose target port fits.
	if s := inboundService(dir, rv2, forwardedHost(`for="10.1.0.13";host=reviews-v2-only.mesh.svc.cluster.local`), 9080); s == nil || s.Name != "reviews-v2-only" {
		t.Errorf("service from the Forwarded host: %v", s)
	}
	if s := inboundService(dir, rv2, "", 9080); s == nil || s.Name != "reviews" {
		t.Errorf("service by target port: %v", s)
	}
	if s := inboundService(dir, rv2, "other.mesh.svc.cluster.local", 9999); s != nil {
		t.Errorf("a host the pod does not serve and no port match gave %v", s)
	}
	if s := inboundService(dir, pp, "reviews.mesh.svc.cluster.local", 9080); s != nil {
		t.Errorf("a service the pod is no endpoint of was named: %v", s)
	}

	svc := inboundService(dir, rv2, "reviews.mesh.svc.cluster.local", 9080)
	for _, reporter := range []string{"source", "destination"} {
		l := m.labels(connInfo{reporter: reporter, src: pp, srcID: srcID, dst: rv2, dstID: dstID, service: svc, secure: true})
		want := prometheus.Labels{
			"reporter":                  reporter,
			"source_workload":           "productpage-v1",
			"source_canonical_service":  "productpage",
			"source_canonical_revision": "v1",
			"source_workload_namespace": "mesh",
			"source_principal":          "spiffe://cluster.local/ns/mesh/sa/bookinfo-productpage-v1",
			"source_app":                "productpage",
			"source_version":            "v1",
			"source_cluster":            "Kubernetes",
			"destination_service":       "reviews.mesh.svc.cluster.local", "destination_service_namespace": "mesh", "destination_service_name": "reviews",
			"destination_workload":           "reviews-v2",
			"destination_canonical_service":  "reviews",
			"destination_canonical_revision": "v2",
			"destination_workload_namespace": "mesh",
			"destination_principal":          "spiffe://cluster.local/ns/mesh/sa/bookinfo-reviews-v2",
			"destination_app":                "reviews",
			"destination_version":            "v2",
			"destination_cluster":            "Kubernetes",
			"request_protocol":               "tcp", "response_flags": "-", "connection_security_policy": "mutual_tls",
			"source_region": "unknown", "source_zone": "unknown", "destination_region": "unknown", "destination_zone": "unknown",
		}
		if len(l) != len(istioLabels) {
			t.Errorf("%d labels, want ztunnel's %d", len(l), len(istioLabels))
		}
		for k, v := range want {
			if l[k] != v {
				t.Errorf("%s reporter: %s=%q, want %q", reporter, k, l[k], v)
			}
		}
	}
	// Unknown peers and plaintext read as ztunnel writes them.
	l := m.labels(connInfo{reporter: "destination", dst: rv2, flags: flagDeny})
	if l["source_workload"] != "unknown" || l["connection_security_policy"] != "unknown" || l["response_flags"] != "DENY" {
		t.Errorf("plaintext denied from an unknown client: %v", l)
	}
}

// A policy denial is counted with the workloads on both sides, and in
// istio_tcp_* with the DENY flag.
func TestDenialCarriesWorkloads(t *testing.T) {
	dir := bookinfo(t)
	m := NewMetrics(nil)
	m.setLive(dir)
	c := connInfo{reporter: "destination", src: mustPod(t, dir, "10.1.0.13"), dst: mustPod(t, dir, "10.1.0.12"),
		srcID: identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "bookinfo-productpage-v1"}, secure: true}
	m.deniedConn(context.Background(), "authorization", c, "", errors.New("denied"))
	got := testutil.ToFloat64(m.policyDenials.With(prometheus.Labels{"reason": "authorization",
		"source_workload": "productpage-v1", "source_workload_namespace": "mesh", "source_principal": "spiffe://cluster.local/ns/mesh/sa/bookinfo-productpage-v1",
		"destination_workload": "reviews-v2", "destination_workload_namespace": "mesh"}))
	if got != 1 {
		t.Errorf("denial counter with workloads = %v, want 1", got)
	}
	l := m.labels(connInfo{reporter: "destination", src: c.src, srcID: c.srcID, dst: c.dst, secure: true, flags: flagDeny})
	if v := testutil.ToFloat64(m.connsClosed.With(l)); v != 1 {
		t.Errorf("istio_tcp_connections_closed_total{response_flags=DENY} = %v, want 1", v)
	}
}

// The baggage the source sends is what the destination reads back, and
// only for the namespace of the verified identity.
func TestBaggageRoundTrip(t *testing.T) {
	dir := bookinfo(t)
	rv2 := mustPod(t, dir, "10.1.0.12")
	b := baggageOf(rv2, "east")
	if want := "k8s.cluster.name=east,k8s.namespace.name=mesh,k8s.deployment.name=reviews-v2,service.name=reviews,service.version=v2"; b != want {
		t.Errorf("baggage %q, want %q", b, want)
	}
	peer := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "bookinfo-reviews-v2"}
	got := parseBaggage(http.Header{"Baggage": {b}}, peer)
	if got == nil || *got != (peerMeta{cluster: "east", namespace: "mesh", workload: "reviews-v2", service: "reviews", revision: "v2"}) {
		t.Errorf("parsed %+v", got)
	}
	// ztunnel's own header, split over several fields, parses the same.
	split := http.Header{"Baggage": {"k8s.cluster.name=east", "k8s.namespace.name=mesh,k8s.deployment.name=reviews-v2", "service.name=reviews,service.version=v2"}}
	if g := parseBaggage(split, peer); g == nil || *g != *got {
		t.Errorf("split baggage parsed %+v", g)
	}
	l := prometheus.Labels{}
	got.labels(l)
	if l["source_workload"] != "reviews-v2" || l["source_canonical_service"] != "reviews" || l["source_cluster"] != "east" || l["source_app"] != "reviews-v2" {
		t.Errorf("derived source labels %v", l)
	}
	for _, bad := range []string{
		"k8s.namespace.name=other,k8s.deployment.name=x",                           // not the peer's namespace
		"k8s.namespace.name=mesh,k8s.deployment.name=x y",                          // not a name
		"k8s.namespace.name=mesh,k8s.deployment.name=" + strings.Repeat("a", 254),  // too long
		"k8s.namespace.name=" + strings.Repeat("a", 64) + ",k8s.deployment.name=x", // a namespace too long
		"k8s.namespace.name=mesh",                                                  // no workload
	} {
		if g := parseBaggage(http.Header{"Baggage": {bad}}, peer); g != nil {
			t.Errorf("baggage %q accepted: %+v", bad, g)
		}
	}
	// One odd value is left out on its own: a Deployment's name may be
	// 253 characters, and a region with a space costs only the region.
	long := strings.Repeat("d", 253)
	odd := "k8s.cluster.name=east,k8s.namespace.name=mesh,k8s.deployment.name=" + long +
		",service.name=reviews,service.version=" + strings.Repeat("v", 64) + ",cloud.region=us east,cloud.availability_zone=z1,x-unknown=a b"
	if g := parseBaggage(http.Header{"Baggage": {odd}}, peer); g == nil || *g != (peerMeta{cluster: "east", namespace: "mesh", workload: long, service: "reviews", zone: "z1"}) {
		t.Errorf("baggage with odd values parsed %+v, want every plain value kept and the odd ones left out", g)
	}
	if parseBaggage(http.Header{"Baggage": {b}}, identity.ID{}) != nil {
		t.Error("baggage accepted without a verified identity")
	}
	tp := newTraceparent()
	if id := traceID(http.Header{"Traceparent": {tp}}); id == "" || id != traceIDOf(tp) || id == traceIDOf(newTraceparent()) {
		t.Errorf("traceparent %q: trace id %q", tp, id)
	}
	if traceID(http.Header{"Traceparent": {"00-xyz-abc-00"}}) != "" {
		t.Error("a malformed traceparent gave a trace id")
	}
}

// Peers naming new workloads in baggage cannot grow the series without
// bound.
func TestDerivedSeriesBounded(t *testing.T) {
	dir := bookinfo(t)
	m := NewMetrics(nil)
	for i := range maxDerivedSeries + 50 {
		// Peers of their share each, so that the node's bound is reached.
		peer := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: fmt.Sprintf("x%d", i/maxDerivedSeriesPerPeer)}
		meta := parseBaggage(http.Header{"Baggage": {fmt.Sprintf("k8s.namespace.name=mesh,k8s.deployment.name=w%d", i)}}, peer)
		m.open(connInfo{reporter: "destination", peer: meta, srcID: peer, dst: mustPod(t, dir, "10.1.0.12"), secure: true}, "").close(context.Background(), 0, 0, nil)
	}
	if n := testutil.CollectAndCount(m.connsOpened); n != maxDerivedSeries+1 {
		t.Errorf("%d series, want %d named by peers and 1 with an unknown source", n, maxDerivedSeries+1)
	}
	if got := testutil.ToFloat64(m.derivedRefused.WithLabelValues("node")); got != 50 {
		t.Errorf(`redirector_baggage_series_refused_total{limit="node"} = %v, want 50`, got)
	}
}

// Access log lines carry ztunnel's fields; a completed connection logs at
// info, opening at debug, and a flood of denials is rate-limited.
func TestAccessLog(t *testing.T) {
	dir := bookinfo(t)
	var buf bytes.Buffer
	m := NewMetrics(nil)
	m.SetAccessLog(slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
	ctx := context.Background()
	c := connInfo{reporter: "source", src: mustPod(t, dir, "10.1.0.13"), dst: mustPod(t, dir, "10.1.0.12"), secure: true,
		srcID:   identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "bookinfo-productpage-v1"},
		dstID:   identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "bookinfo-reviews-v2"},
		srcAddr: netip.MustParseAddrPort("10.1.0.13:40000"), dstAddr: netip.MustParseAddrPort("10.1.0.12:15008"), hboneAddr: netip.MustParseAddrPort("10.1.0.12:9080")}
	r := m.open(c, "4bf92f3577b34da6a3ce929d0e0e4736")
	r.opened(ctx)
	r.close(ctx, 100, 2000, nil)
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d lines, want opened and complete:\n%s", len(lines), buf.String())
	}
	for _, want := range []string{`"level":"DEBUG"`, `"msg":"connection opened"`} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("opened line lacks %s: %s", want, lines[0])
		}
	}
	for _, want := range []string{`"level":"INFO"`, `"msg":"connection complete"`, `"src.addr":"10.1.0.13:40000"`, `"src.workload":"productpage-v1-6c7d8e-ccccc"`,
		`"src.namespace":"mesh"`, `"src.identity":"spiffe://cluster.local/ns/mesh/sa/bookinfo-productpage-v1"`, `"dst.addr":"10.1.0.12:15008"`,
		`"dst.hbone_addr":"10.1.0.12:9080"`, `"dst.workload":"reviews-v2-5b8d7c-bbbbb"`, `"dst.identity":"spiffe://cluster.local/ns/mesh/sa/bookinfo-reviews-v2"`,
		`"direction":"outbound"`, `"bytes_sent":100`, `"bytes_recv":2000`, `"duration":"`, `"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736"`} {
		if !strings.Contains(lines[1], want) {
			t.Errorf("complete line lacks %s: %s", want, lines[1])
		}
	}

	buf.Reset()
	for range 1000 {
		m.deniedConn(ctx, "authorization", connInfo{reporter: "destination", dst: c.dst}, "", errors.New("denied by mesh/deny"))
	}
	out := buf.String()
	if n := strings.Count(out, "\n"); n != 1 || !strings.Contains(out, `"response_flags":"DENY"`) || !strings.Contains(out, `"error":"denied by mesh/deny"`) || !strings.Contains(out, `"level":"WARN"`) {
		t.Errorf("1000 denials logged %d lines, want 1 WARN line with the flag and error:\n%s", n, out)
	}

	buf.Reset()
	m.SetAccessLog(nil)
	m.open(c, "").close(ctx, 1, 1, nil)
	if buf.Len() != 0 {
		t.Errorf("access logs off still wrote %q", buf.String())
	}
}

// countingWriter counts the writes that reach it.
type countingWriter struct {
	bytes.Buffer
	writes int
}

func (c *countingWriter) Write(p []byte) (int, error) { c.writes++; return c.Buffer.Write(p) }

// Access log lines are batched into few writes, and none is lost at Close.
func TestAccessLogWriterBatches(t *testing.T) {
	var out countingWriter
	w := NewAccessLogWriter(&out)
	log := slog.New(slog.NewTextHandler(w, nil))
	for i := range 1000 {
		log.Info("connection complete", "i", i)
	}
	w.Close()
	if n := strings.Count(out.String(), "\n"); n != 1000 {
		t.Errorf("%d lines out of 1000", n)
	}
	if out.writes > 20 {
		t.Errorf("%d writes for 1000 lines, want them batched", out.writes)
	}
}

// Locality a source knows goes into the labels and the baggage, and back.
func TestLocality(t *testing.T) {
	w := &workload.Workload{Name: "a-1", Namespace: "mesh", WorkloadName: "a", WorkloadType: workload.TypeDeployment, Region: "eu-west1", Zone: "eu-west1-b"}
	m := NewMetrics(nil)
	l := m.labels(connInfo{reporter: "source", src: w, dst: w})
	if l["source_region"] != "eu-west1" || l["destination_zone"] != "eu-west1-b" {
		t.Errorf("locality labels %v", l)
	}
	peer := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "a"}
	got := parseBaggage(http.Header{"Baggage": {baggageOf(w, "c1")}}, peer)
	if got == nil || got.region != "eu-west1" || got.zone != "eu-west1-b" {
		t.Errorf("baggage locality %+v", got)
	}
}

// BenchmarkConnCounted is what the metrics and the access log cost one
// connection: counted opened, then closed with its bytes and its line
// written (to io.Discard, through the agent's batching writer).
func BenchmarkConnCounted(b *testing.B) {
	dir := bookinfo(b)
	m := NewMetrics(prometheus.NewRegistry())
	w := NewAccessLogWriter(io.Discard)
	defer w.Close()
	m.SetAccessLog(slog.New(slog.NewTextHandler(w, nil)))
	m.setLive(dir)
	src, dst := dir.All()[0], dir.All()[1]
	srcID := identity.ID{TrustDomain: "cluster.local", Namespace: src.Namespace, ServiceAccount: src.ServiceAccount}
	dstID := identity.ID{TrustDomain: "cluster.local", Namespace: dst.Namespace, ServiceAccount: dst.ServiceAccount}
	c := connInfo{reporter: "destination", src: src, dst: dst, srcID: srcID, dstID: dstID, secure: true,
		srcAddr: netip.MustParseAddrPort("10.0.0.1:40000"), dstAddr: netip.MustParseAddrPort("10.0.0.2:9080")}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		m.open(c, "").close(ctx, 1, 1, nil)
	}
}
