package file

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"

	yamlv2 "go.yaml.in/yaml/v2"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	nodev1 "k8s.io/api/node/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/redirector-mesh/redirector/internal/smallfile"
	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
)

// DocError is a malformed document. It says where the document is, so the
// user can find it: the file, its 1-based index among the file's non-empty
// documents, the line it starts on and, inside a `kind: List` document, the
// 1-based item.
type DocError struct {
	File string
	Doc  int // 1-based, blank and comment-only documents not counted
	Line int // 1-based line of the document's first line
	Item int // 1-based item of a List document, or 0
	// Reason is source.ReasonParse (not YAML) or source.ReasonInvalid (YAML,
	// but not an object the source accepts).
	Reason string
	Err    error
}

func (e *DocError) Error() string { return e.File + ": " + e.where() + ": " + e.Err.Error() }

// where is the document's place in its file.
func (e *DocError) where() string {
	w := fmt.Sprintf("document %d (line %d)", e.Doc, e.Line)
	if e.Item > 0 {
		w += fmt.Sprintf(" item %d", e.Item)
	}
	return w
}

func (e *DocError) Unwrap() error { return e.Err }

// FileError is a problem with a whole file (or with PATH): it cannot be read,
// it looks cut short, or it lost all its documents.
type FileError struct {
	File   string
	Reason string // source.ReasonRead, ReasonTooLarge, ReasonTruncated, ReasonEmpty or ReasonInvalid
	Err    error
}

func (e *FileError) Error() string { return e.File + ": " + e.Err.Error() }

func (e *FileError) Unwrap() error { return e.Err }

// errorReason is the source.Reason* of an error of a load.
func errorReason(err error) string {
	var de *DocError
	var fe *FileError
	switch {
	case errors.As(err, &de):
		return de.Reason
	case errors.As(err, &fe):
		return fe.Reason
	}
	return source.ReasonRead
}

// Load reads the manifests at path, a YAML file or a directory of *.yaml and
// *.yml files, once. Malformed documents, unreadable files and files that do
// not end with a newline are returned as errors; everything that parsed is in
// the snapshot. Source.Run applies nothing of a load with errors; Load shows
// what would be left.
func Load(path string) (kubeobj.Objects, []error) {
	r, err := load(path, nil)
	if err != nil {
		return kubeobj.Objects{}, []error{err}
	}
	return r.snap, r.errs
}

// result is one load: the snapshot, the per-file and per-document errors, what
// each file held, and a digest of everything read, so a reload that reads the
// same bytes can be recognised and not delivered again.
type result struct {
	snap  kubeobj.Objects
	errs  []error
	files map[string]fileState
	sum   [sha256.Size]byte
	// decoded memoizes the documents of this load, for the next one.
	decoded docCache
	// badObjects are the pods and services translation would leave out.
	badObjects []badObject
	// known: the bytes read are those of a load the caller named, and were
	// not decoded (see loadOnce).
	known bool
}

// docCache maps the bytes of a document (their SHA-256) that decoded without
// any error to what it decoded to, so that a reload decodes only the
// documents that changed: at a few hundred pods, strictly decoding every
// document again is most of the time from a manifest write to the agent
// seeing it. It is a pure memo: the same bytes always decode to the same
// objects, so a hit gives exactly what decoding would, and every check that
// depends on more than the document itself (duplicates, end markers, empty
// files) runs on every load as before. It holds the documents of one load
// only (the last one), so it is bounded by the manifests' size.
type docCache map[[sha256.Size]byte]cachedDoc

// cachedDoc is one decoded document: how to add its objects again, and
// what its aliases added to it (see aliasBytes), charged again at every
// load that holds it, as a fresh decode would charge it.
type cachedDoc struct {
	replays    []replay
	aliasBytes int64
}

// replay adds one decoded object of a cached document to b again, as a deep
// copy: a delivered snapshot is read-only by contract, but the cache must
// not depend on every consumer keeping it.
type replay struct {
	item int // 1-based item of a List document, or 0
	add  func(b *builder, loc DocError) error
}

// fileState is what one load saw of a file, to judge the next load of it.
type fileState struct {
	docs int // non-blank documents
	// ended: the file's last document is closed by a "..." end marker line, so
	// the writer says where the file ends and a cut at a line boundary shows.
	ended bool
}

