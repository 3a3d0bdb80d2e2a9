// Package loader loads the data path's BPF objects with their maps pinned,
// attaches and detaches the programs of each enrolled pod inside the pod's
// network namespace, and removes everything on uninstall.
//
// Pinned maps and links outlive the agent: Close releases file descriptors
// only, traffic keeps being redirected, and the next Load picks the state up
// again and swaps in its own programs without a gap.
package loader

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/bpf"
	"github.com/redirector-mesh/redirector/pkg/accel"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/pin"
	"github.com/redirector-mesh/redirector/pkg/probe"
)

// DefaultPinRoot is where a node agent pins its maps and links.
const DefaultPinRoot = "/sys/fs/bpf/redirector"

// Config says where to pin and what to compile into the programs.
type Config struct {
	PinRoot  string
	Settings Settings
	// ForceLegacyTC attaches with clsact + cls_bpf even where tcx exists
	// (tcx is used otherwise, with the legacy path as the fallback).
	ForceLegacyTC bool
	// CgroupPath is the cgroup v2 directory holding the pods' cgroups, where
	// the sock_ops program that routes established captured connections over
	// lo is attached (localroute.go). Empty: this process's cgroup v2 mount.
	CgroupPath string
	// PodsCgroupID is the cgroup id of the pods' cgroup, whose processes'
	// connections are not host probes (probe.Config).
	PodsCgroupID uint64
	// PacketPathOnly leaves that program off (and detaches one an earlier
	// agent attached): every packet of a captured connection takes the pod
	// interface's programs.
	PacketPathOnly bool
	// DeferRelink leaves every pinned link on the program it runs, the
	// local-routing link as it is and the host-probe veth map unbuilt,
	// until Relink: an older agent still running holds the node, and this
	// one takes it over (and relinks, under the claim's lock) only once its
	// source has delivered state to apply. One that never does, and stops,
	// leaves the node on the older agent's programs, where a relink at
	// start left the pods on its own with nothing to put the older ones
	// back.
	DeferRelink bool
	Logger      *slog.Logger
}

// Loader holds the loaded programs and pinned maps of one node.
type Loader struct {
	cfg     Config
	log     *slog.Logger
	maps    *maps.Maps
	ingress *ebpf.Program
	egress  *ebpf.Program
	sockops *ebpf.Program // rd_pod_sockops, on the pods' cgroup (localroute.go)
	// captured is rd_captured, the socket storage naming captured app
	// sockets, and capturedID its kernel id: a leaving pod's are ended at
	// its detach (endcaptured.go). nil in Uninstall's loader.
	captured   *ebpf.Map
	capturedID ebpf.MapID
	// endedSockets counts what endCaptured did, by result.
	endedSockets endedCounts
	// probes SNATs host-originated connections (kubelet probes) on the host
	// end of each pod's veth.
	probes *probe.Attacher

	// mu guards the pod index: ids by uid, the metadata last written, and
	// which uids an attach or detach is working on. Different pods are
	// attached concurrently; one pod's changes are serialised (lockPod).
	mu      sync.Mutex
	indexed bool
	byUID   map[string]uint32
	metas   map[uint32]maps.PodMeta
	busy    map[string]chan struct{}
	// podNetNS: the namespace inode each pod's rd_pod_netns entry has
	// (podnetns.go), by pod id.
	podNetNS map[uint32]uint32
	// hostProbe: pods whose host-probe links this process attached.
	hostProbe map[uint32]bool
	// stale: pods with a pinned link Relink could not point at this
	// loader's programs (relink.go), until their next attach.
	stale map[uint32]bool
	// relinkUpdated and relinkFailed count Relink's links.
	relinkUpdated, relinkFailed atomic.Uint64

	// entries serialises writes and removals of enrollment entries.
	entries  sync.Mutex
	linksMu  sync.Mutex
	links    map[uint32][2]link.Link // held tcx links by pod id (held.go)
	linkFDs  map[uint32][2]int       // their file descriptors, for CheckLinks
	linksGen uint64                  // changes whenever links does
	// strays are other pods' links found at a pod's pin paths (two pods'
	// pins swapped) and replaced there: kept open, so that they stay
	// attached, until their own pod's attach or detach (held.go).
	strays map[link.ID]link.Link

	// claim, once set, guards every enrollment change (SetClaim).
	claim atomic.Pointer[maps.Claim]
}

