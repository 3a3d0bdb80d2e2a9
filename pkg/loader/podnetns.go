package loader

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/maps"
)

// rd_pod_netns tells the programs which enrolled pod the interface of a
// packet belongs to, by the inode number of the interface's network
// namespace (the programs run only on the interfaces AttachPod attached,
// one per pod namespace). With it they drop TCP to or from the pod's
// addresses that are not enrolled, its IPv6 link-local address first, and
// VLAN-stacked frames on the pod's interface, where they would otherwise
// pass it as not the mesh's. An entry counts only while the rd_pods entry
// of the address it names has the pod's id: DeletePod stays the kill
// switch, and an entry left behind changes nothing.

// netnsIno is the inode number of the network namespace at path (a bind
// mount under /var/run/netns, or /proc/<pid>/ns/net): what netns_ino in
// capture.c reads from a packet's device. A path that is not a namespace
// (an unmounted bind-mount target) is an error, not some other inode.
func netnsIno(path string) (uint32, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil {
		return 0, fmt.Errorf("network namespace %s: %w", path, err)
	}
	if fs.Type != unix.NSFS_MAGIC {
		return 0, fmt.Errorf("network namespace %s: not a namespace file (filesystem %#x)", path, fs.Type)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("network namespace %s: %w", path, err)
	}
	if st.Ino == 0 || st.Ino > math.MaxUint32 {
		return 0, fmt.Errorf("network namespace %s: inode %d is not a namespace's", path, st.Ino)
	}
	return uint32(st.Ino), nil
}

// setPodNetNS records pod id's namespace in rd_pod_netns, named by its first
// address, and forgets the namespace it had before if that changed. Entries
// are written and removed under l.entries, as enrollment entries are: a
// namespace inode number is reused once its namespace is gone, so a leaving
// pod's removal must not race a new pod's write.
func (l *Loader) setPodNetNS(id uint32, meta maps.PodMeta) error {
	ino, err := netnsIno(meta.NetNS)
	if err != nil {
		return err
	}
	l.entries.Lock()
	defer l.entries.Unlock()
	if err := l.maps.SetPodNetNS(ino, meta.Addrs[0], id); err != nil {
		return err
	}
	l.mu.Lock()
	old, had := l.podNetNS[id]
	if l.podNetNS == nil {
		l.podNetNS = map[uint32]uint32{}
	}
	l.podNetNS[id] = ino
	l.mu.Unlock()
	if had && old != ino {
		return l.maps.DeletePodNetNS(old, id)
	}
	return nil
}

// deletePodNetNS removes pod id's rd_pod_netns entry: the namespace this
// process recorded, else the one meta's path names now, else (the namespace
// is gone and was recorded by another process) whichever entry names the
// pod.
func (l *Loader) deletePodNetNS(id uint32, meta maps.PodMeta) error {
	l.mu.Lock()
	ino, ok := l.podNetNS[id]
	delete(l.podNetNS, id)
	l.mu.Unlock()
	if !ok && meta.NetNS != "" {
		var err error
		ino, err = netnsIno(meta.NetNS)
		ok = err == nil
	}
	l.entries.Lock()
	defer l.entries.Unlock()
	if ok {
		return l.maps.DeletePodNetNS(ino, id)
	}
	all, err := l.maps.ListPodNetNS()
	if err != nil {
		return err
	}
	var errs []error
	for ino, e := range all {
		if e.PodID == id {
			errs = append(errs, l.maps.DeletePodNetNS(ino, id))
		}
	}
	return errors.Join(errs...)
}

// syncPodNetNS makes rd_pod_netns match the pinned pods at Load: pods an
// agent from before the map attached get their entry (the programs just
// swapped into their links drop nothing by namespace until then), and
// entries of pods no longer attached, or of namespaces gone, are removed.
func (l *Loader) syncPodNetNS(ctx context.Context) error {
	metas, err := l.maps.ListMeta()
	if err != nil {
		return err
	}
	entries, err := l.maps.ListPodNetNS()
	if err != nil {
		return err
	}
	l.entries.Lock()
	defer l.entries.Unlock()
	want := map[uint32]uint32{}     // namespace inode -> pod id
	pinned := map[uint32][]uint32{} // pod id -> namespace inodes its entries name
	for ino, e := range entries {
		pinned[e.PodID] = append(pinned[e.PodID], ino)
	}
	var errs []error
	for id, m := range metas {
		if len(m.Addrs) == 0 || m.NetNS == "" {
			continue
		}
		ino, err := netnsIno(m.NetNS)
		if err != nil {
			continue // gone: the reconciler detaches the pod
		}
		if rec := pinned[id]; len(rec) > 0 && !slices.Contains(rec, ino) {
			// The pod was attached in another namespace than the one its
			// path names now: the path went to a new sandbox (the pod's own,
			// or another pod's) while no agent ran. The record stays the
			// attachment's; the reconciler decides where the pod goes.
			l.log.WarnContext(ctx, "pod's network namespace path names another namespace than the one it was attached in",
				"pod", m.Namespace+"/"+m.Name, "netns", m.NetNS, "attached_inode", rec[0], "path_inode", ino)
			for _, r := range rec {
				want[r] = id
			}
			l.mu.Lock()
			if l.podNetNS == nil {
				l.podNetNS = map[uint32]uint32{}
			}
			l.podNetNS[id] = rec[0]
			l.mu.Unlock()
			continue
		}
		want[ino] = id
		l.mu.Lock()
		if l.podNetNS == nil {
			l.podNetNS = map[uint32]uint32{}
		}
		l.podNetNS[id] = ino
		l.mu.Unlock()
		if e, ok := entries[ino]; ok && e.PodID == id && e.Addr == m.Addrs[0] {
			continue
		}
		errs = append(errs, l.maps.SetPodNetNS(ino, m.Addrs[0], id))
	}
	for ino, e := range entries {
		if id, ok := want[ino]; !ok || id != e.PodID {
			errs = append(errs, l.maps.DeletePodNetNS(ino, e.PodID))
		}
	}
	if err := errors.Join(errs...); err != nil {
		l.log.WarnContext(ctx, "pod network namespaces not all recorded: link-local and unenrolled addresses of those pods pass until they are attached again", "error", err)
	}
	return nil
}