// docs is the number of documents of every file.
func (r result) docs() int {
	n := 0
	for _, f := range r.files {
		n += f.docs
	}
	return n
}

// load fails only when path itself cannot be read, or keeps changing while
// read; problems in single files or documents end up in result.errs.
//
// A directory mounted from a ConfigMap (or Secret, or projected volume)
// holds its manifests as links through "..data", which the kubelet swaps to
// a new version in one rename. A load that read some files before the swap
// and some after mixed two versions: a pod moved from one key to another
// was in neither, and would be unenrolled until the next reload. So the
// link is read before and after, and a load that saw it change is read
// again.
//
// prev, which may be nil, is the decoded documents of the last load.
func load(path string, prev docCache, known ...[sha256.Size]byte) (result, error) {
	for attempt := 1; ; attempt++ {
		before := dataVersion(path)
		r, err := loadOnce(path, prev, known)
		after := dataVersion(path)
		if before == after {
			return r, err
		}
		if attempt == maxVersionReads {
			return result{}, fmt.Errorf("read manifests: %s changed while read, %d times in a row (a ConfigMap updated that often?): not applied",
				filepath.Join(path, dataLink), attempt)
		}
		if r.decoded != nil {
			prev = r.decoded
		}
	}
}

// dataLink is the link through which a mounted ConfigMap's files point to
// its current version; maxVersionReads bounds how often a load whose
// version changed while read is read again.
const (
	dataLink        = "..data"
	maxVersionReads = 3
)

// dataVersion is the version a ConfigMap volume at path shows (the target
// of its "..data" link), or "" for a path that is no such directory.
func dataVersion(path string) string {
	v, err := os.Readlink(filepath.Join(path, dataLink))
	if err != nil {
		return ""
	}
	return v
}

// afterRead and afterDecode, when set (by tests), are called after each
// manifest file is read, and after its documents are decoded.
var afterRead, afterDecode func(file string)

// loadOnce reads path once (see load). It reads every file first, and
// decodes nothing when their bytes are one of the known loads' (the one
// applied, the one last refused): the result would be the same, and a
// refused load of many documents, read again at every resync and event,
// was decoded again each time (a 64 MiB manifest, half a minute of a core
// every 10 s). Such a result has only its sum, and known set.
func loadOnce(path string, prev docCache, known [][sha256.Size]byte) (result, error) {
	files, err := manifestFiles(path)
	if err != nil {
		return result{}, err
	}
	b := newBuilder()
	b.prev = prev
	h := sha256.New()
	type read struct {
		file string
		data []byte
		err  error
	}
	var reads []read
	for _, f := range files {
		data, err := readManifest(f, b.budget)
		if afterRead != nil {
			afterRead(f)
		}
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed since the directory was listed: an edit
		}
		reads = append(reads, read{f, data, err})
		if err != nil {
			fmt.Fprintf(h, "%s\x00error\x00%v\x00", f, err)
			if errorReason(err) == source.ReasonTooLarge {
				break
			}
			continue
		}
		b.budget -= int64(len(data))
		fmt.Fprintf(h, "%s\x00%d\x00", f, len(data))
		h.Write(data)
	}
	r := result{files: map[string]fileState{}}
	h.Sum(r.sum[:0])
	if slices.Contains(known, r.sum) {
		return result{sum: r.sum, known: true}, nil
	}
	for _, rd := range reads {
		if rd.err != nil {
			b.errs = append(b.errs, rd.err)
			continue
		}
		r.files[rd.file] = b.addStream(rd.file, rd.data)
		if afterDecode != nil {
			afterDecode(rd.file)
		}
	}
	r.snap, r.errs, r.decoded, r.badObjects = b.snapshot(), b.errs, b.next, b.badObjects
	return r, nil
}

// maxLoadBytes and maxLoadObjects bound what one load reads of all its
// files together (variables for tests). Decoded, and kept for the next
// load (docCache), manifests take some twenty times their size: 16 MiB of
// minimal Namespace documents held 300 MiB. 64 MiB is some 20k pods as
// `kubectl get -o yaml` prints them; 100k objects (documents and list
// items) keep small documents from costing more.
var (
	maxLoadBytes   int64 = 64 << 20
	maxLoadObjects       = 100_000
	// maxLoadFiles bounds the *.yaml and *.yml names of a directory: each
	// costs an open, a read and its entry in the load's state, documents or
	// not, at every reload.
	maxLoadFiles = 10_000
)

