package file

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/promtest"
	"github.com/redirector-mesh/redirector/internal/syncbuf"
	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubeobj"
)

func namespaceDoc(names ...string) string {
	var b strings.Builder
	for _, n := range names {
		b.WriteString("---\napiVersion: v1\nkind: Namespace\nmetadata: {name: " + n + "}\n")
	}
	return b.String()
}

func nsNames(s kubeobj.Objects) string {
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
	updates chan kubeobj.Objects
	done    chan error
	cancel  context.CancelFunc
}

func start(t *testing.T, path string, log *slog.Logger) *running {
	t.Helper()
	return startWith(t, New(path, log))
}

func startWith(t *testing.T, src *Source) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{src: src, updates: make(chan kubeobj.Objects, 16), done: make(chan error, 1), cancel: cancel}
	go func() { r.done <- r.src.Run(ctx, func(s kubeobj.Objects) { r.updates <- s }) }()
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

// drain takes the updates already delivered, failing unless their
// namespaces are want.
func (r *running) drain(t *testing.T, want string) {
	t.Helper()
	for {
		select {
		case s := <-r.updates:
			if got := nsNames(s); got != want {
				t.Fatalf("update with namespaces %q, want %q", got, want)
			}
		default:
			return
		}
	}
}

// refused waits until the source reports an error and returns them.
func (r *running) refused(t *testing.T) []error {
	t.Helper()
	waitfor.Until(t, "the source to report an error", func() bool { return len(r.src.Errors()) > 0 })
	return r.src.Errors()
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
		errs := r.refused(t)
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

// TestRunRefusesMalformed: a load with a malformed document is not applied,
// not even its good documents; the error names the file and document, and
// is counted once however often the same bytes are read.
func TestRunRefusesMalformed(t *testing.T) {
	var logs syncbuf.Buffer
	log := slog.New(slog.NewJSONHandler(&logs, nil))
	path := writeFile(t, t.TempDir(), "c.yaml", namespaceDoc("a"))
	m := source.NewMetrics(nil)
	r := startWith(t, New(path, log).WithMetrics(m))
	r.waitFor(t, "a")

	writeFile(t, filepath.Dir(path), "c.yaml", namespaceDoc("b")+"---\nkind: Nope\napiVersion: v1\nmetadata: {name: x}\n"+namespaceDoc("c"))
	r.noUpdate(t, 300*time.Millisecond)
	errs := r.refused(t)
	var de *DocError
	if len(errs) != 1 || !errors.As(errs[0], &de) || de.File != path || de.Doc != 2 || de.Reason != source.ReasonInvalid {
		t.Fatalf("Errors() = %v, want document 2 of %s, invalid", errs, path)
	}
	waitfor.Until(t, "the refusal's log line", func() bool { return strings.Contains(logs.String(), "manifests not applied") })
	out := logs.String()
	for _, want := range []string{`"msg":"manifests not applied; keeping the last good snapshot"`, `"file":"` + path + `"`, `"doc":2`, `"reason":"invalid"`, `unsupported kind Nope`} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %s:\n%s", want, out)
		}
	}
	// The same bytes again (an unrelated event in the directory): one count.
	writeFile(t, filepath.Dir(path), "other.txt", "x")
	r.noUpdate(t, 200*time.Millisecond)
	wantCount(t, m, source.ReasonInvalid, 1)

	writeFile(t, filepath.Dir(path), "c.yaml", namespaceDoc("b", "c"))
	r.waitFor(t, "b c")
	if errs := r.src.Errors(); len(errs) != 0 {
		t.Fatalf("Errors() = %v after the fix", errs)
	}
}

