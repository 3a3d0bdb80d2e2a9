package manifests

import (
	"bytes"
	"encoding/json"
	"encoding/pem"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

const nodeScript = "image/redirector-node"

// nodeEnv is a node laid out in temporary directories for redirector-node: a CNI bin and
// conf dir, a plugin binary "in the image", and a fake `redirector` that records its calls.
type nodeEnv struct {
	t                       *testing.T
	binDir, confDir, plugin string
	redirectorCalls         string // file the fake redirector appends its arguments to
	env                     map[string]string
}

// primaryConf is a typical primary CNI's conflist (kindnet's shape).
const primaryConf = `{
  "cniVersion": "1.0.0",
  "name": "kindnet",
  "plugins": [
    {"type": "ptp", "ipMasq": false, "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.1.0/24"}]]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}`

func newNodeEnv(t *testing.T) *nodeEnv {
	t.Helper()
	for _, tool := range []string{"sh", "jq", "cmp", "stat"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("redirector-node needs %s, which is not installed here (the image has it)", tool)
		}
	}
	dir := t.TempDir()
	n := &nodeEnv{
		t:               t,
		binDir:          filepath.Join(dir, "opt/cni/bin"),
		confDir:         filepath.Join(dir, "etc/cni/net.d"),
		plugin:          filepath.Join(dir, "image/redirector-cni"),
		redirectorCalls: filepath.Join(dir, "redirector-calls"),
	}
	for _, d := range []string{n.binDir, n.confDir, filepath.Dir(n.plugin)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	n.write(n.plugin, "#!/bin/sh\necho plugin v1\n", 0o755)
	fakeRedirector := filepath.Join(dir, "image/redirector")
	n.write(fakeRedirector, "#!/bin/sh\necho \"$*\" >>"+n.redirectorCalls+"\n", 0o755)
	n.env = map[string]string{
		"CNI_BIN_DIR":           n.binDir,
		"CNI_CONF_DIR":          n.confDir,
		"CNI_PLUGIN_SRC":        n.plugin,
		"PLUGIN_AGENT_SOCKET":   "/var/run/redirector/cni.sock",
		"PLUGIN_SELECTION_HINT": "/var/run/redirector/ambient-namespaces.json",
		"REDIRECTOR":            fakeRedirector,
		"SA_DIR":                filepath.Join(dir, "sa"),
		"DAEMONSET_NAME":        "redirector",
		"POD_NAMESPACE":         "istio-system",
		"CNI_CHECK_INTERVAL":    "1",
	}
	return n
}

func (n *nodeEnv) write(path, content string, mode os.FileMode) {
	n.t.Helper()
	if err := os.WriteFile(path, []byte(content), mode); err != nil {
		n.t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		n.t.Fatal(err)
	}
}

func (n *nodeEnv) command(args ...string) *exec.Cmd {
	cmd := exec.Command("sh", append([]string{nodeScript}, args...)...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	for k, v := range n.env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	return cmd
}

// run runs the script and returns its output and exit code.
func (n *nodeEnv) run(args ...string) (string, int) {
	n.t.Helper()
	out, err := n.command(args...).CombinedOutput()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return string(out), 0
	case errors.As(err, &exit):
		return string(out), exit.ExitCode()
	}
	n.t.Fatalf("run %v: %v", args, err)
	return "", -1
}

// mustRun runs the script and fails the test unless it exits 0.
func (n *nodeEnv) mustRun(args ...string) string {
	n.t.Helper()
	out, code := n.run(args...)
	if code != 0 {
		n.t.Fatalf("redirector-node %v exited %d:\n%s", args, code, out)
	}
	return out
}

// plugins returns the plugin list of a conflist, and the whole document.
func (n *nodeEnv) plugins(name string) ([]map[string]any, map[string]any) {
	n.t.Helper()
	var doc map[string]any
	if err := json.Unmarshal([]byte(readFile(n.t, filepath.Join(n.confDir, name))), &doc); err != nil {
		n.t.Fatalf("%s: %v", name, err)
	}
	var out []map[string]any
	for _, p := range doc["plugins"].([]any) {
		out = append(out, p.(map[string]any))
	}
	return out, doc
}

func types(plugins []map[string]any) []string {
	var out []string
	for _, p := range plugins {
		out = append(out, p["type"].(string))
	}
	return out
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestNodeScriptInstallChainsLast(t *testing.T) {
	n := newNodeEnv(t)
	n.write(filepath.Join(n.confDir, "10-kindnet.conflist"), primaryConf, 0o644)
	n.write(filepath.Join(n.confDir, "99-other.conflist"), `{"cniVersion":"1.0.0","name":"other","plugins":[{"type":"bridge"}]}`, 0o644)

	if _, code := n.run("check-cni"); code == 0 {
		t.Fatal("check-cni passes before anything is installed")
	}
	n.mustRun("install-cni")

	bin := filepath.Join(n.binDir, "redirector-cni")
	if got := readFile(t, bin); got != readFile(t, n.plugin) {
		t.Errorf("installed binary differs from the image's")
	}
	if st, err := os.Stat(bin); err != nil || st.Mode().Perm() != 0o755 {
		t.Errorf("installed binary mode %v, %v; want 0755", st.Mode(), err)
	}
	plugins, doc := n.plugins("10-kindnet.conflist")
	if got := strings.Join(types(plugins), ","); got != "ptp,portmap,redirector-cni" {
		t.Errorf("plugins %s, want ptp,portmap,redirector-cni", got)
	}
	want := map[string]any{"type": "redirector-cni", "agentSocket": "/var/run/redirector/cni.sock",
		"selectionHint": "/var/run/redirector/ambient-namespaces.json"}
	if got, _ := json.Marshal(plugins[2]); string(got) != mustJSON(t, want) {
		t.Errorf("chained entry %s, want %s", got, mustJSON(t, want))
	}
	// The primary's own settings survive the rewrite untouched.
	var orig map[string]any
	_ = json.Unmarshal([]byte(primaryConf), &orig)
	if doc["name"] != "kindnet" || doc["cniVersion"] != "1.0.0" || mustJSON(t, plugins[0]) != mustJSON(t, orig["plugins"].([]any)[0]) {
		t.Errorf("primary conflist changed beyond the chained entry: %v", doc)
	}
	if other, _ := n.plugins("99-other.conflist"); len(other) != 1 {
		t.Errorf("a conflist the runtime does not use was changed: %v", other)
	}
	n.mustRun("check-cni")

	// Idempotent: nothing is rewritten when nothing changed (watchers of the directory,
	// such as the primary CNI's own installer, would see every write).
	before := inode(t, filepath.Join(n.confDir, "10-kindnet.conflist"))
	binBefore := inode(t, bin)
	if out := n.mustRun("install-cni"); strings.Contains(out, "chained") || strings.Contains(out, "installed") {
		t.Errorf("second install changed something:\n%s", out)
	}
	if inode(t, filepath.Join(n.confDir, "10-kindnet.conflist")) != before || inode(t, bin) != binBefore {
		t.Error("second install rewrote the conflist or the binary")
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestNodeScriptRepairs(t *testing.T) {
	n := newNodeEnv(t)
	conf := filepath.Join(n.confDir, "10-kindnet.conflist")
	n.write(conf, primaryConf, 0o600)
	n.mustRun("install-cni")

	// The primary CNI rewrites its file (as on its own restart): chained again.
	n.write(conf, primaryConf, 0o600)
	if _, code := n.run("check-cni"); code == 0 {
		t.Error("check-cni passes after the primary dropped the entry")
	}
	n.mustRun("install-cni")
	if plugins, _ := n.plugins("10-kindnet.conflist"); strings.Join(types(plugins), ",") != "ptp,portmap,redirector-cni" {
		t.Errorf("after the primary's rewrite: %v", types(plugins))
	}
	if st, _ := os.Stat(conf); st.Mode().Perm() != 0o600 {
		t.Errorf("conflist mode %v, want the original 0600", st.Mode().Perm())
	}

	// Someone chained a plugin after ours: ours moves back to the end, once.
	var doc map[string]any
	_ = json.Unmarshal([]byte(readFile(t, conf)), &doc)
	doc["plugins"] = append(doc["plugins"].([]any), map[string]any{"type": "bandwidth"})
	n.write(conf, mustJSON(t, doc), 0o600)
	n.mustRun("install-cni")
	if plugins, _ := n.plugins("10-kindnet.conflist"); strings.Join(types(plugins), ",") != "ptp,portmap,bandwidth,redirector-cni" {
		t.Errorf("with a plugin after ours: %v", types(plugins))
	}

	// A changed setting replaces the entry instead of adding a second one.
	n.env["PLUGIN_AGENT_SOCKET"] = "/run/redirector/cni.sock"
	n.mustRun("install-cni")
	plugins, _ := n.plugins("10-kindnet.conflist")
	if strings.Join(types(plugins), ",") != "ptp,portmap,bandwidth,redirector-cni" || plugins[3]["agentSocket"] != "/run/redirector/cni.sock" {
		t.Errorf("after a settings change: %v", plugins)
	}

	// A stale binary (an older image's) is replaced.
	n.write(filepath.Join(n.binDir, "redirector-cni"), "#!/bin/sh\necho plugin v0\n", 0o755)
	if _, code := n.run("check-cni"); code == 0 {
		t.Error("check-cni passes with a stale binary")
	}
	n.mustRun("install-cni")
	n.mustRun("check-cni")
}

func TestNodeScriptUninstall(t *testing.T) {
	n := newNodeEnv(t)
	n.write(filepath.Join(n.confDir, "10-kindnet.conflist"), primaryConf, 0o644)
	n.mustRun("install-cni")
	n.mustRun("uninstall-cni")
	if plugins, _ := n.plugins("10-kindnet.conflist"); strings.Join(types(plugins), ",") != "ptp,portmap" {
		t.Errorf("after uninstall: %v", types(plugins))
	}
	if _, err := os.Stat(filepath.Join(n.binDir, "redirector-cni")); !os.IsNotExist(err) {
		t.Errorf("binary still there after uninstall: %v", err)
	}
	// Uninstalling twice, or on a node without the plugin, is fine.
	if out := n.mustRun("uninstall-cni"); strings.Contains(out, "removed") {
		t.Errorf("second uninstall did something:\n%s", out)
	}
}

func TestNodeScriptPicksTheRuntimesConf(t *testing.T) {
	n := newNodeEnv(t)
	// Without a conflist the binary goes in, the chain waits.
	out, code := n.run("install-cni")
	if code == 0 || !strings.Contains(out, "waiting for the primary CNI") {
		t.Errorf("install without any conflist: exit %d\n%s", code, out)
	}
	// The runtime uses the first file in byte order, whatever its extension; a single-plugin
	// .conf cannot be chained into, and is left alone.
	single := `{"cniVersion":"0.4.0","name":"single","type":"bridge"}`
	n.write(filepath.Join(n.confDir, "05-single.conf"), single, 0o644)
	n.write(filepath.Join(n.confDir, "10-kindnet.conflist"), primaryConf, 0o644)
	out, code = n.run("install-cni")
	if code == 0 || !strings.Contains(out, "05-single.conf is not a conflist") {
		t.Errorf("install with a .conf first: exit %d\n%s", code, out)
	}
	if got := readFile(t, filepath.Join(n.confDir, "05-single.conf")); got != single {
		t.Errorf("the .conf was changed: %s", got)
	}
	// CNI_CONF_NAME names the file outright.
	n.env["CNI_CONF_NAME"] = "10-kindnet.conflist"
	n.mustRun("install-cni")
	if plugins, _ := n.plugins("10-kindnet.conflist"); types(plugins)[len(plugins)-1] != "redirector-cni" {
		t.Errorf("CNI_CONF_NAME not honoured: %v", types(plugins))
	}
}

// fakeAPI serves the node script's one API call, GET of its DaemonSet, with the given status
// and body, over TLS, and writes the service-account files the script reads.
func fakeAPI(t *testing.T, n *nodeEnv, status int, body string) *int {
	t.Helper()
	return fakeAPISeq(t, n, apiAnswer{status, body}).gets
}

// apiAnswer is one answer of the fake API server; status 0 means no answer (the request
// hangs past the script's 5 s timeout).
type apiAnswer struct {
	status int
	body   string
}

// fakeCalls counts the requests the fake API server got.
type fakeCalls struct {
	gets    *int
	deletes []string // the bodies of DELETE requests
}

// fakeAPISeq is fakeAPI answering GETs with answers in turn, the last one from then on. A
// DELETE is answered 200 and recorded.
func fakeAPISeq(t *testing.T, n *nodeEnv, answers ...apiAnswer) *fakeCalls {
	t.Helper()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("redirector-node on-exit needs curl, which is not installed here (the image has it)")
	}
	calls := &fakeCalls{gets: new(int)}
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/apis/apps/v1/namespaces/istio-system/daemonsets/redirector" || r.Header.Get("Authorization") != "Bearer secret-token" {
			http.Error(w, "unexpected "+r.URL.Path+" "+r.Header.Get("Authorization"), http.StatusTeapot)
			return
		}
		if r.Method == http.MethodDelete {
			b := new(bytes.Buffer)
			_, _ = b.ReadFrom(r.Body)
			calls.deletes = append(calls.deletes, b.String())
			_, _ = w.Write([]byte(`{"kind":"DaemonSet"}`))
			return
		}
		a := answers[min(*calls.gets, len(answers)-1)]
		*calls.gets++
		if a.status == 0 {
			select {
			case <-r.Context().Done():
			case <-time.After(10 * time.Second):
			}
			return
		}
		w.WriteHeader(a.status)
		_, _ = w.Write([]byte(a.body))
	}))
	t.Cleanup(srv.Close)
	sa := n.env["SA_DIR"]
	if err := os.MkdirAll(sa, 0o755); err != nil {
		t.Fatal(err)
	}
	n.write(filepath.Join(sa, "token"), "secret-token", 0o600)
	n.write(filepath.Join(sa, "ca.crt"), string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})), 0o644)
	u, _ := url.Parse(srv.URL)
	// The certificate is for 127.0.0.1, as an in-cluster one is for the Service address.
	n.env["KUBERNETES_SERVICE_HOST"] = u.Hostname()
	n.env["KUBERNETES_SERVICE_PORT"] = u.Port()
	n.env["ON_EXIT_RETRY_SECONDS"] = "2" // one retry: tests stay short
	return calls
}

