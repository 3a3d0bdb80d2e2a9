package file

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/internal/smallfile/smallfiletest"
	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/source"
)

// TestRunManifestReplacedByNonFile: a manifest file replaced (atomically,
// by a rename) with something that is not a regular file must not read as
// the file's removal: its objects would vanish and its pods be unenrolled.
// The load is refused, naming the file; the last good snapshot stays.
func TestRunManifestReplacedByNonFile(t *testing.T) {
	kinds := map[string]func(t *testing.T, path string){
		"dangling symlink": func(t *testing.T, path string) {
			if err := os.Symlink(filepath.Join(filepath.Dir(path), "gone"), path); err != nil {
				t.Fatal(err)
			}
		},
		"symlink to a directory": func(t *testing.T, path string) {
			if err := os.Symlink(t.TempDir(), path); err != nil {
				t.Fatal(err)
			}
		},
		"symlink to a fifo": func(t *testing.T, path string) {
			fifo := filepath.Join(t.TempDir(), "fifo")
			if err := syscall.Mkfifo(fifo, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(fifo, path); err != nil {
				t.Fatal(err)
			}
		},
		"directory": func(t *testing.T, path string) {
			if err := os.Mkdir(path, 0o755); err != nil {
				t.Fatal(err)
			}
		},
	}
	for name, replace := range kinds {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			writeFile(t, dir, "a.yaml", namespaceDoc("a"))
			writeFile(t, dir, "b.yaml", namespaceDoc("b"))
			m := source.NewMetrics(nil)
			r := startWith(t, New(dir, nil).WithMetrics(m))
			r.waitFor(t, "a b")

			// Made beside the directory, swapped with a.yaml in one step
			// (a directory cannot be renamed over a file).
			tmp := filepath.Join(t.TempDir(), "next")
			replace(t, tmp)
			if err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, filepath.Join(dir, "a.yaml"), unix.RENAME_EXCHANGE); err != nil {
				t.Fatal(err)
			}
			r.noUpdate(t, 300*time.Millisecond)
			errs := r.refused(t)
			if !strings.Contains(errors.Join(errs...).Error(), filepath.Join(dir, "a.yaml")+": not a regular file") {
				t.Fatalf("Errors() = %v, want a.yaml named as not a regular file", errs)
			}
			wantCount(t, m, source.ReasonRead, 1)
		})
	}
}

// TestLoadSinglePathNotRegular: PATH naming a fifo (or a device) is refused
// at once, not read: a fifo would block the watch loop for ever, a device
// such as /dev/zero would be read without end.
func TestLoadSinglePathNotRegular(t *testing.T) {
	fifo := smallfiletest.Fifo(t, filepath.Join(t.TempDir(), "c.yaml"))
	for _, path := range []string{fifo, "/dev/zero"} {
		var errs []error
		waitfor.Returns(t, "Load("+path+")", func() error { _, errs = Load(path); return nil })
		if len(errs) != 1 || !strings.Contains(errs[0].Error(), "not a regular file") {
			t.Errorf("Load(%s) errors = %v, want one: not a regular file", path, errs)
		}
	}
}

// TestLoadTooLarge: a load reads at most maxLoadBytes of manifests, in all
// its files together; past that it is refused (reason too_large), naming the
// file where the bound was crossed.
func TestLoadTooLarge(t *testing.T) {
	defer func(n int64) { maxLoadBytes = n }(maxLoadBytes)
	maxLoadBytes = 1 << 10
	dir := t.TempDir()
	writeFile(t, dir, "a.yaml", namespaceDoc("a")+"# "+strings.Repeat("x", 600)+"\n")
	b := writeFile(t, dir, "b.yaml", namespaceDoc("b")+"# "+strings.Repeat("x", 600)+"\n")
	_, errs := Load(dir)
	if len(errs) != 1 || errorReason(errs[0]) != source.ReasonTooLarge || !strings.Contains(errs[0].Error(), b+": ") {
		t.Fatalf("errors = %v, want one too_large naming %s", errs, b)
	}
	if _, errs := Load(filepath.Join(dir, "a.yaml")); len(errs) != 0 {
		t.Errorf("a.yaml alone, under the bound: errors %v", errs)
	}
}

