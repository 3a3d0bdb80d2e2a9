package file

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/source"
)

// TestLoadTooManyFiles: what a load holds is bounded by bytes and objects,
// but a file costs its open, its read and its entry in the load's state
// whether it holds a document or not, and the directory's listing was read
// whole: a directory of a million empty manifests was a million opens at
// every reload. Past maxLoadFiles manifest names the load is refused, as
// too large, naming PATH; the last good snapshot stays.
func TestLoadTooManyFiles(t *testing.T) {
	defer func(n int) { maxLoadFiles = n }(maxLoadFiles)
	maxLoadFiles = 50
	dir := t.TempDir()
	writeFile(t, dir, "a.yaml", namespaceDoc("a"))
	m := source.NewMetrics(nil)
	r := startWith(t, New(dir, nil).WithMetrics(m))
	r.waitFor(t, "a")
	for i := range 60 {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("e%03d.yaml", i)), []byte("# empty\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	errs := r.refused(t)
	if len(errs) != 1 || errorReason(errs[0]) != source.ReasonTooLarge || !strings.Contains(errs[0].Error(), dir) {
		t.Fatalf("errors = %v, want one too_large naming %s", errs, dir)
	}
	// A load while the files were written, of 50 names or fewer, was
	// applied (the same namespaces); none comes after the refusal.
	r.drain(t, "a")
	r.noUpdate(t, 300*time.Millisecond)
	wantCount(t, m, source.ReasonTooLarge, 1)
	// Other names do not count.
	for i := range 60 {
		if err := os.Rename(filepath.Join(dir, fmt.Sprintf("e%03d.yaml", i)), filepath.Join(dir, fmt.Sprintf("e%03d.txt", i))); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, dir, "a.yaml", namespaceDoc("a", "b"))
	r.waitWithin(t, 3*time.Second, "a b")
}