// readDirBatch is how many directory entries manifestFiles reads at once,
// so that listing a huge directory holds a batch, not the whole listing.
const readDirBatch = 1024

// readManifest reads the manifest file f, at most budget bytes of it. A
// name that holds no regular file (a directory, a fifo, a device, a
// symlink to one of those or to nothing) is an error, never skipped: a
// manifest replaced by one would otherwise read as removed, and its pods
// be unenrolled. The file is opened without blocking and checked after
// opening, so a fifo swapped in cannot stall the load. A name gone since
// the directory was listed is fs.ErrNotExist (a removal is an edit).
func readManifest(f string, budget int64) ([]byte, error) {
	fd, err := os.OpenFile(f, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if errors.Is(err, fs.ErrNotExist) {
		if fi, lerr := os.Lstat(f); lerr == nil && fi.Mode()&fs.ModeSymlink != 0 {
			return nil, &FileError{File: f, Reason: source.ReasonRead, Err: errors.New("not a regular file: a symlink to nothing")}
		}
		return nil, err
	}
	if err != nil {
		return nil, &FileError{File: f, Reason: source.ReasonRead, Err: fmt.Errorf("read manifest: %w", err)}
	}
	defer fd.Close()
	fi, err := fd.Stat()
	if err != nil {
		return nil, &FileError{File: f, Reason: source.ReasonRead, Err: fmt.Errorf("read manifest: %w", err)}
	}
	if !fi.Mode().IsRegular() {
		return nil, &FileError{File: f, Reason: source.ReasonRead, Err: fmt.Errorf("not a regular file: %s", smallfile.Kind(fi.Mode()))}
	}
	data, err := io.ReadAll(io.LimitReader(fd, budget+1))
	if err != nil {
		return nil, &FileError{File: f, Reason: source.ReasonRead, Err: fmt.Errorf("read manifest: %w", err)}
	}
	if int64(len(data)) > budget {
		return nil, &FileError{File: f, Reason: source.ReasonTooLarge,
			Err: fmt.Errorf("manifests over %d bytes in all (this file and those before it): not read", maxLoadBytes)}
	}
	return data, nil
}

// manifestFiles is path itself, or the *.yaml and *.yml names in the
// directory path, sorted. Hidden files are skipped: editors' lock and swap
// files and the "..data" links of a mounted ConfigMap start with a dot. A
// name that is not a regular file is listed too: reading it fails (see
// readManifest).
func manifestFiles(path string) ([]string, error) {
	info, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("read manifests: %w", err)
	}
	if !info.IsDir() {
		return []string{path}, nil
	}
	d, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read manifests: %w", err)
	}
	defer d.Close()
	var files []string
	for {
		names, err := d.Readdirnames(readDirBatch)
		for _, name := range names {
			ext := filepath.Ext(name)
			if strings.HasPrefix(name, ".") || (ext != ".yaml" && ext != ".yml") {
				continue
			}
			if len(files) == maxLoadFiles {
				return nil, &FileError{File: path, Reason: source.ReasonTooLarge,
					Err: fmt.Errorf("more than %d manifest files (*.yaml, *.yml): not read", maxLoadFiles)}
			}
			files = append(files, filepath.Join(path, name))
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read manifests: %w", err)
		}
	}
	sort.Strings(files)
	return files, nil
}

// document is one YAML document of a stream and the line it starts on.
type document struct {
	data  []byte
	index int // 1-based, among the stream's non-blank documents
	line  int
	err   error
}

