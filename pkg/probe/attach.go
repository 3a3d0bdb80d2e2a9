package probe

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/pin"
)

type direction string

const (
	ingress direction = "host-ingress"
	egress  direction = "host-egress"
)

var directions = []direction{egress, ingress}

func (a *Attacher) program(d direction) *ebpf.Program {
	if d == ingress {
		return a.objs.RdHostIngress
	}
	return a.objs.RdHostEgress
}

func (a *Attacher) podDir(podID uint32) string {
	return filepath.Join(a.cfg.PinRoot, "pods", fmt.Sprint(podID))
}

func (a *Attacher) linkPin(podID uint32, d direction) string {
	return filepath.Join(a.podDir(podID), string(d))
}

// AttachHost attaches the programs to the node-side veth of pod podID
// (hostIfindex, in the calling thread's network namespace: the node's) as
// tcx links pinned at <pin root>/pods/<podID>/host-{ingress,egress}, and
// starts the pod's counters. An existing pinned link is updated in place.
// Probes are SNATed to the pod's addresses while they are in rd_pods, so the
// caller enrolls them once the pod's own programs and listeners are ready.
// On error nothing of the pod is left behind, unless it was attached before.
func (a *Attacher) AttachHost(podID uint32, hostIfindex int) error {
	if podID == 0 || hostIfindex <= 0 {
		return fmt.Errorf("attach host veth: bad pod id %d or ifindex %d", podID, hostIfindex)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	existed := a.pinned(podID)
	err := a.createCounters(podID)
	if err == nil {
		err = a.recordVeth(podID, hostIfindex)
	}
	for _, d := range directions {
		if err == nil {
			err = a.attachTCX(podID, hostIfindex, d)
		}
	}
	if err != nil {
		if !existed {
			err = errors.Join(err, a.detach(podID))
		}
		return fmt.Errorf("attach host veth (ifindex %d) of pod %d: %w", hostIfindex, podID, err)
	}
	return nil
}

// DetachHost stops SNAT for pod podID: it unpins its host links (the kernel
// detaches them), deletes its counters and veth record and forgets its NAT
// entries. Detaching
// a pod that is not attached, or whose veth is gone, is not an error.
func (a *Attacher) DetachHost(podID uint32) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.detach(podID); err != nil {
		return fmt.Errorf("detach host veth of pod %d: %w", podID, err)
	}
	return nil
}

func (a *Attacher) detach(podID uint32) error {
	var errs []error
	for _, d := range directions {
		errs = append(errs, a.detachTCX(podID, d))
	}
	removeIfEmpty(a.podDir(podID))
	errs = append(errs, ignoreMissing(a.objs.RdProbeStats.Delete(podID)), a.forgetVeths(podID, 0), a.forgetNAT(podID))
	return errors.Join(errs...)
}

func (a *Attacher) pinned(podID uint32) bool {
	for _, d := range directions {
		if _, err := os.Lstat(a.linkPin(podID, d)); err == nil {
			return true
		}
	}
	return false
}

func (d direction) attachType() ebpf.AttachType {
	if d == ingress {
		return ebpf.AttachTCXIngress
	}
	return ebpf.AttachTCXEgress
}

func (a *Attacher) updatePinnedLink(podID uint32, d direction) error {
	return pin.UpdateTCX(a.linkPin(podID, d), a.program(d), d.attachType())
}

// attachTCX runs in the calling thread's network namespace (the node's).
func (a *Attacher) attachTCX(podID uint32, hostIfindex int, d direction) error {
	return pin.AttachTCX(a.linkPin(podID, d), hostIfindex, a.program(d), d.attachType())
}

func (a *Attacher) detachTCX(podID uint32, d direction) error {
	return pin.DetachLink(a.linkPin(podID, d))
}

// upgradePinnedLinks points every pinned host link at the programs just
// loaded. A link it cannot update keeps its old program, and its pod is in
// the result's Failed: the caller's next AttachHost replaces it. It returns
// the pods whose egress link it upgraded, by the ifindex of their host veth.
func (a *Attacher) upgradePinnedLinks() (map[uint32]uint32, Relinked) {
	veths := make(map[uint32]uint32)
	res := Relinked{Failed: map[uint32]error{}}
	for _, d := range directions {
		pins, _ := filepath.Glob(filepath.Join(a.cfg.PinRoot, "pods", "*", string(d)))
		for _, p := range pins {
			var id uint32
			if _, err := fmt.Sscan(filepath.Base(filepath.Dir(p)), &id); err != nil {
				continue
			}
			lk, err := pin.UpdateTCXHeld(a.linkPin(id, d), a.program(d), d.attachType())
			if err != nil {
				res.Failed[id] = errors.Join(res.Failed[id], fmt.Errorf("%s: %w", d, err))
				continue
			}
			res.Updated++
			if d == egress {
				if ifindex, err := tcxIfindex(lk); err == nil && ifindex > 0 {
					veths[ifindex] = id
				}
			}
			lk.Close()
		}
	}
	return veths, res
}

