package tunnel

import (
	"cmp"
	"net/netip"
	"slices"
)

// OpenInbound is an open inbound connection of a served pod, as the config
// dump lists it (after ztunnel's connection manager, which istioctl
// ztunnel-config connections reads).
type OpenInbound struct {
	// Src is the client: for HBONE the address and port its tunnel came
	// from. Dst is the pod address and port it reached.
	Src, Dst netip.AddrPort
	// Service is the host name of the service the connection is counted
	// under (ztunnel's guess_inbound_service), "" if none.
	Service string
	HBONE   bool
}

// OpenOutbound is an open outbound connection of a served pod.
type OpenOutbound struct {
	Src         netip.AddrPort // the app's socket
	OriginalDst netip.AddrPort // where the app connected
	// ActualDst is where the tunnel connected: the HBONE port of the
	// destination pod, of a service endpoint or of a waypoint, or in plain
	// TCP the destination (or the endpoint) itself.
	ActualDst netip.AddrPort
	HBONE     bool
}

// Connections lists the open connections of the pod served under key
// (workload.Workload.Key), each direction ordered by source; ok is false
// when no pod is served under it. Inbound connections are listed once
// admitted and connected to the app. The lists are bounded by the
// tunnel's connection limits (Limits).
func (t *Tunnel) Connections(key string) (in []OpenInbound, out []OpenOutbound, ok bool) {
	t.mu.Lock()
	p, ok := t.pods[key]
	t.mu.Unlock()
	if !ok {
		return nil, nil, false
	}
	p.mu.Lock()
	ics := make([]*inboundConn, 0, len(p.inbound))
	for ic := range p.inbound {
		ics = append(ics, ic)
	}
	out = make([]OpenOutbound, 0, len(p.outbound))
	for oc := range p.outbound {
		out = append(out, *oc)
	}
	p.mu.Unlock()
	in = make([]OpenInbound, 0, len(ics))
	for _, ic := range ics {
		ic.mu.Lock()
		open, service := ic.closer != nil && ic.revoked == "", ic.service
		ic.mu.Unlock()
		if open {
			in = append(in, OpenInbound{Src: ic.src, Dst: ic.dst, Service: service, HBONE: ic.secure})
		}
	}
	slices.SortFunc(in, func(a, b OpenInbound) int { return cmp.Or(a.Src.Compare(b.Src), a.Dst.Compare(b.Dst)) })
	slices.SortFunc(out, func(a, b OpenOutbound) int { return cmp.Or(a.Src.Compare(b.Src), a.OriginalDst.Compare(b.OriginalDst)) })
	return in, out, true
}
