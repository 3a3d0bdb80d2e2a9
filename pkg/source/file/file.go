// Package file is a source.Source backed by YAML manifests on disk, for
// standalone use, demos and tests: `--source file:PATH`, where PATH is a YAML
// file or a directory of *.yaml / *.yml files. Each file is a multi-document
// stream of v1 Namespace, Node, Pod and Service, discovery.k8s.io/v1
// EndpointSlice, node.k8s.io/v1 RuntimeClass and security.istio.io/v1 (or
// v1beta1) PeerAuthentication and
// AuthorizationPolicy objects, or `kind: List` documents of them, as
// `kubectl get -o yaml` prints.
//
// # Never fail open
//
// A snapshot is all or nothing: a load with any error is not applied, the
// last good snapshot stays (and with it every pod's enrollment and every
// policy), the error is logged with its file, document and line, counted in
// redirector_source_errors_total{source="file",reason}, and readiness stays
// as it was. A load that would drop what the file says only because the file
// is damaged or half-written must never unenroll pods or drop a
// PeerAuthentication. A load is refused when:
//
//   - PATH or a manifest file cannot be read, or a manifest name (PATH, or
//     a *.yaml / *.yml name in the directory) holds no regular file: a
//     directory, fifo, device or a symlink to one or to nothing (reason
//     "read"). Such a name is never skipped: a manifest replaced by one
//     must not read as removed;
//   - PATH was a file when the agent started and is a directory now, or
//     the other way round (reason "read");
//   - PATH is a mounted ConfigMap (its files link through "..data", which
//     the kubelet swaps to a new version in one rename) whose version
//     changed while read, three reads in a row (reason "read"). A load
//     that saw it change once is read again: files of two versions are
//     never mixed (a pod moved from one key to another would be in
//     neither, and unenrolled);
//   - the manifests are over 64 MiB (YAML aliases counted expanded) or
//     100k objects (documents and list items) in all, or a directory has
//     over 10k *.yaml and *.yml names (reason "too_large"): what a load
//     holds is bounded;
//   - a document is not YAML (reason "parse");
//   - a document is not an object this source takes: an unknown kind (a
//     misspelt AuthorizationPolicy must not vanish quietly), an unknown or
//     mistyped field (names match case-sensitively, as the API server
//     matches them: "hostnetwork" is not hostNetwork; values are typed as
//     kubectl sends them, so an unquoted number or yes/no/on/off where a
//     string belongs is an error, not "1" or "true"), a key given twice,
//     no name, a duplicate object or pod uid, or what the API server
//     would refuse in an object it is asked to create: a name, namespace,
//     label or annotation it does not admit, a serviceAccountName that is
//     no name, a pod uid that is not a plain token (it could read as
//     another pod's namespace/name key), a policy selector whose labels no
//     pod can carry (reason "invalid"). Taken as written, a namespace
//     labelled "ambient " was not ambient and its pods were silently left
//     unenrolled;
//   - a pod of the last applied load has an address that no longer parses
//     (status.podIP or a status.podIPs entry such as "10.0.0.300",
//     "10.0.0.05", "fe80::1%eth0" or ""): translation would leave the pod
//     out and so unenroll it (reason "invalid"; the error names the pod
//     and the field). A pod malformed from its first load on is only left
//     out, with the error logged: it has no enrollment to lose. The same
//     for a service whose spec.clusterIP or spec.clusterIPs entry stops
//     parsing: left out, connections to its cluster IP would pass through
//     in plaintext;
//   - a namespace of the last applied load is gone while pods in it remain
//     (reason "invalid"): Kubernetes never removes a namespace before its
//     pods, and the pods its label enrolled would be unenrolled (its
//     manifest removed from a directory, say). Remove the pods with it;
//   - a file does not end with a newline: it was cut mid-line or is still
//     being written (reason "truncated"). Every cut that is not at a line
//     end is caught by this, even when what is left still parses;
//   - a file that ended with a "..." line (YAML's end-of-document marker)
//     in the last applied load no longer does (reason "truncated"): a
//     writer that ends its files with "..." makes a cut at any line, even
//     between two documents, visible. Once used, the marker stays required
//     for that file while the agent runs;
//   - a file's last line (blanks and comments aside) opens a value that
//     never comes: a mapping key with nothing after it ("labels:"), a list
//     item's bare dash or a block scalar's header ("note: |") (reason
//     "truncated"). YAML reads such a value as null, so a file cut at a line
//     end right after one parsed with the value gone: a namespace without
//     its labels (its pods unenrolled), a PeerAuthentication without its
//     mtls (STRICT dropped). Write an empty value explicitly ({}, [], "");
//     a block scalar whose last line ends with a colon is refused too;
//   - a `kind: List` document has no items field, or items: null (reason
//     "truncated"): a list cut at a line end after its header or right after
//     "items:" parsed as a list of nothing, and unenrolled every pod;
//   - PATH holds no document at all (an empty or comment-only file, a
//     directory without manifests), or a file that had documents in the
//     last applied load has none now (reason "empty"). This holds for the
//     first load too: a restarted agent cannot see what the previous one
//     enrolled. To apply an empty state on purpose, write an empty list:
//     `apiVersion: v1`, `kind: List`, `items: []`.
//
// A pod whose address turns malformed while the agent is down is first
// seen malformed by the next agent, and left out.
//
// What cannot be told from an edit: a file cut exactly at a line end, without
// the end marker, whose rest still parses (a document cut after a complete
// scalar field, or whole documents gone). Replace files atomically (write a new file
// and rename it over the old one, as ConfigMap volumes and editors do), or
// end them with "...". Removing a file from a watched directory is an edit,
// not a truncation.
//
// A reload decodes only the documents whose bytes changed since the last
// load (see docCache); every check above still runs on the whole load. A
// reload that reads the bytes of the load applied, or of the one last
// refused, decodes nothing: its verdict would be the same.
package file

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
)

