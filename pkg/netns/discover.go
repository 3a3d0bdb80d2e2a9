package netns

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/vishvananda/netlink"
)

// Finder locates the network namespace of a pod from one of its addresses,
// for pods that existed before the agent (the CNI plugin reports new ones).
// It looks at named namespaces (/var/run/netns/*) and at every process's
// namespace (/proc/*/ns/net), entering each distinct namespace once per scan.
type Finder struct {
	// NetNSDirs are searched for namespace files; default /var/run/netns.
	NetNSDirs []string
	// ProcDir is searched for /proc/<pid>/ns/net; default /proc, "" to skip.
	ProcDir string
}

// DefaultFinder searches the usual places.
func DefaultFinder() *Finder {
	return &Finder{NetNSDirs: []string{"/var/run/netns"}, ProcDir: "/proc"}
}

// Scan maps every address found in any candidate namespace (except
// loopback) to a path of that namespace. The root namespace of the agent is
// left out: a pod never lives there. Namespaces are visited in a fixed
// order (each directory of NetNSDirs by name, then /proc by pid name), and
// an address found in several maps to the first.
func (f *Finder) Scan() (map[netip.Addr]string, error) {
	return f.scan(nil)
}

// ScanFor is Scan that stops as soon as every address in want has been
// found. It visits the namespaces in Scan's order, so for each address of
// want it gives what Scan would; other addresses may be missing from the
// result. Usually the pods' namespaces are named ones, and the walk of
// /proc is skipped.
func (f *Finder) ScanFor(want []netip.Addr) (map[netip.Addr]string, error) {
	if len(want) == 0 {
		return map[netip.Addr]string{}, nil
	}
	return f.scan(want)
}

// scan visits the candidate namespaces; with want non-nil it stops once all
// of want is found.
func (f *Finder) scan(want []netip.Addr) (map[netip.Addr]string, error) {
	own, err := OwnInode() // not /proc/self: the main thread may be in a pod's
	if err != nil {
		return nil, err
	}
	missing := map[netip.Addr]bool{}
	for _, a := range want {
		missing[a.Unmap()] = true
	}
	done := func() bool { return want != nil && len(missing) == 0 }
	seen := map[uint64]bool{own: true}
	out := map[netip.Addr]string{}
	var errs []error
	visit := func(path string) {
		ino, err := Inode(path)
		if err != nil || seen[ino] {
			return
		}
		seen[ino] = true
		addrs, err := addrsIn(path)
		if err != nil {
			errs = append(errs, err)
			return
		}
		for _, a := range addrs {
			if _, dup := out[a]; !dup {
				out[a] = path
				delete(missing, a)
			}
		}
	}
	for _, dir := range f.NetNSDirs {
		entries, err := os.ReadDir(dir)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("read %s: %w", dir, err))
		}
		for _, e := range entries {
			if done() {
				return out, nil
			}
			visit(filepath.Join(dir, e.Name()))
		}
	}
	if f.ProcDir != "" {
		// /proc/<pid>/ns/net of every process, pids in name order. One stat
		// per process (in visit), where a glob would read two directories.
		entries, _ := os.ReadDir(f.ProcDir)
		for _, e := range entries {
			if done() {
				return out, nil
			}
			if name := e.Name(); name[0] >= '0' && name[0] <= '9' {
				visit(filepath.Join(f.ProcDir, name, "ns", "net"))
			}
		}
	}
	if len(out) == 0 && len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

// Addrs lists the addresses, loopback excepted, configured in the network
// namespace at path.
func Addrs(path string) ([]netip.Addr, error) { return addrsIn(path) }

// addrsIn lists the addresses in the namespace at path, one address family
// at a time: a dump of a single family does not take the kernel's RTNL lock
// (an AF_UNSPEC dump does), so a scan never queues behind tc, route or
// namespace changes elsewhere on the node.
func addrsIn(path string) ([]netip.Addr, error) {
	var out []netip.Addr
	err := Do(path, func() error {
		for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
			list, err := netlink.AddrList(nil, fam)
			if err != nil {
				return err
			}
			for _, a := range list {
				if ip, ok := netip.AddrFromSlice(a.IP); ok && !ip.IsLoopback() {
					out = append(out, ip.Unmap())
				}
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list addresses in %s: %w", path, err)
	}
	return out, nil
}

// HostPath maps a namespace path the host names, /proc/<pid>/ns/net, into
// procDir, where the agent sees the host's /proc when it runs without the
// host's PID namespace (the Helm chart mounts it at /host/proc). Runtimes
// such as cri-dockerd report such paths in CNI_NETNS. Other paths, and every
// path when procDir is /proc, are returned unchanged; so is a path that is
// not clean ("/proc/../../x" would be mapped out of procDir and cleaned on
// the way, past CheckPodPath's rule), for CheckPodPath to refuse.
func HostPath(procDir, path string) string {
	const hostProc = "/proc/"
	if procDir == "" || filepath.Clean(procDir) == "/proc" || !strings.HasPrefix(path, hostProc) || filepath.Clean(path) != path {
		return path
	}
	return filepath.Join(procDir, strings.TrimPrefix(path, hostProc))
}