// Load loads the programs, creating or reusing the maps pinned under
// cfg.PinRoot, and swaps the new programs into every pinned pod link.
func Load(ctx context.Context, cfg Config) (*Loader, error) {
	if cfg.PinRoot == "" {
		cfg.PinRoot = DefaultPinRoot
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if err := cfg.Settings.Validate(); err != nil {
		return nil, fmt.Errorf("data path settings: %w", err)
	}
	if err := CheckKernel(); err != nil {
		return nil, err
	}
	if err := pin.EnsureBPFFS(cfg.PinRoot); err != nil {
		return nil, err
	}
	// Nothing pinned is used before the tree is known to be the agent's.
	if err := pin.CheckTree(cfg.PinRoot); err != nil {
		return nil, err
	}
	spec, err := bpf.LoadCapture()
	if err != nil {
		return nil, fmt.Errorf("read embedded BPF object: %w", err)
	}
	if err := cfg.Settings.apply(spec); err != nil {
		return nil, err
	}
	// Refuse maps of another layout before touching anything.
	if err := maps.CheckLayout(cfg.PinRoot); err != nil {
		return nil, err
	}
	// An upgrade may have grown a counter map (a new verdict reason).
	dropped, err := maps.DropIncompatibleCounters(cfg.PinRoot, spec)
	if err != nil {
		return nil, err
	}
	if len(dropped) > 0 {
		cfg.Logger.WarnContext(ctx, "counter maps of an older agent replaced, their counts start again", "maps", dropped)
	}
	// Whether rd_pods was pinned before this load: if not, loading creates
	// it empty (see restoreEntries).
	_, err = os.Lstat(filepath.Join(cfg.PinRoot, maps.PodsName))
	podsPinned := err == nil
	var objs bpf.CaptureObjects
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinRoot}}
	if err := spec.LoadAndAssign(&objs, opts); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("load BPF programs: %+v", ve)
		}
		return nil, fmt.Errorf("load BPF programs (pin root %s): %w", cfg.PinRoot, err)
	}
	if err := maps.PinLayout(cfg.PinRoot); err != nil {
		objs.Close()
		return nil, err
	}
	l := &Loader{
		cfg:      cfg,
		log:      cfg.Logger,
		ingress:  objs.RdPodIngress,
		egress:   objs.RdPodEgress,
		sockops:  objs.RdPodSockops,
		captured: objs.RdCaptured,
		maps: &maps.Maps{
			Pods:     objs.RdPods,
			PodStats: objs.RdPodStats,
			Reasons:  objs.RdReasons,
			PodMeta:  objs.RdPodMeta,
			PodNetNS: objs.RdPodNetns,
		},
	}
	if info, err := objs.RdCaptured.Info(); err == nil {
		l.capturedID, _ = info.ID()
	}
	l.probes, err = probe.Load(ctx, probe.Config{PinRoot: cfg.PinRoot, SNATv4: cfg.Settings.ProbeSNATv4, SNATv6: cfg.Settings.ProbeSNATv6,
		TunnelMark: cfg.Settings.TunnelMark, MarkMask: cfg.Settings.MarkMask, PodsCgroupID: cfg.PodsCgroupID, DeferRelink: cfg.DeferRelink, Logger: cfg.Logger})
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("load host-probe SNAT: %w", err)
	}
	if !podsPinned {
		if err := l.restoreEntries(ctx); err != nil {
			l.Close()
			return nil, err
		}
	}
	if !cfg.DeferRelink {
		if _, err := l.relinkPods(ctx); err != nil {
			l.Close()
			return nil, err
		}
		l.attachLocalRoute(ctx)
	}
	if err := l.syncPodNetNS(ctx); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// Maps returns the typed maps. The Loader owns them.
