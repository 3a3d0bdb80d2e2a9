// Package pin keeps BPF objects on a bpffs so they outlive the agent:
// it mounts a bpffs where none is, and attaches tcx and cgroup links that
// are pinned, updated in place by a new process, and detached by removing
// the pin.
package pin

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// EnsureBPFFS makes root a directory on a bpffs, mounting one where none is:
// on /sys/fs/bpf when root lies below it (the usual node layout), else on
// root itself (tests and simulated nodes use their own roots).
//
// A bpffs is only ever mounted on an empty directory: mounting over one that
// holds files would hide them from everything on the node (think of a
// mistyped --bpf-root /var/lib/kubelet) until the mount went away. A
// non-empty directory that is not on a bpffs is an error naming it.
func EnsureBPFFS(root string) error {
	if OnBPFFS(root) {
		return nil
	}
	const sysBPF = "/sys/fs/bpf"
	if strings.HasPrefix(filepath.Clean(root)+"/", sysBPF+"/") && !OnBPFFS(sysBPF) {
		if err := mountOnEmpty(sysBPF); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return fmt.Errorf("create pin root %s: %w", root, err)
	}
	if OnBPFFS(root) {
		return nil
	}
	return mountOnEmpty(root)
}

// ErrNotEmpty marks a directory that EnsureBPFFS will not mount over.
var ErrNotEmpty = errors.New("directory is not empty and not on a bpffs")

// mountOnEmpty mounts a bpffs on dir, which must be an empty directory.
func mountOnEmpty(dir string) error {
	entries, err := readDirNames(dir, 3)
	if err != nil {
		return fmt.Errorf("pin root %s: %w", dir, err)
	}
	if len(entries) > 0 {
		return fmt.Errorf("pin root %s: %w (it holds %s): refusing to mount a bpffs over it; "+
			"give an empty directory, one on a bpffs, or a path below /sys/fs/bpf", dir, ErrNotEmpty, strings.Join(entries, ", "))
	}
	if err := unix.Mount("bpffs", dir, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs on %s: %w", dir, err)
	}
	return nil
}

// readDirNames returns up to n names in dir (n <= 0: all), sorted.
func readDirNames(dir string, n int) ([]string, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	names, err := f.Readdirnames(n)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	slices.Sort(names)
	return names, nil
}

// OnBPFFS reports whether path is on a bpffs.
func OnBPFFS(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.BPF_FS_MAGIC
}

// RemoveRootIfEmpty deletes the pin root once nothing is left in it,
// unmounting it first if it is a bpffs mount of its own (never
// /sys/fs/bpf itself, which the node shares). Entries that are still there
// belong to someone else: they and the root stay, and are returned.
func RemoveRootIfEmpty(root string) (left []string, err error) {
	left, err = readDirNames(root, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read pin root %s: %w", root, err)
	}
	// A new bpffs comes with the kernel's preloaded iterators (bpf_preload):
	// they go with the mount.
	if isMountPoint(root) && OnBPFFS(root) {
		left = slices.DeleteFunc(left, func(n string) bool { return n == "maps.debug" || n == "progs.debug" })
	}
	if len(left) > 0 {
		return left, nil
	}
	if filepath.Clean(root) == "/sys/fs/bpf" {
		return nil, nil
	}
	if isMountPoint(root) && OnBPFFS(root) {
		if err := unix.Unmount(root, 0); err != nil {
			return nil, fmt.Errorf("unmount %s: %w", root, err)
		}
	}
	// Not RemoveAll: a directory someone filled since is theirs.
	if err := os.Remove(root); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove pin root %s: %w", root, err)
	}
	return nil, nil
}

// LinkProgramName is the name of the program the link pinned at path runs,
// so a caller can tell its own pins from others' before removing one.
func LinkProgramName(path string) (string, error) {
	lk, err := link.LoadPinnedLink(path, &ebpf.LoadPinOptions{})
	if err != nil {
		return "", err
	}
	defer lk.Close()
	info, err := lk.Info()
	if err != nil {
		return "", fmt.Errorf("link info of %s: %w", path, err)
	}
	prog, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		return "", fmt.Errorf("program of link %s: %w", path, err)
	}
	defer prog.Close()
	pi, err := prog.Info()
	if err != nil {
		return "", fmt.Errorf("program info of link %s: %w", path, err)
	}
	return pi.Name, nil
}

