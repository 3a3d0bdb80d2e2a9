package loader_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/maps"
	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestLoadRefusesLoosePinTree: whoever may write a pin, or a directory of
// the pin root, can end the capture. On kernels from 6.5 BPF_OBJ_GET is
// checked by the pin's file mode only, even with unprivileged BPF off, so
// an rd_pods pin any user may write lets any user delete a pod's
// enrollment entry (the kill switch: its traffic then passes in
// plaintext); a directory any user may write lets them rename pins (swap
// a pod's links, hide a map). Load refuses such a tree before it uses
// anything in it, with an error naming the path, and the pods stay
// captured by what is pinned.
func TestLoadRefusesLoosePinTree(t *testing.T) {
	topo := netnstest.New(t, 1)
	client, other := topo.Nodes[0].AddPod("client"), topo.Nodes[0].AddPod("other")
	root := loadertest.TempBPFFS(t)
	ctx := context.Background()
	loadertest.Listen(t, client.Path(), "[::]:15001", "outbound", netns.SocketOptions{Transparent: true, Mark: loadertest.TunnelMark})
	loadertest.Listen(t, other.Path(), "[::]:8080", "other-app", netns.SocketOptions{})
	l := loadertest.Load(t, root)
	id, err := l.AttachPod(ctx, loadertest.PodOf(client, true))
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	podDir := filepath.Join(root, "pods", fmt.Sprint(id.ID))

	for _, c := range []struct {
		name string
		path string
		mode os.FileMode
		want string
	}{
		{"enrollment map writable by all", filepath.Join(root, maps.PodsName), 0o666, "writable by group or others"},
		{"metadata map writable by group", filepath.Join(root, maps.PodMetaName), 0o620, "writable by group or others"},
		{"pin root writable by all", root, 0o777, "writable by group or others"},
		{"pods directory writable by all", filepath.Join(root, "pods"), 0o777, "writable by group or others"},
		{"pod's link directory writable by all", podDir, 0o777, "writable by group or others"},
	} {
		t.Run(c.name, func(t *testing.T) {
			fi, err := os.Stat(c.path)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(c.path, c.mode); err != nil {
				t.Fatal(err)
			}
			defer os.Chmod(c.path, fi.Mode().Perm())
			l, err := loader.Load(ctx, loader.Config{PinRoot: root, Settings: loader.DefaultSettings(), Logger: slog.Default()})
			if err == nil {
				l.Close()
				t.Fatalf("Load accepted a pin tree with %s mode %v", c.path, c.mode)
			}
			if !strings.Contains(err.Error(), c.path) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Load: %v, want an error naming %s and %q", err, c.path, c.want)
			}
			if r, err := loadertest.Call(client.Path(), ap(other.IPv4, 8080), netns.SocketOptions{}); err != nil || r.Name != "outbound" {
				t.Errorf("after the refused load, conn reached %+v (%v), want outbound (still captured)", r, err)
			}
		})
	}
	// A pin owned by another user is refused too.
	t.Run("map owned by another user", func(t *testing.T) {
		p := filepath.Join(root, maps.PodsName)
		if err := os.Chown(p, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		defer os.Chown(p, 0, 0)
		l, err := loader.Load(ctx, loader.Config{PinRoot: root, Settings: loader.DefaultSettings(), Logger: slog.Default()})
		if err == nil {
			l.Close()
			t.Fatal("Load accepted a pin owned by uid 65534")
		}
		if !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "uid 65534") {
			t.Errorf("Load: %v, want an error naming %s and its owner", err, p)
		}
	})
	// With the modes back, the same tree loads.
	l = loadertest.Load(t, root)
	l.Close()
}
