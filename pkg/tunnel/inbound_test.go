package tunnel

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// spiffeCert is a parsed certificate whose one URI SAN is uri: a peer's
// leaf as handleHBONE gets it, the handshake having verified its chain.
func spiffeCert(t *testing.T, uri string) *x509.Certificate {
	t.Helper()
	u, err := url.Parse(uri)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, URIs: []*url.URL{u}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestHBONERequestChecks covers the checks made before any dial: the
// tunnel is never an open proxy, never a path to its own listeners, and
// never serves a peer without a verified identity.
func TestHBONERequestChecks(t *testing.T) {
	tun := New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008})
	p := &pod{t: tun, uid: "u", addrs: []netip.Addr{netip.MustParseAddr("10.1.0.2"), netip.MustParseAddr("fd00::2")}, ctx: context.Background()}
	remote := &net.TCPAddr{IP: net.ParseIP("10.1.0.3"), Port: 40000}
	for _, tc := range []struct {
		target netip.AddrPort
		status int
		reason string
	}{
		{netip.AddrPort{}, http.StatusBadRequest, "not ip:port"},
		{netip.MustParseAddrPort("10.9.9.9:80"), http.StatusBadRequest, "not an address of this pod"},
		{netip.MustParseAddrPort("[fd00::9]:80"), http.StatusBadRequest, "not an address of this pod"},
		{netip.MustParseAddrPort("10.1.0.2:15001"), http.StatusBadRequest, "tunnel's own"},
		{netip.MustParseAddrPort("10.1.0.2:15008"), http.StatusBadRequest, "tunnel's own"},
		{netip.MustParseAddrPort("[fd00::2]:8080"), http.StatusForbidden, "no verified client identity"},
	} {
		resp := p.handleHBONE(context.Background(), &hbone.ServerRequest{Target: tc.target, Authority: tc.target.String(), TLS: &tls.ConnectionState{}, RemoteAddr: remote})
		if resp.Upstream != nil || resp.Status != tc.status || !strings.Contains(resp.Reason, tc.reason) {
			t.Errorf("target %v: status %d %q, want %d with %q", tc.target, resp.Status, resp.Reason, tc.status, tc.reason)
		}
	}
}

