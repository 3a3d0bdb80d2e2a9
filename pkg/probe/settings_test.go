package probe

import (
	"strings"
	"testing"
)

func TestParseSNAT(t *testing.T) {
	if a4, a6, err := ParseSNAT(DefaultSNATv4.String(), DefaultSNATv6.String()); err != nil || a4 != DefaultSNATv4 || a6 != DefaultSNATv6 {
		t.Fatalf("defaults: %v %v %v", a4, a6, err)
	}
	if _, _, err := ParseSNAT("169.254.1.2", "fd00::9"); err != nil {
		t.Fatalf("custom valid values refused: %v", err)
	}
	for _, tc := range []struct{ v4, v6, want string }{
		{"10.0.0.1", "fd00::1", "HOST_PROBE_SNAT_IP=10.0.0.1 must be an IPv4 address inside 169.254.0.0/16"},
		{"not-an-ip", "fd00::1", `HOST_PROBE_SNAT_IP="not-an-ip" is not an IP address`},
		{"fd00::1", "fd00::1", "HOST_PROBE_SNAT_IP=fd00::1 must be"},
		{"169.254.7.127", "not-an-ip", `HOST_PROBE_SNAT_IPV6="not-an-ip" is not an IP address`},
		{"169.254.7.127", "169.254.7.127", "HOST_PROBE_SNAT_IPV6=169.254.7.127 must be"},
		{"169.254.7.127", "ff02::1", "HOST_PROBE_SNAT_IPV6=ff02::1 must be"},
		{"169.254.7.127", "::1", "HOST_PROBE_SNAT_IPV6=::1 must be"},
		{"169.254.7.127", "fe80::1", "HOST_PROBE_SNAT_IPV6=fe80::1 must be"},
	} {
		_, _, err := ParseSNAT(tc.v4, tc.v6)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseSNAT(%q, %q) = %v, want error containing %q", tc.v4, tc.v6, err, tc.want)
		}
	}
}