// TestNodeScriptOnExit: the node is undone only when the API server confirms the DaemonSet
// is gone (404) or being deleted; never on an error, a refusal or no answer, which is what an
// API server hiccup during a restart looks like.
func TestNodeScriptOnExit(t *testing.T) {
	const (
		alive    = `{"metadata":{"name":"redirector"}}`
		deleting = `{"metadata":{"name":"redirector","deletionTimestamp":"2026-01-01T00:00:00Z"}}`
	)
	for _, tc := range []struct {
		name    string
		answers []apiAnswer
		cleanUp bool
		gets    int
	}{
		{"restart or upgrade: the DaemonSet stays", []apiAnswer{{200, alive}}, false, 1},
		{"foreground deletion of the DaemonSet", []apiAnswer{{200, deleting}}, true, 1},
		{"the DaemonSet is gone", []apiAnswer{{404, `{"kind":"Status","code":404}`}}, true, 1},
		{"forbidden is not gone", []apiAnswer{{403, `{"kind":"Status","code":403}`}}, false, 2},
		{"unauthorized is not gone", []apiAnswer{{401, `{"kind":"Status","code":401}`}}, false, 2},
		{"a server error is not gone", []apiAnswer{{503, `{"kind":"Status","code":503}`}}, false, 2},
		{"200 that is not a DaemonSet", []apiAnswer{{200, `<html>proxy</html>`}}, false, 2},
		{"a hiccup, then alive", []apiAnswer{{500, `{}`}, {200, alive}}, false, 2},
		{"a hiccup, then gone", []apiAnswer{{503, `{}`}, {404, `{}`}}, true, 2},
		{"a timeout is not gone", []apiAnswer{{0, ""}}, false, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNodeEnv(t)
			calls := fakeAPISeq(t, n, tc.answers...)
			n.write(filepath.Join(n.confDir, "10-kindnet.conflist"), primaryConf, 0o644)
			n.mustRun("install-cni")

			out := n.mustRun("on-exit")
			if *calls.gets != tc.gets {
				t.Errorf("the script asked the API server %d times, want %d:\n%s", *calls.gets, tc.gets, out)
			}
			uninstalled, _ := os.ReadFile(n.redirectorCalls)
			plugins, _ := n.plugins("10-kindnet.conflist")
			chained := types(plugins)[len(plugins)-1] == "redirector-cni"
			if tc.cleanUp {
				if string(uninstalled) != "uninstall\n" || chained {
					t.Errorf("no clean-up: redirector calls %q, still chained %v\n%s", uninstalled, chained, out)
				}
			} else if len(uninstalled) > 0 || !chained {
				t.Errorf("cleaned up without the API server's word: redirector calls %q, chained %v\n%s", uninstalled, chained, out)
			}
		})
	}
}