// Timings of the watch loop. A write (or an editor's write, fsync and
// rename) fires several events within a few milliseconds; the debounce makes
// one reload out of them, 10 ms after the last, so that a new pod is seen
// quickly. Events that never pause (a busy directory) still reload every
// half second, and reloads come at most every 50 ms.
//
// A file written in place in pieces with pauses of more than the quiet
// period can be read half-written; such a read is refused where it shows (see
// the package documentation), and the next write event reloads it. Replace
// files atomically (write a new file and rename it over the old one), as
// ConfigMap volumes and editors do.
var debounce = source.Debounce{Quiet: 10 * time.Millisecond, MaxWait: 500 * time.Millisecond, MinGap: 50 * time.Millisecond}

const rewatchGap = time.Second

// resyncPeriod is how often PATH is read again with no event (a variable
// for tests). A load that reads the bytes of the last one delivers
// nothing, and decodes nothing again (docCache): its cost is reading and
// hashing the manifests.
var resyncPeriod = 10 * time.Second

// maxLinkHops bounds how many symlinks watchLinks follows, as the kernel
// bounds a lookup (40): a loop is not followed for ever.
const maxLinkHops = 40

// watchLinks adds to w the directories that hold the symlinks PATH leads
// through, and the directory it ends in, that are not watched yet (links,
// which it updates, holds those it added). inotify watches what a name
// points to when it is added, not the name: with only PATH's directory
// watched, a write to a linked file in its own directory, or a link to a
// manifest or directory swapped in another directory (a deployment
// tool's `current`), was never seen, and the agent kept enforcing the old
// manifests without a word. Directories no longer on the way stay watched
// (an event there costs one reload, which reads the same bytes); what
// cannot be watched is logged, and the periodic resync reads it anyway.
func (s *Source) watchLinks(w *fsnotify.Watcher, dir string, links map[string]bool) {
	var want []string
	p := s.path
	for hop := 0; hop <= maxLinkHops; hop++ {
		want = append(want, filepath.Dir(p))
		fi, err := os.Lstat(p)
		if err != nil || fi.Mode()&os.ModeSymlink == 0 {
			if err == nil && fi.IsDir() {
				want = append(want, p)
			}
			break
		}
		target, err := os.Readlink(p)
		if err != nil {
			break
		}
		if !filepath.IsAbs(target) {
			target = filepath.Join(filepath.Dir(p), target)
		}
		p = filepath.Clean(target)
	}
	for _, d := range want {
		if d == dir || links[d] {
			continue
		}
		if err := w.Add(d); err != nil {
			s.log.Warn("cannot watch a directory a symlink of PATH leads through; it is read again every "+resyncPeriod.String(), "dir", d, "err", err)
			continue
		}
		links[d] = true
	}
}

// Source watches PATH and delivers a full snapshot at start and after every
// change of the bytes it reads, unless the load has errors (see the package
// documentation).
type Source struct {
	path    string
	log     *slog.Logger
	metrics *source.Metrics

	mu   sync.Mutex
	errs []error
}

var _ kubeobj.ObjectSource = (*Source)(nil)

// New returns a Source for path; log may be nil.
func New(path string, log *slog.Logger) *Source {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Source{path: filepath.Clean(path), log: log.With("source", "file:"+path)}
}

