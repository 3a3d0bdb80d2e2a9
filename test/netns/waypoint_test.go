package netnstest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

const (
	waypointVIP = "10.96.0.20"
	webVIP      = "10.96.0.21"
)

// waypointManifest is namespace mesh (ambient) with a waypoint, as Istio
// users write it: the waypoint's Service (what its Gateway's controller
// creates, HBONE port 15008, istio.io/waypoint-for: all) with the waypoint
// pod as its endpoint (or none, with noEndpoint), the namespace labelled
// istio.io/use-waypoint, and a Service web in front of the server pod.
// The server accepts mesh traffic only from the waypoint's identity: the
// L4 AuthorizationPolicy Istio documents for refusing traffic that
// bypasses the waypoint.
func waypointManifest(client, plain, server, wp *Pod, noEndpoint bool) *Manifest {
	eps := fmt.Sprintf("endpoints:\n- addresses: [%q]\n  conditions: {ready: true}\n", wp.IPv4)
	if noEndpoint {
		eps = "endpoints: []\n"
	}
	return (&Manifest{}).
		Namespace("mesh", "istio.io/dataplane-mode=ambient", "istio.io/use-waypoint=waypoint").Namespace("plain").
		Pod(client, "mesh", "client").Pod(plain, "plain", "default").
		Pod(server, "mesh", "server", "app=server").
		// Not in the mesh itself, as Istio's waypoints.
		Pod(wp, "mesh", "waypoint", "istio.io/dataplane-mode=none", "gateway.networking.k8s.io/gateway-name=waypoint").
		Raw(fmt.Sprintf(`apiVersion: v1
kind: Service
metadata:
  name: waypoint
  namespace: mesh
  labels: {istio.io/waypoint-for: all, gateway.networking.k8s.io/gateway-name: waypoint}
spec:
  clusterIP: %s
  ports:
  - {name: mesh, port: 15008}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: waypoint-1
  namespace: mesh
  labels: {kubernetes.io/service-name: waypoint}
addressType: IPv4
ports:
- {name: mesh, port: 15008}
%s---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: mesh}
spec:
  clusterIP: %s
  ports:
  - {name: http, port: 80, targetPort: 8080}
---
%s---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: only-via-waypoint, namespace: mesh}
spec:
  selector: {matchLabels: {app: server}}
  action: ALLOW
  rules:
  - from:
    - source: {principals: ["cluster.local/ns/mesh/sa/waypoint"]}
`, waypointVIP, eps, webVIP, readyEndpointSlice("web", server.IPv4)))
}

// connectSeen is one CONNECT the stand-in waypoint received.
type connectSeen struct {
	authority, forwarded, peer string
}

// standInWaypoint is NOT Istio's waypoint (Envoy): a stand-in built from the
// project's own HBONE server and client, run by the test in the waypoint
// pod's namespace with the waypoint's SPIFFE identity. It records each
// CONNECT and forwards it, as a waypoint does after its L7 processing,
// over HBONE to the destination pod's tunnel (port 15008) with the pod's
// ip:port as authority and its own identity as the client: a service VIP
// goes to the one endpoint routes names.
type standInWaypoint struct {
	mu   sync.Mutex
	seen []connectSeen
}

func (s *standInWaypoint) all() []connectSeen {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]connectSeen(nil), s.seen...)
}

