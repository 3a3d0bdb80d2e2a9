package tunnel

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

// A refused peer learns that it was refused, not the names of the
// policies it met nor which rule refused it: those are the destination's
// configuration, and its access log has them.
func TestHBONEDenialHidesPolicy(t *testing.T) {
	tun := newTestTunnel(t, nil)
	podAddr := netip.MustParseAddr("10.1.0.2")
	allow := policy.AuthorizationPolicy{Meta: policy.Meta{Namespace: "mesh", Name: "secret-allow-list"},
		Spec: policy.AuthorizationPolicySpec{Action: policy.ActionAllow, Rules: []policy.Rule{{From: []policy.From{{Source: &policy.Source{Principals: []string{"cluster.local/ns/mesh/sa/friend"}}}}}}}}
	deny := denyFrom("cluster.local/ns/mesh/sa/client")
	deny.Name = "block-client-quietly"
	p := testPod(tun, "uid-server", podAddr)
	target := netip.AddrPortFrom(podAddr, 8080)
	connect := func(sa string) hbone.Response {
		cert := spiffeCert(t, "spiffe://cluster.local/ns/mesh/sa/"+sa)
		return p.handleHBONE(context.Background(), &hbone.ServerRequest{Target: target, Authority: target.String(),
			TLS:        &tls.ConnectionState{HandshakeComplete: true, PeerCertificates: []*x509.Certificate{cert}},
			RemoteAddr: &net.TCPAddr{IP: net.ParseIP("10.2.0.9"), Port: 40000}, LocalAddr: &net.TCPAddr{IP: podAddr.AsSlice(), Port: 15008}})
	}
	tun.Update(&State{Dir: testDir(t, podObj("mesh", "server", "server-sa", "10.1.0.2", nil)),
		AuthorizationPolicies: []policy.AuthorizationPolicy{allow, deny}})
	for _, sa := range []string{"client", "stranger"} {
		r := connect(sa)
		if r.Status != http.StatusForbidden {
			t.Fatalf("%s: status %d %q, want 403", sa, r.Status, r.Reason)
		}
		for _, secret := range []string{"secret-allow-list", "block-client-quietly", "rule", "mesh/"} {
			if strings.Contains(r.Reason, secret) {
				t.Errorf("%s: the reason sent to the peer names %q: %s", sa, secret, r.Reason)
			}
		}
	}
}
