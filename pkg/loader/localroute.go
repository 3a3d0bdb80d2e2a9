package loader

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"

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
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		if named {
			return fmt.Errorf("cgroup %s for local routing: not a directory (%v)", dir, err)
		}
		l.log.WarnContext(ctx, "established captured connections keep the capture's packet path: cgroup v2 root is not a directory", "cgroup", dir, "error", err)
		return nil
	}
	if err := pin.AttachCgroup(path, dir, l.sockops, ebpf.AttachCGroupSockOps); err != nil {
		if named {
			return fmt.Errorf("local routing: %w", err)
		}
		l.log.WarnContext(ctx, "established captured connections keep the capture's packet path", "error", err)
		return nil
	}
	return nil
}

// detachLocalRoute removes the local-routing link pinned under root.
func detachLocalRoute(root string) error {
	err := pin.DetachLink(localRoutePin(root))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}