func (l *Loader) Maps() *maps.Maps { return l.maps }

// PinRoot is where this loader pins.
func (l *Loader) PinRoot() string { return l.cfg.PinRoot }

// Close releases file descriptors. Pinned maps and links stay, so the pods
// stay redirected while no agent runs.
func (l *Loader) Close() error {
	l.closeHeld()
	errs := []error{l.ingress.Close(), l.egress.Close(), l.sockops.Close(), l.maps.Close()}
	if l.captured != nil {
		errs = append(errs, l.captured.Close())
	}
	if l.probes != nil {
		errs = append(errs, l.probes.Close())
	}
	return errors.Join(errs...)
}

// restoreEntries writes the enrollment entries of every pod the metadata
// map records into an rd_pods that this load had to create (its pin was
// gone while the pods' links and metadata stayed). It runs before the new
// programs are swapped into the pinned links: they read the new map, and
// with it empty they would pass the pods' traffic uncaptured, in plaintext,
// until the first reconcile wrote the entries again.
func (l *Loader) restoreEntries(ctx context.Context) error {
	metas, err := l.maps.ListMeta()
	if err != nil {
		return err
	}
	n := 0
	// A pod whose attach never finished is recorded too: enrolled here, it
	// fails closed until the first reconcile converges it.
	for _, m := range metas {
		for _, a := range m.Addrs {
			if err := l.maps.SetPod(a, m.Settings); err != nil {
				return fmt.Errorf("restore enrollment entry of pod %s/%s: %w", m.Namespace, m.Name, err)
			}
			n++
		}
	}
	if n > 0 {
		l.log.WarnContext(ctx, "pinned enrollment map was missing: recreated and refilled from the pod metadata", "map", maps.PodsName, "entries", n)
	}
	return nil
}

// SetClaim makes every later enrollment change (AttachPod, DetachPod, a
// link pin put back) run under c's guard, so that an agent a newer one took
// the node from changes nothing more (maps.ErrNotHeld). Call it right after
// claiming, before any change: the pod index is read again from the map,
// since an older agent may have attached or detached pods between Load and
// the claim. Taking the node back is Relink's.
func (l *Loader) SetClaim(c *maps.Claim) {
	l.mu.Lock()
	l.indexed = false
	l.claim.Store(c)
	l.mu.Unlock()
}

// guard holds off a claim by another agent while one enrollment change is
// made; it fails with maps.ErrNotHeld once another agent holds the node.
func (l *Loader) guard(ctx context.Context) (release func(), err error) {
	c := l.claim.Load()
	if c == nil {
		return func() {}, nil
	}
	return c.Guard(ctx)
}

func (l *Loader) podDir(id uint32) string {
	return filepath.Join(l.cfg.PinRoot, "pods", fmt.Sprint(id))
}

// ErrNotPinRoot marks a --bpf-root that cannot hold this agent's pins.
var ErrNotPinRoot = errors.New("not a pin root")