// splitDocuments splits a YAML stream at "---" lines and calls each with
// every document that holds more than blanks and comments (each a slice of
// data), so document numbers match what a reader of the file counts; it
// returns how many there were. A "..." line ends a document: what follows
// it up to the next "---" must be blank or comments (the YAML decoder would
// ignore it silently). ended reports whether the stream's last non-blank,
// non-comment line is such an end marker. It holds one document at a time:
// 64 MiB of separators or newlines, split up front, held some 2 GiB.
func splitDocuments(data []byte, each func(document)) (n int, ended bool) {
	cur := document{line: 1}
	closed := false // cur follows a "..." line
	start, pos := 0, 0
	flush := func() {
		cur.data = data[start:pos]
		if !blank(cur.data) || cur.err != nil {
			n++
			cur.index = n
			each(cur)
		}
	}
	i := 0
	for line := range bytes.SplitAfterSeq(data, []byte("\n")) {
		i++
		if rest, ok := marker(line, "---"); ok {
			flush()
			cur, closed = document{line: i + 1}, false
			if len(rest) > 0 && rest[0] != '#' {
				cur.line = i
				cur.err = errors.New("content after a \"---\" separator on the same line is not supported")
			}
			pos += len(line)
			start = pos
			continue
		}
		if rest, ok := marker(line, "..."); ok && !closed {
			flush()
			cur, closed, ended = document{line: i + 1}, true, true
			if len(rest) > 0 && rest[0] != '#' {
				cur.line = i
				cur.err = errors.New("content after a \"...\" end marker on the same line is not supported")
			}
			pos += len(line)
			start = pos
			continue
		}
		pos += len(line)
		if blank(line) {
			continue
		}
		ended = false
		if closed && cur.err == nil {
			cur.line = i
			cur.err = errors.New("content after a \"...\" end marker needs a \"---\" separator first")
		}
	}
	flush()
	return n, ended
}

// marker reports whether line is a "---" separator or "..." end marker
// (dashes or dots, then nothing, or a blank and more) and returns what
// follows it on the line.
func marker(line []byte, m string) (rest []byte, ok bool) {
	after, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte(m))
	if !ok || (len(after) > 0 && after[0] != ' ' && after[0] != '\t') {
		return nil, false
	}
	return bytes.TrimSpace(after), true
}

func blank(doc []byte) bool {
	for line := range bytes.SplitSeq(doc, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) > 0 && line[0] != '#' {
			return false
		}
	}
	return true
}

// builder collects the objects of one load and remembers where each was
// defined, to report duplicates.
type builder struct {
	snap kubeobj.Objects
	// The policies, until snapshot translates their metadata.
	peerAuthn []peerAuthnDoc
	authz     []authzDoc
	seen      map[string]string
	errs      []error
	// badObjects are the pods and services translation would leave out
	// (see badObject).
	badObjects []badObject

	// objects counts the documents and list items of the load, full says
	// they went over maxLoadObjects (or the aliases over budget).
	objects int
	full    bool
	// budget is what is left of maxLoadBytes: the files' bytes and what
	// their aliases add when expanded (see aliasBytes).
	budget int64

	prev, next docCache
	// replays collects how to add again the objects of the document being
	// decoded; cacheable is false once one of them cannot be deep-copied.
	replays   []replay
	cacheable bool
}

func newBuilder() *builder {
	return &builder{seen: map[string]string{}, next: docCache{}, budget: maxLoadBytes}
}

// addStream adds the documents of one file and returns what it held. A file
// that does not end with a newline was cut short mid-line, or is being
// written: an error, whatever its documents parse to.
func (b *builder) addStream(file string, data []byte) fileState {
	if len(data) > 0 && data[len(data)-1] != '\n' {
		// First: the documents' own errors are likely its consequences.
		b.errs = append(b.errs, &FileError{File: file, Reason: source.ReasonTruncated,
			Err: errors.New("does not end with a newline: cut short, or still being written")})
	}
	if line, ok := danglingEnd(data); ok && data[len(data)-1] == '\n' {
		b.errs = append(b.errs, &FileError{File: file, Reason: source.ReasonTruncated,
			Err: fmt.Errorf("ends with %q, a key or list item whose value never comes: cut short at a line end? "+
				"(write an empty value explicitly: {}, [], \"\" or null)", line)})
	}
	n, ended := splitDocuments(data, func(doc document) {
		if !b.room(file, 1) {
			return
		}
		loc := DocError{File: file, Doc: doc.index, Line: doc.line, Reason: source.ReasonParse}
		if doc.err != nil {
			b.fail(loc, doc.err)
			return
		}
		b.addCached(loc, doc.data)
	})
	return fileState{docs: n, ended: ended}
}

