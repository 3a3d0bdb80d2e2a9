package loader_test

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/pin"
)

// TestLocalRouteCgroupSetting: a cgroup directory the operator named that
// holds no cgroup v2 hierarchy leaves local routing off with an error naming
// it, and the agent loads all the same (the capture does not need it); the
// hierarchy is found at the directory itself or below it at unified/, as
// hybrid hosts mount it.
func TestLocalRouteCgroupSetting(t *testing.T) {
	v2, err := pin.CgroupV2Root()
	if err != nil {
		t.Fatal(err)
	}
	// A directory whose unified/ is the cgroup v2 hierarchy, as a hybrid
	// host's /sys/fs/cgroup is.
	hybrid := t.TempDir()
	if err := os.Mkdir(filepath.Join(hybrid, "unified"), 0o755); err != nil {
		t.Fatal(err)
	}
	bindMount(t, v2, filepath.Join(hybrid, "unified"))
	plain := t.TempDir()
	for _, c := range []struct {
		name, dir string
		on        bool
	}{
		{"cgroup v2 itself", v2, true},
		{"hybrid layout", hybrid, true},
		{"not a cgroup", plain, false},
		{"missing", filepath.Join(plain, "nope"), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := loadertest.TempBPFFS(t)
			var logs bytes.Buffer
			l, err := loader.Load(context.Background(), loader.Config{PinRoot: root, Settings: loader.DefaultSettings(), CgroupPath: c.dir,
				Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			if err != nil {
				t.Fatalf("Load with cgroup %s: %v; local routing must never fail the load", c.dir, err)
			}
			defer l.Close()
			_, err = os.Stat(filepath.Join(root, "sockops"))
			if on := err == nil; on != c.on {
				t.Fatalf("local routing link pinned = %v, want %v (log: %s)", on, c.on, logs.String())
			}
			if !c.on && (!strings.Contains(logs.String(), "level=ERROR") || !strings.Contains(logs.String(), c.dir)) {
				t.Fatalf("no error naming %s in the log: %s", c.dir, logs.String())
			}
			if err := loader.Uninstall(context.Background(), root, loader.DefaultSettings(), slog.Default()); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// bindMount bind-mounts src on dst until the test's end.
func bindMount(t *testing.T, src, dst string) {
	t.Helper()
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind %s on %s: %v", src, dst, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dst, unix.MNT_DETACH) })
}
