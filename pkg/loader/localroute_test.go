package loader_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
)

// TestLocalRouteRefusesANonCgroupDirectory: a cgroup directory the operator
// named that is not on a cgroup v2 file system fails the load, naming it,
// rather than leaving local routing off unnoticed.
func TestLocalRouteRefusesANonCgroupDirectory(t *testing.T) {
	root := loadertest.TempBPFFS(t)
	dir := t.TempDir()
	l, err := loader.Load(context.Background(), loader.Config{PinRoot: root, Settings: loader.DefaultSettings(), CgroupPath: dir, Logger: slog.Default()})
	if err == nil {
		l.Close()
		t.Fatalf("Load with cgroup %s (a plain directory): no error", dir)
	}
	if !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "not on a cgroup v2 file system") {
		t.Fatalf("Load with cgroup %s: %v, want an error naming it as not cgroup v2", dir, err)
	}
}
