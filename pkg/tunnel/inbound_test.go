package tunnel

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
)

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