func tcxIfindex(lk link.Link) (uint32, error) {
	info, err := lk.Info()
	if err != nil {
		return 0, err
	}
	tcx := info.TCX()
	if tcx == nil {
		return 0, fmt.Errorf("link %d is no tcx link", info.ID)
	}
	return tcx.Ifindex, nil
}

// recordVeth tells the egress program that hostIfindex is pod podID's host
// veth, the one veth by which a SYN to the pod starts SNAT (a bridge may
// flood the node's SYN to every pod's veth), and forgets any other veth
// recorded for the pod.
func (a *Attacher) recordVeth(podID uint32, hostIfindex int) error {
	if err := a.forgetVeths(podID, uint32(hostIfindex)); err != nil {
		return err
	}
	if err := a.objs.RdProbeVeths.Put(uint32(hostIfindex), podID); err != nil {
		return fmt.Errorf("record host veth in %s: %w", VethsMapName, err)
	}
	return nil
}

// forgetVeths deletes the veth records of pod podID, except that of ifindex
// keep (0: none kept).
func (a *Attacher) forgetVeths(podID, keep uint32) error {
	var ifindex, owner uint32
	var stale []uint32
	it := a.objs.RdProbeVeths.Iterate()
	for it.Next(&ifindex, &owner) {
		if owner == podID && ifindex != keep {
			stale = append(stale, ifindex)
		}
	}
	err := it.Err()
	if err != nil {
		err = fmt.Errorf("iterate %s: %w", VethsMapName, err)
	}
	for _, i := range stale {
		err = errors.Join(err, ignoreMissing(a.objs.RdProbeVeths.Delete(i)))
	}
	return err
}

// syncVeths makes the veth map hold exactly veths (ifindex -> pod id): the
// pods whose pinned links this load found, so that after an upgrade (an
// older agent wrote no such map) or a pod detached while no agent ran, the
// egress program knows every pod's veth and no departed pod's.
func (a *Attacher) syncVeths(veths map[uint32]uint32) error {
	var ifindex, owner uint32
	var stale []uint32
	it := a.objs.RdProbeVeths.Iterate()
	for it.Next(&ifindex, &owner) {
		if want, ok := veths[ifindex]; !ok || want != owner {
			stale = append(stale, ifindex)
		}
	}
	err := it.Err()
	for _, i := range stale {
		err = errors.Join(err, ignoreMissing(a.objs.RdProbeVeths.Delete(i)))
	}
	for i, id := range veths {
		err = errors.Join(err, a.objs.RdProbeVeths.Put(i, id))
	}
	if err != nil {
		return fmt.Errorf("rebuild %s from the pinned host links: %w", VethsMapName, err)
	}
	return nil
}

// HostPeerIndex returns the ifindex, in the calling thread's network
// namespace (the node's), of the peer of the veth podIface inside the pod's
// network namespace at podNetNSPath: the interface AttachHost wants.
func HostPeerIndex(podNetNSPath, podIface string) (int, error) {
	var peer, podIndex int
	err := netns.Do(podNetNSPath, func() error {
		l, err := netlink.LinkByName(podIface)
		if err != nil {
			return fmt.Errorf("interface %s: %w", podIface, err)
		}
		if l.Type() != "veth" {
			return fmt.Errorf("interface %s is a %s, not a veth", podIface, l.Type())
		}
		peer, podIndex = l.Attrs().ParentIndex, l.Attrs().Index
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("find host peer of %s in %s: %w", podIface, podNetNSPath, err)
	}
	host, err := netlink.LinkByIndex(peer)
	if err != nil {
		return 0, fmt.Errorf("peer (ifindex %d) of %s in %s is not in this network namespace: %w", peer, podIface, podNetNSPath, err)
	}
	// ifindexes repeat across namespaces: check that the peer points back at
	// this pod's interface in this pod's namespace.
	ok := host.Type() == "veth" && host.Attrs().ParentIndex == podIndex
	if ok {
		f, err := os.OpenFile(podNetNSPath, os.O_RDONLY|unix.O_NONBLOCK, 0) // a fifo swapped in must not block
		if err != nil {
			return 0, fmt.Errorf("open %s: %w", podNetNSPath, err)
		}
		id, err := netlink.GetNetNsIdByFd(int(f.Fd()))
		f.Close()
		ok = err == nil && id >= 0 && host.Attrs().NetNsID == id
	}
	if !ok {
		return 0, fmt.Errorf("interface %s (ifindex %d) in this network namespace is not the peer of %s in %s", host.Attrs().Name, peer, podIface, podNetNSPath)
	}
	return peer, nil
}

// removeIfEmpty removes a pod's pin directory once neither this package nor
// the loader has anything left in it.
func removeIfEmpty(dir string) {
	_ = os.Remove(dir) // fails, harmlessly, while the directory holds pins
}
