package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/identity/istioca"
)

// runCA handles `redirector ca init`: a file CA every node agent can read.
func runCA(args []string) error {
	s := newSettings("ca init")
	s.synopsis = "redirector ca init --dir DIR [flags]\n\ncreates a file CA (root-key.pem, root-cert.pem) for standalone agents (--ca-dir)"
	dir := s.add("dir", "CA_DIR", "", "directory to create the root key and certificate in")
	td := s.add("trust-domain", "TRUST_DOMAIN", "cluster.local", "SPIFFE trust domain of the mesh")
	switch {
	case len(args) > 0 && isHelp(args[0]):
		s.help()
		return flag.ErrHelp
	case len(args) == 0:
		return fmt.Errorf("usage: redirector ca init --dir DIR [--trust-domain cluster.local] (see redirector ca -h)")
	case args[0] != "init":
		return fmt.Errorf("unknown ca command %q: the only one is init (see redirector ca -h)", args[0])
	}
	if err := s.parse(args[1:]); err != nil {
		return err
	}
	if err := s.require(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(*dir, 0o755); err != nil {
		return fmt.Errorf("%s: create %s: %w", s.name(dir), *dir, err)
	}
	if err := identity.InitCA(*dir, *td); err != nil {
		return err
	}
	fmt.Printf("created CA for trust domain %s in %s\n", *td, *dir)
	return nil
}

// caFlags are the settings of where workload certificates come from.
type caFlags struct {
	addr, tokenFile, rootCert, clusterID, rootReload *string
}

// caSettings are caFlags validated. Exactly one of dir (file CA) and addr
// (istiod) is set.
type caSettings struct {
	dir        string
	addr       string
	tokenFile  string
	rootCert   string
	clusterID  string
	rootReload time.Duration
}

func addCAFlags(s *settings) caFlags {
	return caFlags{
		addr:       s.add("ca-address", "CA_ADDRESS", "", "istiod's CA, host:port (e.g. istiod.istio-system.svc:15012): certificates are requested from it for the identities of this node's pods; exclusive with --ca-dir"),
		tokenFile:  s.add("ca-token-file", "CA_TOKEN_FILE", "/var/run/secrets/tokens/istio-token", "the agent's service account token for istiod (projected, audience istio-ca); re-read for every request"),
		rootCert:   s.add("ca-root-cert", "CA_ROOT_CERT", "", "PEM trust bundle (one or more roots; root-cert.pem of the istio-ca-root-cert ConfigMap) that istiod and peers are verified against; reloaded while running"),
		clusterID:  s.add("cluster-id", "CLUSTER_ID", "Kubernetes", "istiod's name for this cluster, sent with certificate requests"),
		rootReload: s.add("ca-root-cert-reload", "CA_ROOT_CERT_RELOAD", "10s", "how often --ca-root-cert is re-read"),
	}
}

func parseCAFlags(s *settings, f caFlags, dir *string) (caSettings, error) {
	c := caSettings{dir: *dir, addr: *f.addr, tokenFile: *f.tokenFile, rootCert: *f.rootCert, clusterID: *f.clusterID}
	switch {
	case c.dir != "" && c.addr != "":
		return c, fmt.Errorf("%s and %s are exclusive: a node either signs itself (standalone) or asks istiod", s.name(dir), s.name(f.addr))
	case c.dir == "" && c.addr == "":
		return c, fmt.Errorf("%s (istiod) or, standalone, %s is required", s.name(f.addr), s.name(dir))
	case c.addr != "" && c.rootCert == "":
		return c, fmt.Errorf("%s is required with %s: it is how istiod is verified", s.name(f.rootCert), s.name(f.addr))
	}
	d, err := time.ParseDuration(*f.rootReload)
	if err != nil || d <= 0 {
		return c, fmt.Errorf("%s: %q is not a positive duration such as 10s", s.name(f.rootReload), *f.rootReload)
	}
	if d < time.Second {
		return c, fmt.Errorf("%s: %s is shorter than the 1s minimum (each reload reads and parses the bundle)", s.name(f.rootReload), d)
	}
	c.rootReload = d
	return c, nil
}

// newCertManager builds the agent's certificate manager: from istiod when
// --ca-address is set (no signing key on the node; the trust bundle is
// re-read while running), else from the file CA in --ca-dir.
func newCertManager(ctx context.Context, cfg agentConfig, log *slog.Logger) (*identity.Manager, func(), error) {
	opts := identity.ManagerOptions{TTL: cfg.certTTL, Logger: log}
	if cfg.ca.addr == "" {
		ca, err := identity.LoadCAFor(cfg.ca.dir, cfg.trustDomain)
		if err != nil {
			return nil, nil, fmt.Errorf("--ca-dir (CA_DIR): %w", err)
		}
		if path, mode, exposed := ca.ExposedKey(); exposed {
			log.Warn("the CA's signing key is readable or writable by group or others: whoever reads it can sign any identity of the mesh; mount it 0400 (a Secret volume's defaultMode)",
				"path", path, "mode", mode.String())
		}
		opts.Signer, opts.Trust = ca, ca
		m := identity.New(opts)
		log.Info("certificates from the file CA on this node (standalone mode)", "dir", cfg.ca.dir, "trust_domain", ca.TrustDomain())
		return m, m.Close, nil
	}
	// The token is re-read per request (the kubelet rotates it), but a
	// missing one at start is a misconfiguration: say so now.
	if _, err := os.Stat(cfg.ca.tokenFile); err != nil {
		return nil, nil, fmt.Errorf("--ca-token-file (CA_TOKEN_FILE): %w (mount a projected service account token with audience istio-ca)", err)
	}
	bundle, err := identity.LoadBundle(cfg.ca.rootCert, cfg.trustDomain)
	if err != nil {
		return nil, nil, fmt.Errorf("--ca-root-cert (CA_ROOT_CERT): %w", err)
	}
	if exp := bundle.Expired(); len(exp) > 0 {
		log.Warn("trust bundle holds expired roots; they are not trusted", "path", cfg.ca.rootCert, "expired", exp)
	}
	client, err := istioca.New(istioca.Config{Addr: cfg.ca.addr, TokenFile: cfg.ca.tokenFile, ClusterID: cfg.ca.clusterID, Trust: bundle})
	if err != nil {
		return nil, nil, fmt.Errorf("--ca-address (CA_ADDRESS): %w", err)
	}
	opts.Signer, opts.Trust = client, bundle
	m := identity.New(opts)
	wctx, cancel := context.WithCancel(ctx)
	go bundle.Watch(wctx, cfg.ca.rootReload, log)
	log.Info("certificates from istiod", "address", cfg.ca.addr, "cluster_id", cfg.ca.clusterID, "roots", cfg.ca.rootCert, "roots_count", len(bundle.Certificates()))
	return m, func() { cancel(); m.Close(); client.Close() }, nil
}