func isMountPoint(path string) bool {
	var st, parent unix.Stat_t
	if unix.Stat(path, &st) != nil || unix.Stat(filepath.Dir(path), &parent) != nil {
		return false
	}
	return st.Dev != parent.Dev
}

// ErrForeignLink marks a pin that is not the link its path is for: another
// kind of object, a link of another type or direction, one running another
// program than the one to be put in, or one on another interface.
var ErrForeignLink = errors.New("pinned object is not the expected link")

// ErrLinkElsewhere is ErrForeignLink for a link of the right kind on
// another interface than the one asked for (checkTCX with an ifindex): when
// still attached, some other pod's link, which a caller may have to keep.
var ErrLinkElsewhere = fmt.Errorf("%w: on another interface", ErrForeignLink)

// UpdateTCX points the tcx link pinned at path at prog. The link stays
// attached throughout, so no packet goes unhandled. It reports
// os.ErrNotExist when nothing is pinned there, ErrForeignLink when the pin
// is not a tcx link of attach running a program of prog's name (checkTCX),
// and another error when the link is defunct (its interface is gone).
func UpdateTCX(path string, prog *ebpf.Program, attach ebpf.AttachType) error {
	lk, err := UpdateTCXHeld(path, prog, attach)
	if err != nil {
		return err
	}
	return lk.Close()
}

// UpdateTCXHeld is UpdateTCX that returns the link, open: the caller holds
// it (see AttachTCXHeld).
func UpdateTCXHeld(path string, prog *ebpf.Program, attach ebpf.AttachType) (link.Link, error) {
	lk, err := link.LoadPinnedLink(path, &ebpf.LoadPinOptions{})
	if err != nil {
		return nil, err
	}
	if err := checkTCX(lk, prog, attach, 0); err != nil {
		lk.Close()
		return nil, fmt.Errorf("pinned link %s: %w", path, err)
	}
	if err := lk.Update(prog); err != nil {
		lk.Close()
		return nil, fmt.Errorf("update pinned link %s: %w", path, err)
	}
	return lk, nil
}

// checkTCX refuses (ErrForeignLink) a link that is not a tcx link of
// attach running a program named as prog is, and with ifindex > 0 one not
// attached to that interface of the calling thread's network namespace.
// Why: the kernel updates any tcx link with any classifier, whatever its
// direction or interface. A pin renamed into another's place (ingress and
// egress swapped, another pod's link) had each hook run the other
// direction's program, or a pod hold another's link, and no repair saw it:
// every link was attached and every pin there.
func checkTCX(lk link.Link, prog *ebpf.Program, attach ebpf.AttachType, ifindex int) error {
	info, err := lk.Info()
	if err != nil {
		return fmt.Errorf("link info: %w", err)
	}
	tcx := info.TCX()
	if info.Type != link.TCXType || tcx == nil {
		return fmt.Errorf("%w: a link of type %d, not tcx", ErrForeignLink, info.Type)
	}
	if got := ebpf.AttachType(tcx.AttachType); got != attach {
		return fmt.Errorf("%w: a tcx link of attach type %v, want %v", ErrForeignLink, got, attach)
	}
	want, err := prog.Info()
	if err != nil {
		return fmt.Errorf("program info: %w", err)
	}
	running, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		return fmt.Errorf("program of the link: %w", err)
	}
	got, err := running.Info()
	running.Close()
	if err != nil {
		return fmt.Errorf("program info of the link: %w", err)
	}
	if got.Name != want.Name {
		return fmt.Errorf("%w: it runs program %q, not %q", ErrForeignLink, got.Name, want.Name)
	}
	if ifindex <= 0 {
		return nil
	}
	if int(tcx.Ifindex) != ifindex {
		return fmt.Errorf("%w (index %d, not %d)", ErrLinkElsewhere, tcx.Ifindex, ifindex)
	}
	// The same index in another namespace is another interface.
	res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: attach})
	if err != nil {
		return fmt.Errorf("query tcx links of interface %d: %w", ifindex, err)
	}
	for _, p := range res.Programs {
		if id, ok := p.LinkID(); ok && id == info.ID {
			return nil
		}
	}
	return fmt.Errorf("%w (not interface %d of this network namespace)", ErrLinkElsewhere, ifindex)
}

