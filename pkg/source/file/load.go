package file

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/redirector-mesh/redirector/pkg/source"
)

// DocError is a malformed document that was skipped. It says where the
// document is, so the user can find it: the file, its 1-based index among
// the file's non-empty documents, the line it starts on and, inside a
// `kind: List` document, the 1-based item.
type DocError struct {
	File string
	Doc  int // 1-based, blank and comment-only documents not counted
	Line int // 1-based line of the document's first line
	Item int // 1-based item of a List document, or 0
	Err  error
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

// Load reads the manifests at path, a YAML file or a directory of *.yaml and
// *.yml files, once. Malformed documents and unreadable files are left out
// and returned as errors; everything else is in the snapshot.
func Load(path string) (source.Snapshot, []error) {
	r, err := load(path)
	if err != nil {
		return source.Snapshot{}, []error{err}
	}
	return r.snap, r.errs
}

// result is one load: the snapshot, the per-file and per-document errors, and
// a digest of everything read, so a reload that reads the same bytes can be
// recognised and not delivered again.
type result struct {
	snap source.Snapshot
	errs []error
	sum  [sha256.Size]byte
}

// load fails only when path itself cannot be read; problems in single files
// or documents end up in result.errs.
func load(path string) (result, error) {
	files, err := manifestFiles(path)
	if err != nil {
		return result{}, err
	}
	b := newBuilder()
	h := sha256.New()
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			b.errs = append(b.errs, fmt.Errorf("read manifest: %w", err))
			continue
		}
		fmt.Fprintf(h, "%s\x00%d\x00", f, len(data))
		h.Write(data)
		b.addStream(f, data)
	}
	var r result
	r.snap, r.errs = b.snapshot(), b.errs
	h.Sum(r.sum[:0])
	return r, nil
}

// manifestFiles is path itself, or the *.yaml and *.yml regular files in the
// directory path, sorted. Hidden files are skipped: editors' lock and swap
// files and the "..data" links of a mounted ConfigMap start with a dot.
func manifestFiles(path string) ([]string, error) {
	info, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("read manifests: %w", err)
	}
	if !info.IsDir() {
		return []string{path}, nil
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return nil, fmt.Errorf("read manifests: %w", err)
	}
	var files []string
	for _, e := range entries {
		name := e.Name()
		ext := filepath.Ext(name)
		if strings.HasPrefix(name, ".") || (ext != ".yaml" && ext != ".yml") {
			continue
		}
		full := filepath.Join(path, name)
		if fi, err := os.Stat(full); err != nil || !fi.Mode().IsRegular() {
			continue // a dangling link or a directory named *.yaml
		}
		files = append(files, full)
	}
	return files, nil
}

// document is one YAML document of a stream and the line it starts on.
type document struct {
	data []byte
	line int
	err  error
}

// splitDocuments splits a YAML stream at "---" lines and drops documents
// that hold only blanks and comments, so document numbers match what a
// reader of the file counts.
func splitDocuments(data []byte) []document {
	var docs []document
	cur := document{line: 1}
	flush := func() {
		if !blank(cur.data) || cur.err != nil {
			docs = append(docs, cur)
		}
	}
	for i, line := range bytes.SplitAfter(data, []byte("\n")) {
		rest, ok := separator(line)
		if !ok {
			cur.data = append(cur.data, line...)
			continue
		}
		flush()
		cur = document{line: i + 2}
		if len(rest) > 0 && rest[0] != '#' {
			cur.line = i + 1
			cur.err = errors.New("content after a \"---\" separator on the same line is not supported")
		}
	}
	flush()
	return docs
}

// separator reports whether line is a "---" document separator and returns
// what follows the dashes on it.
func separator(line []byte) (rest []byte, ok bool) {
	after, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("---"))
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
	snap source.Snapshot
	seen map[string]string
	errs []error
}

func newBuilder() *builder { return &builder{seen: map[string]string{}} }

func (b *builder) addStream(file string, data []byte) {
	for i, doc := range splitDocuments(data) {
		loc := DocError{File: file, Doc: i + 1, Line: doc.line}
		if doc.err != nil {
			b.fail(loc, doc.err)
			continue
		}
		b.addDocument(loc, doc.data)
	}
}

