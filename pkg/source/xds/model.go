package xds

import (
	"cmp"
	"net/netip"
	"slices"
	"strconv"

	"istio.io/istio/pkg/workloadapi"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Workload is one workload as istiod describes it: the model's
// workload.Workload (name, namespace, uid, service account, node,
// addresses, workload name and type, canonical service, locality, waypoint;
// Enrolled is true when istiod says it takes HBONE on port 15008: pods the
// agent annotated ambient.istio.io/redirection=enabled; false is a
// plaintext peer, tunnel_protocol NONE, or LEGACY_ISTIO_MTLS, a sidecar
// whose Istio mTLS is not spoken here) plus what only the xDS client uses.
type Workload struct {
	workload.Workload
	// TrustDomain is the workload's SPIFFE trust domain (istiod sends none
	// for cluster.local, which this then holds).
	TrustDomain string
	// Network is the network istiod puts the workload on ("" is the
	// default network). Only workloads on the agent's own network are
	// reachable at their addresses.
	Network string
	// Healthy is false for a workload istiod marks UNHEALTHY (a pod not
	// ready, or deleted but not yet gone): not a ready endpoint.
	Healthy bool
	// Services maps a service key (namespace/hostname) to the ports this
	// workload serves it on.
	Services map[string][]PortMap
	// Policies are the keys (namespace/name) of the workload-selector
	// authorization policies that select this workload.
	Policies []string
	// HostNetwork is istiod's mark (network_mode HOST_NETWORK) on a pod
	// that uses its node's network: its addresses are the node's, shared
	// by every such pod there, so the directory does not index them
	// (merge); it stays an endpoint of its services at them.
	HostNetwork bool
}

// Identity is the workload's SPIFFE ID.
func (w *Workload) Identity() string { return w.Workload.Identity(w.TrustDomain) }

// PortMap maps a service port to the port the workload serves it on.
type PortMap struct {
	ServicePort uint16
	// TargetPort is the workload's port; 0 means the service port.
	TargetPort uint16
}

// Service is one service as istiod describes it (a Kubernetes Service or
// a ServiceEntry), as the model's workload.Service: its ports are named by
// their number so endpoints map them to target ports.
type Service struct {
	workload.Service
	// Canonical is istiod's mark on the service that owns its host name
	// (a Kubernetes Service, not a ServiceEntry naming the same host): of
	// two services listing one VIP, it keeps it (sharedVIPs).
	Canonical bool
	// vipNetworks holds, per VIP, the network the address is on; the
	// snapshot keeps only the VIPs on the agent's network.
	vipNetworks []string
	// cidrNetworks holds, per CIDR, the network the range is on.
	cidrNetworks []string
	// What istiod's load_balancing says beyond a preference (see
	// translateLoadBalancing): allowUnhealthy (health_policy ALLOW_ALL,
	// publishNotReadyAddresses) makes every endpoint ready; nodeLocal
	// (mode STRICT by NODE, internalTrafficPolicy: Local) keeps only the
	// endpoints on the client's node, this one; passthrough (mode
	// PASSTHROUGH, a ServiceEntry with resolution NONE) sends connections
	// to the address called, so its VIPs route nothing (merge).
	allowUnhealthy, nodeLocal, passthrough bool
	// families is istiod's ip_families (checked by translateFamilies):
	// the address families a headless service's endpoints are listed in
	// (endpointAddrs). The zero value, AUTOMATIC, is both.
	families workloadapi.IPFamilies
}

// hasFamily: whether the service has a's address family.
func (s *Service) hasFamily(a netip.Addr) bool {
	switch s.families {
	case workloadapi.IPFamilies_IPV4_ONLY:
		return a.Is4()
	case workloadapi.IPFamilies_IPV6_ONLY:
		return a.Is6()
	}
	return true
}

// headless: istiod gives the service no address at all, not even on
// another network (ztunnel's test, vips empty), so DNS answers its
// endpoints' addresses and nothing dials it by a VIP.
func (s *Service) headless() bool { return len(s.VIPs) == 0 && len(s.CIDRs) == 0 }

// endpointAddrs are the addresses at which w is listed as an endpoint of
// svc. A service with addresses is dialled through its endpoints: one per
// workload, at its first address (a workload's share of the balancer's
// rotation is its count of endpoints). A headless service's clients ask
// DNS for its endpoints' addresses and dial those, which are workloads'
// (routed as such, not through the service), so w is listed at its first
// address of each of the service's families, as ztunnel answers a
// headless service: per endpoint workload, its first address of the
// asked family, if the service has that family. A dual-stack pod behind
// a dual-stack headless service is then answered over A and over AAAA,
// as the Kubernetes source lists it in the service's two EndpointSlices;
// a family the service has not is left out, as Kubernetes makes no slice
// of it. At most two per workload. (A waypoint named by a headless
// service's host name is dialled through them, at the caller's family of
// each instance: twice in the rotation each, as under the Kubernetes
// source.)
func endpointAddrs(w *Workload, svc *Service) []netip.Addr {
	if !svc.headless() {
		return w.Addrs[:1]
	}
	var out []netip.Addr
	for _, a := range w.Addrs {
		if svc.hasFamily(a) && !slices.ContainsFunc(out, func(b netip.Addr) bool { return b.Is4() == a.Is4() }) {
			out = append(out, a)
		}
	}
	return out
}

// Key is namespace/hostname, how workloads name the services they serve.
func (s *Service) Key() string { return s.Namespace + "/" + s.Hostname }

// Snapshot is everything istiod sent, translated. It is built anew on each
// change and never modified afterwards.
type Snapshot struct {
	// Workloads are sorted by namespace and name.
	Workloads []*Workload
	// Services are sorted by namespace and hostname; their endpoints are
	// the workloads that serve them (a headless service's, at each of its
	// families: endpointAddrs), sorted by address.
	Services []*Service
	// Policies are sorted by namespace and name.
	Policies []*policy.Compiled
	// Unresolved names, sorted, the Authorization resources that could
	// not be held in any form, not even fail-closed (undecodable, an
	// unknown scope, over a limit): policy.CompiledSet refuses everything
	// while there are any.
	Unresolved []string
	// Network is the agent's network. Workloads on other networks stay in
	// Workloads (so a local pod's copy can be checked), but they are not
	// any service's endpoints, and VIPs on other networks are left out:
	// such an address means another host there, and reaching it would
	// take an east-west gateway, which the agent does not drive.
	Network string
	// Cluster is the agent's cluster as istiod names it (CLUSTER_ID; ""
	// takes any): istiod's copy of a local pod is the pod of its name in
	// this cluster (see merge), not another cluster's pod of that name.
	Cluster string
	// OtherNetwork counts the workloads on other networks.
	OtherNetwork int
	// Rejected are the workloads and services istiod sent that the client
	// rejected and holds no accepted version of, with their addresses on
	// the agent's network, sorted by name (see Rejected).
	Rejected []*Rejected
}

// Rejected stands in for a workload or service istiod sent that does not
// translate (a value a newer istiod added, a malformed field) and of which
// the client holds no accepted version: it keeps the resource's addresses
// that parse, so that connections to them are refused (merge makes it a
// Contested, Rejected service). Left out, the addresses were no
// workload's, and connections to them left the pod in plaintext, though
// istiod meant them for the mesh. A version that translates, or istiod's
// removal, replaces it; a rejected update of an accepted version keeps
// that version instead (Client.applyOne).
type Rejected struct {
	// Name is istiod's resource name: a workload's uid, a service's
	// namespace/hostname.
	Name      string
	Namespace string
	Addrs     []netip.Addr
	// networks holds, per address, the network istiod puts it on.
	networks []string
}

// on is r with only its addresses on network, nil if none is.
func (r *Rejected) on(network string) *Rejected {
	c := &Rejected{Name: r.Name, Namespace: r.Namespace}
	for i, a := range r.Addrs {
		if r.networks[i] == network {
			c.Addrs = append(c.Addrs, a)
		}
	}
	if len(c.Addrs) == 0 {
		return nil
	}
	return c
}

// portName is the name a service port gets in the directory: its number,
// since xDS ports have no names.
func portName(p int32) string { return strconv.Itoa(int(p)) }

// buildSnapshot joins services with the workloads serving them on
// network, the agent's. Services are copied: the client's stored ones
// never change once decoded.
func buildSnapshot(workloads map[string]*Workload, services map[string]*Service, policies map[string]*policy.Compiled, network string) *Snapshot {
	s := &Snapshot{
		Workloads: make([]*Workload, 0, len(workloads)),
		Services:  make([]*Service, 0, len(services)),
		Policies:  make([]*policy.Compiled, 0, len(policies)),
		Network:   network,
	}
	// Per key, the copy and istiod's service, whose addresses on every
	// network tell a headless one.
	type joined struct{ copy, istiod *Service }
	byKey := make(map[string]joined, len(services))
	for _, svc := range services {
		c := *svc
		c.Endpoints = nil
		c.VIPs, c.vipNetworks = nil, nil
		for i, vip := range svc.VIPs {
			vipNetwork := ""
			if i < len(svc.vipNetworks) {
				vipNetwork = svc.vipNetworks[i]
			}
			if vipNetwork == network {
				c.VIPs = append(c.VIPs, vip)
			}
		}
		c.CIDRs, c.cidrNetworks = nil, nil
		for i, p := range svc.CIDRs {
			if svc.cidrNetworks[i] == network {
				c.CIDRs = append(c.CIDRs, p)
			}
		}
		s.Services = append(s.Services, &c)
		byKey[c.Key()] = joined{&c, svc}
	}
	for _, w := range workloads {
		s.Workloads = append(s.Workloads, w)
		if w.Network != network {
			s.OtherNetwork++
			continue
		}
		if len(w.Addrs) == 0 {
			continue
		}
		for key, ports := range w.Services {
			j, ok := byKey[key]
			if !ok {
				continue
			}
			svc := j.copy
			addrs := endpointAddrs(w, j.istiod)
			if len(addrs) == 0 {
				continue
			}
			targets := make(map[string]int32, len(ports))
			for _, p := range ports {
				targets[portName(int32(p.ServicePort))] = int32(cmp.Or(p.TargetPort, p.ServicePort))
			}
			for _, a := range addrs {
				// The port map is shared: the directory treats it as
				// read-only.
				ep := workload.Endpoint{Addr: a, Ready: w.Healthy || svc.allowUnhealthy, Ports: targets, Node: w.Node, Workload: &w.Workload}
				if isPod(w) {
					// The endpoint is this pod, as ztunnel keys endpoints
					// by workload uid: the directory resolves it only to
					// the pod, not to another workload it gives the
					// address to (merge names a local pod's by the API's
					// uid). A ServiceEntry's or WorkloadEntry's endpoint
					// names no pod: at a pod's address it is that pod.
					ep.PodNamespace, ep.PodName, ep.PodUID = w.Namespace, w.Name, w.UID
				}
				svc.Endpoints = append(svc.Endpoints, ep)
			}
		}
	}
	for _, p := range policies {
		s.Policies = append(s.Policies, p)
	}
	slices.SortFunc(s.Workloads, func(a, b *Workload) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name), cmp.Compare(a.UID, b.UID))
	})
	slices.SortFunc(s.Services, func(a, b *Service) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Hostname, b.Hostname))
	})
	for _, svc := range s.Services {
		slices.SortFunc(svc.Endpoints, func(a, b workload.Endpoint) int { return a.Addr.Compare(b.Addr) })
	}
	policy.SortCompiled(s.Policies)
	return s
}