// AttachTCX updates the link pinned at path, or attaches prog to ifindex
// and pins the new link there. The kernel resolves ifindex in the calling
// thread's network namespace. A defunct link, stale pin or foreign object
// is replaced.
func AttachTCX(path string, ifindex int, prog *ebpf.Program, attach ebpf.AttachType) error {
	a, err := AttachTCXHeld(path, ifindex, prog, attach)
	if err != nil {
		return err
	}
	if a.Displaced != nil {
		a.Displaced.Close()
	}
	return a.Link.Close()
}

// Attached is what AttachTCXHeld did.
type Attached struct {
	// Link is the pod's link, open.
	Link link.Link
	// Displaced, when not nil, is a link that was pinned at the path but
	// is not the one for it (Replaced says why), kept open so that it stays
	// attached: closing it detaches it, unless it is pinned elsewhere.
	// The caller closes it once the other links it attaches are in place
	// (a pod's ingress and egress pins swapped: each path holds the other
	// direction's only link).
	Displaced link.Link
	// Replaced is why the pin at the path was not updated in place
	// (nil: it was, or there was none).
	Replaced error
}

// AttachTCXHeld is AttachTCX that returns the link, open. A holder keeps
// the link attached even when someone removes its pin, and can pin it again
// (Repin) without a moment of the program missing; closing the link
// leaves it to its pin. A pin that is not this direction's link of prog's
// program on ifindex (checkTCX), or a link that cannot be updated, is
// replaced: the new link is attached before the pin moves, and the old one
// comes back open (Attached.Displaced), so nothing is detached before its
// replacement runs.
func AttachTCXHeld(path string, ifindex int, prog *ebpf.Program, attach ebpf.AttachType) (Attached, error) {
	var res Attached
	old, err := link.LoadPinnedLink(path, &ebpf.LoadPinOptions{})
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		// Not a link, or a defunct one: nothing there runs.
		res.Replaced = err
	default:
		if err := checkTCX(old, prog, attach, ifindex); err != nil {
			res.Replaced = err
		} else if err := old.Update(prog); err != nil {
			res.Replaced = fmt.Errorf("update: %w", err)
		} else {
			return Attached{Link: old}, nil
		}
		res.Displaced = old
	}
	// The interface may run prog in this direction already, through a link
	// pinned elsewhere (two pods' pins swapped) or not at all (held by this
	// process): that link is the pod's, and is pinned here again. The
	// kernel would refuse a second link of the same program on the hook.
	lk, err := linkRunning(ifindex, prog, attach)
	if err == nil && lk == nil {
		lk, err = link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: attach})
	}
	if err != nil {
		if res.Displaced != nil {
			res.Displaced.Close() // still pinned: stays attached
		}
		return Attached{}, fmt.Errorf("attach tcx %s: %w", filepath.Base(path), err)
	}
	if res.Replaced != nil {
		_ = os.Remove(path)
	}
	if err := Repin(lk, path); err != nil {
		lk.Close()
		if res.Displaced != nil {
			// Back where it was, so that closing it detaches nothing.
			_ = Repin(res.Displaced, path)
			res.Displaced.Close()
		}
		return Attached{}, err
	}
	res.Link = lk
	return res, nil
}

// linkRunning opens the tcx link of attach on interface ifindex (in the
// calling thread's network namespace) that runs prog, nil if there is none.
func linkRunning(ifindex int, prog *ebpf.Program, attach ebpf.AttachType) (link.Link, error) {
	info, err := prog.Info()
	if err != nil {
		return nil, fmt.Errorf("program info: %w", err)
	}
	id, ok := info.ID()
	if !ok {
		return nil, nil
	}
	res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: attach})
	if err != nil {
		return nil, nil // attaching will say what is wrong
	}
	for _, p := range res.Programs {
		if lid, ok := p.LinkID(); ok && p.ID == id {
			lk, err := link.NewFromID(lid)
			if err != nil {
				return nil, fmt.Errorf("open link %d running the program: %w", lid, err)
			}
			return lk, nil
		}
	}
	return nil, nil
}

// Repin pins lk at path again, creating the directory if it went too.
func Repin(lk link.Link, path string) error {
	// The link remembers the path it was pinned at and would skip pinning
	// there again: forget it first (a missing file is fine).
	_ = lk.Unpin()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("create pin dir: %w", err)
	}
	if err := lk.Pin(path); err != nil {
		return fmt.Errorf("pin tcx link %s: %w", path, err)
	}
	return nil
}

