package file

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestRunFollowsSymlinkedPath: PATH may be a symlink to a manifest or a
// directory elsewhere (a `current` link a deployment tool swaps, a file
// linked in from a volume). Only PATH's own directory was watched, and
// inotify watches the target of a link it is given: a write to the linked
// file in its own directory, or the link's directory swapped to a new one,
// went unseen, and the agent kept enforcing the old manifests (a new DENY
// or STRICT policy never applied) with nothing logged. Each change below
// must be delivered.
func TestRunFollowsSymlinkedPath(t *testing.T) {
	t.Run("file linked from another directory, written in place", func(t *testing.T) {
		data, links := t.TempDir(), t.TempDir()
		target := writeFile(t, data, "m.yaml", namespaceDoc("a"))
		path := filepath.Join(links, "m.yaml")
		if err := os.Symlink(target, path); err != nil {
			t.Fatal(err)
		}
		r := start(t, path, nil)
		r.waitFor(t, "a")
		writeFile(t, data, "m.yaml", namespaceDoc("a", "b"))
		r.waitWithin(t, 3*time.Second, "a b")
	})
	t.Run("file linked to a link that is swapped", func(t *testing.T) {
		// links/m.yaml -> data/current.yaml -> v1.yaml, then current.yaml -> v2.yaml.
		data, links := t.TempDir(), t.TempDir()
		writeFile(t, data, "v1.yaml", namespaceDoc("a"))
		writeFile(t, data, "v2.yaml", namespaceDoc("a", "b"))
		if err := os.Symlink("v1.yaml", filepath.Join(data, "current.yaml")); err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(links, "m.yaml")
		if err := os.Symlink(filepath.Join(data, "current.yaml"), path); err != nil {
			t.Fatal(err)
		}
		r := start(t, path, nil)
		r.waitFor(t, "a")
		swapLink(t, filepath.Join(data, "current.yaml"), "v2.yaml")
		r.waitWithin(t, 3*time.Second, "a b")
	})
	t.Run("directory link swapped", func(t *testing.T) {
		// top/current -> v1, then -> v2: PATH is top/current.
		top := t.TempDir()
		for v, ns := range map[string]string{"v1": namespaceDoc("a"), "v2": namespaceDoc("a", "b")} {
			if err := os.Mkdir(filepath.Join(top, v), 0o755); err != nil {
				t.Fatal(err)
			}
			writeFile(t, filepath.Join(top, v), "m.yaml", ns)
		}
		path := filepath.Join(top, "current")
		if err := os.Symlink("v1", path); err != nil {
			t.Fatal(err)
		}
		r := start(t, path, nil)
		r.waitFor(t, "a")
		swapLink(t, path, "v2")
		r.waitWithin(t, 3*time.Second, "a b")
		// And the new target is watched: an edit there is seen.
		writeFile(t, filepath.Join(top, "v2"), "m.yaml", namespaceDoc("a", "b", "c"))
		r.waitWithin(t, 3*time.Second, "a b c")
	})
}

// swapLink points the symlink link at target in one rename.
func swapLink(t *testing.T, link, target string) {
	t.Helper()
	tmp := link + ".tmp"
	if err := os.Symlink(target, tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, link); err != nil {
		t.Fatal(err)
	}
}

// TestRunResyncsWithoutEvents: a change no watch reports (a link above
// PATH's directory swapped; a filesystem without inotify, such as NFS) is
// read by the periodic resync.
func TestRunResyncsWithoutEvents(t *testing.T) {
	defer func(p time.Duration) { resyncPeriod = p }(resyncPeriod)
	resyncPeriod = 200 * time.Millisecond
	top := t.TempDir()
	for v, ns := range map[string]string{"v1": namespaceDoc("a"), "v2": namespaceDoc("a", "b")} {
		if err := os.Mkdir(filepath.Join(top, v), 0o755); err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(top, v), "m.yaml", ns)
	}
	if err := os.Symlink("v1", filepath.Join(top, "current")); err != nil {
		t.Fatal(err)
	}
	r := start(t, filepath.Join(top, "current", "m.yaml"), nil)
	r.waitFor(t, "a")
	swapLink(t, filepath.Join(top, "current"), "v2")
	r.waitWithin(t, 3*time.Second, "a b")
}