// danglingEnd reports the last line of data holding more than blanks and
// comments when it opens a value that never comes: a mapping key with
// nothing after it ("labels:"), a list item's bare dash, or a block
// scalar's header ("note: |"). YAML reads such a value as null (or ""),
// so a file cut at a line end right after one still parses, the value
// gone: a namespace's labels (its pods unenrolled), a
// PeerAuthentication's mtls (STRICT dropped), a list's items. No writer
// ends a file so; kubectl writes an empty value as {} or [].
func danglingEnd(data []byte) (string, bool) {
	rest := data
	for len(rest) > 0 {
		i := bytes.LastIndexByte(bytes.TrimRight(rest, "\r\n"), '\n')
		line := rest[i+1:]
		rest = rest[:max(i, 0)]
		t := bytes.TrimSpace(line)
		if len(t) == 0 || t[0] == '#' {
			if i < 0 {
				break
			}
			continue
		}
		if _, ok := marker(line, "---"); ok {
			return "", false
		}
		if _, ok := marker(line, "..."); ok {
			return "", false
		}
		// A comment after the value; not looked for past a quote, where
		// " #" may be the value's own.
		if j := bytes.Index(t, []byte(" #")); j >= 0 && !bytes.ContainsAny(t[:j], `"'`) {
			t = bytes.TrimSpace(t[:j])
		}
		fields := strings.Fields(string(t))
		last := fields[len(fields)-1]
		switch {
		case bytes.HasSuffix(t, []byte(":")), last == "-":
			return string(bytes.TrimSpace(line)), true
		case len(fields) > 1 && blockScalarHeader(last):
			if prev := fields[len(fields)-2]; strings.HasSuffix(prev, ":") || prev == "-" {
				return string(bytes.TrimSpace(line)), true
			}
		}
		return "", false
	}
	return "", false
}

// blockScalarHeader reports whether s is a block scalar's header: | or >,
// then at most a chomping indicator and an indentation digit.
func blockScalarHeader(s string) bool {
	if s == "" || (s[0] != '|' && s[0] != '>') {
		return false
	}
	for _, c := range s[1:] {
		if c != '+' && c != '-' && (c < '1' || c > '9') {
			return false
		}
	}
	return len(s) <= 3
}

// addCached adds one document: from the cache if the last load decoded the
// same bytes without error, else by decoding it (and caching the result if
// it had no error).
func (b *builder) addCached(loc DocError, data []byte) {
	sum := sha256.Sum256(data)
	if c, ok := b.prev[sum]; ok {
		if !b.chargeAliases(loc, c.aliasBytes) {
			return
		}
		if len(c.replays) > 1 && !b.room(loc.File, len(c.replays)-1) {
			return
		}
		for _, r := range c.replays {
			loc.Item = r.item
			loc.Reason = source.ReasonInvalid
			b.fail(loc, r.add(b, loc))
		}
		b.next[sum] = c
		return
	}
	errs := len(b.errs)
	b.replays, b.cacheable = nil, true
	extra := b.addDocument(loc, data)
	if len(b.errs) == errs && b.cacheable {
		b.next[sum] = cachedDoc{replays: b.replays, aliasBytes: extra}
	}
	b.replays = nil
}

// chargeAliases charges n bytes that a document's aliases add (see
// aliasBytes) to the load's budget. The first time they do not fit, it
// records the error (reason too_large, at loc) and the load decodes
// nothing more.
func (b *builder) chargeAliases(loc DocError, n int64) bool {
	if n == 0 {
		return true
	}
	if b.full {
		return false
	}
	if n > b.budget {
		b.full = true
		loc.Reason = source.ReasonTooLarge
		b.fail(loc, fmt.Errorf("YAML aliases expand this document by %d bytes, past the bound of %d bytes on the manifests in all "+
			"(every file read, aliases expanded): not decoded", n, maxLoadBytes))
		return false
	}
	b.budget -= n
	return true
}

// aliasBytes is how many bytes the YAML aliases (*name) of a document
// add to it once expanded, as converting it to JSON expands them: an
// alias of a 1 MiB string, given 300 times in a 1 MiB document, made 300
// MiB of JSON, twice (for the kind, then the object), and some 2 GiB of
// memory. The YAML decoder bounds how many aliases a document expands,
// not how large they are. Only a document with both an anchor and an
// alias mark is parsed for it; the expanded value holds each aliased
// string once, so it is measured in the time it takes to decode.
func aliasBytes(data []byte) int64 {
	if !bytes.ContainsRune(data, '&') || !bytes.ContainsRune(data, '*') {
		return 0
	}
	var v any
	if err := yamlv2.Unmarshal(data, &v); err != nil {
		return 0 // not YAML: the conversion says so
	}
	return max(0, expandedSize(v)-int64(len(data)))
}