// TCXAttached reports whether the tcx link is still attached to an
// interface: a link detached by someone else, or whose interface went away,
// is defunct (ifindex 0). It is one bpf(2) call on the open link, with no
// allocation, so that every pod's links can be checked several times a
// second.
func TCXAttached(lk link.Link) (bool, error) {
	fdr, ok := lk.(interface{ FD() int })
	if !ok {
		return false, fmt.Errorf("link has no file descriptor")
	}
	ok, err := TCXAttachedFD(fdr.FD())
	runtime.KeepAlive(lk)
	return ok, err
}

// TCXAttachedFD is TCXAttached on the link's file descriptor, for a caller
// that checks many held links often and keeps their descriptors at hand
// (following each link's pointers costs about as much as the call). The
// caller keeps the link open meanwhile.
func TCXAttachedFD(fd int) (bool, error) {
	// The head of struct bpf_link_info, up to the tcx member of its union.
	// On the heap, which never moves, since the kernel gets its address
	// as an integer.
	info := new(struct {
		Type, ID, ProgID, _ uint32
		Ifindex, AttachType uint32
	})
	attr := &struct {
		FD, InfoLen uint32
		Info        uint64
	}{uint32(fd), uint32(unsafe.Sizeof(*info)), uint64(uintptr(unsafe.Pointer(info)))}
	_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_OBJ_GET_INFO_BY_FD, uintptr(unsafe.Pointer(attr)), unsafe.Sizeof(*attr))
	runtime.KeepAlive(info)
	if errno != 0 {
		return false, fmt.Errorf("link info: %w", errno)
	}
	if info.Type != uint32(link.TCXType) {
		return false, fmt.Errorf("link is of type %d, not tcx", info.Type)
	}
	return info.Ifindex != 0, nil
}

// DetachLink removes the pin at path; the kernel detaches the link with its
// last reference. A missing pin is fine.
func DetachLink(path string) error {
	lk, err := link.LoadPinnedLink(path, &ebpf.LoadPinOptions{})
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		// Defunct links cannot be opened as links; the pin is all that is left.
		if rmErr := os.Remove(path); rmErr != nil && !errors.Is(rmErr, os.ErrNotExist) {
			return fmt.Errorf("remove pin %s: %w", path, rmErr)
		}
		return nil
	}
	defer lk.Close()
	if err := lk.Unpin(); err != nil {
		return fmt.Errorf("unpin %s: %w", path, err)
	}
	return nil
}

// ErrLoosePins marks a pin tree that someone other than root or the
// agent's user could change.
var ErrLoosePins = errors.New("pin tree not the agent's alone")

// CheckTree refuses a pin root in which anything (the root, a directory,
// a pin) is owned by a user other than root and this process's, or is
// writable by group or others, or is a symlink (the agent pins none). Why:
// since Linux 6.5 BPF_OBJ_GET is checked against the pin's file mode only,
// unprivileged BPF off or not, so any user who may write rd_pods may delete
// a pod's enrollment entry (the kill switch: its traffic passes in
// plaintext); who may write a directory may rename pins (swap a pod's
// links, hide a map for the next agent to recreate empty). The agent
// creates everything 0700/0600: a looser tree was changed by someone, and
// what is in it cannot be trusted. The error names the first such path.
func CheckTree(root string) error {
	euid := uint32(os.Geteuid())
	return filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("pin tree %s: %w", root, err)
		}
		var st unix.Stat_t
		if err := unix.Lstat(path, &st); err != nil {
			return fmt.Errorf("pin tree %s: %w", root, err)
		}
		mode := os.FileMode(st.Mode & 0o777)
		switch {
		case st.Mode&unix.S_IFMT == unix.S_IFLNK:
			return fmt.Errorf("%w: %s is a symlink; the agent pins none: remove it", ErrLoosePins, path)
		case st.Uid != 0 && st.Uid != euid:
			return fmt.Errorf("%w: %s is owned by uid %d, neither root nor the agent's user: its owner could change the capture state; give it to root", ErrLoosePins, path, st.Uid)
		case mode&0o022 != 0:
			return fmt.Errorf("%w: %s is writable by group or others (mode %v): they could change or remove the capture state; make it 0700 (directories) or 0600 (pins)", ErrLoosePins, path, mode)
		}
		return nil
	})
}