// TestNodeScriptUnreachableAPI: without an answer the node stays as it is: an API server
// that does not answer says nothing about the DaemonSet.
func TestNodeScriptUnreachableAPI(t *testing.T) {
	n := newNodeEnv(t)
	n.env["KUBERNETES_SERVICE_HOST"] = "127.0.0.1"
	n.env["KUBERNETES_SERVICE_PORT"] = "1" // nothing listens there
	n.env["ON_EXIT_RETRY_SECONDS"] = "2"
	out := n.mustRun("on-exit")
	if got, _ := os.ReadFile(n.redirectorCalls); len(got) > 0 {
		t.Errorf("redirector calls %q, want none", got)
	}
	if !strings.Contains(out, "leaving the CNI plugin and redirection in place") {
		t.Errorf("on-exit does not say it left the node as it is:\n%s", out)
	}
}

// TestNodeScriptDeleteDaemonSet: the pre-delete hook deletes the DaemonSet in the foreground
// and returns once the API server says it is gone.
func TestNodeScriptDeleteDaemonSet(t *testing.T) {
	n := newNodeEnv(t)
	calls := fakeAPISeq(t, n, apiAnswer{200, `{"metadata":{"deletionTimestamp":"2026-01-01T00:00:00Z"}}`}, apiAnswer{404, `{}`})
	out := n.mustRun("delete-daemonset")
	if len(calls.deletes) != 1 || !strings.Contains(calls.deletes[0], `"propagationPolicy":"Foreground"`) {
		t.Errorf("DELETE bodies %q, want one with propagationPolicy Foreground\n%s", calls.deletes, out)
	}
	if *calls.gets != 2 {
		t.Errorf("%d GETs, want 2 (deleting, then gone)\n%s", *calls.gets, out)
	}

	n = newNodeEnv(t)
	fakeAPISeq(t, n, apiAnswer{200, `{"metadata":{"deletionTimestamp":"2026-01-01T00:00:00Z"}}`})
	n.env["DELETE_TIMEOUT_SECONDS"] = "2"
	if out, code := n.run("delete-daemonset"); code == 0 {
		t.Errorf("delete-daemonset succeeded while the DaemonSet stayed:\n%s", out)
	}
}