// TestRunKnownBytesNotDecoded: a reload that reads the bytes of the load
// last refused, or of the one applied, decodes nothing: the verdict would be
// the same. A refused load was decoded again at every resync and event, so
// a broken manifest of many documents left in place cost a core for good.
// The refusal stays reported, and counted once.
func TestRunKnownBytesNotDecoded(t *testing.T) {
	defer func(p time.Duration) { resyncPeriod = p }(resyncPeriod)
	resyncPeriod = 20 * time.Millisecond
	var decodes atomic.Int64
	afterDecode = func(string) { decodes.Add(1) }
	t.Cleanup(func() { afterDecode = nil })
	dir := t.TempDir()
	path := writeFile(t, dir, "c.yaml", namespaceDoc("a"))
	m := source.NewMetrics(nil)
	r := startWith(t, New(path, nil).WithMetrics(m))
	r.waitFor(t, "a")
	quiet := func(what string) {
		t.Helper()
		n := decodes.Load()
		time.Sleep(10 * resyncPeriod)
		if got := decodes.Load() - n; got != 0 {
			t.Errorf("%s: decoded %d times again in %v of resyncs", what, got, 10*resyncPeriod)
		}
	}
	quiet("applied")

	// Renamed into place: a write in place can be seen half done, refused
	// once for that, then read whole.
	tmp := writeFile(t, dir, ".c.yaml.tmp", namespaceDoc("a")+"---\napiVersion: v1\nkind: Namespace\nmetadata: {name: b, labels: {app: \"web \"}}\n")
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	r.refused(t)
	quiet("refused")
	if errs := r.src.Errors(); len(errs) != 1 || errorReason(errs[0]) != source.ReasonInvalid {
		t.Errorf("errors %v, want the refusal kept", errs)
	}
	wantCount(t, m, source.ReasonInvalid, 1)

	writeFile(t, dir, "c.yaml", namespaceDoc("a", "b"))
	r.waitFor(t, "a b")
	if errs := r.src.Errors(); len(errs) != 0 {
		t.Errorf("errors %v after the fix", errs)
	}
}

func wantCount(t *testing.T, m *source.Metrics, reason string, want float64) {
	t.Helper()
	key := `redirector_source_errors_total{reason="` + reason + `",source="file"}`
	waitfor.Until(t, key, func() bool { return promtest.Scrape(t, m)[key] >= want })
	if got := promtest.Scrape(t, m)[key]; got != want {
		t.Errorf("%s = %v, want %v", key, got, want)
	}
}

// block is namespaceDoc in block style: a cut inside a name still parses.
func block(names ...string) string {
	var b strings.Builder
	for _, n := range names {
		b.WriteString("---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: " + n + "\n")
	}
	return b.String()
}

// TestRunNeverFailsOpen damages a good file in every way a truncation, a
// half-done write or a bad edit can, and checks each time that nothing is
// delivered (the last good snapshot stays), that Errors says why, and that
// the reason is counted; then a good file is picked up again.
func TestRunNeverFailsOpen(t *testing.T) {
	const ended = "...\n"
	good := namespaceDoc("a", "b", "c")
	policy := "---\napiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: strict, namespace: a}\nspec:\n  mtls: {mode: STRICT}\n"
	half := good[:len(good)/2]
	if strings.HasSuffix(half, "\n") {
		half = half[:len(half)-1]
	}
	tests := []struct {
		name       string
		good, bad  string
		reason     string
		wantErrSub string
	}{
		{"zero bytes", good, "", source.ReasonEmpty, "no documents"},
		{"blanks and comments only", good, "\n# all gone\n---\n\n", source.ReasonEmpty, "no documents"},
		{"cut in half mid-line", good, half, source.ReasonTruncated, "does not end with a newline"},
		{"cut before the last newline", good, strings.TrimSuffix(good, "\n"), source.ReasonTruncated, "does not end with a newline"},
		{"cut mid-line, the rest parses", block("a", "b", "c"), block("a", "b", "c")[:len(block("a", "b", "c"))-2], source.ReasonTruncated, "does not end with a newline"},
		{"YAML syntax error", good, good + "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: [d\n", source.ReasonParse, "converting YAML to JSON"},
		{"unknown kind", good, good + "---\napiVersion: security.istio.io/v1\nkind: AuthorisationPolicy\nmetadata: {name: x}\n", source.ReasonInvalid, "unsupported kind"},
		{"content after an end marker", good, good + ended + "apiVersion: v1\n", source.ReasonParse, `after a "..." end marker`},
		{"end marker lost at a document boundary", good + policy + ended, good, source.ReasonTruncated, "no longer ends with a \"...\" end marker"},
		{"end marker lost at a line end mid-document", good + policy + ended, good + policy[:strings.Index(policy, "spec:")], source.ReasonTruncated, "end marker"},
		{"end marker lost, zero bytes", good + ended, "", source.ReasonEmpty, "no documents"},
		// A list cut after its header, at a line end: what is left parses as
		// a list of nothing. An empty state on purpose writes items: [].
		{"list cut before its items", good, "apiVersion: v1\nkind: List\n", source.ReasonTruncated, "no items field"},
		// Cut at a line end right after a key whose value was to follow on
		// the next lines: what is left parses, the key null. A namespace
		// without its labels unenrolls its pods, a PeerAuthentication
		// without its mode drops STRICT.
		{"cut after a key opening a block", good, good + "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: d\n  labels:\n", source.ReasonTruncated, "ends with"},
		{"cut after a key opening a block, commented", good, good + "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: d\n  labels: # ambient\n\n# trailing comment\n", source.ReasonTruncated, "ends with"},
		{"cut after mtls:", good, good + "---\napiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: strict, namespace: a}\nspec:\n  mtls:\n", source.ReasonTruncated, "ends with"},
		{"cut after a list item's dash", good, "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Namespace\n  metadata: {name: a}\n-\n", source.ReasonTruncated, "ends with"},
		{"cut after a block scalar's header", good, good + "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: d\n  annotations:\n    note: |\n", source.ReasonTruncated, "ends with"},
		{"list of items: null", good, "apiVersion: v1\nkind: List\nitems: null\n", source.ReasonTruncated, "no items field"},
		{"list cut before its items, with metadata", good, "apiVersion: v1\nkind: List\nmetadata:\n  resourceVersion: \"\"\n", source.ReasonTruncated, "no items field"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			path := writeFile(t, dir, "c.yaml", tt.good)
			m := source.NewMetrics(nil)
			r := startWith(t, New(path, nil).WithMetrics(m))
			r.waitFor(t, "a b c")

			writeFile(t, dir, "c.yaml", tt.bad)
			r.noUpdate(t, 300*time.Millisecond)
			errs := r.refused(t)
			if len(errs) == 0 || !strings.Contains(errors.Join(errs...).Error(), tt.wantErrSub) {
				t.Fatalf("Errors() = %v, want one with %q", errs, tt.wantErrSub)
			}
			if errorReason(errs[0]) != tt.reason {
				t.Errorf("reason of %v = %s, want %s", errs[0], errorReason(errs[0]), tt.reason)
			}
			wantCount(t, m, tt.reason, 1)

			fixed := namespaceDoc("a", "d")
			if strings.HasSuffix(tt.good, ended) {
				fixed += ended // the marker stays required
			}
			writeFile(t, dir, "c.yaml", fixed)
			r.waitFor(t, "a d")
		})
	}
}

