package maps

import (
	"fmt"
	"net/netip"

	"github.com/redirector-mesh/redirector/bpf"
)

// PodNetNS is the rd_pod_netns entry of one pod network namespace: the
// enrolled pod whose interface there the programs are attached to, named by
// one of its addresses. With it the programs drop TCP to or from the pod's
// addresses that are not enrolled (its IPv6 link-local address, SLAAC or
// secondary addresses) and stacked VLAN tags on its interface. It counts
// only while Addr's enrollment entry has PodID: DeletePod stays the kill
// switch.
type PodNetNS struct {
	Addr  netip.Addr
	PodID uint32
}

// SetPodNetNS records that the namespace with inode number ino holds the
// interface of pod id, enrolled with addr.
func (m *Maps) SetPodNetNS(ino uint32, addr netip.Addr, id uint32) error {
	if m.PodNetNS == nil {
		return fmt.Errorf("map %s not loaded", PodNetNSName)
	}
	v := bpf.CapturePodNetns{Addr: PodKey(addr), PodId: id}
	if err := m.PodNetNS.Put(&ino, &v); err != nil {
		return fmt.Errorf("record network namespace %d of pod %d: %w", ino, id, err)
	}
	return nil
}

// DeletePodNetNS removes the entry of namespace ino if pod id still owns
// it. Absent is fine.
func (m *Maps) DeletePodNetNS(ino, id uint32) error {
	if m.PodNetNS == nil {
		return nil
	}
	var v bpf.CapturePodNetns
	if err := m.PodNetNS.Lookup(&ino, &v); err != nil {
		return ignoreMissing(err)
	}
	if v.PodId != id {
		return nil
	}
	if err := ignoreMissing(m.PodNetNS.Delete(&ino)); err != nil {
		return fmt.Errorf("delete network namespace %d of pod %d: %w", ino, id, err)
	}
	return nil
}

// PodNetNSOf returns the entry of namespace ino, if there is one.
func (m *Maps) PodNetNSOf(ino uint32) (PodNetNS, bool, error) {
	if m.PodNetNS == nil {
		return PodNetNS{}, false, fmt.Errorf("map %s not loaded", PodNetNSName)
	}
	var v bpf.CapturePodNetns
	if err := m.PodNetNS.Lookup(&ino, &v); err != nil {
		if ignoreMissing(err) == nil {
			return PodNetNS{}, false, nil
		}
		return PodNetNS{}, false, fmt.Errorf("look up network namespace %d: %w", ino, err)
	}
	return PodNetNS{Addr: AddrOf(v.Addr), PodID: v.PodId}, true, nil
}

// ListPodNetNS returns every entry by namespace inode number.
func (m *Maps) ListPodNetNS() (map[uint32]PodNetNS, error) {
	out := map[uint32]PodNetNS{}
	if m.PodNetNS == nil {
		return out, nil
	}
	var k uint32
	var v bpf.CapturePodNetns
	it := m.PodNetNS.Iterate()
	for it.Next(&k, &v) {
		out[k] = PodNetNS{Addr: AddrOf(v.Addr), PodID: v.PodId}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate %s: %w", PodNetNSName, err)
	}
	return out, nil
}
