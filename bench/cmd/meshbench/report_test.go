package main

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"
)

// The plain pair is the TLS pair with the TLS left out: the same listeners,
// hops and timeouts, so what the two measure apart is the cryptography.
func TestPlainPairIsHAProxyPairWithoutTLS(t *testing.T) {
	pc := peerCerts{CA: "/ca.pem", ServerPEM: "/server-both.pem", ClientPEM: "/client-both.pem"}
	server := netip.MustParseAddr("10.0.2.4")
	tlsClient, tlsServer := haproxyConfigs(pc, server, haproxyPeer.hopPort, haproxyPeer.local)
	plainClient, plainServer := haproxyPlainConfigs(pc, server, haproxyPeer.hopPort, haproxyPeer.local)
	for _, conf := range []string{plainClient, plainServer} {
		if strings.Contains(conf, "ssl") || strings.Contains(conf, ".pem") {
			t.Errorf("plain configuration mentions TLS:\n%s", conf)
		}
	}
	for _, c := range []struct{ name, tls, plain string }{{"client", tlsClient, plainClient}, {"server", tlsServer, plainServer}} {
		var kept []string
		for _, line := range strings.Split(c.tls, "\n") {
			if strings.Contains(line, "tcp-request session reject") { // the client-name check: TLS only
				continue
			}
			if i := strings.Index(line, " ssl "); i >= 0 {
				line = line[:i]
			}
			kept = append(kept, line)
		}
		if got := strings.Join(kept, "\n"); got != c.plain {
			t.Errorf("%s side: the TLS configuration without its TLS parts\n%s\nis not the plain one\n%s", c.name, got, c.plain)
		}
	}
	if !strings.Contains(tlsServer, "verify required") || !strings.Contains(tlsClient, "verifyhost "+peerServerName) {
		t.Errorf("TLS pair does not verify both sides:\n%s\n%s", tlsClient, tlsServer)
	}
}

// Each variant's added p99 is its p99 minus direct's in the same round, and
// a round either misses is left out.
func TestAddedP99RowsPairByRound(t *testing.T) {
	r := newResults(config{Runs: 3}, time.Now())
	r.Variants = []variantInfo{{Name: "direct"}, {Name: "meshed-cross"}, {Name: "plain-pair"}}
	for i, v := range []float64{1.5, 4.0, 2.0} {
		r.put("direct", "http_p99", i, v)
	}
	for i, v := range []float64{3.0, 4.5, 3.1} {
		r.put("meshed-cross", "http_p99", i, v)
	}
	r.put("plain-pair", "http_p99", 0, 3.5)
	r.put("plain-pair", "http_p99", 2, 3.0)

	rows := r.addedP99Rows()
	if len(rows) != 2 || rows[0].variant != "meshed-cross" || rows[1].variant != "plain-pair" {
		t.Fatalf("rows: %+v", rows)
	}
	if !slices.Equal(rows[0].rounds, []string{"1.50", "0.500", "1.10"}) || rows[0].median != 1.1 {
		t.Errorf("meshed-cross: %+v", rows[0])
	}
	if !slices.Equal(rows[1].rounds, []string{"2.00", "1.00"}) || rows[1].median != 1.5 {
		t.Errorf("plain-pair (round 2 missing): %+v", rows[1])
	}
}
