package dnsproxy

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"strings"

	"github.com/miekg/dns"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// TTL is the TTL of the records answered from the mesh, ztunnel's
// DEFAULT_TTL_SECONDS: short, since a service's VIPs rarely change but a
// headless service's endpoints do.
const TTL = 30

// clusterDomain is the Kubernetes cluster domain (see
// workload.ClusterHostname), svcDomain the domain of its services.
const (
	clusterDomain = "cluster.local."
	svcDomain     = "svc." + clusterDomain
)

// hostIndex indexes one directory's services by hostname (lowercase, no
// trailing dot), in the directory's order (namespace, name).
type hostIndex struct {
	dir   *workload.Directory
	hosts map[string][]*workload.Service
	// choices holds best's answers, worked out once, for the host names
	// of more than manyServices services: a ServiceEntry for a popular
	// host in each of thousands of namespaces made every query for it,
	// from every pod, walk them all (2.5 ms a query at 10k).
	choices map[string]*hostChoice
}

// manyServices is how many services of one host name best walks per query;
// past it, the index has its answers.
const manyServices = 8

// hostChoice is what best picks among the services of one host name: for a
// client in a namespace of own, that namespace's; for any other, other.
type hostChoice struct {
	own   map[string]*workload.Service
	other *workload.Service
}

func (c *hostChoice) pick(ns string) *workload.Service {
	if s, ok := c.own[ns]; ok {
		return s
	}
	return c.other
}

// choose works out best's answers for list, as best walks it.
func choose(list []*workload.Service) *hostChoice {
	c := &hostChoice{own: map[string]*workload.Service{}}
	var canonical, first *workload.Service
	for _, s := range list {
		if !answerable(s) {
			continue
		}
		if _, seen := c.own[s.Namespace]; !seen {
			c.own[s.Namespace] = s
		}
		if s.NamespaceOnly {
			continue
		}
		if canonical == nil && isCanonical(s) {
			canonical = s
		}
		if first == nil {
			first = s
		}
	}
	c.other = first
	if canonical != nil {
		c.other = canonical
	}
	return c
}

// lookup returns the service a client in ns resolves host to (see best).
func (ix *hostIndex) lookup(host, ns string) *workload.Service {
	if c := ix.choices[host]; c != nil {
		return c.pick(ns)
	}
	return best(ix.hosts[host], ns)
}

// hosts returns the index of the current directory, built once per
// directory (directories are immutable; a new snapshot is a new pointer).
// The build is O(services), some 10 MB and tens of milliseconds at 50k
// services, and every query in flight when the directory changes wants
// it: they wait for one build rather than each making its own (up to the
// node's 1024 at once, which on two CPUs took 20 s and 900 MB for 128 of
// them, every DNS answer of the node waiting meanwhile).
func (p *Proxy) hosts() *hostIndex {
	dir := p.dir()
	if ix := p.index.Load(); ix != nil && ix.dir == dir {
		return ix
	}
	p.indexMu.Lock()
	defer p.indexMu.Unlock()
	if ix := p.index.Load(); ix != nil && ix.dir == dir {
		return ix // built while this query waited
	}
	ix := &hostIndex{dir: dir, hosts: map[string][]*workload.Service{}, choices: map[string]*hostChoice{}}
	if dir != nil {
		for _, s := range dir.Services() {
			h := strings.TrimSuffix(strings.ToLower(s.Hostname), ".")
			if h != "" {
				ix.hosts[h] = append(ix.hosts[h], s)
			}
		}
	}
	for h, list := range ix.hosts {
		if len(list) > manyServices {
			ix.choices[h] = choose(list)
		}
	}
	p.index.Store(ix)
	return ix
}

// alias is one name the requested one may stand for (ztunnel's Alias):
// fqdn, lowercase. stripped is set when the alias came from taking a
// search domain off the requested name: the name the client asked
// before its resolver appended the domain.
type alias struct {
	name     string
	stripped string
}