// WithMetrics makes s count the loads it refuses in m; it returns s.
func (s *Source) WithMetrics(m *source.Metrics) *Source {
	s.metrics = m
	return s
}

// Errors returns the problems of the last load: malformed documents
// (*DocError), files that are unreadable, cut short or emptied
// (*FileError), or a missing PATH. While there are any, the last good
// snapshot is still the current one.
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
// When PATH is a symlink (or a chain of them), the directories of its links
// and the one it ends in are watched too, followed again at every reload;
// and PATH is read again every resyncPeriod whatever the events, for what
// no watch reports (a link above PATH's directory, a filesystem without
// inotify).
func (s *Source) Run(ctx context.Context, update func(kubeobj.Objects)) error {
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
	links := map[string]bool{}
	s.watchLinks(w, dir, links)

	// Watch first, then load: a change in between is seen twice, never lost.
	last := state{dir: info.IsDir()}
	s.reload(update, &last)

	reload := source.NewDebouncer(debounce)
	defer reload.Stop()
	resync := time.NewTicker(resyncPeriod)
	defer resync.Stop()
	var rewatch <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-resync.C:
			// A change no event told of: a link above PATH swapped, a
			// filesystem without inotify (NFS, FUSE), a lost event.
			s.watchLinks(w, dir, links)
			s.reload(update, &last)
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
				s.watchLinks(w, dir, links)
				s.reload(update, &last)
			}
		}
	}
}

// state is what the watch loop remembers between loads.
type state struct {
	// dir: PATH was a directory at start. A PATH of the other kind later is
	// refused: its manifests are not the ones configured.
	dir     bool
	applied bool                 // a snapshot was delivered
	sum     [sha256.Size]byte    // the bytes behind it
	files   map[string]fileState // what its files held
	// objects are the pods and services behind it (by kind namespace/name)
	// that translation took in.
	objects map[string]bool
	// namespaces are the namespaces behind it.
	namespaces map[string]bool
	// refused identifies the last refused load, so that the same broken
	// bytes, read again, are logged and counted once.
	refused [sha256.Size]byte
	// decoded is the documents of the last load (applied or not), decoded.
	decoded docCache
}

// reload loads PATH and calls update, unless the load has errors or reads
// the bytes of the last delivery.
func (s *Source) reload(update func(kubeobj.Objects), last *state) {
	if fi, err := os.Stat(s.path); err == nil && fi.IsDir() != last.dir {
		was, is := "a file", "a directory"
		if last.dir {
			was, is = is, was
		}
		err := fmt.Errorf("is %s now, and was %s when the agent started", is, was)
		s.refuse(last, sha256.Sum256([]byte(err.Error())), []error{&FileError{File: s.path, Reason: source.ReasonRead, Err: err}})
		return
	}
	var applied [sha256.Size]byte
	if last.applied {
		applied = last.sum
	}
	r, err := load(s.path, last.decoded, applied, last.refused)
	if r.known {
		if r.sum == last.refused {
			return // refused and reported already, errors kept
		}
		s.setErrors(nil)
		last.refused = [sha256.Size]byte{}
		return // what is applied
	}
	if err != nil {
		var fe *FileError
		if !errors.As(err, &fe) {
			err = &FileError{File: s.path, Reason: source.ReasonRead, Err: err}
		}
		s.refuse(last, sha256.Sum256([]byte(err.Error())), []error{err})
		return
	}
	last.decoded = r.decoded
	if errs := append(r.errs, s.lost(r, last)...); len(errs) > 0 {
		s.refuse(last, r.sum, errs)
		return
	}
	s.setErrors(nil)
	last.refused = [sha256.Size]byte{}
	if last.applied && last.sum == r.sum {
		return
	}
	last.applied, last.sum, last.files = true, r.sum, r.files
	last.objects = make(map[string]bool, len(r.snap.Pods)+len(r.snap.Services))
	for i := range r.snap.Pods {
		last.objects[objectKey("Pod", &r.snap.Pods[i])] = true
	}
	for i := range r.snap.Services {
		last.objects[objectKey("Service", &r.snap.Services[i])] = true
	}
	for _, o := range r.badObjects {
		delete(last.objects, o.key)
	}
	last.namespaces = make(map[string]bool, len(r.snap.Namespaces))
	for i := range r.snap.Namespaces {
		last.namespaces[r.snap.Namespaces[i].Name] = true
	}
	s.log.Info("loaded manifests", "namespaces", len(r.snap.Namespaces), "pods", len(r.snap.Pods),
		"services", len(r.snap.Services), "endpointslices", len(r.snap.EndpointSlices),
		"peerauthentications", len(r.snap.PeerAuthentications),
		"authorizationpolicies", len(r.snap.AuthorizationPolicies))
	update(r.snap)
}