// HBONE tunnels to a pod's apps count against the node's, the pod's and
// the source's budgets, apart from plaintext inbound: a mesh peer that
// opens stream after stream (each an app socket) is refused with 503 and
// counted once over its limit, and a slot comes back when a tunnel ends.
// Loopback only: the "pod" is 127.0.0.1 in this namespace, its clients
// 127.0.0.3 and 127.0.0.4.
func TestHBONETunnelLimits(t *testing.T) {
	tun := New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008,
		Limits: Limits{PerNode: 10, PerPod: 10, PerSource: 2}})
	app, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()
	go func() {
		for {
			c, err := app.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	podAddr := netip.MustParseAddr("127.0.0.1")
	tun.Update(&State{Dir: testDir(t, podObj("mesh", "server", "server-sa", "127.0.0.1", nil))})
	p := testPod(tun, "uid-server", podAddr)
	inOwnNamespace(t, p)
	target := netip.AddrPortFrom(podAddr, uint16(app.Addr().(*net.TCPAddr).Port))
	peerCert := spiffeCert(t, "spiffe://cluster.local/ns/mesh/sa/client")
	connect := func(src string) hbone.Response {
		return p.handleHBONE(context.Background(), &hbone.ServerRequest{Target: target, Authority: target.String(),
			TLS:        &tls.ConnectionState{HandshakeComplete: true, PeerCertificates: []*x509.Certificate{peerCert}},
			RemoteAddr: &net.TCPAddr{IP: net.ParseIP(src), Port: 40000}, LocalAddr: &net.TCPAddr{IP: podAddr.AsSlice(), Port: 15008}})
	}
	accepted := func(r hbone.Response) bool {
		if r.Upstream == nil {
			return false
		}
		t.Cleanup(func() { r.Upstream.Close() })
		return true
	}
	first, second := connect("127.0.0.3"), connect("127.0.0.3")
	if !accepted(first) || !accepted(second) {
		t.Fatalf("tunnels within the limits refused: %d %q, %d %q", first.Status, first.Reason, second.Status, second.Reason)
	}
	over := connect("127.0.0.3")
	if accepted(over) || over.Status != http.StatusServiceUnavailable || !strings.Contains(over.Reason, "source connection limit") {
		t.Fatalf("third tunnel from one source: status %d %q, want 503 over the source limit", over.Status, over.Reason)
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.limitRefused.WithLabelValues("hbone", "source")); got != 1 {
		t.Errorf("refused{hbone,source} = %v, want 1", got)
	}
	if other := connect("127.0.0.4"); !accepted(other) {
		t.Errorf("another source refused: %d %q", other.Status, other.Reason)
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.openConns.WithLabelValues("hbone")); got != 3 {
		t.Errorf("open hbone gauge %v, want 3", got)
	}
	// Plaintext inbound has its own budget: the source's HBONE tunnels
	// leave it whole.
	if release, by := tun.limits.acquire(listenerInbound, p, netip.MustParseAddr("127.0.0.3")); by != "" {
		t.Errorf("plaintext inbound from the same source refused by %q", by)
	} else {
		release()
	}
	first.Done(0, 0, nil)
	if again := connect("127.0.0.3"); !accepted(again) {
		t.Errorf("after a tunnel ended: %d %q, want accepted", again.Status, again.Reason)
	}
}

// HBONE tunnels share the node's budget like the capture listeners'
// connections: mesh peers that hold tunnels to three pods (each source
// within its 2,000, each pod within its 10,000) filled the node's 30,000,
// and every other pod of the node answered each new tunnel 503. A full
// node budget now closes the oldest tunnel of the pod holding the most
// (its app socket, so its relay and stream end) for a pod holding at least
// two fewer.
func TestHBONETunnelNodeLimitSharedFairly(t *testing.T) {
	tun := New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008,
		Limits: Limits{PerNode: 2, PerPod: 2, PerSource: 10}})
	accepted := make(chan net.Conn, 8)
	listen := func(addr string) netip.AddrPort {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				t.Cleanup(func() { c.Close() })
				accepted <- c
			}
		}()
		return netip.MustParseAddrPort(l.Addr().String())
	}
	appA, appB := listen("127.0.0.1:0"), listen("127.0.0.3:0")
	tun.Update(&State{Dir: testDir(t, podObj("mesh", "a", "a-sa", "127.0.0.1", nil), podObj("mesh", "b", "b-sa", "127.0.0.3", nil))})
	a := testPod(tun, "uid-a", appA.Addr())
	b := testPod(tun, "uid-b", appB.Addr())
	inOwnNamespace(t, a)
	inOwnNamespace(t, b)
	peerCert := spiffeCert(t, "spiffe://cluster.local/ns/mesh/sa/client")
	connect := func(p *pod, target netip.AddrPort) hbone.Response {
		return p.handleHBONE(context.Background(), &hbone.ServerRequest{Target: target, Authority: target.String(),
			TLS:        &tls.ConnectionState{HandshakeComplete: true, PeerCertificates: []*x509.Certificate{peerCert}},
			RemoteAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.5"), Port: 40000}, LocalAddr: &net.TCPAddr{IP: target.Addr().AsSlice(), Port: 15008}})
	}
	first, second := connect(a, appA), connect(a, appA)
	if first.Upstream == nil || second.Upstream == nil {
		t.Fatalf("pod a's tunnels within the limits refused: %d %q, %d %q", first.Status, first.Reason, second.Status, second.Reason)
	}
	defer first.Upstream.Close()
	defer second.Upstream.Close()
	other := connect(b, appB)
	if other.Upstream == nil {
		t.Fatalf("pod b's first tunnel on a full node: %d %q, want it accepted", other.Status, other.Reason)
	}
	defer other.Upstream.Close()
	// Pod a's oldest tunnel lost its app socket.
	_ = first.Upstream.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := first.Upstream.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Errorf("pod a's oldest tunnel: read %v, want its app socket closed", err)
	}
	_ = second.Upstream.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if _, err := second.Upstream.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("pod a's second tunnel: read %v, want it open", err)
	}
	if got := testutil.ToFloat64(tun.cfg.Metrics.limitEvicted.WithLabelValues("hbone")); got != 1 {
		t.Errorf("evicted{hbone} = %v, want 1", got)
	}
	// The evicted tunnel's relay ends; its Done releases nothing more.
	first.Done(0, 0, nil)
	tun.limits.mu.Lock()
	node := tun.limits.node[listenerHBONE]
	tun.limits.mu.Unlock()
	if node != 2 {
		t.Errorf("node hbone count %d, want 2", node)
	}
}
