package probe

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
)

// Counters are one pod's host-probe counters, summed over CPUs.
type Counters struct {
	Conns        uint64 // node connections SNATed (their SYNs)
	SNATPackets  uint64 // node -> pod packets whose source was rewritten
	ReplyPackets uint64 // pod -> node replies whose destination was restored
	TunnelMarked uint64 // node SYNs left alone because of the tunnel mark
	Errors       uint64 // packets dropped because a rewrite failed
}

func (c *Counters) add(r bpf.HostProbeSnatCounters) {
	c.Conns += r.Conns
	c.SNATPackets += r.SnatPackets
	c.ReplyPackets += r.ReplyPackets
	c.TunnelMarked += r.TunnelMarked
	c.Errors += r.Errors
}

func (a *Attacher) createCounters(podID uint32) error {
	zero := make([]bpf.HostProbeSnatCounters, ebpf.MustPossibleCPU())
	err := a.objs.RdProbeStats.Update(podID, zero, ebpf.UpdateNoExist)
	if err != nil && !errors.Is(err, ebpf.ErrKeyExist) {
		return fmt.Errorf("create counters: %w", err)
	}
	return nil
}

// Counters returns pod podID's counters; ok is false if it is not attached.
func (a *Attacher) Counters(podID uint32) (c Counters, ok bool, err error) {
	var per []bpf.HostProbeSnatCounters
	if err := a.objs.RdProbeStats.Lookup(podID, &per); err != nil {
		if ignoreMissing(err) == nil {
			return c, false, nil
		}
		return c, false, fmt.Errorf("read host probe counters of pod %d: %w", podID, err)
	}
	for _, r := range per {
		c.add(r)
	}
	return c, true, nil
}

// NATEntry is one SNATed connection: the pod's end, the node's end before
// SNAT, the pod it belongs to and the host veth (ifindex) its SYN left by.
type NATEntry struct {
	Pod         netip.AddrPort
	Node        netip.AddrPort
	PodID       uint32
	HostIfindex uint32
}

// NAT lists the probe connections the NAT map remembers.
func (a *Attacher) NAT() ([]NATEntry, error) {
	var out []NATEntry
	err := a.eachNAT(func(k bpf.HostProbeNatKey, v bpf.HostProbeNatEntry) {
		out = append(out, NATEntry{
			Pod:         netip.AddrPortFrom(netip.AddrFrom16(k.Pod.Addr).Unmap(), ntohs(k.PodPort)),
			Node:        netip.AddrPortFrom(netip.AddrFrom16(v.Node.Addr).Unmap(), ntohs(k.NodePort)),
			PodID:       v.PodId,
			HostIfindex: v.Ifindex,
		})
	})
	return out, err
}

// NATEntries counts the probe connections the NAT map remembers; never more
// than Config.NATSize.
func (a *Attacher) NATEntries() (int, error) {
	n := 0
	err := a.eachNAT(func(bpf.HostProbeNatKey, bpf.HostProbeNatEntry) { n++ })
	return n, err
}

func (a *Attacher) eachNAT(fn func(bpf.HostProbeNatKey, bpf.HostProbeNatEntry)) error {
	var k bpf.HostProbeNatKey
	var v bpf.HostProbeNatEntry
	it := a.objs.RdProbeNat.Iterate()
	for it.Next(&k, &v) {
		fn(k, v)
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("iterate %s: %w", NATMapName, err)
	}
	return nil
}

// forgetNAT deletes the NAT entries of pod podID, so that a later pod at the
// same address inherits none.
func (a *Attacher) forgetNAT(podID uint32) error {
	var keys []bpf.HostProbeNatKey
	err := a.eachNAT(func(k bpf.HostProbeNatKey, v bpf.HostProbeNatEntry) {
		if v.PodId == podID {
			keys = append(keys, k)
		}
	})
	for _, k := range keys {
		err = errors.Join(err, ignoreMissing(a.objs.RdProbeNat.Delete(&k)))
	}
	return err
}

func ntohs(v uint16) uint16 {
	var b [2]byte
	binary.NativeEndian.PutUint16(b[:], v)
	return binary.BigEndian.Uint16(b[:])
}

func ignoreMissing(err error) error {
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil
	}
	return err
}