// TestLoadTooManyObjects: a load decodes at most maxLoadObjects documents
// and list items in all; past that it is refused (reason too_large), as
// small documents would otherwise cost twenty times their bytes each.
func TestLoadTooManyObjects(t *testing.T) {
	defer func(n int) { maxLoadObjects = n }(maxLoadObjects)
	maxLoadObjects = 3
	dir := t.TempDir()
	a := writeFile(t, dir, "a.yaml", namespaceDoc("a", "b", "c"))
	if _, errs := Load(a); len(errs) != 0 {
		t.Fatalf("3 documents: errors %v", errs)
	}
	b := writeFile(t, dir, "b.yaml", "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Namespace, metadata: {name: d}}\n")
	_, errs := Load(dir)
	if len(errs) != 1 || errorReason(errs[0]) != source.ReasonTooLarge || !strings.Contains(errs[0].Error(), b+": more than 3 objects") {
		t.Fatalf("errors = %v, want one too_large naming %s", errs, b)
	}
	// A cached reload counts the same.
	r, _ := load(a, nil)
	writeFile(t, dir, "a.yaml", "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Namespace, metadata: {name: d}}\n- {apiVersion: v1, kind: Namespace, metadata: {name: e}}\n")
	r, _ = load(a, r.decoded)
	writeFile(t, dir, "a.yaml", "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Namespace, metadata: {name: d}}\n- {apiVersion: v1, kind: Namespace, metadata: {name: e}}\n"+namespaceDoc("f", "g"))
	if r, _ = load(a, r.decoded); len(r.errs) != 1 || errorReason(r.errs[0]) != source.ReasonTooLarge {
		t.Fatalf("cached list and 2 more: errors %v, want too_large", r.errs)
	}
}

// TestLoadAliasesCharged: YAML aliases are charged to the load's byte bound
// as they expand. The decoder bounds how many aliases a document expands,
// not how large: a 1 MiB string aliased 300 times in a 1 MiB file became
// 300 MiB of JSON, twice, some 2 GiB of memory and 20 s of a core, under a
// bound of 64 MiB. A document over the bound is refused (too_large) naming
// it, before it is expanded; a cached reload is charged the same; a few
// aliases as people write them (shared labels) load as before.
func TestLoadAliasesCharged(t *testing.T) {
	defer func(n int64) { maxLoadBytes = n }(maxLoadBytes)
	maxLoadBytes = 64 << 10
	dir := t.TempDir()
	pod := func(name string, aliases int) string {
		doc := "apiVersion: v1\nkind: Pod\nmetadata: {name: " + name + ", namespace: shop}\nspec:\n  containers:\n  - name: app\n    env:\n" +
			"    - {name: E0, value: &big " + strings.Repeat("x", 4<<10) + "}\n"
		for i := 1; i <= aliases; i++ {
			doc += fmt.Sprintf("    - {name: E%d, value: *big}\n", i)
		}
		return doc
	}
	bomb := writeFile(t, dir, "bomb.yaml", pod("web-1", 40)) // 5 KiB, 160 KiB expanded
	_, errs := Load(bomb)
	if len(errs) != 1 || errorReason(errs[0]) != source.ReasonTooLarge ||
		!strings.Contains(errs[0].Error(), bomb+": document 1 (line 1): YAML aliases expand this document by ") {
		t.Fatalf("errors = %v, want one too_large naming %s document 1", errs, bomb)
	}

	// Under the bound alone, over it with another file: fresh or cached.
	a := writeFile(t, dir, "bomb.yaml", pod("web-1", 10)) // some 40 KiB expanded
	r, err := load(a, nil)
	if err != nil || len(r.errs) != 0 {
		t.Fatalf("10 aliases of 4 KiB: %v %v", err, r.errs)
	}
	writeFile(t, dir, "b.yaml", namespaceDoc("shop")+"# "+strings.Repeat("x", 30<<10)+"\n")
	for _, prev := range []docCache{nil, r.decoded} {
		if r, err := load(dir, prev); err != nil || len(r.errs) != 1 || errorReason(r.errs[0]) != source.ReasonTooLarge {
			t.Errorf("with 30 KiB more (cache %v): %v, errors %v, want too_large", prev != nil, err, r.errs)
		}
	}

	labels := "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop, labels: &l {app: web, team: a}, annotations: *l}\n"
	if snap, errs := Load(writeFile(t, t.TempDir(), "ns.yaml", labels)); len(errs) != 0 || snap.Namespaces[0].Annotations["team"] != "a" {
		t.Errorf("labels aliased as annotations: errors %v, snapshot %+v", errs, snap.Namespaces)
	}
}