// TestNodeScriptWatch runs the sidecar's main loop: it installs, then SIGTERM runs on-exit.
func TestNodeScriptWatch(t *testing.T) {
	n := newNodeEnv(t)
	fakeAPI(t, n, 404, `{}`)
	n.write(filepath.Join(n.confDir, "10-kindnet.conflist"), primaryConf, 0o644)
	cmd := n.command("watch")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, code := n.run("check-cni"); code == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("watch did not install the plugin in 10s:\n%s", out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The primary drops the entry: the loop puts it back within an interval.
	n.write(filepath.Join(n.confDir, "10-kindnet.conflist"), primaryConf, 0o644)
	for {
		if _, code := n.run("check-cni"); code == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("watch did not repair the chain:\n%s", out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}

	if err := cmd.Process.Signal(unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("watch exited with %v after SIGTERM:\n%s", err, out.String())
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("watch ignored SIGTERM:\n%s", out.String())
	}
	if got, _ := os.ReadFile(n.redirectorCalls); string(got) != "uninstall\n" {
		t.Errorf("on SIGTERM with the DaemonSet gone: redirector calls %q, want uninstall\n%s", got, out.String())
	}
	if _, code := n.run("check-cni"); code == 0 {
		t.Error("still chained after the DaemonSet's deletion")
	}
}

// TestNodeScriptMountBPFFS mounts a bpffs on a temporary directory, as the init container
// does on /sys/fs/bpf, and checks that a second run leaves the mount alone.
func TestNodeScriptMountBPFFS(t *testing.T) {
	n := newNodeEnv(t)
	dir := t.TempDir()
	n.env["BPF_MOUNT"] = dir
	out, code := n.run("mount-bpffs")
	if code != 0 {
		if os.Geteuid() != 0 {
			t.Skipf("mounting needs root:\n%s", out)
		}
		t.Fatalf("mount-bpffs as root: exit %d\n%s", code, out)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, 0) })
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil || st.Type != unix.BPF_FS_MAGIC {
		t.Fatalf("no bpffs on %s after mount-bpffs (%v):\n%s", dir, err, out)
	}
	if out := n.mustRun("mount-bpffs"); !strings.Contains(out, "already mounted") {
		t.Errorf("second run:\n%s", out)
	}
}