// expandedSize is about what v takes written out as JSON.
func expandedSize(v any) int64 {
	switch v := v.(type) {
	case string:
		return int64(len(v)) + 2
	case []any:
		n := int64(2)
		for _, e := range v {
			n += expandedSize(e) + 1
		}
		return n
	case map[any]any:
		n := int64(2)
		for k, e := range v {
			n += expandedSize(k) + expandedSize(e) + 2
		}
		return n
	}
	return 8 // a number, boolean or null
}

// addDocument decodes one document, reporting failures at loc, and
// returns what its aliases added to the load's budget.
func (b *builder) addDocument(loc DocError, data []byte) (aliases int64) {
	aliases = aliasBytes(data)
	if !b.chargeAliases(loc, aliases) {
		return aliases
	}
	j, err := yaml.YAMLToJSON(data)
	if err != nil {
		b.fail(loc, fmt.Errorf("error converting YAML to JSON: %w", err))
		return aliases
	}
	loc.Reason = source.ReasonInvalid // YAML, whatever follows
	var tm metav1.TypeMeta
	if err := json.Unmarshal(j, &tm); err != nil {
		b.fail(loc, fmt.Errorf("error unmarshaling JSON: %w", err))
		return aliases
	}
	if tm.APIVersion == "v1" && tm.Kind == "List" {
		b.addList(loc, data)
		return aliases
	}
	b.fail(loc, b.addObject(loc, tm, data))
	return aliases
}

// addList adds the items of a `kind: List` document, what `kubectl get -o
// yaml` prints, so a dump of a real cluster loads as it is. A list without
// an items field, or with items: null, is refused as cut short (reason
// "truncated"): a list cut at a line end after its header (apiVersion, kind,
// metadata) or right after "items:" parsed as a list of nothing, and
// applied an empty state, every pod unenrolled. kubectl and the API server
// always write the field; an empty state on purpose is items: [].
func (b *builder) addList(loc DocError, data []byte) {
	var list struct {
		metav1.TypeMeta `json:",inline"`
		metav1.ListMeta `json:"metadata,omitempty"`
		Items           *[]json.RawMessage `json:"items"`
	}
	if err := decodeYAML(data, &list); err != nil {
		b.fail(loc, err)
		return
	}
	if list.Items == nil {
		loc.Reason = source.ReasonTruncated
		b.fail(loc, errors.New("a List with no items field (or items: null): cut short after its header? "+
			"to apply an empty state write items: []"))
		return
	}
	items := *list.Items
	if len(items) > 1 && !b.room(loc.File, len(items)-1) {
		return
	}
	for i, item := range items {
		loc.Item = i + 1
		var tm metav1.TypeMeta
		err := json.Unmarshal(item, &tm)
		if err == nil {
			err = b.addObject(loc, tm, item)
		}
		b.fail(loc, err)
	}
}

// decodeYAML decodes a YAML (or JSON) object into v strictly, as the API
// server takes a manifest kubectl sends: a key given twice is an error, and
// field names match case-sensitively (kubeobj.DecodeStrict).
func decodeYAML(data []byte, v any) error {
	j, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return fmt.Errorf("error converting YAML to JSON: %w", err)
	}
	return kubeobj.DecodeStrict(j, v)
}

// room counts n more objects (documents or list items) of the load and
// reports whether they fit under maxLoadObjects. The first time they do
// not, it records the error (reason too_large, at file) and the load
// decodes nothing more.
func (b *builder) room(file string, n int) bool {
	if b.full {
		return false
	}
	b.objects += n
	if b.objects <= maxLoadObjects {
		return true
	}
	b.full = true
	b.errs = append(b.errs, &FileError{File: file, Reason: source.ReasonTooLarge,
		Err: fmt.Errorf("more than %d objects in all (this file and those before it): not decoded", maxLoadObjects)})
	return false
}

