package maps

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
)

// PodCounters are one pod address's packet counters, summed over CPUs.
type PodCounters struct {
	OutboundConns   uint64 // outbound connections steered to the tunnel
	InboundConns    uint64 // inbound plaintext connections steered to the tunnel
	SteeredPackets  uint64 // packets re-injected from egress to ingress
	DroppedPackets  uint64 // packets dropped to fail closed
	BypassedPackets uint64 // packets deliberately passed (probes, HBONE, tunnel sockets)
}

func (c *PodCounters) add(r bpf.CapturePodCounters) {
	c.OutboundConns += r.OutboundConns
	c.InboundConns += r.InboundConns
	c.SteeredPackets += r.SteeredPackets
	c.DroppedPackets += r.DroppedPackets
	c.BypassedPackets += r.BypassedPackets
}

// CreateCounters starts addr's counters at zero (the programs only count
// addresses that have an entry). An existing entry is kept.
func (m *Maps) CreateCounters(addr netip.Addr) error {
	k := PodKey(addr)
	zero := make([]bpf.CapturePodCounters, ebpf.MustPossibleCPU())
	err := m.PodStats.Update(&k, zero, ebpf.UpdateNoExist)
	if err != nil && !errors.Is(err, ebpf.ErrKeyExist) {
		return fmt.Errorf("create counters of %s: %w", addr, full(m.PodStats, PodStatsName, err))
	}
	return nil
}

// DeleteCounters drops addr's counters. Absent is fine.
func (m *Maps) DeleteCounters(addr netip.Addr) error {
	k := PodKey(addr)
	if err := ignoreMissing(m.PodStats.Delete(&k)); err != nil {
		return fmt.Errorf("delete counters of %s: %w", addr, err)
	}
	return nil
}

// Counters returns addr's counters summed over CPUs; ok is false if addr has none.
func (m *Maps) Counters(addr netip.Addr) (c PodCounters, ok bool, err error) {
	k := PodKey(addr)
	var per []bpf.CapturePodCounters
	if err := m.PodStats.Lookup(&k, &per); err != nil {
		if ignoreMissing(err) == nil {
			return c, false, nil
		}
		return c, false, fmt.Errorf("read counters of %s: %w", addr, err)
	}
	for _, r := range per {
		c.add(r)
	}
	return c, true, nil
}

// AllCounters returns the counters of every address that has them.
func (m *Maps) AllCounters() (map[netip.Addr]PodCounters, error) {
	out := map[netip.Addr]PodCounters{}
	var k bpf.CapturePodAddr
	var per []bpf.CapturePodCounters
	it := m.PodStats.Iterate()
	for it.Next(&k, &per) {
		var c PodCounters
		for _, r := range per {
			c.add(r)
		}
		out[AddrOf(k)] = c
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate %s: %w", PodStatsName, err)
	}
	return out, nil
}

// Reason is why the programs passed, steered or dropped a packet.
type Reason = bpf.CaptureVerdictReason

