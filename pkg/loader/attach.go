package loader

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
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

// updatePinnedLink swaps the program of a pinned tcx link. It reports
// os.ErrNotExist when there is no pin and an error when the link is defunct
// (its interface is gone).
func (l *Loader) updatePinnedLink(id uint32, d direction) error {
	lk, err := link.LoadPinnedLink(l.linkPin(id, d), &ebpf.LoadPinOptions{})
	if err != nil {
		return err
	}
	defer lk.Close()
	if err := lk.Update(l.program(d)); err != nil {
		return fmt.Errorf("update pinned %s link: %w", d, err)
	}
	return nil
}

// attachTCX attaches (or updates) the pod's tcx link in direction d and pins
// it. It must run inside the pod's network namespace: the kernel resolves
// ifindex there.
func (l *Loader) attachTCX(id uint32, ifindex int, d direction) error {
	err := l.updatePinnedLink(id, d)
	if err == nil {
		return nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		// A defunct link (ENOLINK) or a stale pin: replace it.
		_ = os.Remove(l.linkPin(id, d))
	}
	attach := ebpf.AttachTCXIngress
	if d == egress {
		attach = ebpf.AttachTCXEgress
	}
	lk, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: l.program(d), Attach: attach})
	if err != nil {
		return fmt.Errorf("attach tcx %s: %w", d, err)
	}
	defer lk.Close()
	if err := os.MkdirAll(l.podDir(id), 0o700); err != nil {
		return fmt.Errorf("create pod pin dir: %w", err)
	}
	if err := lk.Pin(l.linkPin(id, d)); err != nil {
		return fmt.Errorf("pin tcx %s link: %w", d, err)
	}
	return nil
}

// detachTCX unpins the pod's link; the kernel detaches it once the last
// reference (the pin) is gone. Missing pins are fine.
func (l *Loader) detachTCX(id uint32, d direction) error {
	lk, err := link.LoadPinnedLink(l.linkPin(id, d), &ebpf.LoadPinOptions{})
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		// Defunct links cannot be opened as links; the pin is all that is left.
		if rmErr := os.Remove(l.linkPin(id, d)); rmErr != nil && !errors.Is(rmErr, os.ErrNotExist) {
			return fmt.Errorf("remove %s pin: %w", d, rmErr)
		}
		return nil
	}
	defer lk.Close()
	if err := lk.Unpin(); err != nil {
		return fmt.Errorf("unpin %s link: %w", d, err)
	}
	return nil
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