// TestRunDirectoryNeverFailsOpen: in a directory, an emptied file or a
// directory left without manifests is refused; removing one file of several
// is an edit.
func TestRunDirectoryNeverFailsOpen(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.yaml", namespaceDoc("a"))
	writeFile(t, dir, "b.yaml", namespaceDoc("b"))
	m := source.NewMetrics(nil)
	r := startWith(t, New(dir, nil).WithMetrics(m))
	r.waitFor(t, "a b")

	writeFile(t, dir, "b.yaml", "")
	r.noUpdate(t, 300*time.Millisecond)
	wantCount(t, m, source.ReasonEmpty, 1)

	if err := os.Remove(filepath.Join(dir, "b.yaml")); err != nil {
		t.Fatal(err)
	}
	r.waitFor(t, "a")
	if err := os.Remove(filepath.Join(dir, "a.yaml")); err != nil {
		t.Fatal(err)
	}
	r.noUpdate(t, 300*time.Millisecond)
	wantCount(t, m, source.ReasonEmpty, 2)

	// An empty state on purpose: an empty list.
	writeFile(t, dir, "a.yaml", "apiVersion: v1\nkind: List\nitems: []\n")
	r.waitFor(t, "")
}

// TestRunFirstLoadRefused: a broken or empty file at start delivers nothing
// (a restarted agent must not unenroll what the last one enrolled); the
// first good version is delivered.
func TestRunFirstLoadRefused(t *testing.T) {
	for name, content := range map[string]string{"empty": "", "cut": "apiVersion: v1\nkind: Namespace\nmetadata: {name: a"} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			writeFile(t, dir, "c.yaml", content)
			r := start(t, filepath.Join(dir, "c.yaml"), nil)
			r.noUpdate(t, 300*time.Millisecond)
			r.refused(t)
			writeFile(t, dir, "c.yaml", namespaceDoc("a"))
			r.waitFor(t, "a")
		})
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
	err := New(filepath.Join(t.TempDir(), "nope.yaml"), nil).Run(context.Background(), func(kubeobj.Objects) {
		t.Error("update called")
	})
	if !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Run() = %v, want not-exist", err)
	}
}

