package maps

import (
	"fmt"
	"net/netip"

	"github.com/redirector-mesh/redirector/bpf"
)

// AttachMode says how a pod's programs are attached.
type AttachMode uint32

// Attach modes.
const (
	AttachTCX      = AttachMode(bpf.CaptureAttachModeATTACH_TCX)
	AttachTCLegacy = AttachMode(bpf.CaptureAttachModeATTACH_TC_LEGACY)
)

func (m AttachMode) String() string {
	switch m {
	case AttachTCX:
		return "tcx"
	case AttachTCLegacy:
		return "tc"
	}
	return fmt.Sprintf("mode(%d)", uint32(m))
}

// PodMeta is the loader's record of one attached pod, kept in a pinned map so
// that it survives the agent and needs no other state on disk.
type PodMeta struct {
	UID, Namespace, Name string
	NetNS                string // path of the pod's network namespace
	Interface            string
	Addrs                []netip.Addr
	Settings             PodSettings
	AttachMode           AttachMode
	// Interface sysctls before attach, restored on detach (-1: unknown).
	AcceptLocal, RPFilter int32
	// RPFilterAll is the namespace's net.ipv4.conf.all.rp_filter before
	// attach, restored on detach (-1: unknown; 0 in the entries of agents
	// before it was recorded, which then leave it at 0 as they did).
	RPFilterAll int32
}

// MaxMetaAddrs is how many addresses one pod can have.
const MaxMetaAddrs = len(bpf.CapturePodMeta{}.Addrs)

// The metadata strings are C chars, so bpftool prints them as text.
func putString(dst []int8, s, field string) error {
	if len(s) >= len(dst) {
		return fmt.Errorf("%s %q is longer than %d bytes", field, s, len(dst)-1)
	}
	for i := 0; i < len(s); i++ {
		dst[i] = int8(s[i])
	}
	return nil
}

func getString(b []int8) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}

func (p PodMeta) raw() (bpf.CapturePodMeta, error) {
	var r bpf.CapturePodMeta
	for _, f := range []struct {
		dst        []int8
		val, field string
	}{
		{r.Uid[:], p.UID, "pod uid"},
		{r.Namespace[:], p.Namespace, "pod namespace"},
		{r.Name[:], p.Name, "pod name"},
		{r.Netns[:], p.NetNS, "netns path"},
		{r.Ifname[:], p.Interface, "interface name"},
	} {
		if err := putString(f.dst, f.val, f.field); err != nil {
			return r, err
		}
	}
	if len(p.Addrs) > MaxMetaAddrs {
		return r, fmt.Errorf("pod has %d addresses, at most %d are supported", len(p.Addrs), MaxMetaAddrs)
	}
	for i, a := range p.Addrs {
		r.Addrs[i] = PodKey(a)
	}
	r.Naddrs = uint32(len(p.Addrs))
	r.Flags = p.Settings.raw().Flags
	r.AttachMode = uint32(p.AttachMode)
	r.AcceptLocal = p.AcceptLocal
	r.RpFilter = p.RPFilter
	r.RpFilterAll = p.RPFilterAll
	return r, nil
}

func metaOf(id uint32, r bpf.CapturePodMeta) PodMeta {
	p := PodMeta{
		UID:         getString(r.Uid[:]),
		Namespace:   getString(r.Namespace[:]),
		Name:        getString(r.Name[:]),
		NetNS:       getString(r.Netns[:]),
		Interface:   getString(r.Ifname[:]),
		Settings:    settingsOf(bpf.CapturePodSettings{Flags: r.Flags, PodId: id}),
		AttachMode:  AttachMode(r.AttachMode),
		AcceptLocal: r.AcceptLocal,
		RPFilter:    r.RpFilter,
		RPFilterAll: r.RpFilterAll,
	}
	for i := 0; i < int(min(r.Naddrs, uint32(MaxMetaAddrs))); i++ {
		p.Addrs = append(p.Addrs, AddrOf(r.Addrs[i]))
	}
	return p
}

// PutMeta records pod id's metadata.
func (m *Maps) PutMeta(id uint32, p PodMeta) error {
	r, err := p.raw()
	if err != nil {
		return fmt.Errorf("record pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	if err := m.PodMeta.Put(&id, &r); err != nil {
		return fmt.Errorf("record pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	return nil
}

// DeleteMeta forgets pod id. Absent is fine.
func (m *Maps) DeleteMeta(id uint32) error {
	if err := ignoreMissing(m.PodMeta.Delete(&id)); err != nil {
		return fmt.Errorf("forget pod %d: %w", id, err)
	}
	return nil
}

// ListMeta returns every attached pod by id.
func (m *Maps) ListMeta() (map[uint32]PodMeta, error) {
	out := map[uint32]PodMeta{}
	var id uint32
	var r bpf.CapturePodMeta
	it := m.PodMeta.Iterate()
	for it.Next(&id, &r) {
		out[id] = metaOf(id, r)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate %s: %w", PodMetaName, err)
	}
	return out, nil
}
