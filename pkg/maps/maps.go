// Package maps gives typed Go views of the data path's BPF maps: callers speak
// netip.Addr and Go structs, the C layout stays in bpf/. Deleting a key that
// is absent is not an error, so every caller can be idempotent.
package maps

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/bpf"
)

// Names of the pinned maps, as bpftool shows them under the pin root.
const (
	PodsName     = bpf.CaptureMapRdPods
	PodStatsName = bpf.CaptureMapRdPodStats
	ReasonsName  = bpf.CaptureMapRdReasons
	PodMetaName  = bpf.CaptureMapRdPodMeta
	PodNetNSName = bpf.CaptureMapRdPodNetns
	// CapturedName is the socket storage marking captured app sockets; no
	// Go code reads it (the loader asks sock_diag which sockets have an
	// entry, to end a leaving pod's), the uninstaller removes its pin.
	CapturedName = bpf.CaptureMapRdCaptured
	// DialledName is the LRU of handshakes the tunnel dialled to an app,
	// until the app's socket is marked in CapturedName; no Go code reads
	// it, the uninstaller removes its pin.
	DialledName = bpf.CaptureMapRdDialled
)

// Maps holds the data path's maps. It owns the file descriptors.
type Maps struct {
	Pods     *ebpf.Map // pod address -> PodSettings (the enrollment map)
	PodStats *ebpf.Map // pod address -> per-CPU PodCounters
	Reasons  *ebpf.Map // Reason -> per-CPU packet count
	PodMeta  *ebpf.Map // pod id -> PodMeta
	PodNetNS *ebpf.Map // pod netns inode -> PodNetNS (nil under a pin root of an older agent)
}

// OpenPinned opens the maps pinned under root, for readers such as
// `redirector inspect` that work while the agent is stopped.
func OpenPinned(root string) (*Maps, error) {
	m := &Maps{}
	for _, x := range []struct {
		name string
		dst  **ebpf.Map
	}{{PodsName, &m.Pods}, {PodStatsName, &m.PodStats}, {ReasonsName, &m.Reasons}, {PodMetaName, &m.PodMeta}} {
		mp, err := ebpf.LoadPinnedMap(filepath.Join(root, x.name), &ebpf.LoadPinOptions{})
		if err != nil {
			m.Close()
			return nil, fmt.Errorf("open pinned map %s under %s: %w", x.name, root, err)
		}
		*x.dst = mp
	}
	// Optional: a pin root an older agent left has none.
	if mp, err := ebpf.LoadPinnedMap(filepath.Join(root, PodNetNSName), &ebpf.LoadPinOptions{}); err == nil {
		m.PodNetNS = mp
	}
	return m, nil
}

// Close releases the file descriptors; pinned maps stay.
func (m *Maps) Close() error {
	var errs []error
	for _, mp := range []*ebpf.Map{m.Pods, m.PodStats, m.Reasons, m.PodMeta, m.PodNetNS} {
		if mp != nil {
			errs = append(errs, mp.Close())
		}
	}
	return errors.Join(errs...)
}

// PodKey converts an address to the map key: IPv4 is stored IPv4-mapped so one
// map holds both families.
func PodKey(a netip.Addr) bpf.CapturePodAddr {
	return bpf.CapturePodAddr{Addr: a.As16()}
}

// AddrOf converts a map key back to an address, unmapping IPv4.
func AddrOf(k bpf.CapturePodAddr) netip.Addr {
	return netip.AddrFrom16(k.Addr).Unmap()
}

// ErrFull marks an enrollment refused because a per-address map has no
// room: rd_pods and rd_pod_stats hold one entry per enrolled address,
// MAX_PODS (4096) in all, so a node of dual-stack pods is full at 2048
// pods, though pod ids go to 4096.
var ErrFull = errors.New("map full")

// full names the map and its bound when the kernel refused a new key for
// lack of room (E2BIG, which reads "argument list too long").
func full(mp *ebpf.Map, name string, err error) error {
	if errors.Is(err, unix.E2BIG) {
		return fmt.Errorf("%w: %s holds at most %d pod addresses, all taken on this node: %w", ErrFull, name, mp.MaxEntries(), err)
	}
	return err
}

func ignoreMissing(err error) error {
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil
	}
	return err
}
