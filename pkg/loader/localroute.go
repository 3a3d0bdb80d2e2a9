package loader

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/pin"
)

// localRoutePin is where the sock_ops link of local routing is pinned.
func localRoutePin(root string) string { return filepath.Join(root, "sockops") }

// attachLocalRoute attaches rd_pod_sockops to the cgroup v2 directory that
// holds the pods' cgroups, or points the link an earlier agent pinned at it.
// It takes an established captured connection off the capture's packet path:
// the app's socket is routed over lo to the tunnel's (see capture.c). The
// capture does not depend on it: where it cannot attach, every packet takes
// the pod interface's programs as before, so a missing cgroup v2 mount is a
// warning. A path the operator named that cannot be used is an error.
func (l *Loader) attachLocalRoute(ctx context.Context) error {
	path := localRoutePin(l.cfg.PinRoot)
	dir := l.cfg.CgroupPath
	if l.cfg.PacketPathOnly {
		// Off, as the setting says, also for a link an earlier agent left.
		return detachLocalRoute(l.cfg.PinRoot)
	}
	named := dir != ""
	if !named {
		var err error
		if dir, err = pin.CgroupV2Root(); err != nil {
			l.log.WarnContext(ctx, "established captured connections keep the capture's packet path: no cgroup v2 to attach local routing to", "error", err)
			return nil
		}
	}
	err := checkCgroup2(dir)
	if err == nil {
		err = pin.AttachCgroup(path, dir, l.sockops, ebpf.AttachCGroupSockOps)
	}
	if err != nil && named {
		return fmt.Errorf("local routing: %w", err)
	}
	if err != nil {
		l.log.WarnContext(ctx, "established captured connections keep the capture's packet path", "error", err)
	}
	return nil
}

// checkCgroup2 reports why dir is not a cgroup v2 directory, if it is not.
func checkCgroup2(dir string) error {
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return fmt.Errorf("cgroup %s: %w", dir, err)
	}
	if fs.Type != unix.CGROUP2_SUPER_MAGIC {
		return fmt.Errorf("cgroup %s: not on a cgroup v2 file system", dir)
	}
	return nil
}

// detachLocalRoute removes the local-routing link pinned under root.
func detachLocalRoute(root string) error { return pin.DetachLink(localRoutePin(root)) }