// aliases enumerates what name (lowercase FQDN) may mean to a client in
// namespace ns, as ztunnel's get_aliases: the name itself, its expansions
// to a service's FQDN (kubeFQDNs), and the same for the name with one of
// the pod's search domains taken off (its resolver appends them, ndots:5,
// before trying the name as it is).
func aliases(name, ns string) []alias {
	var out []alias
	seen := map[string]bool{}
	add := func(a alias) {
		if !seen[a.name] {
			seen[a.name] = true
			out = append(out, a)
		}
	}
	add(alias{name: name})
	for _, f := range kubeFQDNs(name, ns) {
		add(alias{name: f})
	}
	for _, domain := range []string{ns + "." + svcDomain, svcDomain, clusterDomain} {
		stripped, ok := strings.CutSuffix(name, "."+domain)
		if !ok || stripped == "" {
			continue
		}
		stripped += "."
		add(alias{name: stripped, stripped: stripped})
		for _, f := range kubeFQDNs(stripped, ns) {
			add(alias{name: f, stripped: stripped})
		}
	}
	return out
}

// kubeFQDNs expands name into the service FQDNs it may be short for, as
// ztunnel's to_kube_fqdns: <svc> (the client's namespace), <svc>.<ns>,
// <svc>.<ns>.svc, and the pod forms <host>.<subdomain>[.<ns>[.svc]].
func kubeFQDNs(name, ns string) []string {
	labels := dns.SplitDomainName(name)
	inNamespace := ns + "." + svcDomain
	switch last := len(labels) - 1; {
	case len(labels) == 1:
		return []string{name + inNamespace}
	case len(labels) == 2:
		return []string{name + svcDomain, name + inNamespace}
	case len(labels) == 3 && labels[last] == "svc":
		return []string{name + clusterDomain, name + svcDomain}
	case len(labels) == 3:
		return []string{name + svcDomain}
	case len(labels) == 4 && labels[last] == "svc":
		return []string{name + clusterDomain}
	}
	return nil
}

// wildcards lists name and the wildcards that cover it, most specific
// first: a.b.c. gives a.b.c., *.b.c., *.c. (ztunnel's get_wildcards).
func wildcards(name string) []string {
	labels := dns.SplitDomainName(name)
	out := []string{name}
	for i := 1; i < len(labels); i++ {
		out = append(out, "*."+strings.Join(labels[i:], ".")+".")
	}
	return out
}

// meshMatch is the service a name resolved to, and how.
type meshMatch struct {
	service *workload.Service
	host    string // the hostname (or wildcard) matched
	alias   alias
}

// find resolves name (lowercase FQDN) for client: the first alias, and
// within it the most specific host, that names a service client sees.
func (p *Proxy) find(client *workload.Workload, name string) (meshMatch, bool) {
	ix := p.hosts()
	if len(ix.hosts) == 0 {
		return meshMatch{}, false
	}
	for _, a := range aliases(name, client.Namespace) {
		for _, host := range wildcards(a.name) {
			if s := ix.lookup(strings.TrimSuffix(host, "."), client.Namespace); s != nil {
				return meshMatch{service: s, host: host, alias: a}, true
			}
		}
	}
	return meshMatch{}, false
}

// best picks among the services of one hostname the one a client in ns
// resolves it to, as ztunnel's find_best_match: its own namespace's, else
// a Kubernetes Service's (the hostname is that service's own name), else
// the first. Left out, so the name is forwarded as if not in the mesh:
// services ns does not see (NamespaceOnly), and those without VIPs unless
// they are Kubernetes headless services (ztunnel tells them by the
// cluster's service domain). A long list is worked out once (choose).
func best(list []*workload.Service, ns string) *workload.Service {
	var canonical, first *workload.Service
	for _, s := range list {
		if s.NamespaceOnly && s.Namespace != ns {
			continue
		}
		if !answerable(s) {
			continue
		}
		if s.Namespace == ns {
			return s
		}
		if canonical == nil && isCanonical(s) {
			canonical = s
		}
		if first == nil {
			first = s
		}
	}
	if canonical != nil {
		return canonical
	}
	return first
}