// Uninstall removes what a loader pinned under root, and nothing else: each
// pod its metadata map records loses its links, rules and routes (its
// interface sysctls restored); then the maps it pins by name go, each pod
// pin directory and the pods directory if they end up empty, the pin root
// lock's gate (maps.GateName, empty), and the root itself once empty. It
// never removes a directory recursively: a root that is not on a bpffs
// holds no pins and is refused, and entries someone else put under root
// stay (they are logged). Pods whose namespace is gone are skipped quietly.
func Uninstall(ctx context.Context, root string, s Settings, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	st, err := os.Stat(root)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("pin root %s: %w", root, err)
	}
	if !st.IsDir() || !pin.OnBPFFS(root) {
		return fmt.Errorf("%w: %s is not a directory on a bpffs, so it holds no pins of this agent; leaving it untouched", ErrNotPinRoot, root)
	}
	// Host links first: they share the pod pin directories.
	errs := []error{accel.Uninstall(root), probe.Uninstall(root), detachLocalRoute(root)}
	m, err := maps.OpenPinned(root)
	if err == nil {
		l := &Loader{cfg: Config{PinRoot: root, Settings: s}, log: log, maps: m, podNetNS: map[uint32]uint32{}}
		metas, err := m.ListMeta()
		errs = append(errs, err)
		// The namespace each pod was attached in, read once (detach looks
		// it up per pod otherwise).
		netnsEntries, err := m.ListPodNetNS()
		errs = append(errs, err)
		for ino, e := range netnsEntries {
			l.podNetNS[e.PodID] = ino
		}
		for id, meta := range metas {
			// Pods of a node being cleaned keep their sockets: see
			// endCaptured.
			errs = append(errs, l.detach(ctx, id, meta, false))
		}
		errs = append(errs, m.Close())
	} else {
		log.WarnContext(ctx, "no pinned maps to read pods from", "root", root, "error", err)
	}
	// Pod pins the metadata did not list (a crash between pinning and
	// recording, or lost maps): only links running this agent's programs.
	errs = append(errs, removeStrayPodPins(root, log))

	for _, name := range []string{maps.PodsName, maps.PodStatsName, maps.ReasonsName, maps.PodMetaName, maps.PodNetNSName, maps.CapturedName, maps.DialledName, maps.LayoutName} {
		if err := os.Remove(filepath.Join(root, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin %s: %w", name, err))
		}
	}
	removeEmptyDir(filepath.Join(root, "pods"))
	removeEmptyDir(filepath.Join(root, maps.GateName))
	if err := errors.Join(errs...); err != nil {
		return err
	}
	left, err := pin.RemoveRootIfEmpty(root)
	if err != nil {
		return err
	}
	if len(left) > 0 {
		log.WarnContext(ctx, "pin root kept: it holds entries this agent did not create", "root", root, "entries", left)
	}
	return nil
}

// ownPrograms are the names of the programs a pod link pin of this agent
// runs.
var ownPrograms = []string{"rd_pod_ingress", "rd_pod_egress"}

// removeStrayPodPins unpins <root>/pods/<id>/{ingress,egress} where the link
// runs one of this agent's programs, and removes pod directories left empty.
func removeStrayPodPins(root string, log *slog.Logger) error {
	dirs, err := os.ReadDir(filepath.Join(root, "pods"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read pod pins: %w", err)
	}
	var errs []error
	for _, d := range dirs {
		if _, err := strconv.ParseUint(d.Name(), 10, 32); err != nil || !d.IsDir() {
			continue
		}
		dir := filepath.Join(root, "pods", d.Name())
		for _, dir2 := range []direction{ingress, egress} {
			p := filepath.Join(dir, string(dir2))
			name, err := pin.LinkProgramName(p)
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err != nil || !slices.Contains(ownPrograms, name) {
				log.Warn("pin left in place: not a link of this agent", "pin", p, "program", name, "error", err)
				continue
			}
			errs = append(errs, pin.DetachLink(p))
		}
		removeEmptyDir(dir)
	}
	return errors.Join(errs...)
}

// removeEmptyDir removes dir if nothing is in it.
func removeEmptyDir(dir string) { _ = unix.Rmdir(dir) }

// Healthy reports whether the pinned maps are still in place under the pin
// root: if someone removed them underneath, the programs no longer see the
// loader's updates and the node must not claim to be ready.
func (l *Loader) Healthy() error {
	for _, name := range []string{maps.PodsName, maps.PodStatsName, maps.ReasonsName, maps.PodMetaName, maps.PodNetNSName} {
		if _, err := os.Stat(filepath.Join(l.cfg.PinRoot, name)); err != nil {
			return fmt.Errorf("pinned map %s is gone from %s", name, l.cfg.PinRoot)
		}
	}
	return nil
}
