package tunnel

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// derivedLabels opens and closes one connection from a client the
// directory does not know, announcing baggage as peer, and returns the
// source labels it was counted with.
func derivedLabels(t *testing.T, m *Metrics, peer identity.ID, baggage string) (workloadName, canonical string) {
	t.Helper()
	meta := parseBaggage(http.Header{"Baggage": {baggage}}, peer)
	if meta == nil {
		t.Fatalf("baggage %q not parsed", baggage)
	}
	dir := bookinfo(t)
	r := m.open(connInfo{reporter: "destination", peer: meta, srcID: peer, dst: mustPod(t, dir, "10.1.0.13"), secure: true}, "")
	r.close(context.Background(), 0, 0, nil)
	return r.l["source_workload"], r.l["source_canonical_service"]
}

// Baggage is a claim. A peer may name itself only as a workload (or
// canonical service) that the directory does not know, or knows to run
// under the peer's own verified identity: a peer in the right namespace
// with another service account must not have its connections counted, in
// the metrics and the access log, as another team's workload.
func TestBaggageCannotClaimAnotherIdentitysWorkload(t *testing.T) {
	m := NewMetrics(nil)
	m.setLive(bookinfo(t))
	intruder := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "intruder"}
	owner := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "bookinfo-reviews-v1"}

	if w, c := derivedLabels(t, m, intruder, "k8s.namespace.name=mesh,k8s.deployment.name=reviews-v1,service.name=reviews"); w != "unknown" || c != "unknown" {
		t.Errorf("a peer running as %s counted as workload %q, service %q; want unknown", intruder, w, c)
	}
	if w, c := derivedLabels(t, m, intruder, "k8s.namespace.name=mesh,k8s.deployment.name=batch,service.name=reviews"); w != "unknown" || c != "unknown" {
		t.Errorf("a peer running as %s claimed the canonical service of another identity: workload %q, service %q", intruder, w, c)
	}
	if w, c := derivedLabels(t, m, owner, "k8s.namespace.name=mesh,k8s.deployment.name=reviews-v1,service.name=reviews"); w != "reviews-v1" || c != "reviews" {
		t.Errorf("the workload's own identity counted as %q, %q; want reviews-v1, reviews", w, c)
	}
	if w, c := derivedLabels(t, m, intruder, "k8s.namespace.name=mesh,k8s.deployment.name=batch,service.name=batch"); w != "batch" || c != "batch" {
		t.Errorf("names the directory does not know counted as %q, %q; want batch, batch", w, c)
	}
}

// The budget of series named by peers must come back: a peer that names a
// workload the directory knows, with ever new versions, must not hold it
// for ever (those series were live, so never deleted, so never freed).
func TestDerivedSeriesBudgetNotPinned(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	m := NewMetrics(nil)
	m.series.now = func() time.Time { return now }
	dir := bookinfo(t)
	m.setLive(dir)
	owner := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "bookinfo-reviews-v1"}
	for i := range maxDerivedSeriesPerPeer {
		derivedLabels(t, m, owner, fmt.Sprintf("k8s.namespace.name=mesh,k8s.deployment.name=reviews-v1,service.version=x%d", i))
	}
	if w, _ := derivedLabels(t, m, owner, "k8s.namespace.name=mesh,k8s.deployment.name=fresh"); w != "unknown" {
		t.Fatalf("over the budget, a new name counted as %q", w)
	}
	now = now.Add(seriesGrace + time.Second)
	m.setLive(dir)
	if w, _ := derivedLabels(t, m, owner, "k8s.namespace.name=mesh,k8s.deployment.name=fresh"); w != "fresh" {
		t.Errorf("a grace after the peer's connections closed, a new name counted as %q, want fresh", w)
	}
	if n := testutil.CollectAndCount(m.connsOpened); n > 10 {
		t.Errorf("%d series of peers' names left after their grace", n)
	}
}

// Errors can carry a peer's text: the GOAWAY debug data (up to a frame,
// 1 MiB) of a destination that closes a pooled connection ends every
// stream on it, and each stream's access log line carried it whole, so one
// frame became megabytes of log. Logged errors are bounded, in the access
// log and the rate-limited refusal logs alike.
func TestLoggedErrorsBounded(t *testing.T) {
	huge := errors.New("hbone connection closed by peer: GOAWAY PROTOCOL_ERROR: " + strings.Repeat("\xffA\n", 1<<18))
	dir := bookinfo(t)
	var buf bytes.Buffer
	m := NewMetrics(nil)
	m.SetAccessLog(slog.New(slog.NewJSONHandler(&buf, nil)))
	c := connInfo{reporter: "source", src: mustPod(t, dir, "10.1.0.13"), dst: mustPod(t, dir, "10.1.0.12"), secure: true}
	m.open(c, "").close(context.Background(), 1, 1, huge)
	if buf.Len() > 2<<10 || !strings.Contains(buf.String(), "GOAWAY PROTOCOL_ERROR") {
		t.Errorf("access log line of %d bytes for a peer's error, want it bounded with its start kept", buf.Len())
	}

	buf.Reset()
	r := newRefusalLog(slog.New(slog.NewTextHandler(&buf, nil)), slog.LevelWarn)
	r.note(context.Background(), "HBONE connect failed", "error", huge)
	if buf.Len() > 2<<10 || !strings.Contains(buf.String(), "GOAWAY PROTOCOL_ERROR") {
		t.Errorf("refusal log line of %d bytes for a peer's error, want it bounded with its start kept", buf.Len())
	}
}