// TestLoadSplitsAsItDecodes: a file is split into documents as they are
// decoded, each a slice of the file, so what splitting holds does not grow
// with the lines or documents of a file: 64 MiB of newlines, or of "---"
// separators between one-letter documents, split up front, held some 2 GiB
// (a slice per line, a copy and a record per document) before the object
// bound stopped anything.
func TestLoadSplitsAsItDecodes(t *testing.T) {
	defer func(n int) { maxLoadObjects = n }(maxLoadObjects)
	maxLoadObjects = 10
	dir := t.TempDir()
	for name, content := range map[string]string{
		"newlines.yaml": strings.Repeat("\n", 4<<20),
		"docs.yaml":     strings.Repeat("a\n---\n", 1<<20),
	} {
		path := writeFile(t, dir, name, content)
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		_, errs := Load(path)
		runtime.ReadMemStats(&after)
		if name == "docs.yaml" && (len(errs) != 11 || errorReason(errs[10]) != source.ReasonTooLarge) {
			t.Errorf("%s: %d errors, want 10 documents refused then too_large: %v", name, len(errs), errs[len(errs)-1])
		}
		// Reading the file takes about twice its size (a growing buffer), more
		// under the race detector; splitting up front took 30 times.
		if got, limit := after.TotalAlloc-before.TotalAlloc, uint64(8*len(content)+1<<20); got > limit {
			t.Errorf("%s: loading %d bytes allocated %d, want at most %d", name, len(content), got, limit)
		}
	}
}

// TestLoadDuplicatePodUID: the agent keys pods by uid (the loader, the
// tunnel, the node agent's queue), which Kubernetes makes unique; two pods
// of a manifest with one uid (a copied pod renamed) would be taken for one,
// each replacing the other's enrollment. The second is an error naming
// the first.
func TestLoadDuplicatePodUID(t *testing.T) {
	pod := func(name string) string {
		return "---\napiVersion: v1\nkind: Pod\nmetadata: {name: " + name + ", namespace: shop, uid: \"1234\"}\n"
	}
	path := writeFile(t, t.TempDir(), "c.yaml", pod("web-1")+pod("web-2"))
	_, errs := Load(path)
	if len(errs) != 1 || errorReason(errs[0]) != source.ReasonInvalid ||
		!strings.Contains(errs[0].Error(), `document 2 (line 6): pod shop/web-2: uid "1234" is already pod shop/web-1's, defined in `+path+" document 1 (line 2)") {
		t.Fatalf("errors = %v, want document 2 refused for pod web-1's uid", errs)
	}
}

// TestRunPathChangesKind: PATH named a file at start and is now a
// directory (or the other way round): the load is refused, not read as the
// other kind: the manifests it would apply are not the ones configured.
func TestRunPathChangesKind(t *testing.T) {
	dir := t.TempDir()
	path := writeFile(t, dir, "c.yaml", namespaceDoc("a"))
	m := source.NewMetrics(nil)
	r := startWith(t, New(path, nil).WithMetrics(m))
	r.waitFor(t, "a")

	other := t.TempDir()
	writeFile(t, other, "x.yaml", namespaceDoc("x"))
	if err := unix.Renameat2(unix.AT_FDCWD, other, unix.AT_FDCWD, path, unix.RENAME_EXCHANGE); err != nil {
		t.Fatal(err)
	}
	r.noUpdate(t, 300*time.Millisecond)
	errs := r.refused(t)
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), path+": is a directory now, and was a file when the agent started") {
		t.Fatalf("Errors() = %v, want PATH named as changed kind", errs)
	}
	wantCount(t, m, source.ReasonRead, 1)
}

