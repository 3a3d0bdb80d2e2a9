package loader

import (
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
)

// Settings are the data path's load-time constants. They are compiled into the
// programs through spec.Variables, so changing one means reloading, which the
// agent does at start.
type Settings struct {
	OutboundPort uint16 // tunnel listener for captured outbound connections
	InboundPort  uint16 // tunnel listener for captured inbound plaintext
	HBONEPort    uint16 // the tunnel's own HBONE listener, never captured
	DNSPort      uint16 // the tunnel's UDP socket for captured DNS queries
	// TunnelMark is the SO_MARK of every tunnel socket, compared under MarkMask:
	// packets that carry it are never captured.
	TunnelMark uint32
	// ReinjectMark tags packets the programs steered; a fwmark rule in the pod
	// routes them to the local table so they reach their socket.
	ReinjectMark uint32
	MarkMask     uint32
	RouteTable   int // the pod's table holding `local 0.0.0.0/0 dev lo`
	RulePriority int // priority of the fwmark rule
	ProbeSNATv4  netip.Addr
	ProbeSNATv6  netip.Addr
	// ProcDir is the procfs the pods' per-namespace sysctls are written
	// through (<ProcDir>/sys/net/...; the namespace is the writing thread's).
	// Not compiled into the programs. Empty means /proc; the Helm chart
	// mounts the host's /proc read-write at /host/proc, because a container's
	// own /proc/sys is read-only unless it is privileged.
	ProcDir string
}

// DefaultSettings match Istio ambient's ports, marks and probe addresses.
func DefaultSettings() Settings {
	return Settings{
		OutboundPort: 15001,
		InboundPort:  15006,
		HBONEPort:    15008,
		DNSPort:      15053,
		TunnelMark:   0x539,
		ReinjectMark: 0x111,
		MarkMask:     0xfff,
		RouteTable:   100,
		RulePriority: 32764,
		ProbeSNATv4:  netip.MustParseAddr("169.254.7.127"),
		ProbeSNATv6:  netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff"),
	}
}

// Validate reports the first setting that cannot work.
func (s Settings) Validate() error {
	ports := map[string]uint16{"outbound port": s.OutboundPort, "inbound port": s.InboundPort, "HBONE port": s.HBONEPort, "DNS port": s.DNSPort}
	seen := map[uint16]string{}
	for name, p := range ports {
		if p == 0 {
			return fmt.Errorf("%s must not be 0", name)
		}
		if other, dup := seen[p]; dup {
			return fmt.Errorf("%s and %s are both %d", name, other, p)
		}
		seen[p] = name
	}
	if s.MarkMask == 0 {
		return fmt.Errorf("mark mask must not be 0")
	}
	if s.TunnelMark&s.MarkMask == 0 || s.ReinjectMark&s.MarkMask == 0 {
		return fmt.Errorf("tunnel mark %#x and reinject mark %#x must be non-zero under mask %#x", s.TunnelMark, s.ReinjectMark, s.MarkMask)
	}
	if s.TunnelMark&s.MarkMask == s.ReinjectMark&s.MarkMask {
		return fmt.Errorf("tunnel mark %#x and reinject mark %#x are equal under mask %#x", s.TunnelMark, s.ReinjectMark, s.MarkMask)
	}
	if s.RouteTable <= 0 || s.RouteTable == 253 || s.RouteTable == 254 || s.RouteTable == 255 {
		return fmt.Errorf("route table %d is reserved or invalid", s.RouteTable)
	}
	if !s.ProbeSNATv4.Is4() {
		return fmt.Errorf("probe SNAT IPv4 address %s is not IPv4", s.ProbeSNATv4)
	}
	if !s.ProbeSNATv6.Is6() || s.ProbeSNATv6.Is4In6() {
		return fmt.Errorf("probe SNAT IPv6 address %s is not IPv6", s.ProbeSNATv6)
	}
	return nil
}

// apply writes the settings into the spec's constants.
func (s Settings) apply(spec *ebpf.CollectionSpec) error {
	vars := map[string]any{
		bpf.CaptureVarOutboundPort: s.OutboundPort,
		bpf.CaptureVarInboundPort:  s.InboundPort,
		bpf.CaptureVarHbonePort:    s.HBONEPort,
		bpf.CaptureVarDnsPort:      s.DNSPort,
		bpf.CaptureVarTunnelMark:   s.TunnelMark,
		bpf.CaptureVarReinjectMark: s.ReinjectMark,
		bpf.CaptureVarMarkMask:     s.MarkMask,
		bpf.CaptureVarProbeSnatV4:  s.ProbeSNATv4.As4(),
		bpf.CaptureVarProbeSnatV6:  s.ProbeSNATv6.As16(),
	}
	for name, v := range vars {
		vs, ok := spec.Variables[name]
		if !ok {
			return fmt.Errorf("program constant %s missing from the object", name)
		}
		if err := vs.Set(v); err != nil {
			return fmt.Errorf("set program constant %s: %w", name, err)
		}
	}
	return nil
}