// TestRunRefusesMalformedPodAddress: an enrolled pod whose address is edited
// into one that does not parse, or is of no one host, is not delivered without it (translation
// would leave the pod out, and the agent unenroll it): the load is refused,
// also when another document changes meanwhile (the pod's document then
// comes from the decode cache), the error names the file, document, pod and
// field, and the last good snapshot, with the pod at its old address,
// stays. A pod malformed from its first load on has no enrollment to lose:
// it is delivered, for translation to leave out with the error.
func TestRunRefusesMalformedPodAddress(t *testing.T) {
	pod := func(status string) string {
		return "---\napiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: a, uid: uid-web}\n" +
			"spec: {nodeName: node1, containers: [{name: c, image: c}]}\nstatus: " + status + "\n"
	}
	ns := "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: a, labels: {istio.io/dataplane-mode: ambient}}\n"
	good := ns + pod(`{phase: Running, podIP: 10.0.0.5, podIPs: [{ip: 10.0.0.5}]}`)
	for _, tt := range []struct{ name, status, field, value string }{
		{"out of range", `{phase: Running, podIP: 10.0.0.300}`, "status.podIP", "10.0.0.300"},
		{"leading zero", `{phase: Running, podIP: 10.0.0.05, podIPs: [{ip: 10.0.0.05}]}`, "status.podIPs[0].ip", "10.0.0.05"},
		{"zone", `{phase: Running, podIP: 10.0.0.5, podIPs: [{ip: 10.0.0.5}, {ip: "fe80::1%eth0"}]}`, "status.podIPs[1].ip", "fe80::1%eth0"},
		{"empty entry", `{phase: Running, podIP: 10.0.0.5, podIPs: [{ip: ""}]}`, "status.podIPs[0].ip", ""},
		{"garbage entry", `{phase: Running, podIP: 10.0.0.5, podIPs: [{ip: 10.0.0.5}, {ip: garbage}]}`, "status.podIPs[1].ip", "garbage"},
		// Parseable, but of no one host: translation leaves the pod out
		// as it does a malformed one.
		{"link-local", `{phase: Running, podIP: 169.254.169.254}`, "status.podIP", "169.254.169.254"},
		{"loopback", `{phase: Running, podIP: 10.0.0.5, podIPs: [{ip: 10.0.0.5}, {ip: "::1"}]}`, "status.podIPs[1].ip", "::1"},
		{"IPv4-mapped unspecified", `{phase: Running, podIP: "::ffff:0.0.0.0"}`, "status.podIP", "::ffff:0.0.0.0"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r, m, dir := refuseEdit(t, good, ns+pod(tt.status), `pod a/web: `+tt.field+`: bad IP "`+tt.value+`"`)
			writeFile(t, dir, "c.yaml", strings.Replace(ns, "ambient}", "ambient, team: x}", 1)+pod(tt.status))
			r.noUpdate(t, 300*time.Millisecond)
			wantCount(t, m, source.ReasonInvalid, 2)

			writeFile(t, dir, "c.yaml", ns+pod(`{phase: Running, podIP: 10.0.0.6}`))
			r.waitFor(t, "a")
			if errs := r.src.Errors(); len(errs) != 0 {
				t.Fatalf("Errors() = %v after the fix", errs)
			}
			newPod := strings.ReplaceAll(pod(tt.status), "web", "new")
			writeFile(t, dir, "c.yaml", ns+pod(`{phase: Running, podIP: 10.0.0.6}`)+newPod)
			r.waitFor(t, "a")
			if errs := r.src.Errors(); len(errs) != 0 {
				t.Fatalf("Errors() = %v for a pod malformed from the start", errs)
			}
		})
	}
	// The same at start.
	dir := t.TempDir()
	path := writeFile(t, dir, "c.yaml", ns+pod(`{phase: Running, podIP: 10.0.0.300}`))
	r := start(t, path, nil)
	r.waitFor(t, "a")
}

// refuseEdit starts a source on the manifest good (namespace "a" first),
// rewrites it to bad and checks that the load is refused with its second
// document invalid, the error containing want, and counted once. It
// returns the running source, its metrics and the manifest's directory.
func refuseEdit(t *testing.T, good, bad, want string) (*running, *source.Metrics, string) {
	t.Helper()
	dir := t.TempDir()
	path := writeFile(t, dir, "c.yaml", good)
	m := source.NewMetrics(nil)
	r := startWith(t, New(path, nil).WithMetrics(m))
	r.waitFor(t, "a")

	writeFile(t, dir, "c.yaml", bad)
	r.noUpdate(t, 300*time.Millisecond)
	errs := r.refused(t)
	var de *DocError
	if len(errs) != 1 || !errors.As(errs[0], &de) || de.Doc != 2 || de.Reason != source.ReasonInvalid {
		t.Fatalf("Errors() = %v, want document 2 invalid", errs)
	}
	if !strings.Contains(errs[0].Error(), want) {
		t.Errorf("error %q does not name the object and field: want %q", errs[0], want)
	}
	wantCount(t, m, source.ReasonInvalid, 1)
	return r, m, dir
}

