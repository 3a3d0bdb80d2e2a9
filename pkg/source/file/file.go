// Package file is a source.Source backed by YAML manifests on disk, for
// standalone use, demos and tests: `--source file:PATH`, where PATH is a YAML
// file or a directory of *.yaml / *.yml files. Each file is a multi-document
// stream of v1 Namespace, Pod and Service, discovery.k8s.io/v1 EndpointSlice
// and security.istio.io/v1 (or v1beta1) PeerAuthentication and
// AuthorizationPolicy objects, or `kind: List` documents of them, as
// `kubectl get -o yaml` prints.
//
// Documents are decoded strictly: one with a syntax error, an unknown kind
// or field, or no name is logged with its file and index and skipped, and
// the rest still applies.
package file

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/redirector-mesh/redirector/pkg/source"
)

// Timings of the watch loop. A write (or an editor's write, fsync and
// rename) fires several events within a few milliseconds; the debounce makes
// one reload out of them, 10 ms after the last, so that a new pod is seen
// quickly. Events that never pause (a busy directory) still reload every
// half second, and reloads come at most every 50 ms.
//
// A file written in place in pieces with pauses of more than the quiet
// period can be read half-written; replace files atomically (write a new file
// and rename it over the old one), as ConfigMap volumes and editors do.
var debounce = source.Debounce{Quiet: 10 * time.Millisecond, MaxWait: 500 * time.Millisecond, MinGap: 50 * time.Millisecond}

const rewatchGap = time.Second

// Source watches PATH and delivers a full snapshot at start and after every
// change of the bytes it reads.
type Source struct {
	path string
	log  *slog.Logger

	mu   sync.Mutex
	errs []error
}

var _ source.Source = (*Source)(nil)

// New returns a Source for path; log may be nil.
func New(path string, log *slog.Logger) *Source {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Source{path: filepath.Clean(path), log: log.With("source", "file:"+path)}
}

// Errors returns the problems of the last load: skipped documents
// (*DocError), unreadable files, or a missing PATH (then the previous
// snapshot is still the current one).
func (s *Source) Errors() []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]error(nil), s.errs...)
}

// Run loads PATH, calls update, and then reloads after every change until
// ctx is done, when it returns nil. It fails at start if PATH does not exist
// (most likely a typo). The directory holding the file (or PATH itself, for
// a directory) is watched, not the file, so editors that write a new file
// and rename it over the old one, and ConfigMap volume updates, are seen. If
// PATH disappears later the last good snapshot stays and the loss is logged.
func (s *Source) Run(ctx context.Context, update func(source.Snapshot)) error {
	info, err := os.Stat(s.path)
	if err != nil {
		return fmt.Errorf("file source: %w", err)
	}
	dir := s.path
	if !info.IsDir() {
		dir = filepath.Dir(s.path)
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("file source: watch %s: %w", dir, err)
	}
	defer w.Close()
	if err := w.Add(dir); err != nil {
		return fmt.Errorf("file source: watch %s: %w", dir, err)
	}

	// Watch first, then load: a change in between is seen twice, never lost.
	var last delivered
	s.reload(update, &last)

	reload := source.NewDebouncer(debounce)
	defer reload.Stop()
	var rewatch <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return errors.New("file source: watcher closed")
			}
			if filepath.Clean(ev.Name) == dir && ev.Has(fsnotify.Remove|fsnotify.Rename) {
				// The watched directory itself is gone; its watch with it.
				s.log.Error("watched directory removed; keeping the last snapshot until it returns", "dir", dir)
				_ = w.Remove(dir)
				rewatch = time.After(rewatchGap)
				continue
			}
			reload.Changed()
		case err, ok := <-w.Errors:
			if !ok {
				return errors.New("file source: watcher closed")
			}
			s.log.Warn("watch error", "err", err)
			reload.Changed()
		case <-rewatch:
			if err := w.Add(dir); err != nil {
				rewatch = time.After(rewatchGap)
				continue
			}
			rewatch = nil
			s.log.Info("watched directory is back", "dir", dir)
			s.reload(update, &last)
		case <-reload.C():
			if reload.Due() {
				s.reload(update, &last)
			}
		}
	}
}

// delivered identifies the bytes behind the last snapshot given to update.
type delivered struct {
	sum [sha256.Size]byte
	ok  bool
}

// reload loads PATH and calls update unless the bytes read are those of the
// last delivery. A missing PATH keeps the previous snapshot.
func (s *Source) reload(update func(source.Snapshot), last *delivered) {
	r, err := load(s.path)
	if err != nil {
		s.setErrors([]error{err})
		s.log.Error("cannot read manifests; keeping the last snapshot", "err", err)
		return
	}
	s.setErrors(r.errs)
	if last.ok && last.sum == r.sum {
		return
	}
	*last = delivered{sum: r.sum, ok: true}
	for _, err := range r.errs {
		var de *DocError
		if errors.As(err, &de) {
			s.log.Warn("skipping malformed document", "file", de.File, "doc", de.Doc, "line", de.Line, "item", de.Item, "err", de.Err)
		} else {
			s.log.Warn("skipping manifest file", "err", err)
		}
	}
	s.log.Info("loaded manifests", "namespaces", len(r.snap.Namespaces), "pods", len(r.snap.Pods),
		"services", len(r.snap.Services), "endpointslices", len(r.snap.EndpointSlices),
		"peerauthentications", len(r.snap.PeerAuthentications),
		"authorizationpolicies", len(r.snap.AuthorizationPolicies), "errors", len(r.errs))
	update(r.snap)
}

func (s *Source) setErrors(errs []error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.errs = errs
}