var reasonNames = map[Reason]string{
	bpf.CaptureVerdictReasonREASON_OUT_SYN_STEERED:         "out_syn_steered",
	bpf.CaptureVerdictReasonREASON_OUT_TUNNEL_SOCKET:       "out_tunnel_socket",
	bpf.CaptureVerdictReasonREASON_OUT_PASS_TUNNEL_MARK:    "out_pass_tunnel_mark",
	bpf.CaptureVerdictReasonREASON_OUT_PASS_EXCLUDED:       "out_pass_excluded",
	bpf.CaptureVerdictReasonREASON_IN_ASSIGN_OUTBOUND:      "in_assign_outbound",
	bpf.CaptureVerdictReasonREASON_IN_ASSIGN_INBOUND:       "in_assign_inbound",
	bpf.CaptureVerdictReasonREASON_IN_PASS_HBONE:           "in_pass_hbone",
	bpf.CaptureVerdictReasonREASON_IN_PASS_PROBE:           "in_pass_probe",
	bpf.CaptureVerdictReasonREASON_IN_PASS_REINJECTED:      "in_pass_reinjected",
	bpf.CaptureVerdictReasonREASON_IN_PASS_EXISTING:        "in_pass_existing",
	bpf.CaptureVerdictReasonREASON_IN_PASS_NO_CAPTURE:      "in_pass_no_capture",
	bpf.CaptureVerdictReasonREASON_DROP_NO_LISTENER:        "drop_no_listener",
	bpf.CaptureVerdictReasonREASON_DROP_ASSIGN_FAILED:      "drop_assign_failed",
	bpf.CaptureVerdictReasonREASON_DROP_SPOOFED:            "drop_spoofed",
	bpf.CaptureVerdictReasonREASON_DROP_TRUNCATED:          "drop_truncated",
	bpf.CaptureVerdictReasonREASON_DROP_MALFORMED:          "drop_malformed",
	bpf.CaptureVerdictReasonREASON_DROP_FRAGMENT:           "drop_fragment",
	bpf.CaptureVerdictReasonREASON_DROP_EXTHDR:             "drop_exthdr",
	bpf.CaptureVerdictReasonREASON_IN_SYN_TIMEWAIT:         "in_syn_timewait",
	bpf.CaptureVerdictReasonREASON_DROP_SYN_TIMEWAIT:       "drop_syn_timewait",
	bpf.CaptureVerdictReasonREASON_IN_SYN_EXISTING:         "in_syn_existing",
	bpf.CaptureVerdictReasonREASON_DROP_PROBE_SPOOFED:      "drop_probe_spoofed",
	bpf.CaptureVerdictReasonREASON_DROP_LINK_LOCAL:         "drop_link_local",
	bpf.CaptureVerdictReasonREASON_DROP_UNENROLLED_ADDR:    "drop_unenrolled_addr",
	bpf.CaptureVerdictReasonREASON_DROP_VLAN:               "drop_vlan",
	bpf.CaptureVerdictReasonREASON_DROP_SYN_SENT:           "drop_syn_sent",
	bpf.CaptureVerdictReasonREASON_DROP_SOURCE_ROUTE:       "drop_source_route",
	bpf.CaptureVerdictReasonREASON_DROP_TUNNEL_GONE:        "drop_tunnel_gone",
	bpf.CaptureVerdictReasonREASON_DROP_CAPTURE_MARK:       "drop_capture_mark",
	bpf.CaptureVerdictReasonREASON_DROP_LOOPBACK:           "drop_loopback",
	bpf.CaptureVerdictReasonREASON_SOCK_ROUTED_LOCAL:       "sock_routed_local",
	bpf.CaptureVerdictReasonREASON_DROP_FOREIGN_LISTENER:   "drop_foreign_listener",
	bpf.CaptureVerdictReasonREASON_DROP_FOREIGN_DST:        "drop_foreign_dst",
	bpf.CaptureVerdictReasonREASON_IN_ASSIGN_COOKIE_ACK:    "in_assign_cookie_ack",
	bpf.CaptureVerdictReasonREASON_DROP_STEER:              "drop_steer",
	bpf.CaptureVerdictReasonREASON_DROP_PROBE_UNMATCHED:    "drop_probe_unmatched",
	bpf.CaptureVerdictReasonREASON_OUT_DNS_STEERED:         "out_dns_steered",
	bpf.CaptureVerdictReasonREASON_IN_ASSIGN_DNS:           "in_assign_dns",
	bpf.CaptureVerdictReasonREASON_DROP_NO_DNS_SOCKET:      "drop_no_dns_socket",
	bpf.CaptureVerdictReasonREASON_DROP_FOREIGN_DNS_SOCKET: "drop_foreign_dns_socket",
	bpf.CaptureVerdictReasonREASON_DROP_IP_OPTIONS:         "drop_ip_options",
	bpf.CaptureVerdictReasonREASON_HOST_POD_NOT_PROBE:      "host_pod_not_probe",
	bpf.CaptureVerdictReasonREASON_DROP_FOREIGN_SRC:        "drop_foreign_src",
}

// ReasonName is the short, stable name of a reason used in metrics and the
// inspect CLI, e.g. "drop_no_listener".
func ReasonName(r Reason) string {
	if n, ok := reasonNames[r]; ok {
		return n
	}
	return fmt.Sprintf("reason_%d", uint32(r))
}

// IsDrop reports whether the reason counts packets dropped to fail closed.
func IsDrop(r Reason) bool { return strings.HasPrefix(ReasonName(r), "drop_") }

// ReasonCounts returns the per-reason packet counts, summed over CPUs.
func (m *Maps) ReasonCounts() (map[Reason]uint64, error) {
	out := map[Reason]uint64{}
	for r := Reason(0); r < bpf.CaptureVerdictReasonREASON_MAX; r++ {
		var per []uint64
		key := uint32(r)
		if err := m.Reasons.Lookup(&key, &per); err != nil {
			return nil, fmt.Errorf("read reason %s: %w", ReasonName(r), err)
		}
		var sum uint64
		for _, v := range per {
			sum += v
		}
		out[r] = sum
	}
	return out, nil
}
