package main

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestDNSUpstreams(t *testing.T) {
	s, f := runSettings()
	if err := s.parse([]string{"--node-name", "n", "--source", "file:/x", "--dns-upstreams", " 10.96.0.10 , [fd00::a]:5353,::ffff:10.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	d, err := f.dns.parse(s)
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.AddrPort{netip.MustParseAddrPort("10.96.0.10:53"), netip.MustParseAddrPort("[fd00::a]:5353"), netip.MustParseAddrPort("10.0.0.1:53")}
	if !d.capture || !slices.Equal(d.upstreams, want) {
		t.Errorf("parsed %+v, want capture on and upstreams %v", d, want)
	}
}

// TestResolvers reads a resolv.conf as the C library does: nameserver
// lines with an address, in order; the rest (search, options, comments, a
// name instead of an address, a scoped link-local address) is skipped.
func TestResolvers(t *testing.T) {
	path := filepath.Join(t.TempDir(), "resolv.conf")
	conf := "# generated\nsearch istio-system.svc.cluster.local svc.cluster.local\nnameserver 10.96.0.10\nnameserver fe80::1%eth0\nnameserver kube-dns\noptions ndots:5\nnameserver fd00:10:96::a\n"
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := resolvers(path, nil)
	want := []netip.AddrPort{netip.MustParseAddrPort("10.96.0.10:53"), netip.MustParseAddrPort("[fd00:10:96::a]:53")}
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("resolvers = %v, %v; want %v", got, err, want)
	}
	if _, err := resolvers(filepath.Join(t.TempDir(), "missing"), nil); err == nil {
		t.Error("a missing resolv.conf gave no error")
	}
}

// TestDNSUpstreamsNotFromPods: queries are forwarded from the client pod's
// network namespace, where a loopback address is the pod's own loopback
// (a pod's own listener there would get every pod's forwarded queries as
// its own, and with none every forwarded name fails), and an unspecified,
// multicast or broadcast address is no resolver at all. Before, such an
// upstream was taken as given (DNS_UPSTREAMS) or read from resolv.conf (a
// node's systemd-resolved stub, 127.0.0.53) and every query for a name
// outside the mesh failed, silently but for a debug log. Now the setting
// is refused naming the address, and resolv.conf's such lines skipped.
func TestDNSUpstreamsNotFromPods(t *testing.T) {
	for _, bad := range []string{"127.0.0.53", "127.0.0.1:5353", "::1", "[::1]:53", "0.0.0.0", "::", "224.0.0.251", "255.255.255.255", "::ffff:127.0.0.1"} {
		s, f := runSettings()
		if err := s.parse([]string{"--node-name", "n", "--source", "file:/x", "--dns-upstreams", "10.96.0.10," + bad}); err != nil {
			t.Fatal(err)
		}
		_, err := f.dns.parse(s)
		if err == nil || !strings.Contains(err.Error(), bad) || !strings.Contains(err.Error(), "dns-upstreams") {
			t.Errorf("--dns-upstreams with %s: %v, want an error naming the setting and the address", bad, err)
		}
	}
	path := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(path, []byte("nameserver 127.0.0.53\nnameserver ::1\nnameserver 0.0.0.0\nnameserver 10.96.0.10\nnameserver 169.254.20.10\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := resolvers(path, nil)
	want := []netip.AddrPort{netip.MustParseAddrPort("10.96.0.10:53"), netip.MustParseAddrPort("169.254.20.10:53")}
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("resolvers = %v, %v; want %v (loopback and unspecified skipped; NodeLocal DNSCache's link-local address kept)", got, err, want)
	}
}

func TestEffectiveCap(t *testing.T) {
	for _, tc := range []struct {
		status string
		want   bool
		err    bool
	}{
		{"Name:\tx\nCapEff:\t000001ffffffffff\n", true, false},
		{"CapEff:\t0000000000003000\n", false, false}, // NET_ADMIN and NET_RAW only
		{"CapEff:\t0000000000000400\n", true, false},  // NET_BIND_SERVICE alone
		{"CapEff:\tzz\n", false, true},
		{"Name:\tx\n", false, true},
	} {
		got, err := effectiveCap(tc.status, capNetBindService)
		if got != tc.want || (err != nil) != tc.err {
			t.Errorf("effectiveCap(%q) = %v, %v; want %v, error %v", tc.status, got, err, tc.want, tc.err)
		}
	}
}
