// Package unixsock installs the agent's unix sockets (the CNI event socket,
// the listener hand-over socket) at their paths so that an agent replacing
// another takes the path over in one step, and tells who is at the other
// end of a connection.
package unixsock

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/internal/smallfile"
)

// Install listens on a unix socket of network ("unix" or "unixpacket") and
// puts it at path; what names the socket in errors ("CNI socket"). It
// creates the directory (mode 0700) if missing, refuses one that someone
// other than root or this process's user may write (CheckDir), binds a
// name of its own and renames it over the path: a predecessor still
// serving keeps its accepted connections, every dial from then on reaches
// this one, and at no moment is there no socket at the path. A stale
// socket is replaced the same way. The socket is mode 0600. It returns the
// inode, by which the caller knows the path is still its own (RemoveIfOwn).
func Install(what, path, network string) (net.Listener, uint64, error) {
	if err := Check(what, path); err != nil {
		return nil, 0, err
	}
	dir := filepath.Dir(path)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		// Only a directory we create gets our mode: chmod on an existing one
		// (say /tmp) would be a surprise for everyone else using it.
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, 0, fmt.Errorf("create %s directory: %w", what, err)
		}
	}
	if err := CheckDir(what, dir); err != nil {
		return nil, 0, err
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode().Type() != os.ModeSocket {
		return nil, 0, fmt.Errorf("%s path %s exists and is not a socket; remove it", what, path)
	}
	// A temporary name of this call's own: not the process id, which the
	// agents of an upgrade share (each is PID 1 in its container). Two
	// agents installing at once each removed the other's temporary socket,
	// and one renamed the other's over the path and took it for its own.
	// A name taken (a crash's leftover) is never removed: another is drawn.
	var (
		tmp string
		l   net.Listener
		err error
	)
	for range 4 {
		tmp = fmt.Sprintf("%s.%07x.tmp", path, rand.Uint32N(1<<28))
		if l, err = net.Listen(network, tmp); !errors.Is(err, syscall.EADDRINUSE) {
			break
		}
	}
	if err != nil {
		return nil, 0, fmt.Errorf("listen on %s: %w", what, err)
	}
	// The path belongs to whoever renamed last: closing must not unlink it.
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := os.Chmod(tmp, 0o600); err != nil {
		l.Close()
		os.Remove(tmp)
		return nil, 0, fmt.Errorf("restrict %s: %w", what, err)
	}
	// The inode before the rename, which keeps it: after it, the path may
	// already be another agent's socket, renamed over this one.
	fi, err := os.Lstat(tmp)
	if err != nil {
		l.Close()
		os.Remove(tmp)
		return nil, 0, fmt.Errorf("install %s %s: %w", what, path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		l.Close()
		os.Remove(tmp)
		return nil, 0, fmt.Errorf("install %s %s: %w", what, path, err)
	}
	return l, inodeOf(fi), nil
}

// Check reports, changing nothing, whether Install could put a socket at
// path: nothing but a socket there, and its directory, if it exists, one
// CheckDir accepts, or, if not, to be made under a directory. An agent
// checks its socket settings with it before it takes over anything, so
// that a path it can never serve fails its start, not after it claimed the
// node.
func Check(what, path string) error {
	if fi, err := os.Lstat(path); err == nil && fi.Mode().Type() != os.ModeSocket {
		return fmt.Errorf("%s path %s exists and is not a socket (%s); remove it", what, path, smallfile.Kind(fi.Mode()))
	}
	dir := filepath.Dir(path)
	for d := dir; ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		switch {
		case (errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOTDIR)) && d != filepath.Dir(d):
			continue // made by Install, or a parent is no directory (found above)
		case err != nil:
			return fmt.Errorf("%s directory %s: %w", what, dir, err)
		case !fi.IsDir():
			return fmt.Errorf("%s directory %s: %s is not a directory", what, dir, d)
		case d == dir:
			return CheckDir(what, dir)
		}
		return nil
	}
}

// RemoveIfOwn removes the socket at path if it is still the one Install
// put there (inode ino), not a successor's.
func RemoveIfOwn(path string, ino uint64) {
	if Names(path, ino) {
		_ = os.Remove(path)
	}
}

// Names reports whether path is still the socket Install put there (inode
// ino).
func Names(path string, ino uint64) bool {
	fi, err := os.Lstat(path)
	return err == nil && inodeOf(fi) == ino
}

func inodeOf(fi os.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}

// CheckDir refuses a socket directory that someone other than root or this
// process's user owns or may write: whoever can write there can rename a
// socket of their own over the agent's, delete it, or take the temporary
// name first, and answer in the agent's place.
func CheckDir(what, dir string) error {
	fi, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("%s directory: %w", what, err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return fmt.Errorf("%s directory %s is not a directory", what, dir)
	case !ok || (st.Uid != 0 && st.Uid != uint32(os.Geteuid())):
		return fmt.Errorf("%s directory %s is owned by uid %d, neither root nor the agent's user: its owner could replace the socket; give it to root", what, dir, st.Uid)
	case fi.Mode().Perm()&0o022 != 0:
		return fmt.Errorf("%s directory %s is writable by group or others (mode %v): they could replace the socket; make it 0755 or tighter", what, dir, fi.Mode().Perm())
	}
	return nil
}

// PeerCred is the process at the other end of c (SO_PEERCRED): for a
// dialled connection the process that listened, for an accepted one the
// process that dialled.
func PeerCred(c net.Conn) (*unix.Ucred, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, fmt.Errorf("not a unix socket connection: %T", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	if cerr != nil {
		return nil, fmt.Errorf("SO_PEERCRED: %w", cerr)
	}
	return cred, nil
}

// Trusted reports whether cred is root's or this process's user's: the
// only peers the agent's sockets talk to.
func Trusted(cred *unix.Ucred) bool {
	return cred != nil && (cred.Uid == 0 || cred.Uid == uint32(os.Geteuid()))
}
