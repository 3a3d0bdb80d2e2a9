package main

import (
	"bufio"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strconv"
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
			"comma-separated resolvers that queries for names outside the mesh are forwarded to, from each pod's namespace (so no loopback address), as IP or IP:port (empty: the nameservers of "+resolvConf+")"),
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
	var ap netip.AddrPort
	if a, err := netip.ParseAddr(s); err == nil && a.Zone() == "" {
		ap = netip.AddrPortFrom(a.Unmap(), 53)
	} else {
		ap, err = netip.ParseAddrPort(s)
		if err != nil || ap.Port() == 0 || ap.Addr().Zone() != "" {
			return netip.AddrPort{}, fmt.Errorf("resolver %q is not an IP address or IP:port", s)
		}
		ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	if why := notFromPods(ap.Addr()); why != "" {
		return netip.AddrPort{}, fmt.Errorf("resolver %q: %s", s, why)
	}
	return ap, nil
}

// notFromPods says why a is no resolver to forward to ("" if it is one):
// queries are forwarded from the client pod's network namespace, where a
// loopback address is the pod's own loopback (a node's systemd-resolved
// stub, 127.0.0.53, is not there; a pod's own listener would be), and an
// unspecified, multicast or broadcast address is nobody's. A link-local
// one is kept: NodeLocal DNSCache answers pods at 169.254.20.10.
func notFromPods(a netip.Addr) string {
	switch {
	case a.IsLoopback():
		return "a loopback address, which from the pods' namespaces (where queries are forwarded from) is each pod's own loopback"
	case a.IsUnspecified():
		return "the unspecified address is no resolver"
	case a.IsMulticast(), a == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return "a multicast or broadcast address is no resolver"
	}
	return ""
}

// resolvers are the nameservers of a resolv.conf file. A line that is not
// an address is skipped, as the C library does, and so is an address no
// pod can forward to (notFromPods), logged.
func resolvers(path string, log *slog.Logger) ([]netip.AddrPort, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
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
		a, err := netip.ParseAddr(fields[1])
		if err != nil || a.Zone() != "" {
			continue
		}
		if why := notFromPods(a.Unmap()); why != "" {
			log.Warn("DNS capture: a nameserver of "+path+" skipped as upstream", "nameserver", fields[1], "reason", why)
			continue
		}
		out = append(out, netip.AddrPortFrom(a.Unmap(), 53))
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
		ups, err = resolvers(resolvConf, log)
		if err == nil && len(ups) == 0 {
			err = fmt.Errorf("no nameserver in %s that pods can forward to", resolvConf)
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
	if ok, err := canBindPort53(); err == nil && !ok {
		log.Warn("DNS capture: the agent lacks CAP_NET_BIND_SERVICE, so answers to captured queries, which leave from <resolver>:53, fail in pods whose runtime keeps ports below 1024 privileged; add NET_BIND_SERVICE, as the chart does (with DNS_CAPTURE=false only pods annotated ambient.istio.io/dns-capture=true are captured)")
	}
	return p, nil
}

// capNetBindService is CAP_NET_BIND_SERVICE's bit in /proc/self/status.
const capNetBindService = 10

// canBindPort53 reports whether this process holds CAP_NET_BIND_SERVICE in
// its effective set: an answer to a captured query is sent from a socket
// bound to port 53 in the pod's namespace, which needs it unless the pod's
// runtime opened the privileged ports (ip_unprivileged_port_start).
func canBindPort53() (bool, error) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false, err
	}
	return effectiveCap(string(b), capNetBindService)
}

// effectiveCap reads capability bit c of the CapEff line of a
// /proc/<pid>/status text.
func effectiveCap(status string, c uint) (bool, error) {
	for _, line := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return false, fmt.Errorf("CapEff %q: %w", v, err)
			}
			return mask&(1<<c) != 0, nil
		}
	}
	return false, errors.New("no CapEff line")
}