// startStandInWaypoint serves the stand-in on wp's port 15008 until the
// test ends. routes maps a VIP:port to the pod ip:port behind it; a pod
// ip:port not in routes is forwarded to as is. server is the identity the
// destination must present.
func startStandInWaypoint(t *testing.T, caDir string, wp *Pod, routes map[netip.AddrPort]netip.AddrPort, server identity.ID) *standInWaypoint {
	t.Helper()
	ca, err := identity.LoadCA(caDir)
	if err != nil {
		t.Fatal(err)
	}
	self := identity.ID{TrustDomain: ca.TrustDomain(), Namespace: "mesh", ServiceAccount: "waypoint"}
	certs := identity.NewManager(ca, time.Hour, time.Now)
	t.Cleanup(certs.Close)
	certs.Add(self)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := certs.Wait(ctx, self); err != nil {
		t.Fatalf("stand-in waypoint certificate: %v", err)
	}
	pool := hbone.NewPool(hbone.PoolOptions{})
	t.Cleanup(func() { pool.Close() })
	s := &standInWaypoint{}
	handle := func(ctx context.Context, req *hbone.ServerRequest) hbone.Response {
		peer, _ := identity.PeerID(*req.TLS)
		s.mu.Lock()
		s.seen = append(s.seen, connectSeen{authority: req.Authority, forwarded: req.Forwarded, peer: peer.String()})
		s.mu.Unlock()
		dst, ok := routes[req.Target]
		if !ok {
			dst = req.Target
		}
		next := netip.AddrPortFrom(dst.Addr(), 15008)
		dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
			return netns.Dial(ctx, wp.Path(), network, addr, netns.SocketOptions{})
		}
		key := hbone.PoolKey{Src: "stand-in-waypoint", SrcIdentity: self.String(), DstIdentity: server.String(), DstAddr: next}
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		up, err := pool.Connect(ctx, key, dial, identity.ClientConfig(certs, self, server), hbone.Request{Authority: dst, Forwarded: req.Forwarded})
		if err != nil {
			return hbone.Response{Status: http.StatusServiceUnavailable, Reason: err.Error()}
		}
		return hbone.Response{Upstream: up}
	}
	srv, err := hbone.NewServer(hbone.ServerOptions{TLSConfig: identity.ServerConfig(certs, self), Handler: handle})
	if err != nil {
		t.Fatal(err)
	}
	l, err := netns.Listen(context.Background(), wp.Path(), "tcp", "[::]:15008", netns.SocketOptions{})
	if err != nil {
		t.Fatalf("stand-in waypoint listen: %v", err)
	}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close(); l.Close() })
	return s
}

// TestWaypoint: a client's traffic to a Service VIP and to a pod address,
// both behind a waypoint (istio.io/use-waypoint on the namespace), goes to
// the waypoint over HBONE with the original destination as the CONNECT
// authority, as ztunnel sends it, and reaches the server from the
// waypoint; attempts that bypass the waypoint (HBONE straight to the
// server's tunnel with a mesh certificate, plaintext) are refused by the
// server's ALLOW-the-waypoint policy; and with the waypoint unresolvable
// (no endpoint) the client's connections fail closed instead of going
// direct.
func TestWaypoint(t *testing.T) {
	var client, plain, server, wp *Pod
	ms := newMesh(t, func(top *Topology, m *Manifest) {
		client, plain = top.Nodes[0].AddPod("client"), top.Nodes[0].AddPod("plain")
		server, wp = top.Nodes[1].AddPod("server"), top.Nodes[1].AddPod("waypoint")
		*m = *waypointManifest(client, plain, server, wp, false)
	})
	HTTPApp(t, server, 8080, "server")
	serverID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server"}
	vip := netip.MustParseAddr(webVIP)
	standIn := startStandInWaypoint(t, ms.caDir, wp, map[netip.AddrPort]netip.AddrPort{
		netip.AddrPortFrom(vip, 80): netip.AddrPortFrom(server.IPv4, 8080),
	}, serverID)
	ms.agents[0].WaitLog(t, "pod enrolled", 10*time.Second)
	ms.agents[1].WaitLog(t, "pod enrolled", 10*time.Second)

	for _, tc := range []struct {
		name, url, authority, host string
	}{
		{"service VIP", "http://" + webVIP + "/", webVIP + ":80", "host=web.mesh.svc.cluster.local"},
		{"pod address", URL(server.IPv4, 8080), netip.AddrPortFrom(server.IPv4, 8080).String(), ""},
		{"pod IPv6 address", URL(server.IPv6, 8080), netip.AddrPortFrom(server.IPv6, 8080).String(), ""},
	} {
		before := len(standIn.all())
		var out string
		Eventually(t, 10*time.Second, func() error {
			var err error
			out, err = Curl(client, tc.url)
			return err
		})
		// The server's app sees the waypoint as its client: the
		// connection came from the waypoint, not from the client.
		if !strings.HasPrefix(out, "server peer=") || !strings.Contains(out, "peer="+wp.IPv4.String()) && !strings.Contains(out, "peer="+wp.IPv6.String()) {
			t.Errorf("%s: answered %q, want the server seeing the waypoint %s as its peer", tc.name, out, wp.IPv4)
		}
		seen := standIn.all()[before:]
		if len(seen) == 0 {
			t.Fatalf("%s: the stand-in waypoint saw no CONNECT", tc.name)
		}
		last := seen[len(seen)-1]
		if last.authority != tc.authority {
			t.Errorf("%s: CONNECT authority %q, want the original destination %q", tc.name, last.authority, tc.authority)
		}
		if last.peer != "spiffe://cluster.local/ns/mesh/sa/client" {
			t.Errorf("%s: the waypoint saw client identity %q, want the client pod's", tc.name, last.peer)
		}
		if !strings.Contains(last.forwarded, tc.host) || !strings.Contains(last.forwarded, client.IPv4.String()) && !strings.Contains(last.forwarded, client.IPv6.String()) {
			t.Errorf("%s: Forwarded %q, want the client's address and %q", tc.name, last.forwarded, tc.host)
		}
	}
	ms.agents[0].WaitLog(t, "dst.waypoint", 5*time.Second)
	text := scrape(t, ms.agents[0], "http://127.0.0.1:15020/metrics")
	if got := metricSum(text, "istio_tcp_connections_opened_total", `reporter="source"`, `destination_workload="waypoint"`,
		`destination_principal="spiffe://cluster.local/ns/mesh/sa/waypoint"`, `destination_service="web.mesh.svc.cluster.local"`); got < 1 {
		t.Errorf("no source-side connection to the waypoint for service web in the metrics:\n%s", grepLines(text, "istio_tcp_connections_opened_total"))
	}

	// Bypassing the waypoint: a mesh certificate straight to the server's
	// tunnel, and plaintext, from a pod outside the mesh.
	direct := bypassHBONE(t, ms.caDir, plain, server)
	if direct == nil {
		t.Error("HBONE straight to the server's tunnel, bypassing the waypoint, was accepted")
	} else if !strings.Contains(direct.Error(), "403") {
		t.Errorf("HBONE bypassing the waypoint: %v, want a 403 from the server's policy", direct)
	}
	if out, err := Curl(plain, URL(server.IPv4, 8080)); err == nil {
		t.Errorf("plaintext bypassing the waypoint reached the server: %q", out)
	}

	// The waypoint loses its endpoint: connections fail closed, counted,
	// and never go to the server directly.
	if err := waypointManifest(client, plain, server, wp, true).Write(ms.manifest); err != nil {
		t.Fatal(err)
	}
	Eventually(t, 10*time.Second, func() error {
		if out, err := Curl(client, "http://"+webVIP+"/"); err == nil {
			return fmt.Errorf("still answered %q", out)
		}
		return nil
	})
	seenBefore := len(standIn.all())
	if out, err := Curl(client, "http://"+webVIP+"/"); err == nil {
		t.Errorf("service VIP answered %q with the waypoint gone", out)
	}
	if out, err := Curl(client, URL(server.IPv4, 8080)); err == nil {
		t.Errorf("pod address answered %q with the waypoint gone", out)
	}
	ms.agents[0].WaitLog(t, "its waypoint cannot be resolved", 5*time.Second)
	text = scrape(t, ms.agents[0], "http://127.0.0.1:15020/metrics")
	if got := metricSum(text, "redirector_fail_closed_total", `reason="waypoint_no_endpoint"`); got < 3 {
		t.Errorf("redirector_fail_closed_total{reason=waypoint_no_endpoint} = %v, want at least 3", got)
	}
	if n := len(standIn.all()); n != seenBefore {
		t.Errorf("the waypoint without endpoints still got %d CONNECTs", n-seenBefore)
	}
}

