package netns

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrNotPodNetNS marks a path that cannot be a pod's network namespace.
var ErrNotPodNetNS = errors.New("not a pod's network namespace")

// CheckPodPath says whether path can name a pod's network namespace, and
// returns the namespace's inode. Whoever reports a path (the CNI plugin, a
// runtime) is not trusted to name a pod's: the agent enters the namespace,
// attaches programs, changes sysctls and opens listeners there, so a path
// that leads to the agent's own namespace (the host's: /proc/self/ns/net,
// /proc/thread-self/..., a symlink or bind mount of either; known by
// OwnInode, not by reading /proc/self, which is the main thread's and so a
// pod's while a Do runs there) or to pid 1's
// under procDir (the host's /proc, default /proc) would mesh the node
// itself. The path must be absolute and clean, and name an nsfs file.
// Errors wrap ErrNotPodNetNS and name the path.
func CheckPodPath(path, procDir string) (uint64, error) {
	if path == "" || !filepath.IsAbs(path) || filepath.Clean(path) != path {
		return 0, fmt.Errorf("network namespace path %q: must be absolute and clean: %w", path, ErrNotPodNetNS)
	}
	if err := ownThreadPath(path, procDir); err != nil {
		return 0, err
	}
	// Without blocking: a fifo at the path would wait for a writer for ever;
	// opened so, it is refused below as not a namespace file.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return 0, fmt.Errorf("network namespace %s: %w", path, err)
	}
	defer f.Close()
	var fs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &fs); err != nil {
		return 0, fmt.Errorf("network namespace %s: %w", path, err)
	}
	if fs.Type != unix.NSFS_MAGIC {
		return 0, fmt.Errorf("network namespace %s: not a namespace file (filesystem %#x): %w", path, fs.Type, ErrNotPodNetNS)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, fmt.Errorf("network namespace %s: %w", path, err)
	}
	// A mount or user namespace file is nsfs too; setns(CLONE_NEWNET)
	// would refuse it, but say so now.
	if t, err := unix.IoctlRetInt(int(f.Fd()), unix.NS_GET_NSTYPE); err == nil && t != unix.CLONE_NEWNET {
		return 0, fmt.Errorf("network namespace %s: a namespace of another kind: %w", path, ErrNotPodNetNS)
	}
	own, err := OwnInode()
	if err != nil {
		return 0, fmt.Errorf("network namespace %s: %w", path, err)
	}
	if own == st.Ino {
		return 0, fmt.Errorf("network namespace %s is the agent's own network namespace: %w", path, ErrNotPodNetNS)
	}
	if ino, err := Inode(filepath.Join(cmp.Or(procDir, "/proc"), "1", "ns", "net")); err == nil && ino == st.Ino {
		return 0, fmt.Errorf("network namespace %s is the host's network namespace (pid 1's): %w", path, ErrNotPodNetNS)
	}
	return st.Ino, nil
}

// ownThreadPath refuses a path into the agent's own process under /proc (or
// procDir): self, thread-self, or its pid. Such a path names the namespace
// of whichever thread reads it, or of the main thread, which the Go
// runtime lends to any goroutine, netns.Do's included: it named a pod's
// namespace while a Do ran there, passed the checks, and the agent's own
// a moment later, when the pod's listeners and programs were put there.
func ownThreadPath(path, procDir string) error {
	own := []string{"self", "thread-self", strconv.Itoa(os.Getpid())}
	for _, proc := range []string{"/proc", procDir} {
		if proc == "" {
			continue
		}
		rest, ok := strings.CutPrefix(path, filepath.Clean(proc)+"/")
		if !ok {
			continue
		}
		first, _, _ := strings.Cut(rest, "/")
		if slices.Contains(own, first) {
			return fmt.Errorf("network namespace %s is under the agent's own process (%s/%s): %w", path, proc, first, ErrNotPodNetNS)
		}
	}
	return nil
}