// TestRunRefusesMalformedServiceIP: a Service of the last applied load whose
// cluster IP stops parsing, or becomes an address of no one host, would be left out of the model, and connections
// to its VIP would leave meshed pods in plaintext (an unknown address is
// passed through): the load is refused, naming the service and the field.
func TestRunRefusesMalformedServiceIP(t *testing.T) {
	ns := "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: a, labels: {istio.io/dataplane-mode: ambient}}\n"
	svc := func(spec string) string {
		return "---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: a}\nspec: " + spec + "\n"
	}
	good := ns + svc(`{clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10], ports: [{port: 80}]}`)
	for _, tt := range []struct{ name, spec, field, value string }{
		{"out of range", `{clusterIP: 10.96.0.300, ports: [{port: 80}]}`, "spec.clusterIP", "10.96.0.300"},
		{"a CIDR", `{clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10/32], ports: [{port: 80}]}`, "spec.clusterIPs[0]", "10.96.0.10/32"},
		{"zone", `{clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, "fe80::1%eth0"], ports: [{port: 80}]}`, "spec.clusterIPs[1]", "fe80::1%eth0"},
		// Parseable, but of no one host: as a VIP, the metadata server's
		// address would send meshed pods' connections to it to web's
		// endpoints.
		{"link-local", `{clusterIP: 169.254.169.254, ports: [{port: 80}]}`, "spec.clusterIP", "169.254.169.254"},
		{"IPv4-mapped loopback", `{clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, "::ffff:127.0.0.1"], ports: [{port: 80}]}`, "spec.clusterIPs[1]", "::ffff:127.0.0.1"},
		{"unspecified", `{clusterIP: "::", ports: [{port: 80}]}`, "spec.clusterIP", "::"},
		{"multicast", `{clusterIP: 224.0.0.251, ports: [{port: 80}]}`, "spec.clusterIP", "224.0.0.251"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r, _, dir := refuseEdit(t, good, ns+svc(tt.spec), `service a/web: `+tt.field+`: bad IP "`+tt.value+`"`)

			// Removing the service is an edit; a new malformed one has
			// nothing to lose and is only left out by translation.
			writeFile(t, dir, "c.yaml", ns+strings.ReplaceAll(svc(tt.spec), "web", "new"))
			r.waitFor(t, "a")
		})
	}
}

// TestRunRefusesNamespaceGoneUnderItsPods: Kubernetes never removes a
// namespace before its pods; a load that lost a namespace (its file
// removed, say, in a directory) but still has pods in it would unenroll
// every pod the namespace's label enrolled. It is refused, naming the
// namespace and a pod; removing the pods with it, or relabelling it, is
// an edit.
func TestRunRefusesNamespaceGoneUnderItsPods(t *testing.T) {
	dir := t.TempDir()
	ns := "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}\n"
	pod := "apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: shop}\nspec: {containers: [{name: c, image: c}]}\nstatus: {phase: Running, podIP: 10.0.0.5}\n"
	writeFile(t, dir, "ns.yaml", ns)
	writeFile(t, dir, "pods.yaml", pod)
	m := source.NewMetrics(nil)
	r := startWith(t, New(dir, nil).WithMetrics(m))
	r.waitFor(t, "shop")

	if err := os.Remove(filepath.Join(dir, "ns.yaml")); err != nil {
		t.Fatal(err)
	}
	r.noUpdate(t, 300*time.Millisecond)
	errs := r.refused(t)
	if len(errs) != 1 || errorReason(errs[0]) != source.ReasonInvalid ||
		!strings.Contains(errs[0].Error(), "namespace shop is gone while its pods remain (shop/web)") {
		t.Fatalf("Errors() = %v, want namespace shop named, invalid", errs)
	}
	wantCount(t, m, source.ReasonInvalid, 1)

	// Gone with its pods: an edit.
	if err := os.WriteFile(filepath.Join(dir, "pods.yaml"), []byte(namespaceDoc("other")), 0o644); err != nil {
		t.Fatal(err)
	}
	r.waitFor(t, "other")
}
