// Package accel is the optional sockops acceleration: a cgroup sock_ops
// program puts the connected sockets of this node's pods into two
// sockhashes, apps' and the tunnel's, and an sk_msg program on the apps'
// moves each send of an app straight into the receive queue of the tunnel's
// socket of the same connection. That payload skips the pod's TCP stack, its
// interface and the capture. The other direction, handshakes, FIN and RST
// take the normal path, so half-close works.
//
// A redirect queue has no backpressure, so each connection may have at most
// a budget of bytes in the tunnel's queue; the tunnel returns budget as it
// reads (Conn). A connection that once takes the TCP path (over budget, or
// no tunnel socket to send to) stays on it, so that no redirected send can
// overtake bytes still in the tunnel socket's TCP queue.
package accel

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/redirector-mesh/redirector/bpf"
	"github.com/redirector-mesh/redirector/pkg/pin"
)

// Config says where to pin and which cgroup to watch.
type Config struct {
	// PinRoot is the data path's pin root (rd_pods is shared from there).
	PinRoot string
	// CgroupPath is the cgroup v2 directory whose sockets are accelerated;
	// empty means the root of the cgroup v2 hierarchy.
	CgroupPath string
	// TunnelMark under MarkMask marks the tunnel's own sockets: such a
	// socket belongs to the pod that is its peer.
	TunnelMark, MarkMask uint32
	// HBONEPort is left alone: its connections never pair.
	HBONEPort uint16
	// DeferRelink leaves the hooks on the programs they run until Relink
	// (loader.Config.DeferRelink).
	DeferRelink bool
	Logger      *slog.Logger
}

// Accelerator holds the loaded programs.
type Accelerator struct {
	objs bpf.SockopsObjects
	cfg  Config
}

func linkPin(root string) string { return filepath.Join(root, "accel", "sockops") }

// Load attaches the programs, replacing those of an earlier process in place.
func Load(ctx context.Context, cfg Config) (*Accelerator, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.CgroupPath == "" {
		p, err := pin.CgroupV2Root()
		if err != nil {
			return nil, err
		}
		cfg.CgroupPath = p
	}
	if err := pin.EnsureBPFFS(cfg.PinRoot); err != nil {
		return nil, err
	}
	spec, err := bpf.LoadSockops()
	if err != nil {
		return nil, fmt.Errorf("read embedded sockops object: %w", err)
	}
	if cfg.TunnelMark&cfg.MarkMask == 0 {
		return nil, fmt.Errorf("tunnel mark %#x is zero under mask %#x", cfg.TunnelMark, cfg.MarkMask)
	}
	if cfg.HBONEPort == 0 {
		return nil, errors.New("HBONE port is zero")
	}
	for name, v := range map[string]any{bpf.SockopsVarTunnelMark: cfg.TunnelMark & cfg.MarkMask, bpf.SockopsVarMarkMask: cfg.MarkMask, bpf.SockopsVarHbonePort: cfg.HBONEPort} {
		if err := spec.Variables[name].Set(v); err != nil {
			return nil, fmt.Errorf("set program constant %s: %w", name, err)
		}
	}
	a := &Accelerator{cfg: cfg}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinRoot}}
	err = spec.LoadAndAssign(&a.objs, opts)
	if errors.Is(err, ebpf.ErrMapIncompatible) {
		// Pins of an older version with other map layouts: start afresh.
		// The old maps go once nothing holds them, unpairing their
		// sockets; the old agent's tunnel sockets are closed by then.
		cfg.Logger.InfoContext(ctx, "replacing sockops maps of an older version", "error", err)
		if err := removeMapPins(cfg.PinRoot); err != nil {
			return nil, err
		}
		err = spec.LoadAndAssign(&a.objs, opts)
	}
	if err != nil {
		return nil, fmt.Errorf("load sockops programs: %w", err)
	}
	if !cfg.DeferRelink {
		if err := a.Relink(); err != nil {
			a.objs.Close()
			return nil, err
		}
	}
	cfg.Logger.InfoContext(ctx, "sockops acceleration on", "cgroup", cfg.CgroupPath)
	return a, nil
}

// Relink attaches this process's programs again, replacing whatever runs
// at their hooks (an earlier or a newer agent's): what Load does, and what
// an agent taking the node back from a newer one does.
func (a *Accelerator) Relink() error {
	// The sk_msg verdict hangs off the map; attaching again replaces it.
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{Target: a.objs.RdAppSocks.FD(), Program: a.objs.RdSkMsg, Attach: ebpf.AttachSkMsgVerdict}); err != nil {
		return fmt.Errorf("attach sk_msg to %s: %w", bpf.SockopsMapRdAppSocks, err)
	}
	return a.attachSockops()
}

