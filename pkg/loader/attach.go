package loader

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/pin"
)

type direction string

const (
	ingress direction = "ingress"
	egress  direction = "egress"
)

func (l *Loader) program(d direction) *ebpf.Program {
	if d == ingress {
		return l.ingress
	}
	return l.egress
}

func (l *Loader) linkPin(id uint32, d direction) string {
	return filepath.Join(l.podDir(id), string(d))
}

func (d direction) attachType() ebpf.AttachType {
	if d == ingress {
		return ebpf.AttachTCXIngress
	}
	return ebpf.AttachTCXEgress
}

func (l *Loader) updatePinnedLink(id uint32, d direction) (link.Link, error) {
	return pin.UpdateTCXHeld(l.linkPin(id, d), l.program(d), d.attachType())
}

// attachTCX must run inside the pod's network namespace: the kernel
// resolves ifindex there. The link comes back open, for the loader to hold,
// with the link it replaced at the pin, if any (pin.Attached.Displaced),
// for the caller to close once the pod's other link is in place.
func (l *Loader) attachTCX(id uint32, ifindex int, d direction) (pin.Attached, error) {
	return pin.AttachTCXHeld(l.linkPin(id, d), ifindex, l.program(d), d.attachType())
}

func (l *Loader) detachTCX(id uint32, d direction) error {
	return pin.DetachLink(l.linkPin(id, d))
}

// Legacy tc: a clsact qdisc with one direct-action cls_bpf filter per
// direction, identified by a fixed handle and priority so that it can be
// replaced and deleted idempotently. Used where tcx is missing (kernels < 6.6).
const (
	legacyHandle   = 0x15001
	legacyPriority = 1
)

func legacyFilter(ifindex int, d direction, fd int) *netlink.BpfFilter {
	parent := uint32(netlink.HANDLE_MIN_INGRESS)
	if d == egress {
		parent = netlink.HANDLE_MIN_EGRESS
	}
	return &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: ifindex,
			Parent:    parent,
			Handle:    legacyHandle,
			Priority:  legacyPriority,
			Protocol:  unix.ETH_P_ALL,
		},
		Fd:           fd,
		Name:         "rd_pod_" + string(d),
		DirectAction: true,
	}
}

// attachLegacy must run inside the pod's network namespace.
func (l *Loader) attachLegacy(ifindex int) error {
	qdisc := &netlink.GenericQdisc{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
		QdiscType:  "clsact",
	}
	if err := netlink.QdiscReplace(qdisc); err != nil {
		return fmt.Errorf("add clsact qdisc: %w", err)
	}
	for _, d := range []direction{ingress, egress} {
		if err := netlink.FilterReplace(legacyFilter(ifindex, d, l.program(d).FD())); err != nil {
			return fmt.Errorf("add tc %s filter: %w", d, err)
		}
	}
	return nil
}

// detachLegacy must run inside the pod's network namespace.
func detachLegacy(ifindex int) error {
	var errs []error
	for _, d := range []direction{ingress, egress} {
		err := netlink.FilterDel(legacyFilter(ifindex, d, 0))
		if err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, fmt.Errorf("delete tc %s filter: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// legacyAttached reports whether the pod attached with legacy tc still has
// both filters, running this loader's programs, on its interface in the
// namespace it was attached in. Unlike tcx links, nothing holds a filter:
// one deleted (a qdisc reset), or the interface made anew in the namespace
// (at the old index or not), left the pod enrolled with no program on its
// interface, its traffic uncaptured, and no check ever saw it. It enters
// the pod's namespace, so only full passes ask.
func (l *Loader) legacyAttached(p PodState) bool {
	ino, recorded := l.recordedNetNS(p.ID)
	h, err := netns.Open(p.Meta.NetNS)
	if err != nil {
		return false
	}
	defer h.Close()
	if cur, err := h.Inode(); err != nil || (recorded && cur != uint64(ino)) {
		return false
	}
	err = h.Do(func() error {
		iface, err := netlink.LinkByName(p.Meta.Interface)
		if err != nil {
			return err
		}
		for _, d := range []direction{ingress, egress} {
			info, err := l.program(d).Info()
			if err != nil {
				return err
			}
			id, _ := info.ID()
			want := legacyFilter(iface.Attrs().Index, d, 0)
			fs, err := netlink.FilterList(iface, want.Parent)
			if err != nil {
				return err
			}
			if !slices.ContainsFunc(fs, func(f netlink.Filter) bool {
				bf, ok := f.(*netlink.BpfFilter)
				return ok && bf.Handle == want.Handle && bf.Priority == want.Priority && bf.DirectAction && bf.Id == int(id)
			}) {
				return fmt.Errorf("no %s filter", d)
			}
		}
		return nil
	})
	return err == nil
}