// TestNodeScriptMountBPFFSBusyboxStat is TestNodeScriptMountBPFFS with busybox's stat, as an
// image with a busybox base has: it names no bpffs (%T prints UNKNOWN), so a script that
// compared the name mounted a second bpffs over the first on every agent restart, and
// `redirector uninstall` then cleaned only one of them (found by test/e2enode). The script
// compares the magic number, which every stat prints alike.
func TestNodeScriptMountBPFFSBusyboxStat(t *testing.T) {
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		t.Skipf("needs busybox (Debian busybox-static; make test installs it): %v", err)
	}
	n := newNodeEnv(t)
	bin := t.TempDir()
	if err := os.Symlink(busybox, filepath.Join(bin, "stat")); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	n.env["BPF_MOUNT"] = dir
	mountBPFFS := func() *exec.Cmd {
		cmd := n.command("mount-bpffs")
		for i, e := range cmd.Env {
			if strings.HasPrefix(e, "PATH=") {
				cmd.Env[i] = "PATH=" + bin + ":" + strings.TrimPrefix(e, "PATH=")
			}
		}
		return cmd
	}
	if out, err := exec.Command(filepath.Join(bin, "stat"), "--help").CombinedOutput(); !strings.Contains(string(out), "BusyBox") {
		t.Fatalf("%s is not busybox's stat (%v): %s", filepath.Join(bin, "stat"), err, out)
	}
	mounts := func() int {
		b, err := os.ReadFile("/proc/self/mountinfo")
		if err != nil {
			t.Fatal(err)
		}
		c := 0
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) > 4 && f[4] == dir {
				c++
			}
		}
		return c
	}
	t.Cleanup(func() {
		for range mounts() {
			_ = unix.Unmount(dir, 0)
		}
	})
	for i := range 2 {
		out, err := mountBPFFS().CombinedOutput()
		if err != nil {
			if os.Geteuid() != 0 {
				t.Skipf("mounting needs root:\n%s", out)
			}
			t.Fatalf("mount-bpffs run %d: %v\n%s", i+1, err, out)
		}
		if i == 1 && !strings.Contains(string(out), "already mounted") {
			t.Errorf("second run with busybox stat did not find the bpffs:\n%s", out)
		}
	}
	if got := mounts(); got != 1 {
		t.Errorf("%d mounts on %s after two runs with busybox stat, want 1", got, dir)
	}
}

