package netns

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"

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
// left out: a pod never lives there.
func (f *Finder) Scan() (map[netip.Addr]string, error) {
	own, err := Inode("/proc/self/ns/net")
	if err != nil {
		return nil, err
	}
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
			}
		}
	}
	for _, dir := range f.NetNSDirs {
		entries, err := os.ReadDir(dir)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("read %s: %w", dir, err))
		}
		for _, e := range entries {
			visit(filepath.Join(dir, e.Name()))
		}
	}
	if f.ProcDir != "" {
		matches, _ := filepath.Glob(filepath.Join(f.ProcDir, "[0-9]*", "ns", "net"))
		for _, m := range matches {
			visit(m)
		}
	}
	if len(out) == 0 && len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

func addrsIn(path string) ([]netip.Addr, error) {
	var out []netip.Addr
	err := Do(path, func() error {
		list, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
		if err != nil {
			return err
		}
		for _, a := range list {
			if ip, ok := netip.AddrFromSlice(a.IP); ok && !ip.IsLoopback() {
				out = append(out, ip.Unmap())
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list addresses in %s: %w", path, err)
	}
	return out, nil
}