// answerable says whether the mesh answers for s: it has VIPs, or it is a
// Kubernetes headless service.
func answerable(s *workload.Service) bool {
	return len(s.VIPs) > 0 || strings.HasSuffix(strings.ToLower(s.Hostname), "."+strings.TrimSuffix(svcDomain, "."))
}

// isCanonical says whether s's host name is its own Kubernetes name.
func isCanonical(s *workload.Service) bool {
	return strings.EqualFold(s.Hostname, workload.ClusterHostname(s.Name, s.Namespace))
}

// fromMesh answers req from the directory, or returns nil to forward it:
// a query for another type than A or AAAA, or another class than IN, or
// for a name of no service client sees, goes upstream (as ztunnel).
func (p *Proxy) fromMesh(client *workload.Workload, req *dns.Msg) *dns.Msg {
	q := req.Question[0]
	if q.Qclass != dns.ClassINET || (q.Qtype != dns.TypeA && q.Qtype != dns.TypeAAAA) {
		return nil
	}
	m, ok := p.find(client, strings.ToLower(q.Name))
	if !ok {
		return nil
	}
	// From here on the proxy is the authority: a family the service has
	// no address of is NODATA (an empty NOERROR), never NXDOMAIN.
	resp := replyTo(req, dns.RcodeSuccess)
	resp.Authoritative = true
	owner := q.Name
	if m.alias.stripped != "" && !strings.HasPrefix(m.host, "*.") {
		// The client's resolver appended a search domain to a name of the
		// mesh: point it at that name (in the case the client wrote it).
		owner = q.Name[:len(m.alias.stripped)-1] + "."
		resp.Answer = append(resp.Answer, &dns.CNAME{
			Hdr:    dns.RR_Header{Name: q.Name, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: TTL},
			Target: owner,
		})
	}
	addrs := addresses(m.service, q.Qtype)
	for _, a := range addrs {
		hdr := dns.RR_Header{Name: owner, Rrtype: q.Qtype, Class: dns.ClassINET, Ttl: TTL}
		if q.Qtype == dns.TypeA {
			resp.Answer = append(resp.Answer, &dns.A{Hdr: hdr, A: a.AsSlice()})
		} else {
			resp.Answer = append(resp.Answer, &dns.AAAA{Hdr: hdr, AAAA: a.AsSlice()})
		}
	}
	if len(addrs) == 0 {
		// ztunnel sends no CNAME with an empty answer.
		resp.Answer = nil
	}
	if p.log.Enabled(context.Background(), slog.LevelDebug) {
		p.log.Debug("dns: answered from the mesh", "client", client.String(), "name", q.Name,
			"type", dns.TypeToString[q.Qtype], "service", m.service.String(), "addresses", len(addrs))
	}
	return resp
}

// addresses are s's addresses of qtype's family, in random order (as
// ztunnel shuffles them, for clients that take the first): its VIPs, or
// for a headless service its ready endpoints' addresses.
func addresses(s *workload.Service, qtype uint16) []netip.Addr {
	family := func(a netip.Addr) bool {
		a = a.Unmap()
		return a.Is4() == (qtype == dns.TypeA)
	}
	var out []netip.Addr
	if len(s.VIPs) > 0 {
		for _, v := range s.VIPs {
			if family(v) {
				out = append(out, v.Unmap())
			}
		}
	} else {
		seen := map[netip.Addr]bool{}
		for _, ep := range s.Endpoints {
			a := ep.Addr.Unmap()
			if ep.Ready && a.IsValid() && family(a) && !seen[a] {
				seen[a] = true
				out = append(out, a)
			}
		}
	}
	rand.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}
