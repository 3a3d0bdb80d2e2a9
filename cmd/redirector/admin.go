package main

import (
	"fmt"
	"strings"

	"github.com/redirector-mesh/redirector/pkg/admin"
	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/tunnel"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// podsReady reports whether every pod enrolled on this node has its
// listeners open and a valid certificate (requested by the Manager when the
// pod was enrolled).
func podsReady(cfg agentConfig, tun *tunnel.Tunnel, certs *identity.Manager) (bool, string) {
	var missing []string
	for _, w := range tun.State().Dir.LocalPods(cfg.node) {
		if !w.Enrolled {
			continue
		}
		if !tun.PodReady(w.Key()) {
			missing = append(missing, w.String()+": listeners not open")
			continue
		}
		id := identity.ID{TrustDomain: cfg.trustDomain, Namespace: w.Namespace, ServiceAccount: w.ServiceAccount}
		if err := certs.Ready(id); err != nil {
			missing = append(missing, w.String()+": "+err.Error())
		}
	}
	if len(missing) == 0 {
		return true, ""
	}
	if len(missing) > 3 {
		missing = append(missing[:3], fmt.Sprintf("and %d more pods", len(missing)-3))
	}
	return false, strings.Join(missing, "; ")
}

// configSections feed the admin config dump from the tunnel's current state
// and the certificate cache.
func configSections(cfg agentConfig, tun *tunnel.Tunnel, certs *identity.Manager) map[string]func() any {
	return map[string]func() any{
		admin.SectionPods: func() any {
			rows := []admin.PodRow{}
			for _, w := range tun.State().Dir.LocalPods(cfg.node) {
				r := admin.PodRow{Namespace: w.Namespace, Name: w.Name, UID: w.UID, Enrolled: w.Enrolled, Reason: w.Reason,
					CaptureInbound: w.Enrolled && !w.BypassInbound, CaptureDNS: w.Enrolled && w.DNSCapture.Or(cfg.dns.capture), Listening: tun.PodReady(w.Key())}
				for _, a := range w.Addrs {
					r.Addresses = append(r.Addresses, a.String())
				}
				rows = append(rows, r)
			}
			return rows
		},
		// workloads, services, policies, certificates and workloadState
		// are in ztunnel's shape, for istioctl ztunnel-config and Kiali.
		admin.SectionWorkloads: func() any {
			return admin.ZtunnelWorkloads(tun.State().Dir, cfg.ca.clusterID, cfg.xds.network, cfg.trustDomain)
		},
		admin.SectionServices: func() any { return admin.ZtunnelServices(tun.State().Dir, cfg.ca.clusterID, cfg.xds.network) },
		admin.SectionPolicies: func() any {
			st := tun.State()
			if st.Compiled != nil {
				return admin.ZtunnelCompiledPolicies(st.Compiled)
			}
			return admin.ZtunnelPolicies(st.AuthorizationPolicies, cfg.rootNamespace)
		},
		admin.SectionCertificates: func() any { return admin.ZtunnelCertificates(certRows(certs), nil) },
		admin.SectionWorkloadState: func() any {
			return admin.ZtunnelWorkloadStates(tun.State().Dir.LocalPods(cfg.node), cfg.trustDomain, func(w *workload.Workload) (bool, *admin.ZtunnelConnections) {
				return podConnections(tun, w.Key())
			})
		},
		admin.SectionMeshPolicies: func() any {
			st := tun.State()
			return admin.Policies{PeerAuthentications: st.PeerAuthentications, AuthorizationPolicies: st.AuthorizationPolicies}
		},
		admin.SectionCerts: func() any { return certRows(certs) },
	}
}

// podConnections is whether the tunnel serves the pod under key and, if it
// does, its open connections in ztunnel's shape.
func podConnections(tun *tunnel.Tunnel, key string) (bool, *admin.ZtunnelConnections) {
	in, out, ok := tun.Connections(key)
	if !ok {
		return false, nil
	}
	z := &admin.ZtunnelConnections{Inbound: make([]admin.ZtunnelInboundConnection, 0, len(in)), Outbound: make([]admin.ZtunnelOutboundConnection, 0, len(out))}
	for _, c := range in {
		var svc *string
		if c.Service != "" {
			svc = &c.Service
		}
		z.Inbound = append(z.Inbound, admin.ZtunnelInboundConnection{Src: c.Src.String(), OriginalDst: svc, ActualDst: c.Dst.String(), Protocol: admin.Protocol(c.HBONE)})
	}
	for _, c := range out {
		z.Outbound = append(z.Outbound, admin.ZtunnelOutboundConnection{Src: c.Src.String(), OriginalDst: c.OriginalDst.String(), ActualDst: c.ActualDst.String(), Protocol: admin.Protocol(c.HBONE)})
	}
	return true, z
}

// certRows describes the cached certificates for the config dump and the
// expiry metric.
func certRows(m *identity.Manager) []admin.CertRow {
	rows := []admin.CertRow{}
	for _, c := range m.Snapshot() {
		rows = append(rows, admin.CertRow{Identity: c.ID.String(), Serial: c.Serial, NotBefore: c.NotBefore,
			NotAfter: c.NotAfter, Issuer: c.Issuer, State: string(c.State), CA: c.CA, RefreshAt: c.RefreshAt,
			LastError: c.LastError, Failures: c.Failures, Chain: chainRows(c.Chain)})
	}
	return rows
}

func chainRows(chain []identity.ChainCert) []admin.ChainCert {
	out := make([]admin.ChainCert, 0, len(chain))
	for _, c := range chain {
		out = append(out, admin.ChainCert{Subject: c.Subject, Issuer: c.Issuer, Serial: c.Serial, NotAfter: c.NotAfter, PEM: c.PEM})
	}
	return out
}

// certExpiryRows are the certificate rows that hold a certificate: an
// identity still waiting for its first one has no expiry to report.
func certExpiryRows(m *identity.Manager) []admin.CertRow {
	var rows []admin.CertRow
	for _, r := range certRows(m) {
		if !r.NotAfter.IsZero() {
			rows = append(rows, r)
		}
	}
	return rows
}
