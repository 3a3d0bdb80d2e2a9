// Package probe lets kubelet health probes reach enrolled pods. Probes come
// from the node's own network namespace; they are SNATed to a fixed
// link-local source that the pod-side programs never capture, so probes pass
// even where PeerAuthentication is STRICT and no other plaintext does.
package probe

import (
	"fmt"
	"net/netip"
)

// Environment names of the SNAT settings, as Istio spells them.
const (
	EnvSNATv4 = "HOST_PROBE_SNAT_IP"
	EnvSNATv6 = "HOST_PROBE_SNAT_IPV6"
)

// Defaults, as in Istio ambient.
var (
	DefaultSNATv4 = netip.MustParseAddr("169.254.7.127")
	DefaultSNATv6 = netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff")
)

var linkLocal4 = netip.MustParsePrefix("169.254.0.0/16")

// ParseSNAT validates the two SNAT addresses. The IPv4 one must be
// link-local (169.254.0.0/16), so it can never be a real peer's address; the
// IPv6 one must be a plain unicast address. Errors name the variable and the
// rule it broke.
func ParseSNAT(v4, v6 string) (netip.Addr, netip.Addr, error) {
	a4, err := netip.ParseAddr(v4)
	if err != nil {
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("%s=%q is not an IP address", EnvSNATv4, v4)
	}
	if !a4.Is4() || !linkLocal4.Contains(a4) {
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("%s=%s must be an IPv4 address inside %s", EnvSNATv4, v4, linkLocal4)
	}
	a6, err := netip.ParseAddr(v6)
	if err != nil {
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("%s=%q is not an IP address", EnvSNATv6, v6)
	}
	if !a6.Is6() || a6.Is4In6() || a6.Zone() != "" || a6.IsMulticast() || a6.IsLoopback() || a6.IsUnspecified() || a6.IsLinkLocalUnicast() {
		return netip.Addr{}, netip.Addr{}, fmt.Errorf("%s=%s must be a global or unique-local IPv6 unicast address", EnvSNATv6, v6)
	}
	return a4, a6, nil
}
