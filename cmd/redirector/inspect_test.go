package main

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/admin"
	"github.com/redirector-mesh/redirector/pkg/maps"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// golden compares got with testdata/name, or rewrites it with -update.
func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from the golden file:\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

func TestInspectGolden(t *testing.T) {
	pods := []podRow{
		{ID: 1, UID: "uid-a", Namespace: "shop", Name: "frontend", Addresses: []string{"10.1.0.2", "fd00:1::2"}, CaptureInbound: true, CaptureDNS: true,
			AttachMode: "tcx", NetNS: "/var/run/netns/a", Interface: "eth0", Counters: maps.PodCounters{OutboundConns: 7, InboundConns: 2, SteeredPackets: 40, BypassedPackets: 3}},
		{ID: 2, UID: "uid-b", Namespace: "shop", Name: "legacy-tc", Addresses: []string{"10.1.0.3"}, AttachMode: "tc", NetNS: "/proc/42/ns/net", Interface: "eth0",
			Counters: maps.PodCounters{DroppedPackets: 5}},
	}
	mapRows := []mapRow{{"rd_pods", "10.1.0.2", "pod_id=1 outbound=true inbound=true dns=true"}, {"rd_reasons", "drop_no_listener", "5"}}
	at := time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC)
	certs := []certRow{
		{Identity: "spiffe://cluster.local/ns/shop/sa/frontend", Serial: "0a1b2c", NotBefore: at, NotAfter: at.Add(24 * time.Hour), RefreshAt: at.Add(12 * time.Hour),
			Issuer: "O=cluster.local", State: "valid", CA: "istiod:istiod.istio-system.svc:15012",
			Chain: []admin.ChainCert{{Subject: "", Issuer: "O=cluster.local", Serial: "0a1b2c", NotAfter: at.Add(24 * time.Hour), PEM: "-----BEGIN CERTIFICATE-----\n...\n"}}},
		{Identity: "spiffe://cluster.local/ns/shop/sa/db", State: "failing", CA: "istiod:istiod.istio-system.svc:15012", Failures: 3,
			LastError: "rpc error: code = Unauthenticated desc = request impersonation authentication failure"},
	}
	for _, format := range []string{"table", "json", "yaml"} {
		var b bytes.Buffer
		if err := renderPods(&b, format, pods); err != nil {
			t.Fatal(err)
		}
		golden(t, "inspect-pods."+format, b.Bytes())
		b.Reset()
		if err := renderMaps(&b, format, mapRows); err != nil {
			t.Fatal(err)
		}
		golden(t, "inspect-maps."+format, b.Bytes())
		b.Reset()
		if err := renderCerts(&b, format, certs); err != nil {
			t.Fatal(err)
		}
		golden(t, "inspect-certs."+format, b.Bytes())
	}
}
