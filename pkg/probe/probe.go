package probe

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/bpf"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/pin"
)

// Names of the pinned maps this package owns, as bpftool shows them under the
// pin root. The enrollment map rd_pods is shared with (and owned by) the
// pod-side loader.
const (
	NATMapName   = bpf.HostProbeMapRdProbeNat
	StatsMapName = bpf.HostProbeMapRdProbeStats
	VethsMapName = bpf.HostProbeMapRdProbeVeths
)

// Defaults of the Config fields left zero.
const (
	DefaultNATSize    = 65536
	DefaultTunnelMark = 0x539
	DefaultMarkMask   = 0xfff
)

// Config says where to pin and what to compile into the programs. Zero fields
// take the defaults.
type Config struct {
	// PinRoot is the pin root of the data path (the same as the loader's).
	// It is mounted as a bpffs if it is not on one.
	PinRoot string
	// SNATv4 and SNATv6 are the source addresses probes get (HOST_PROBE_SNAT_IP
	// and HOST_PROBE_SNAT_IPV6); they must match the pod-side programs'.
	SNATv4, SNATv6 netip.Addr
	// TunnelMark under MarkMask marks tunnel sockets, whose connections are
	// never SNATed.
	TunnelMark, MarkMask uint32
	// NATSize bounds the NAT map: the number of probe connections remembered
	// at once (the least recently used is forgotten first).
	NATSize uint32
	// PodsCgroupID is the cgroup id of the pods' cgroup (FindPodsCgroup):
	// SYNs from sockets below it are not probes. Zero: every process of
	// the node's network namespace probes.
	PodsCgroupID uint64
	// DeferRelink leaves the pinned host links and the veth map as they are
	// until Relink (loader.Config.DeferRelink).
	DeferRelink bool
	Logger      *slog.Logger
}

func (c *Config) setDefaults() {
	if !c.SNATv4.IsValid() {
		c.SNATv4 = DefaultSNATv4
	}
	if !c.SNATv6.IsValid() {
		c.SNATv6 = DefaultSNATv6
	}
	if c.TunnelMark == 0 {
		c.TunnelMark = DefaultTunnelMark
	}
	if c.MarkMask == 0 {
		c.MarkMask = DefaultMarkMask
	}
	if c.NATSize == 0 {
		c.NATSize = DefaultNATSize
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// validate reports the first setting that cannot work, naming the variable.
func (c *Config) validate() error {
	if c.PinRoot == "" {
		return errors.New("host probe: no pin root")
	}
	if _, _, err := ParseSNAT(c.SNATv4.String(), c.SNATv6.String()); err != nil {
		return err
	}
	if c.TunnelMark&c.MarkMask == 0 {
		return fmt.Errorf("host probe: tunnel mark %#x is zero under mask %#x", c.TunnelMark, c.MarkMask)
	}
	if c.NATSize < 64 || c.NATSize > 1<<24 {
		return fmt.Errorf("host probe: NAT size %d out of range [64, %d]", c.NATSize, 1<<24)
	}
	return nil
}

// Attacher holds the loaded host-probe programs and maps of one node.
type Attacher struct {
	cfg  Config
	log  *slog.Logger
	objs bpf.HostProbeObjects

	mu sync.Mutex // serialises attach and detach
}

// Load validates cfg, loads the programs with their maps pinned under
// cfg.PinRoot (reusing pinned maps, including the loader's rd_pods), and
// swaps the new programs into every pinned host link, so an upgrade never
// detaches anything. A pinned NAT map of another size is replaced, which
// forgets the probe connections open at that moment.
func Load(ctx context.Context, cfg Config) (*Attacher, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := pin.EnsureBPFFS(cfg.PinRoot); err != nil {
		return nil, err
	}
	spec, err := bpf.LoadHostProbe()
	if err != nil {
		return nil, fmt.Errorf("read embedded host probe BPF object: %w", err)
	}
	vars := map[string]any{
		bpf.HostProbeVarSnatV4:     cfg.SNATv4.As4(),
		bpf.HostProbeVarSnatV6:     cfg.SNATv6.As16(),
		bpf.HostProbeVarTunnelMark: cfg.TunnelMark,
		bpf.HostProbeVarMarkMask:   cfg.MarkMask,
		bpf.HostProbeVarPodsCgroup: cfg.PodsCgroupID,
	}
	for name, v := range vars {
		vs, ok := spec.Variables[name]
		if !ok {
			return nil, fmt.Errorf("program constant %s missing from the host probe object", name)
		}
		if err := vs.Set(v); err != nil {
			return nil, fmt.Errorf("set program constant %s: %w", name, err)
		}
	}
	nat := spec.Maps[NATMapName]
	if nat == nil {
		return nil, fmt.Errorf("map %s missing from the host probe object", NATMapName)
	}
	nat.MaxEntries = cfg.NATSize
	if err := dropResizedPin(ctx, cfg, nat); err != nil {
		return nil, err
	}

	a := &Attacher{cfg: cfg, log: cfg.Logger}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinRoot}}
	if err := spec.LoadAndAssign(&a.objs, opts); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("load host probe programs: %+v", ve)
		}
		return nil, fmt.Errorf("load host probe programs (pin root %s): %w", cfg.PinRoot, err)
	}
	if cfg.DeferRelink {
		return a, nil
	}
	if err := a.rebuildVeths(ctx); err != nil {
		a.objs.Close()
		return nil, err
	}
	return a, nil
}