// addDocument decodes one document, reporting failures at loc.
func (b *builder) addDocument(loc DocError, data []byte) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(data, &tm); err != nil {
		b.fail(loc, err)
		return
	}
	if tm.APIVersion == "v1" && tm.Kind == "List" {
		b.addList(loc, data)
		return
	}
	b.fail(loc, b.addObject(loc, tm, data))
}

// addList adds the items of a `kind: List` document, what `kubectl get -o
// yaml` prints, so a dump of a real cluster loads as it is.
func (b *builder) addList(loc DocError, data []byte) {
	var list struct {
		metav1.TypeMeta `json:",inline"`
		metav1.ListMeta `json:"metadata,omitempty"`
		Items           []json.RawMessage `json:"items"`
	}
	if err := yaml.UnmarshalStrict(data, &list); err != nil {
		b.fail(loc, err)
		return
	}
	for i, item := range list.Items {
		loc.Item = i + 1
		var tm metav1.TypeMeta
		err := json.Unmarshal(item, &tm)
		if err == nil {
			err = b.addObject(loc, tm, item)
		}
		b.fail(loc, err)
	}
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
	s := &b.snap
	switch {
	case tm.APIVersion == "" || tm.Kind == "":
		return errors.New("apiVersion and kind are required")
	case tm.APIVersion == "v1" && tm.Kind == "Namespace":
		return add(b, loc, tm.Kind, data, &s.Namespaces, false)
	case tm.APIVersion == "v1" && tm.Kind == "Pod":
		return add(b, loc, tm.Kind, data, &s.Pods, true)
	case tm.APIVersion == "v1" && tm.Kind == "Service":
		return add(b, loc, tm.Kind, data, &s.Services, true)
	case tm.APIVersion == "discovery.k8s.io/v1" && tm.Kind == "EndpointSlice":
		return add(b, loc, tm.Kind, data, &s.EndpointSlices, true)
	case tm.APIVersion == "node.k8s.io/v1" && tm.Kind == "RuntimeClass":
		return add(b, loc, tm.Kind, data, &s.RuntimeClasses, false)
	case istioSecurity(tm.APIVersion) && tm.Kind == "PeerAuthentication":
		return add(b, loc, tm.Kind, data, &s.PeerAuthentications, true)
	case istioSecurity(tm.APIVersion) && tm.Kind == "AuthorizationPolicy":
		return add(b, loc, tm.Kind, data, &s.AuthorizationPolicies, true)
	}
	return fmt.Errorf("unsupported kind %s in apiVersion %s", tm.Kind, tm.APIVersion)
}

func istioSecurity(apiVersion string) bool {
	return apiVersion == "security.istio.io/v1" || apiVersion == "security.istio.io/v1beta1"
}

// add decodes data into a new T and appends it to list. Namespaced objects
// without a namespace land in "default", as with kubectl apply.
func add[T any, PT interface {
	*T
	metav1.Object
}](b *builder, loc DocError, kind string, data []byte, list *[]T, namespaced bool) error {
	var obj T
	if err := yaml.UnmarshalStrict(data, &obj); err != nil {
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
	key := kind + " " + meta.GetNamespace() + "/" + meta.GetName()
	if first, ok := b.seen[key]; ok {
		return fmt.Errorf("duplicate %s %s, first defined in %s", kind, objectName(meta), first)
	}
	b.seen[key] = loc.File + " " + loc.where()
	*list = append(*list, obj)
	return nil
}

func objectName(o metav1.Object) string {
	if o.GetNamespace() == "" {
		return o.GetName()
	}
	return o.GetNamespace() + "/" + o.GetName()
}

// snapshot sorts every list by namespace and name, so equal inputs give
// equal snapshots whatever the file order.
func (b *builder) snapshot() source.Snapshot {
	s := b.snap
	sortObjects(s.Namespaces)
	sortObjects(s.Pods)
	sortObjects(s.Services)
	sortObjects(s.EndpointSlices)
	sortObjects(s.RuntimeClasses)
	sortObjects(s.PeerAuthentications)
	sortObjects(s.AuthorizationPolicies)
	return s
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
