package loader

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/internal/smallfile"
)

// The functions here run inside the pod's network namespace (netns.Do).

// sysctlPath names a per-interface sysctl of the calling thread's network
// namespace under procDir (empty: /proc).
func sysctlPath(procDir, family, iface, name string) string {
	return filepath.Join(cmp.Or(procDir, "/proc"), "sys/net", family, "conf", iface, name)
}

// maxSysctlBytes bounds the read of a sysctl under ProcDir (a setting): an
// integer's few bytes in a procfs, but a fifo, a device or a huge file at the
// path, where ProcDir is not one, is an error instead of a read that blocks a
// thread in the pod's namespace for ever or fills the memory.
const maxSysctlBytes = 4 << 10

func readSysctl(path string) (int32, error) {
	b, err := smallfile.Read(path, maxSysctlBytes)
	if err != nil {
		return -1, fmt.Errorf("read sysctl: %w", err)
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return -1, fmt.Errorf("read %s: %w", path, err)
	}
	return int32(v), nil
}

// writeSysctl writes v to the sysctl at path as os.WriteFile did, but opens
// without blocking: the attach ignores a failed read of the old value, and
// a fifo at the path (ProcDir not a procfs) waited for a reader for ever.
func writeSysctl(path string, v int32) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_NONBLOCK, 0o644)
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	_, err = f.Write([]byte(strconv.Itoa(int(v))))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// podRouting is the fwmark rule and local route that make re-injected and
// assigned packets, whose destination is not an address of the pod, reach
// their socket: `ip rule fwmark MARK/MASK lookup TABLE` and
// `ip route add local 0.0.0.0/0 dev lo table TABLE` (and the IPv6 twins).
func (l *Loader) podRouting(family int) (*netlink.Rule, *netlink.Route, error) {
	s := l.cfg.Settings
	rule := netlink.NewRule()
	rule.Family = family
	rule.Mark = s.ReinjectMark
	mask := s.MarkMask
	rule.Mask = &mask
	rule.Table = s.RouteTable
	rule.Priority = s.RulePriority

	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return nil, nil, fmt.Errorf("find lo: %w", err)
	}
	// Assigned packets are delivered through lo; a runtime's loopback
	// plugin normally has it up already.
	if lo.Attrs().Flags&net.FlagUp == 0 {
		if err := netlink.LinkSetUp(lo); err != nil {
			return nil, nil, fmt.Errorf("set lo up: %w", err)
		}
	}
	dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
	if family == netlink.FAMILY_V6 {
		dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	route := &netlink.Route{
		LinkIndex: lo.Attrs().Index,
		Dst:       dst,
		Table:     s.RouteTable,
		Type:      unix.RTN_LOCAL,
		Scope:     unix.RT_SCOPE_HOST,
		Family:    family,
	}
	return rule, route, nil
}

func families(addrs []netip.Addr) []int {
	var v4, v6 bool
	for _, a := range addrs {
		v4 = v4 || a.Is4()
		v6 = v6 || a.Is6()
	}
	var out []int
	if v4 {
		out = append(out, netlink.FAMILY_V4)
	}
	if v6 {
		out = append(out, netlink.FAMILY_V6)
	}
	return out
}

func (l *Loader) addRouting(addrs []netip.Addr) error {
	for _, fam := range families(addrs) {
		rule, route, err := l.podRouting(fam)
		if err != nil {
			return err
		}
		if err := netlink.RouteReplace(route); err != nil {
			return fmt.Errorf("add local route to table %d: %w", route.Table, err)
		}
		if err := netlink.RuleAdd(rule); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("add fwmark rule: %w", err)
		}
	}
	return nil
}

func (l *Loader) delRouting(addrs []netip.Addr) error {
	var errs []error
	for _, fam := range families(addrs) {
		rule, route, err := l.podRouting(fam)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if err := netlink.RuleDel(rule); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("delete fwmark rule: %w", err))
		}
		if err := netlink.RouteDel(route); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("delete local route: %w", err))
		}
	}
	return errors.Join(errs...)
}

// checkEthernet fails unless iface is an Ethernet device. The programs read
// an Ethernet header at the start of every frame (and steer by rewriting its
// destination MAC); on a device without one (a tun or WireGuard device, an
// IP tunnel, netkit in L3 mode) frames start at the IP header, the programs
// would take bytes of the addresses for the EtherType and pass nearly every
// packet unclassified: the pod would look enrolled while its TCP crossed the
// interface in plaintext.
func checkEthernet(iface netlink.Link) error {
	a := iface.Attrs()
	if a.EncapType != "ether" || len(a.HardwareAddr) != 6 {
		return fmt.Errorf("interface %s is not an Ethernet device (link type %q): the capture programs need an Ethernet header", a.Name, a.EncapType)
	}
	return nil
}

// otherInterfaces lists the interfaces of the current namespace that are up,
// other than loopback and iface. The programs are only on iface, so TCP that
// arrives on another (a second network, such as Multus adds) reaches the
// pod's sockets uncaptured, in plaintext, to any of the pod's addresses:
// the kernel accepts a packet for a local address on any interface.
func otherInterfaces(iface netlink.Link) ([]string, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list interfaces: %w", err)
	}
	var out []string
	for _, lk := range links {
		a := lk.Attrs()
		if a.Index == iface.Attrs().Index || a.Flags&net.FlagLoopback != 0 || a.Flags&net.FlagUp == 0 {
			continue
		}
		out = append(out, a.Name)
	}
	return out, nil
}

// checkAddrs fails unless every address is configured on iface: enrolling an
// address the pod does not own would capture someone else's traffic. It
// returns the other addresses of iface that are not link-local (a SLAAC or
// secondary address): the programs drop TCP to and from those, as from the
// link-local ones, since they never capture it (see netns_pod in
// capture.c), so they are worth a word in the log.
func checkAddrs(iface netlink.Link, addrs []netip.Addr) (others []netip.Addr, err error) {
	have, err := netlink.AddrList(iface, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list addresses of %s: %w", iface.Attrs().Name, err)
	}
	for _, want := range addrs {
		found := false
		for _, a := range have {
			if got, ok := netip.AddrFromSlice(a.IP); ok && got.Unmap() == want {
				found = true
				break
			}
		}
		if !found {
			return nil, fmt.Errorf("address %s is not configured on %s", want, iface.Attrs().Name)
		}
	}
	for _, a := range have {
		got, ok := netip.AddrFromSlice(a.IP)
		if !ok {
			continue
		}
		got = got.Unmap()
		if !got.IsLinkLocalUnicast() && !slices.Contains(addrs, got) {
			others = append(others, got)
		}
	}
	return others, nil
}
