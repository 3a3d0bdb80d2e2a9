package main

import (
	"bufio"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/pkg/dnsproxy"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// dnsFlags are the run settings of DNS capture (istio-cni's ambient DNS
// capture, answered as ztunnel's DNS proxy answers).
type dnsFlags struct {
	capture, upstreams *string
}

func addDNSSettings(s *settings) dnsFlags {
	return dnsFlags{
		capture: s.add("dns-capture", "DNS_CAPTURE", "true",
			"answer enrolled pods' DNS queries (UDP and TCP to port 53) in the agent: names of the mesh from its services, the rest forwarded; a pod's annotation ambient.istio.io/dns-capture overrides"),
		upstreams: s.add("dns-upstreams", "DNS_UPSTREAMS", "",
			"comma-separated resolvers that queries for names outside the mesh are forwarded to, as IP or IP:port (empty: the nameservers of "+resolvConf+")"),
	}
}

// resolvConf is where the node's resolvers are read when --dns-upstreams
// is empty: in the DaemonSet (host network, ClusterFirstWithHostNet) it
// names the cluster's DNS service, as ztunnel's does.
const resolvConf = "/etc/resolv.conf"

// dnsSettings are dnsFlags parsed.
type dnsSettings struct {
	capture bool
	// upstreams is empty when the setting is: resolvConf is read at start.
	upstreams []netip.AddrPort
}

func (f dnsFlags) parse(s *settings) (dnsSettings, error) {
	var d dnsSettings
	switch *f.capture {
	case "true":
		d.capture = true
	case "false":
	default:
		return d, fmt.Errorf("%s: %q is not true or false", s.name(f.capture), *f.capture)
	}
	for _, field := range strings.Split(*f.upstreams, ",") {
		if field = strings.TrimSpace(field); field == "" {
			continue
		}
		ap, err := parseResolver(field)
		if err != nil {
			return d, fmt.Errorf("%s: %w", s.name(f.upstreams), err)
		}
		d.upstreams = append(d.upstreams, ap)
	}
	return d, nil
}

// parseResolver reads a resolver as IP (port 53) or IP:port.
func parseResolver(s string) (netip.AddrPort, error) {
	if a, err := netip.ParseAddr(s); err == nil && a.Zone() == "" {
		return netip.AddrPortFrom(a.Unmap(), 53), nil
	}
	ap, err := netip.ParseAddrPort(s)
	if err != nil || ap.Port() == 0 || ap.Addr().Zone() != "" {
		return netip.AddrPort{}, fmt.Errorf("resolver %q is not an IP address or IP:port", s)
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
}

// resolvers are the nameservers of a resolv.conf file. A line that is not
// an address is skipped, as the C library does.
func resolvers(path string) ([]netip.AddrPort, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read resolvers: %w", err)
	}
	defer f.Close()
	var out []netip.AddrPort
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 || fields[0] != "nameserver" {
			continue
		}
		if a, err := netip.ParseAddr(fields[1]); err == nil && a.Zone() == "" {
			out = append(out, netip.AddrPortFrom(a.Unmap(), 53))
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read resolvers from %s: %w", path, err)
	}
	return out, nil
}

// newDNSProxy makes the resolver of captured queries. It is made whatever
// the node's setting: a pod's annotation may turn capture on.
func newDNSProxy(d dnsSettings, dir func() *workload.Directory, reg prometheus.Registerer, log *slog.Logger) (*dnsproxy.Proxy, error) {
	ups := d.upstreams
	if len(ups) == 0 {
		var err error
		if ups, err = resolvers(resolvConf); err == nil && len(ups) == 0 {
			err = fmt.Errorf("%s names no nameserver", resolvConf)
		}
		if err != nil {
			// Names of the mesh are still answered; the rest get SERVFAIL.
			log.Warn("DNS capture: no upstream resolver, captured queries for names outside the mesh fail (set DNS_UPSTREAMS)", "error", err)
		}
	}
	p, err := dnsproxy.New(dnsproxy.Config{Upstreams: ups}, dir, dnsproxy.NewMetrics(reg), log)
	if err != nil {
		return nil, fmt.Errorf("DNS proxy: %w", err)
	}
	return p, nil
}
