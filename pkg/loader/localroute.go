package loader

import (
	"context"
	"path/filepath"

	"github.com/cilium/ebpf"

	"github.com/redirector-mesh/redirector/pkg/pin"
)

// localRoutePin is where the sock_ops link of local routing is pinned.
func localRoutePin(root string) string { return filepath.Join(root, "sockops") }

// attachLocalRoute attaches rd_pod_sockops to the cgroup v2 hierarchy that
// holds the pods' cgroups, or points the link an earlier agent pinned at it.
// It takes an established captured connection off the capture's packet path:
// the app's socket is routed over lo to the tunnel's (see capture.c). The
// capture does not depend on it: where it cannot attach, every packet takes
// the pod interface's programs as before. So nothing here fails the load: a
// directory the operator named that cannot be used is logged as an error
// naming it, no cgroup v2 found by default as a warning.
func (l *Loader) attachLocalRoute(ctx context.Context) {
	path := localRoutePin(l.cfg.PinRoot)
	if l.cfg.PacketPathOnly {
		// Off, as the setting says, also for a link an earlier agent left.
		if err := detachLocalRoute(l.cfg.PinRoot); err != nil {
			l.log.WarnContext(ctx, "remove the local-routing link of an earlier agent", "error", err)
		}
		return
	}
	var dir string
	var err error
	if l.cfg.CgroupPath == "" {
		dir, err = pin.CgroupV2Root()
	} else {
		dir, err = pin.Cgroup2Under(l.cfg.CgroupPath)
	}
	if err == nil {
		err = pin.AttachCgroup(path, dir, l.sockops, ebpf.AttachCGroupSockOps)
	}
	switch {
	case err == nil:
		l.log.DebugContext(ctx, "local routing on", "cgroup", dir)
	case l.cfg.CgroupPath != "":
		l.log.ErrorContext(ctx, "local routing off: the cgroup directory cannot be used; established captured connections keep the capture's packet path", "cgroup", l.cfg.CgroupPath, "error", err)
	default:
		l.log.WarnContext(ctx, "local routing off: established captured connections keep the capture's packet path", "error", err)
	}
}

// detachLocalRoute removes the local-routing link pinned under root.
func detachLocalRoute(root string) error { return pin.DetachLink(localRoutePin(root)) }
