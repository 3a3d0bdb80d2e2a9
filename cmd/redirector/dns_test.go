package main

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
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
	got, err := resolvers(path)
	want := []netip.AddrPort{netip.MustParseAddrPort("10.96.0.10:53"), netip.MustParseAddrPort("[fd00:10:96::a]:53")}
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("resolvers = %v, %v; want %v", got, err, want)
	}
	if _, err := resolvers(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Error("a missing resolv.conf gave no error")
	}
}