func TestNodeScriptUsage(t *testing.T) {
	n := newNodeEnv(t)
	out, code := n.run("frobnicate")
	if code != 2 || !strings.Contains(out, "redirector-node install-cni") {
		t.Errorf("unknown command: exit %d\n%s", code, out)
	}
}

// TestNodeScriptWritesNoPlantedPath: node-setup writes the host's CNI directories as root with
// the host's / reachable, so nothing another writer of those directories plants may turn
// its writes elsewhere. Before, its temporary files had fixed names (a symlink there sent the
// conflist or the plugin binary onto any host file), and a symlinked conflist was replaced
// by a regular file its owner no longer wrote. Now temporary names are random (mktemp) and
// a symlinked conflist is refused, its target untouched.
func TestNodeScriptWritesNoPlantedPath(t *testing.T) {
	n := newNodeEnv(t)
	victim := filepath.Join(t.TempDir(), "victim")
	n.write(victim, "host file\n", 0o644)
	for _, planted := range []string{
		filepath.Join(n.confDir, ".10-kindnet.conflist.redirector.tmp"),
		filepath.Join(n.binDir, ".redirector-cni.tmp"),
	} {
		if err := os.Symlink(victim, planted); err != nil {
			t.Fatal(err)
		}
	}
	n.write(filepath.Join(n.confDir, "10-kindnet.conflist"), primaryConf, 0o644)
	n.mustRun("install-cni")
	if got := readFile(t, victim); got != "host file\n" {
		t.Errorf("a planted symlink turned node-setup's write onto another file: %q", got)
	}
	if plugins, _ := n.plugins("10-kindnet.conflist"); len(plugins) != 3 {
		t.Errorf("the conflist was not chained: %v", types(plugins))
	}

	m := newNodeEnv(t)
	real := filepath.Join(t.TempDir(), "10-kindnet.conflist")
	m.write(real, primaryConf, 0o644)
	if err := os.Symlink(real, filepath.Join(m.confDir, "10-kindnet.conflist")); err != nil {
		t.Fatal(err)
	}
	if out, code := m.run("install-cni"); code == 0 || !strings.Contains(out, "is a symlink") {
		t.Errorf("install-cni through a symlinked conflist: exit %d\n%s", code, out)
	}
	if got := readFile(t, real); got != primaryConf {
		t.Errorf("the symlink's target was rewritten: %s", got)
	}
}