// lost reports what r lost against the last applied load: all its documents,
// a file's documents, a file's end marker, a pod's address or a service's
// cluster IP.
func (s *Source) lost(r result, last *state) []error {
	var errs []error
	for _, o := range r.badObjects {
		if last.objects[o.key] {
			e := o.loc
			e.Reason = source.ReasonInvalid
			e.Err = fmt.Errorf("%w: not applied, since %s", o.loc.Err, leftOut(o.key))
			errs = append(errs, &e)
		}
	}
	errs = append(errs, s.namespacesLost(r, last)...)
	if r.docs() == 0 {
		err := errors.New("no documents: not applied, since an emptied file is more likely cut short than meant; " +
			"to apply an empty state write an empty list (apiVersion: v1, kind: List, items: [])")
		errs = append(errs, &FileError{File: s.path, Reason: source.ReasonEmpty, Err: err})
	}
	for _, name := range sortedKeys(r.files) {
		was, ok := last.files[name]
		now := r.files[name]
		switch {
		case !ok:
		case was.docs > 0 && now.docs == 0 && len(r.files) > 1:
			errs = append(errs, &FileError{File: name, Reason: source.ReasonEmpty,
				Err: fmt.Errorf("has no documents, where the last applied version had %d: cut short?", was.docs)})
		case was.ended && !now.ended:
			errs = append(errs, &FileError{File: name, Reason: source.ReasonTruncated,
				Err: errors.New(`no longer ends with a "..." end marker, as the last applied version did: cut short, or still being written`)})
		}
	}
	return errs
}

// namespacesLost reports each namespace of the last applied load that r
// no longer has while it still has pods in it. Kubernetes never removes a
// namespace before its pods, and the pods its label enrolled would be
// unenrolled: a manifest of namespaces removed from a directory, or cut
// short, more likely than meant.
func (s *Source) namespacesLost(r result, last *state) []error {
	now := make(map[string]bool, len(r.snap.Namespaces))
	for i := range r.snap.Namespaces {
		now[r.snap.Namespaces[i].Name] = true
	}
	pods := map[string][]string{} // by lost namespace
	var lost []string
	for i := range r.snap.Pods {
		p := &r.snap.Pods[i]
		if !last.namespaces[p.Namespace] || now[p.Namespace] {
			continue
		}
		if pods[p.Namespace] == nil {
			lost = append(lost, p.Namespace)
		}
		pods[p.Namespace] = append(pods[p.Namespace], objectName(p))
	}
	var errs []error
	for _, ns := range lost {
		which := pods[ns][0]
		if n := len(pods[ns]); n > 1 {
			which += fmt.Sprintf(" and %d more", n-1)
		}
		errs = append(errs, &FileError{File: s.path, Reason: source.ReasonInvalid,
			Err: fmt.Errorf("namespace %s is gone while its pods remain (%s): not applied, since Kubernetes never removes a namespace before its pods "+
				"and the pods its label enrolled would be unenrolled; remove the pods with it", ns, which)})
	}
	return errs
}

// refuse records, logs and counts the errors of a load that is not applied.
func (s *Source) refuse(last *state, sum [sha256.Size]byte, errs []error) {
	s.setErrors(errs)
	if last.refused == sum {
		return // the same bytes as the last refusal: reported already
	}
	last.refused = sum
	for _, err := range errs {
		reason := errorReason(err)
		s.metrics.Error("file", reason)
		attrs := []any{"reason", reason}
		var de *DocError
		var fe *FileError
		switch {
		case errors.As(err, &de):
			attrs = append(attrs, "file", de.File, "doc", de.Doc, "line", de.Line, "item", de.Item, "err", de.Err)
		case errors.As(err, &fe):
			attrs = append(attrs, "file", fe.File, "err", fe.Err)
		default:
			attrs = append(attrs, "err", err)
		}
		s.log.Error("manifests not applied; keeping the last good snapshot", attrs...)
	}
}

// leftOut says what leaving the object of key out of the model would do.
func leftOut(key string) string {
	if strings.HasPrefix(key, "Service ") {
		return "the service would be left out and connections to its cluster IP pass through in plaintext"
	}
	return "the pod would be left out and so unenrolled"
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func (s *Source) setErrors(errs []error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.errs = errs
}
