package file

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/source"
)

func namespaceDoc(names ...string) string {
	var b strings.Builder
	for _, n := range names {
		b.WriteString("---\napiVersion: v1\nkind: Namespace\nmetadata: {name: " + n + "}\n")
	}
	return b.String()
}

func nsNames(s source.Snapshot) string {
	var names []string
	for _, ns := range s.Namespaces {
		names = append(names, ns.Name)
	}
	return strings.Join(names, " ")
}

// running is a Source under test: its updates arrive on a channel and
// done reports Run's result.
type running struct {
	src     *Source
	updates chan source.Snapshot
	done    chan error
	cancel  context.CancelFunc
}

func start(t *testing.T, path string, log *slog.Logger) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{src: New(path, log), updates: make(chan source.Snapshot, 16), done: make(chan error, 1), cancel: cancel}
	go func() { r.done <- r.src.Run(ctx, func(s source.Snapshot) { r.updates <- s }) }()
	t.Cleanup(func() {
		cancel()
		<-r.done
	})
	return r
}

// waitFor waits up to a second for an update whose namespaces are want.
func (r *running) waitFor(t *testing.T, want string) {
	t.Helper()
	r.waitWithin(t, time.Second, want)
}

func (r *running) waitWithin(t *testing.T, d time.Duration, want string) {
	t.Helper()
	deadline := time.After(d)
	var last string
	for {
		select {
		case s := <-r.updates:
			if last = nsNames(s); last == want {
				return
			}
		case err := <-r.done:
			t.Fatalf("Run returned %v while waiting for %q", err, want)
		case <-deadline:
			t.Fatalf("no update with namespaces %q within %v (last %q)", want, d, last)
		}
	}
}

// noUpdate fails if an update arrives within d.
func (r *running) noUpdate(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case s := <-r.updates:
		t.Fatalf("unexpected update with namespaces %q", nsNames(s))
	case <-time.After(d):
	}
}

func TestRunRewrite(t *testing.T) {
	dir := t.TempDir()
	path := writeFile(t, dir, "cluster.yaml", namespaceDoc("a"))
	r := start(t, path, nil)
	r.waitFor(t, "a")

	t.Run("write tmp and rename", func(t *testing.T) {
		tmp := writeFile(t, dir, ".cluster.yaml.tmp", namespaceDoc("a", "b"))
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
		r.waitFor(t, "a b")
	})
	t.Run("plain overwrite", func(t *testing.T) {
		writeFile(t, dir, "cluster.yaml", namespaceDoc("c"))
		r.waitFor(t, "c")
	})
	t.Run("unrelated file or same bytes make no update", func(t *testing.T) {
		writeFile(t, dir, "other.txt", "x")
		writeFile(t, dir, "cluster.yaml", namespaceDoc("c"))
		r.noUpdate(t, 300*time.Millisecond)
	})
	t.Run("removed file keeps the last snapshot", func(t *testing.T) {
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		r.noUpdate(t, 300*time.Millisecond)
		errs := r.src.Errors()
		if len(errs) != 1 || !errors.Is(errs[0], os.ErrNotExist) {
			t.Fatalf("Errors() = %v, want the missing file", errs)
		}
		writeFile(t, dir, "cluster.yaml", namespaceDoc("d"))
		r.waitFor(t, "d")
		if errs := r.src.Errors(); len(errs) != 0 {
			t.Fatalf("Errors() = %v after the file came back", errs)
		}
	})
}

func TestRunDirectory(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.yaml", namespaceDoc("a"))
	r := start(t, dir, nil)
	r.waitFor(t, "a")

	writeFile(t, dir, "b.yml", namespaceDoc("b"))
	r.waitFor(t, "a b")
	if err := os.Remove(filepath.Join(dir, "a.yaml")); err != nil {
		t.Fatal(err)
	}
	r.waitFor(t, "b")
}

func TestRunDirectoryRecreated(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "manifests")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, dir, "a.yaml", namespaceDoc("a"))
	r := start(t, dir, nil)
	r.waitFor(t, "a")

	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	r.noUpdate(t, 300*time.Millisecond)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, dir, "b.yaml", namespaceDoc("b"))
	r.waitWithin(t, rewatchGap+time.Second, "b")
}

// syncBuffer is a log sink the Run goroutine writes while the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestRunReportsMalformedDocuments(t *testing.T) {
	var logs syncBuffer
	log := slog.New(slog.NewJSONHandler(&logs, nil))
	path := writeFile(t, t.TempDir(), "c.yaml", namespaceDoc("a")+"---\nkind: Nope\napiVersion: v1\nmetadata: {name: x}\n"+namespaceDoc("c"))
	r := start(t, path, log)
	r.waitFor(t, "a c")

	errs := r.src.Errors()
	var de *DocError
	if len(errs) != 1 || !errors.As(errs[0], &de) || de.File != path || de.Doc != 2 {
		t.Fatalf("Errors() = %v, want document 2 of %s", errs, path)
	}
	out := logs.String()
	for _, want := range []string{`"msg":"skipping malformed document"`, `"file":"` + path + `"`, `"doc":2`, `unsupported kind Nope`} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %s:\n%s", want, out)
		}
	}
}

func TestRunStopsOnCancel(t *testing.T) {
	r := start(t, writeFile(t, t.TempDir(), "c.yaml", namespaceDoc("a")), nil)
	r.waitFor(t, "a")
	r.cancel()
	select {
	case err := <-r.done:
		if err != nil {
			t.Fatalf("Run() = %v, want nil after cancel", err)
		}
		r.done <- err // for the cleanup
	case <-time.After(time.Second):
		t.Fatal("Run did not return within 1s of cancel")
	}
}

func TestRunMissingPath(t *testing.T) {
	err := New(filepath.Join(t.TempDir(), "nope.yaml"), nil).Run(context.Background(), func(source.Snapshot) {
		t.Error("update called")
	})
	if !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Run() = %v, want not-exist", err)
	}
}
