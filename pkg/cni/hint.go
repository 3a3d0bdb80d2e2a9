package cni

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"
)

// SelectionHint is the agent's last word on which namespaces are in the
// ambient mesh, for the plugin to use only while the agent is unreachable.
//
// The rule the plugin applies with it (WouldEnroll) is deliberately coarse:
// CNI carries no pod labels, so a pod opted in by its own label in a
// non-ambient namespace passes (the agent enrolls it when it is back, its
// start-up reconcile finds pods by address), and a pod opted out by label in
// an ambient namespace is refused until the agent answers again.
type SelectionHint struct {
	// AmbientNamespaces carry istio.io/dataplane-mode=ambient.
	AmbientNamespaces []string `json:"ambientNamespaces"`
	// ExcludedNamespaces are never enrolled whatever their labels.
	ExcludedNamespaces []string `json:"excludedNamespaces"`
	// AmbientUnknown says the agent has not read its source yet (a node
	// just rebooted: the hint lives on tmpfs), so AmbientNamespaces is
	// empty for want of knowing: a pod outside ExcludedNamespaces may be
	// ambient.
	AmbientUnknown bool `json:"ambientUnknown,omitempty"`
	// Written is when the agent wrote the hint, for operators reading it.
	Written time.Time `json:"written"`
}

// WouldEnroll reports whether a pod in namespace would probably be enrolled.
func (h SelectionHint) WouldEnroll(namespace string) bool {
	return !slices.Contains(h.ExcludedNamespaces, namespace) && (h.AmbientUnknown || slices.Contains(h.AmbientNamespaces, namespace))
}

// WriteSelectionHint replaces the hint at path (DefaultHintPath if empty).
// The agent calls it on every snapshot. The write is atomic (temporary file,
// fsync, rename), so a plugin running at the same moment reads the old or the
// new hint, never half of one. The directory is created (0700) if missing.
func WriteSelectionHint(path string, ambientNamespaces, excluded []string) error {
	return writeHint(path, SelectionHint{AmbientNamespaces: sortedUnique(ambientNamespaces), ExcludedNamespaces: sortedUnique(excluded)})
}

// WriteStartupHint writes, where no hint is yet, one that knows only the
// excluded namespaces (AmbientUnknown): after a reboot wiped the hint, the
// agent's own start (before its source answered) must not keep the
// plugin refusing kube-system's pods, CoreDNS among them, that no setting
// would ever enroll. An existing hint, the last agent's word, is kept.
func WriteStartupHint(path string, excluded []string) error {
	if path == "" {
		path = DefaultHintPath
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return writeHint(path, SelectionHint{AmbientNamespaces: []string{}, ExcludedNamespaces: sortedUnique(excluded), AmbientUnknown: true})
}

func writeHint(path string, h SelectionHint) error {
	if path == "" {
		path = DefaultHintPath
	}
	h.Written = time.Now().UTC()
	data, err := json.MarshalIndent(h, "", "  ")
	if err != nil {
		return fmt.Errorf("encode selection hint: %w", err)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create selection hint directory: %w", err)
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("write selection hint: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // fails harmlessly after the rename
	if _, err := f.Write(append(data, '\n')); err != nil {
		f.Close()
		return fmt.Errorf("write selection hint %s: %w", tmp, err)
	}
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return fmt.Errorf("write selection hint %s: %w", tmp, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("sync selection hint %s: %w", tmp, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close selection hint %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("replace selection hint %s: %w", path, err)
	}
	return nil
}

// maxHintBytes bounds the hint read; a node's namespaces take a few KiB.
const maxHintBytes = 4 << 20

// ReadSelectionHint reads the hint at path (DefaultHintPath if empty). A
// missing file is an error wrapping os.ErrNotExist: the caller must not take
// it as "no namespace is ambient". So is a file that someone other than
// root or this process's user owns or may write: the agent writes it as
// root, mode 0644, and a planted hint saying "not ambient" would let pods
// start unmeshed while the agent is down.
func ReadSelectionHint(path string) (SelectionHint, error) {
	if path == "" {
		path = DefaultHintPath
	}
	data, err := readOwnedFile(path, maxHintBytes)
	if err != nil {
		return SelectionHint{}, fmt.Errorf("read selection hint: %w", err)
	}
	var h SelectionHint
	if err := json.Unmarshal(data, &h); err != nil {
		return SelectionHint{}, fmt.Errorf("decode selection hint %s: %w", path, err)
	}
	// The agent always writes both: any other JSON object (a conflist)
	// would decode as a hint naming no ambient namespace.
	if h.AmbientNamespaces == nil || h.Written.IsZero() {
		return SelectionHint{}, fmt.Errorf("decode selection hint %s: no ambientNamespaces or written field: not a hint the agent wrote", path)
	}
	return h, nil
}

func sortedUnique(in []string) []string {
	out := slices.Clone(in)
	slices.Sort(out)
	out = slices.Compact(out)
	if out == nil {
		out = []string{}
	}
	return out
}

// readOwnedFile reads path, at most limit bytes, if it is a regular file
// owned by root or this process's user and writable by no one else, in a
// directory no one else may write, and not through a symlink. The hint is
// read when the agent is unreachable, which is also what the agent is when
// it refuses to serve a directory others may write (unixsock.CheckDir):
// there, a symlink to any root-owned JSON file (a conflist decodes as a
// hint naming no ambient namespace) passed the owner and mode checks, and
// every pod started unmeshed.
func readOwnedFile(path string, limit int64) ([]byte, error) {
	if err := checkHintDir(filepath.Dir(path)); err != nil {
		return nil, err
	}
	// Without blocking: a fifo at the path would wait for a writer for
	// ever; opened so, it is refused below as not a regular file. The agent
	// writes a regular file there (a rename), never a symlink.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOFOLLOW, 0)
	if errors.Is(err, syscall.ELOOP) {
		return nil, fmt.Errorf("%s is a symlink, not the agent's file", path)
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.Mode().IsRegular():
		return nil, fmt.Errorf("%s is not a regular file (%s)", path, fi.Mode().Type())
	case !ok || (st.Uid != 0 && st.Uid != uint32(os.Geteuid())):
		return nil, fmt.Errorf("%s is owned by uid %d, neither root nor this process's user: not the agent's", path, st.Uid)
	case fi.Mode().Perm()&0o022 != 0:
		return nil, fmt.Errorf("%s is writable by group or others (mode %v): not trusted", path, fi.Mode().Perm())
	case fi.Size() > limit:
		return nil, fmt.Errorf("%s has %d bytes, more than %d", path, fi.Size(), limit)
	}
	return io.ReadAll(io.LimitReader(f, limit))
}

// checkHintDir refuses a directory owned by another user than root or this
// process's, or that group or others may write: whoever may write there can
// replace the hint.
func checkHintDir(dir string) error {
	fi, err := os.Stat(dir)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return fmt.Errorf("%s is not a directory", dir)
	case !ok || (st.Uid != 0 && st.Uid != uint32(os.Geteuid())):
		return fmt.Errorf("directory %s is owned by uid %d, neither root nor this process's user: its owner could replace the hint", dir, st.Uid)
	case fi.Mode().Perm()&0o022 != 0:
		return fmt.Errorf("directory %s is writable by group or others (mode %v): they could replace the hint", dir, fi.Mode().Perm())
	}
	return nil
}