// fail records err, if any, as a skipped document at loc.
func (b *builder) fail(loc DocError, err error) {
	if err != nil {
		loc.Err = err
		b.errs = append(b.errs, &loc)
	}
}

// addObject decodes data, strictly, as the type that tm names.
func (b *builder) addObject(loc DocError, tm metav1.TypeMeta, data []byte) error {
	switch {
	case tm.APIVersion == "" || tm.Kind == "":
		return errors.New("apiVersion and kind are required")
	case tm.APIVersion == "v1" && tm.Kind == "Namespace":
		return add(b, loc, tm.Kind, data, func(b *builder) *[]corev1.Namespace { return &b.snap.Namespaces }, false)
	case tm.APIVersion == "v1" && tm.Kind == "Node":
		return add(b, loc, tm.Kind, data, func(b *builder) *[]corev1.Node { return &b.snap.Nodes }, false)
	case tm.APIVersion == "v1" && tm.Kind == "Pod":
		return add(b, loc, tm.Kind, data, func(b *builder) *[]corev1.Pod { return &b.snap.Pods }, true)
	case tm.APIVersion == "v1" && tm.Kind == "Service":
		return add(b, loc, tm.Kind, data, func(b *builder) *[]corev1.Service { return &b.snap.Services }, true)
	case tm.APIVersion == "discovery.k8s.io/v1" && tm.Kind == "EndpointSlice":
		return add(b, loc, tm.Kind, data, func(b *builder) *[]discoveryv1.EndpointSlice { return &b.snap.EndpointSlices }, true)
	case tm.APIVersion == "node.k8s.io/v1" && tm.Kind == "RuntimeClass":
		return add(b, loc, tm.Kind, data, func(b *builder) *[]nodev1.RuntimeClass { return &b.snap.RuntimeClasses }, false)
	case istioSecurity(tm.APIVersion) && tm.Kind == "PeerAuthentication":
		return add(b, loc, tm.Kind, data, func(b *builder) *[]peerAuthnDoc { return &b.peerAuthn }, true)
	case istioSecurity(tm.APIVersion) && tm.Kind == "AuthorizationPolicy":
		return add(b, loc, tm.Kind, data, func(b *builder) *[]authzDoc { return &b.authz }, true)
	}
	return fmt.Errorf("unsupported kind %s in apiVersion %s", tm.Kind, tm.APIVersion)
}

func istioSecurity(apiVersion string) bool {
	return apiVersion == "security.istio.io/v1" || apiVersion == "security.istio.io/v1beta1"
}

// add decodes data into a new T and appends it to the list that list
// selects. Namespaced objects without a namespace land in "default", as with
// kubectl apply. It records how to add the object again from the cache.
func add[T any, PT interface {
	*T
	metav1.Object
}](b *builder, loc DocError, kind string, data []byte, list func(*builder) *[]T, namespaced bool) error {
	var obj T
	if err := decodeYAML(data, &obj); err != nil {
		return err
	}
	meta := PT(&obj)
	if meta.GetName() == "" {
		return errors.New("metadata.name is required")
	}
	switch {
	case !namespaced:
		meta.SetNamespace("")
	case meta.GetNamespace() == "":
		meta.SetNamespace(metav1.NamespaceDefault)
	}
	if err := validateObject(kind, meta, namespaced); err != nil {
		return err
	}
	if dc, ok := any(&obj).(interface{ DeepCopy() *T }); ok {
		kept := any(dc.DeepCopy()).(interface{ DeepCopy() *T })
		b.replays = append(b.replays, replay{item: loc.Item, add: func(b *builder, loc DocError) error {
			return put[T, PT](b, loc, kind, list, *kept.DeepCopy())
		}})
	} else {
		b.cacheable = false
	}
	return put[T, PT](b, loc, kind, list, obj)
}

