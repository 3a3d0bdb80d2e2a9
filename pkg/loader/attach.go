package loader

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

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
