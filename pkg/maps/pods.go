package maps

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
)

// PodSettings is the enrollment entry of one pod address.
type PodSettings struct {
	CaptureOutbound bool
	CaptureInbound  bool
	// CaptureDNS steers the pod's UDP queries to port 53 to the tunnel's
	// DNS socket in the pod (port 15053), as istio-cni's DNS capture does.
	CaptureDNS bool
	// PodID is unique per node; addresses of one pod share it.
	PodID uint32
}

func (s PodSettings) raw() bpf.CapturePodSettings {
	var flags uint32
	if s.CaptureOutbound {
		flags |= uint32(bpf.CapturePodFlagPOD_CAPTURE_OUTBOUND)
	}
	if s.CaptureInbound {
		flags |= uint32(bpf.CapturePodFlagPOD_CAPTURE_INBOUND)
	}
	if s.CaptureDNS {
		flags |= uint32(bpf.CapturePodFlagPOD_CAPTURE_DNS)
	}
	return bpf.CapturePodSettings{Flags: flags, PodId: s.PodID}
}

func settingsOf(r bpf.CapturePodSettings) PodSettings {
	return PodSettings{
		CaptureOutbound: r.Flags&uint32(bpf.CapturePodFlagPOD_CAPTURE_OUTBOUND) != 0,
		CaptureInbound:  r.Flags&uint32(bpf.CapturePodFlagPOD_CAPTURE_INBOUND) != 0,
		CaptureDNS:      r.Flags&uint32(bpf.CapturePodFlagPOD_CAPTURE_DNS) != 0,
		PodID:           r.PodId,
	}
}

// SetPod enrolls addr (or changes its settings): from now on the programs
// capture its traffic.
func (m *Maps) SetPod(addr netip.Addr, s PodSettings) error {
	k, v := PodKey(addr), s.raw()
	if err := m.Pods.Put(&k, &v); err != nil {
		return fmt.Errorf("enroll %s: %w", addr, full(m.Pods, PodsName, err))
	}
	return nil
}

// DeletePod removes addr's enrollment entry: the kill switch. Absent is fine.
func (m *Maps) DeletePod(addr netip.Addr) error {
	k := PodKey(addr)
	if err := ignoreMissing(m.Pods.Delete(&k)); err != nil {
		return fmt.Errorf("unenroll %s: %w", addr, err)
	}
	return nil
}

// Pod returns addr's enrollment entry, if any.
func (m *Maps) Pod(addr netip.Addr) (PodSettings, bool, error) {
	k := PodKey(addr)
	var v bpf.CapturePodSettings
	err := m.Pods.Lookup(&k, &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return PodSettings{}, false, nil
	}
	if err != nil {
		return PodSettings{}, false, fmt.Errorf("look up %s: %w", addr, err)
	}
	return settingsOf(v), true, nil
}

// ListPods returns every enrollment entry.
func (m *Maps) ListPods() (map[netip.Addr]PodSettings, error) {
	out := map[netip.Addr]PodSettings{}
	var k bpf.CapturePodAddr
	var v bpf.CapturePodSettings
	it := m.Pods.Iterate()
	for it.Next(&k, &v) {
		out[AddrOf(k)] = settingsOf(v)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate %s: %w", PodsName, err)
	}
	return out, nil
}