// put appends obj, decoded at loc, to the list that list selects, unless an
// object of the same kind and name came before it.
func put[T any, PT interface {
	*T
	metav1.Object
}](b *builder, loc DocError, kind string, list func(*builder) *[]T, obj T) error {
	meta := PT(&obj)
	key := objectKey(kind, meta)
	if first, ok := b.seen[key]; ok {
		return fmt.Errorf("duplicate %s %s, first defined in %s", kind, objectName(meta), first)
	}
	// Pods are keyed by uid past the source (Workload.Key), which
	// Kubernetes makes unique: two pods with one would be taken for one.
	if uid := meta.GetUID(); kind == "Pod" && uid != "" {
		uidKey := "Pod uid " + string(uid)
		if first, ok := b.seen[uidKey]; ok {
			return fmt.Errorf("pod %s: uid %q is already %s", objectName(meta), uid, first)
		}
		b.seen[uidKey] = "pod " + objectName(meta) + "'s, defined in " + loc.File + " " + loc.where()
	}
	b.seen[key] = loc.File + " " + loc.where()
	var err error
	switch o := any(&obj).(type) {
	case *corev1.Pod:
		_, err = selection.PodAddrsOfOneHost(o)
	case *corev1.Service:
		_, err = kubeobj.Service(o)
	}
	if err != nil {
		loc.Err = err
		b.badObjects = append(b.badObjects, badObject{key: key, loc: loc})
	}
	l := list(b)
	*l = append(*l, obj)
	return nil
}

// objectKey names an object of kind: "Pod shop/web".
func objectKey(kind string, o metav1.Object) string {
	return kind + " " + o.GetNamespace() + "/" + o.GetName()
}

func objectName(o metav1.Object) string {
	if o.GetNamespace() == "" {
		return o.GetName()
	}
	return o.GetNamespace() + "/" + o.GetName()
}

// snapshot sorts every list by namespace and name, so equal inputs give
// equal snapshots whatever the file order.
func (b *builder) snapshot() kubeobj.Objects {
	s := b.snap
	sortObjects(s.Namespaces)
	sortObjects(s.Pods)
	sortObjects(s.Services)
	sortObjects(s.EndpointSlices)
	sortObjects(s.RuntimeClasses)
	sortObjects(b.peerAuthn)
	sortObjects(b.authz)
	s.PeerAuthentications = make([]policy.PeerAuthentication, len(b.peerAuthn))
	for i, d := range b.peerAuthn {
		s.PeerAuthentications[i] = policy.PeerAuthentication{TypeMeta: policyType(d.TypeMeta), Meta: policyMeta(d.ObjectMeta), Spec: d.Spec}
	}
	s.AuthorizationPolicies = make([]policy.AuthorizationPolicy, len(b.authz))
	for i, d := range b.authz {
		s.AuthorizationPolicies[i] = policy.AuthorizationPolicy{TypeMeta: policyType(d.TypeMeta), Meta: policyMeta(d.ObjectMeta), Spec: d.Spec}
	}
	return s
}

// badObject is a pod whose address does not parse (a
// *selection.PodAddrError in loc.Err) or a service whose cluster IP does
// not, where it is defined. Translation leaves such an object out: a pod
// would be unenrolled, and connections to a service's VIP would pass
// through in plaintext. The load is refused if the object was in the last
// applied one (Source.lost).
type badObject struct {
	key string // kind namespace/name
	loc DocError
}

// peerAuthnDoc and authzDoc are policies as a manifest holds them: their
// metadata is Kubernetes', decoded (strictly) as such, and translated into
// the policy package's own at the end.
type peerAuthnDoc struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              policy.PeerAuthenticationSpec `json:"spec"`
}

type authzDoc struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              policy.AuthorizationPolicySpec `json:"spec"`
}

func policyType(t metav1.TypeMeta) policy.TypeMeta {
	return policy.TypeMeta{APIVersion: t.APIVersion, Kind: t.Kind}
}

// policyMeta is the part of a policy's metadata the policy package keeps.
func policyMeta(m metav1.ObjectMeta) policy.Meta {
	return policy.Meta{Name: m.Name, Namespace: m.Namespace, UID: string(m.UID), ResourceVersion: m.ResourceVersion,
		Labels: m.Labels, Annotations: m.Annotations, CreationTimestamp: m.CreationTimestamp.Time}
}

func sortObjects[T any, PT interface {
	*T
	metav1.Object
}](list []T) {
	sort.Slice(list, func(i, j int) bool {
		a, b := PT(&list[i]), PT(&list[j])
		return cmp.Or(cmp.Compare(a.GetNamespace(), b.GetNamespace()), cmp.Compare(a.GetName(), b.GetName())) < 0
	})
}