// The address a connection comes from names a workload only when that
// workload runs as the identity the client proved. A client with another
// identity (behind a gateway or NAT, on an address reused before the
// directory caught up, or sending from a forged address) is counted under
// its own identity, not as the workload the directory has at the address,
// and the mismatch is counted.
func TestHBONESourceWorkloadMustMatchPeerIdentity(t *testing.T) {
	tun := newTestTunnel(t, nil)
	podAddr := netip.MustParseAddr("10.1.0.2")
	p := testPod(tun, "uid-server", podAddr)
	tun.Update(&State{
		Dir: testDir(t, podObj("mesh", "server", "server-sa", "10.1.0.2", nil), podObj("mesh", "frontend", "frontend-sa", "10.1.0.3", nil)),
		// Every client is refused, so the request ends at the denial,
		// counted with the source labels, before any dial.
		AuthorizationPolicies: []policy.AuthorizationPolicy{denyFrom("*")},
	})
	target := netip.AddrPortFrom(podAddr, 8080)
	connect := func(sa string) {
		t.Helper()
		cert := spiffeCert(t, "spiffe://cluster.local/ns/mesh/sa/"+sa)
		r := p.handleHBONE(context.Background(), &hbone.ServerRequest{Target: target, Authority: target.String(),
			TLS:        &tls.ConnectionState{HandshakeComplete: true, PeerCertificates: []*x509.Certificate{cert}},
			RemoteAddr: &net.TCPAddr{IP: net.ParseIP("10.1.0.3"), Port: 40000}, LocalAddr: &net.TCPAddr{IP: podAddr.AsSlice(), Port: 15008}})
		if r.Status != http.StatusForbidden {
			t.Fatalf("%s: status %d %q, want 403", sa, r.Status, r.Reason)
		}
	}
	denials := func(sa, srcWorkload string) float64 {
		return testutil.ToFloat64(tun.cfg.Metrics.policyDenials.With(prometheus.Labels{"reason": "authorization",
			"source_workload": srcWorkload, "source_workload_namespace": map[bool]string{true: "mesh", false: "unknown"}[srcWorkload != "unknown"],
			"source_principal": "spiffe://cluster.local/ns/mesh/sa/" + sa, "destination_workload": "server", "destination_workload_namespace": "mesh"}))
	}

	connect("frontend-sa")
	if got := denials("frontend-sa", "frontend"); got != 1 {
		t.Errorf("the workload at the address, with its own identity: denials labelled frontend = %v, want 1", got)
	}
	connect("intruder")
	if got := denials("intruder", "frontend"); got != 0 {
		t.Errorf("a client running as intruder was counted as workload frontend (%v)", got)
	}
	if got := denials("intruder", "unknown"); got != 1 {
		t.Errorf("a client running as intruder: denials with an unknown source workload = %v, want 1", got)
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.sourceMismatch); got != 1 {
		t.Errorf("redirector_hbone_source_identity_mismatch_total = %v, want 1", got)
	}
}

// One peer cannot take the whole node's budget of series named by peers:
// before, one identity's 1000 connections (each refused by policy, even)
// with ever new names took every slot for five minutes at a time, and every
// other peer's connections lost their names (a remote cluster's edges
// vanished from Kiali), with nothing counting it. Now a refused peer's
// names get no series, one identity holds at most its share, and the
// refusals are counted.
func TestDerivedSeriesOnePeerCannotStarveOthers(t *testing.T) {
	dir := bookinfo(t)
	m := NewMetrics(nil)
	m.setLive(dir)
	ctx := context.Background()
	attacker := identity.ID{TrustDomain: "cluster.local", Namespace: "evil", ServiceAccount: "x"}
	dst := mustPod(t, dir, "10.1.0.12")
	for i := range maxDerivedSeries {
		meta := parseBaggage(http.Header{"Baggage": {fmt.Sprintf("k8s.namespace.name=evil,k8s.deployment.name=d%d", i)}}, attacker)
		m.deniedConn(ctx, "authorization", connInfo{reporter: "destination", peer: meta, srcID: attacker, dst: dst, secure: true}, "", errors.New("denied"))
	}
	for i := range maxDerivedSeries {
		derivedLabels(t, m, attacker, fmt.Sprintf("k8s.namespace.name=evil,k8s.deployment.name=a%d", i))
	}
	if got, want := testutil.ToFloat64(m.derivedRefused.WithLabelValues("peer")), float64(maxDerivedSeries-maxDerivedSeriesPerPeer); got != want {
		t.Errorf(`redirector_baggage_series_refused_total{limit="peer"} = %v, want %v`, got, want)
	}
	honest := identity.ID{TrustDomain: "cluster.local", Namespace: "remote", ServiceAccount: "web"}
	if w, _ := derivedLabels(t, m, honest, "k8s.cluster.name=east,k8s.namespace.name=remote,k8s.deployment.name=web,service.name=web"); w != "web" {
		t.Errorf("after one peer's flood, another peer's connection counted as workload %q, want web", w)
	}
	if n := testutil.CollectAndCount(m.connsOpened); n > maxDerivedSeriesPerPeer+3 {
		t.Errorf("%d istio_tcp_connections_opened_total series, want at most the attacker's share, its unnamed one and the honest peer's", n)
	}
}
