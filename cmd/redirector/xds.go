package main

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubernetes"
	"github.com/redirector-mesh/redirector/pkg/source/nodepods"
	"github.com/redirector-mesh/redirector/pkg/source/xds"
)

// xdsFlags are the settings of --source xds.
type xdsFlags struct {
	addr, podName, podIP, network *string
}

// xdsSettings are xdsFlags validated.
type xdsSettings struct {
	addr         string
	podName      string
	podNamespace string
	podIP        netip.Addr
	network      string
}

func addXDSFlags(s *settings) xdsFlags {
	return xdsFlags{
		addr:    s.add("xds-address", "XDS_ADDRESS", "", "--source xds: istiod's xDS address, host:port (empty: --ca-address)"),
		podName: s.add("pod-name", "POD_NAME", "", "--source xds: the agent's own pod name, part of the node identity istiod sees"),
		podIP:   s.add("instance-ip", "INSTANCE_IP", "", "--source xds: the agent's own pod address, part of the node identity istiod sees"),
		network: s.add("network", "NETWORK", "", "--source xds: the network this node is on, as istiod names it (topology.istio.io/network; empty: the default network); workloads on other networks are left out"),
	}
}

// parseXDSFlags validates the xDS settings when the source is xds.
func parseXDSFlags(s *settings, f xdsFlags, c agentConfig, podNamespace string) (xdsSettings, error) {
	if c.source != "xds" {
		return xdsSettings{}, nil
	}
	x := xdsSettings{addr: cmp.Or(*f.addr, c.ca.addr), podName: *f.podName, podNamespace: cmp.Or(podNamespace, "istio-system")}
	if x.addr == "" {
		return x, fmt.Errorf("--source xds needs istiod: set %s or --ca-address (CA_ADDRESS)", s.name(f.addr))
	}
	if c.ca.rootCert == "" {
		return x, fmt.Errorf("--source xds needs --ca-root-cert (CA_ROOT_CERT) to verify istiod")
	}
	if x.podName == "" {
		return x, fmt.Errorf("%s is required with --source xds", s.name(f.podName))
	}
	ip, err := netip.ParseAddr(*f.podIP)
	if err != nil {
		return x, fmt.Errorf("%s: %q is not an IP address", s.name(f.podIP), *f.podIP)
	}
	// Sent as written in the node id and INSTANCE_IPS, where istiod looks
	// the agent's pod up by its address: a zone, an IPv4-mapped spelling
	// or an address no pod has would name no pod.
	if ip.Zone() != "" || ip.Is4In6() || ip.IsUnspecified() || ip.IsMulticast() {
		return x, fmt.Errorf("%s: %q is not a pod address (no zone, no IPv4-mapped form, not unspecified or multicast)", s.name(f.podIP), *f.podIP)
	}
	x.podIP = ip
	if errs := validation.IsValidLabelValue(*f.network); len(errs) > 0 {
		return x, fmt.Errorf("%s: %q is not a network name (a label value): %s", s.name(f.network), *f.network, errs[0])
	}
	x.network = *f.network
	return x, nil
}

// newXDSSource builds the xDS source: istiod for the mesh, a node-scoped
// pod watch for enrollment, and the annotator that tells istiod (through
// ambient.istio.io/redirection) which pods take HBONE.
//
// trust is the certificate manager's: istiod is verified against the same
// roots as the certificates it signs (see xdsTrust).
func newXDSSource(ctx context.Context, cfg agentConfig, log *slog.Logger, reg prometheus.Registerer, metrics *source.Metrics, trust identity.Trust) (source.Source, *kubernetes.Annotator, error) {
	rc, err := restConfig(cfg.kubeconfig)
	if err != nil {
		return nil, nil, err
	}
	pods, err := nodepods.New(rc, cfg.node, log, metrics)
	if err != nil {
		return nil, nil, err
	}
	ann, err := kubernetes.NewAnnotator(rc)
	if err != nil {
		return nil, nil, fmt.Errorf("kubernetes annotator: %w", err)
	}
	if _, err := os.Stat(cfg.ca.tokenFile); err != nil {
		return nil, nil, fmt.Errorf("--ca-token-file (CA_TOKEN_FILE): %w (istiod's xDS needs the istio-ca token too)", err)
	}
	bundle, err := xdsTrust(ctx, cfg, log, trust)
	if err != nil {
		return nil, nil, err
	}
	conn, err := xds.Dial(cfg.xds.addr, "", bundle)
	if err != nil {
		return nil, nil, fmt.Errorf("--xds-address (XDS_ADDRESS): %w", err)
	}
	client, err := xds.New(xds.Config{
		Conn:    conn,
		Network: cfg.xds.network,
		Token:   xds.TokenFile(cfg.ca.tokenFile),
		Node: xds.Node{IP: cfg.xds.podIP, PodName: cfg.xds.podName, PodNamespace: cfg.xds.podNamespace,
			NodeName: cfg.node, ClusterID: cfg.ca.clusterID},
		Metrics: xds.NewMetrics(reg),
		Logger:  log,
	})
	if err != nil {
		return nil, nil, err
	}
	log.Info("mesh from istiod (xDS), enrollment from this node's pods", "xds_address", cfg.xds.addr, "network", cfg.xds.network, "node_id", xds.Node{IP: cfg.xds.podIP, PodName: cfg.xds.podName, PodNamespace: cfg.xds.podNamespace, NodeName: cfg.node}.ID())
	return xds.NewSource(client, pods, cfg.node, cfg.selection, log), ann, nil
}

// xdsTrust is the bundle istiod's xDS serving certificate is verified
// against: --ca-root-cert, followed while running like the one peers and
// istiod's CA are verified against, so a root rotation reaches xDS too (a
// root removed stops being trusted for the channel that delivers the
// mesh's workloads and policies; a root added lets istiod's new serving
// certificate in without a restart). It is the certificate manager's
// bundle when that is the same file (istiod signs), else a bundle of its
// own, watched until ctx ends.
func xdsTrust(ctx context.Context, cfg agentConfig, log *slog.Logger, certs identity.Trust) (*identity.Bundle, error) {
	if b, ok := certs.(*identity.Bundle); ok && b.Path() == cfg.ca.rootCert {
		return b, nil
	}
	bundle, err := identity.LoadBundle(cfg.ca.rootCert, cfg.trustDomain)
	if err != nil {
		return nil, fmt.Errorf("--ca-root-cert (CA_ROOT_CERT): %w", err)
	}
	if exp := bundle.Expired(); len(exp) > 0 {
		log.Warn("trust bundle holds expired roots; they are not trusted", "path", cfg.ca.rootCert, "expired", exp)
	}
	go bundle.Watch(ctx, cfg.ca.rootReload, log)
	return bundle, nil
}

// sourceSynced is a readiness check: a source that reports its sync (the
// xDS source: istiod answered) is ready only once synced; others always.
func sourceSynced(src source.Source) func() (bool, string) {
	if s, ok := src.(interface{ Synced() (bool, string) }); ok {
		return s.Synced
	}
	return func() (bool, string) { return true, "" }
}