// rebuildVeths points the pinned host links at the programs just loaded
// and rebuilds the veth map from them, with every other agent's attach and
// detach held off (maps.Quiesce): an older agent still running (an
// upgrade, before this one claims the node) records a pod's veth before it
// pins the pod's links, and a rebuild between the two deleted the record,
// so no probe to that pod was SNATed until it was attached again.
func (a *Attacher) rebuildVeths(ctx context.Context) error {
	release, err := maps.Quiesce(ctx, a.cfg.PinRoot, a.log)
	if err != nil {
		return fmt.Errorf("rebuild %s: %w", VethsMapName, err)
	}
	defer release()
	res := a.Relink(ctx)
	for id, err := range res.Failed {
		a.log.WarnContext(ctx, "keep old program on pinned host link", "pod", id, "error", err)
	}
	return res.Err
}

// Relinked is what Relink did.
type Relinked struct {
	// Updated counts the host links now running this attacher's programs.
	Updated int
	// Failed are the pods, by id, with a pinned host link left on the
	// program it had, and why (a pin that is no such link, a defunct link,
	// a failed update): their next AttachHost replaces the link.
	Failed map[uint32]error
	// Err is a failed rebuild of the veth map.
	Err error
}

// Relink points every pinned host link at this attacher's programs and
// rebuilds the veth map from them: what Load does, for a caller that holds
// off every other agent's attach and detach itself (maps.ClaimNodeThen,
// maps.Claim.ReclaimThen: an agent taking the node back from a newer one
// whose programs the links run).
func (a *Attacher) Relink(ctx context.Context) Relinked {
	a.mu.Lock()
	defer a.mu.Unlock()
	veths, res := a.upgradePinnedLinks()
	res.Err = a.syncVeths(veths)
	return res
}

// dropResizedPin unpins a NAT map whose size (or layout, after an upgrade)
// differs from the spec's, so that the load creates it anew.
func dropResizedPin(ctx context.Context, cfg Config, spec *ebpf.MapSpec) error {
	path := filepath.Join(cfg.PinRoot, NATMapName)
	m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{})
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open pinned %s: %w", path, err)
	}
	defer m.Close()
	if spec.Compatible(m) == nil {
		return nil
	}
	cfg.Logger.WarnContext(ctx, "replacing the pinned probe NAT map, whose size or layout changed: open probe connections are forgotten",
		"old", m.MaxEntries(), "new", spec.MaxEntries)
	if err := m.Unpin(); err != nil {
		return fmt.Errorf("unpin %s: %w", path, err)
	}
	return nil
}

// Close releases file descriptors. Pinned maps and links stay, so probes keep
// being SNATed while no agent runs.
func (a *Attacher) Close() error {
	return a.objs.Close()
}

// PinRoot is where this attacher pins.
func (a *Attacher) PinRoot() string { return a.cfg.PinRoot }

// Uninstall removes what this package pinned under root: every host link
// (which detaches it) and the NAT, counter and veth maps. It leaves rd_pods, the
// pin root and the pod-side pins to the loader, so call it before
// loader.Uninstall, which removes the then empty root.
func Uninstall(root string) error {
	if _, err := os.Stat(root); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	var errs []error
	pins, err := filepath.Glob(filepath.Join(root, "pods", "*", "host-*"))
	errs = append(errs, err)
	for _, p := range pins {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin %s: %w", p, err))
		}
		removeIfEmpty(filepath.Dir(p))
	}
	for _, name := range []string{NATMapName, StatsMapName, VethsMapName} {
		if err := os.Remove(filepath.Join(root, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin %s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}