func (a *Accelerator) attachSockops() error {
	if err := pin.AttachCgroup(linkPin(a.cfg.PinRoot), a.cfg.CgroupPath, a.objs.RdSockops, ebpf.AttachCGroupSockOps); err != nil {
		return fmt.Errorf("sockops acceleration: %w", err)
	}
	return nil
}

// Close releases file descriptors; the pinned link keeps working.
func (a *Accelerator) Close() error { return a.objs.Close() }

// Counters are the acceleration's totals.
type Counters struct {
	Sockets, Redirected, RedirectedBytes, Passed uint64
	// Connections that took the TCP path for good, by cause: no local peer
	// at their first send, the peer's budget spent, data sent before pairing.
	FallbackNoPeer, FallbackBudget, FallbackEarly uint64
	// Unpaired counts sockets of this node's pods left out of the maps:
	// one was full (they are the node's, 65536 entries), an app's socket
	// asked for reports of its sends (MSG_ZEROCOPY completions, transmit
	// time stamps; also when it asked once paired), or the kernel refused
	// the socket. Their sends take TCP.
	Unpaired uint64
}

// Counters sums the per-CPU counters.
func (a *Accelerator) Counters() (Counters, error) { return readCounters(a.objs.RdAccelStats) }

func readCounters(m *ebpf.Map) (Counters, error) {
	var per []bpf.SockopsAccelCounters
	if err := m.Lookup(uint32(0), &per); err != nil {
		return Counters{}, fmt.Errorf("read %s: %w", bpf.SockopsMapRdAccelStats, err)
	}
	var c Counters
	for _, p := range per {
		c = c.Add(Counters{Sockets: p.Sockets, Redirected: p.Redirected, RedirectedBytes: p.RedirectedBytes,
			Passed: p.Passed, FallbackNoPeer: p.FallbackNoPeer, FallbackBudget: p.FallbackBudget, FallbackEarly: p.FallbackEarly,
			Unpaired: p.Unpaired})
	}
	return c, nil
}

// Add is c plus o, field by field.
func (c Counters) Add(o Counters) Counters {
	return c.combine(o, func(a, b uint64) uint64 { return a + b })
}

// Sub is c minus o, field by field: what happened between two readings.
func (c Counters) Sub(o Counters) Counters {
	return c.combine(o, func(a, b uint64) uint64 { return a - b })
}

func (c Counters) combine(o Counters, op func(a, b uint64) uint64) Counters {
	return Counters{
		Sockets: op(c.Sockets, o.Sockets), Redirected: op(c.Redirected, o.Redirected),
		RedirectedBytes: op(c.RedirectedBytes, o.RedirectedBytes), Passed: op(c.Passed, o.Passed),
		FallbackNoPeer: op(c.FallbackNoPeer, o.FallbackNoPeer), FallbackBudget: op(c.FallbackBudget, o.FallbackBudget),
		FallbackEarly: op(c.FallbackEarly, o.FallbackEarly), Unpaired: op(c.Unpaired, o.Unpaired),
	}
}

// PinnedCounters reads the counters of the acceleration pinned under root.
func PinnedCounters(root string) (Counters, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, bpf.SockopsMapRdAccelStats), &ebpf.LoadPinOptions{})
	if err != nil {
		return Counters{}, err
	}
	defer m.Close()
	return readCounters(m)
}

// Uninstall detaches the sock_ops program (no new socket joins) and removes
// the acceleration's pins. The maps go with their last reference, which
// unpairs the sockets still in them: their sends take TCP again.
func Uninstall(root string) error {
	var errs []error
	errs = append(errs, pin.DetachLink(linkPin(root)))
	_ = os.Remove(filepath.Dir(linkPin(root)))
	errs = append(errs, removeMapPins(root))
	return errors.Join(errs...)
}

// mapPins are the acceleration's own pinned maps (rd_pods belongs to the
// data path), with the names older versions used.
var mapPins = []string{bpf.SockopsMapRdAppSocks, bpf.SockopsMapRdTunnelSocks, bpf.SockopsMapRdSockState,
	bpf.SockopsMapRdSockConsumed, bpf.SockopsMapRdAccelStats, "rd_sock_pairs", "rd_sock_open"}

func removeMapPins(root string) error {
	var errs []error
	for _, name := range mapPins {
		if err := os.Remove(filepath.Join(root, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin %s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}