// bypassHBONE opens a CONNECT to the server's own tunnel port from pod
// from, with the client's mesh certificate, as a client that skips the
// waypoint would; it returns the refusal (nil if the stream was accepted).
func bypassHBONE(t *testing.T, caDir string, from, server *Pod) error {
	t.Helper()
	ca, err := identity.LoadCA(caDir)
	if err != nil {
		t.Fatal(err)
	}
	self := identity.ID{TrustDomain: ca.TrustDomain(), Namespace: "mesh", ServiceAccount: "client"}
	certs := identity.NewManager(ca, time.Hour, time.Now)
	defer certs.Close()
	certs.Add(self)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := certs.Wait(ctx, self); err != nil {
		t.Fatal(err)
	}
	pool := hbone.NewPool(hbone.PoolOptions{})
	defer pool.Close()
	dst := netip.AddrPortFrom(server.IPv4, 8080)
	next := netip.AddrPortFrom(server.IPv4, 15008)
	serverID := identity.ID{TrustDomain: ca.TrustDomain(), Namespace: "mesh", ServiceAccount: "server"}
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		return netns.Dial(ctx, from.Path(), network, addr, netns.SocketOptions{})
	}
	s, err := pool.Connect(ctx, hbone.PoolKey{Src: "bypass", SrcIdentity: self.String(), DstIdentity: serverID.String(), DstAddr: next},
		dial, identity.ClientConfig(certs, self, serverID), hbone.Request{Authority: dst, Forwarded: fmt.Sprintf("for=%q", from.IPv4)})
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("bypass CONNECT timed out: %v", err)
		}
		return err
	}
	s.Close()
	return nil
}

// grepLines returns the lines of text that contain s.
func grepLines(text, s string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