// TestLoadConfigMapLayout: a mounted ConfigMap's manifests are symlinks
// (a.yaml -> ..data/a.yaml, ..data -> ..<timestamp>): they load as the
// regular files they point to.
func TestLoadConfigMapLayout(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "..2026_12_04"), 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "..2026_12_04"), "a.yaml", namespaceDoc("a"))
	for link, target := range map[string]string{"..data": "..2026_12_04", "a.yaml": "..data/a.yaml"} {
		if err := os.Symlink(target, filepath.Join(dir, link)); err != nil {
			t.Fatal(err)
		}
	}
	snap, errs := Load(dir)
	if len(errs) != 0 || nsNames(snap) != "a" {
		t.Fatalf("Load = %q, %v; want namespace a, no errors", nsNames(snap), errs)
	}
}

// configMapPod is a pod document for the ConfigMap swap tests.
const configMapPod = `apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: shop, uid: u-web-1}
spec: {nodeName: node-a, containers: [{name: web, image: nginx}]}
status: {podIP: 10.0.0.5}
`

// TestLoadConfigMapSwappedMidRead: a ConfigMap update swaps its "..data"
// link between two of the files a load reads. The pod moved from b.yaml
// to a.yaml: read as old a.yaml plus new b.yaml, it was in neither, and
// the load unenrolled it until the next reload. A load reads one version.
func TestLoadConfigMapSwappedMidRead(t *testing.T) {
	dir := t.TempDir()
	ns := "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n"
	version := func(name, a, b string) {
		ts := filepath.Join(dir, name)
		if err := os.Mkdir(ts, 0o755); err != nil {
			t.Fatal(err)
		}
		writeFile(t, ts, "a.yaml", a)
		writeFile(t, ts, "b.yaml", b)
	}
	version("..2026_12_04_old", ns, configMapPod)
	version("..2026_12_04_new", ns+"---\n"+configMapPod, "apiVersion: v1\nkind: List\nitems: []\n")
	for link, target := range map[string]string{"..data": "..2026_12_04_old", "a.yaml": "..data/a.yaml", "b.yaml": "..data/b.yaml"} {
		if err := os.Symlink(target, filepath.Join(dir, link)); err != nil {
			t.Fatal(err)
		}
	}
	// The kubelet's swap: a new link renamed over "..data", done once,
	// right after the load read a.yaml.
	swapped := false
	afterRead = func(f string) {
		if swapped || filepath.Base(f) != "a.yaml" {
			return
		}
		swapped = true
		if err := os.Symlink("..2026_12_04_new", filepath.Join(dir, "..data_tmp")); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { afterRead = nil })
	snap, errs := Load(dir)
	if !swapped {
		t.Fatal("the swap did not happen")
	}
	if len(errs) != 0 || podNames(snap.Pods) != "web-1" {
		t.Fatalf("Load = pods %q, errors %v; want web-1 (the new version), no errors", podNames(snap.Pods), errs)
	}
}

// TestLoadConfigMapKeepsChanging: a version that changes during every read
// is not applied; the error names the "..data" link.
func TestLoadConfigMapKeepsChanging(t *testing.T) {
	dir := t.TempDir()
	for _, v := range []string{"..v1", "..v2"} {
		if err := os.Mkdir(filepath.Join(dir, v), 0o755); err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(dir, v), "a.yaml", namespaceDoc("a"))
	}
	for link, target := range map[string]string{"..data": "..v1", "a.yaml": "..data/a.yaml"} {
		if err := os.Symlink(target, filepath.Join(dir, link)); err != nil {
			t.Fatal(err)
		}
	}
	reads := 0
	afterRead = func(string) {
		reads++
		next := "..v1"
		if reads%2 == 1 {
			next = "..v2"
		}
		tmp := filepath.Join(dir, "..data_tmp")
		if err := os.Symlink(next, tmp); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { afterRead = nil })
	_, errs := Load(dir)
	want := filepath.Join(dir, "..data") + " changed while read, 3 times in a row"
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), want) {
		t.Fatalf("Load errors = %v, want one containing %q", errs, want)
	}
	if reads != maxVersionReads {
		t.Errorf("read %d times, want %d", reads, maxVersionReads)
	}
}
