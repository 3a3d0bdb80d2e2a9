package main

import (
	"context"
	"crypto/x509"
	"crypto/x509/pkix"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
)

func TestCASettings(t *testing.T) {
	base := []string{"--node-name", "n1", "--source", "file:/tmp"}
	for _, tc := range []struct {
		args []string
		want string // error substring; empty: accepted
	}{
		{args: base, want: "--ca-address (CA_ADDRESS) (istiod) or, standalone, --ca-dir (CA_DIR) is required"},
		{args: append(base, "--ca-dir", "/x", "--ca-address", "istiod:15012"), want: "are exclusive"},
		{args: append(base, "--ca-address", "istiod:15012"), want: "--ca-root-cert (CA_ROOT_CERT) is required with --ca-address"},
		{args: append(base, "--ca-address", "istiod:15012", "--ca-root-cert", "/r", "--ca-root-cert-reload", "0s"), want: "--ca-root-cert-reload (CA_ROOT_CERT_RELOAD)"},
		{args: append(base, "--ca-address", "istiod:15012", "--ca-root-cert", "/r")},
		{args: append(base, "--ca-dir", "/x")},
	} {
		c, err := parseRunFlags(tc.args)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("parseRunFlags(%v): %v", tc.args, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("parseRunFlags(%v) = %v, want an error containing %q", tc.args, err, tc.want)
		case tc.want == "" && c.ca.addr != "" && (c.ca.clusterID != "Kubernetes" || c.ca.tokenFile == ""):
			t.Errorf("istiod defaults: %+v", c.ca)
		}
	}
}

// istiod's xDS connection is verified against the same roots as its CA
// and the peers, and follows the file as they do: a root rotation that
// removes a root removes it for xDS too, and a root added reaches it
// without a restart. With istiod signing, xDS shares the certificate
// manager's watched bundle; otherwise (the file CA) it watches its own.
func TestXDSTrustFollowsTheBundle(t *testing.T) {
	dir := t.TempDir()
	oldRoot, newRoot := testRoot(t, "old"), testRoot(t, "new")
	path := filepath.Join(dir, "root-cert.pem")
	if err := os.WriteFile(path, identitytest.CertPEM(oldRoot), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := agentConfig{trustDomain: "cluster.local", ca: caSettings{rootCert: path, rootReload: 10 * time.Millisecond}}
	log := slog.New(slog.DiscardHandler)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	shared, err := identity.LoadBundle(path, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := xdsTrust(ctx, cfg, log, shared); err != nil || got != shared {
		t.Errorf("with the certificate manager's bundle of the same file: %p, %v; want it shared (%p)", got, err, shared)
	}

	own, err := xdsTrust(ctx, cfg, log, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, identitytest.CertPEM(newRoot), 0o644); err != nil {
		t.Fatal(err)
	}
	waitfor.Until(t, "the xDS roots to follow the file", func() bool {
		certs := own.Certificates()
		return len(certs) == 1 && certs[0].Equal(newRoot)
	})
}

func testRoot(t *testing.T, name string) *x509.Certificate {
	return identitytest.MakeCACert(t, pkix.Name{CommonName: name, Organization: []string{"cluster.local"}}, identitytest.NewKey(t, "ecdsa"), nil, nil)
}

// The file CA's signing key, readable by others (a Secret volume's default
// mode), is named in a warning at start; at 0400 nothing is said.
func TestFileCAWarnsOfAnExposedKey(t *testing.T) {
	dir := t.TempDir()
	if err := identity.InitCA(dir, "cluster.local"); err != nil {
		t.Fatal(err)
	}
	key := filepath.Join(dir, identity.RootKeyFile)
	for _, tc := range []struct {
		mode os.FileMode
		warn bool
	}{{0o644, true}, {0o400, false}} {
		if err := os.Chmod(key, tc.mode); err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		log := slog.New(slog.NewTextHandler(&out, nil))
		cfg := agentConfig{trustDomain: "cluster.local", ca: caSettings{dir: dir}}
		_, closeFn, err := newCertManager(context.Background(), cfg, log)
		if err != nil {
			t.Fatal(err)
		}
		closeFn()
		warned := strings.Contains(out.String(), "level=WARN") && strings.Contains(out.String(), key)
		if warned != tc.warn {
			t.Errorf("key mode %04o: warned %v, want %v; log:\n%s", tc.mode, warned, tc.warn, out.String())
		}
	}
}
