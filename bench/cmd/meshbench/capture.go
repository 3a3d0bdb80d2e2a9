package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/loader"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// setupCaptureOnly puts the product's real eBPF capture on pod p, with this
// process as the loader (its own pin root, outbound capture only), in front
// of the plain relay listening on the outbound port. No agent is involved:
// the variant measures the capture plus one Go copy, without TLS.
func setupCaptureOnly(ctx context.Context, r *netnstest.Runner, p *netnstest.Pod) (*child, error) {
	s := loader.DefaultSettings()
	relay, err := startChild(r, p.Path(), "capture-only relay", selfPath(), "relay",
		"-listen", fmt.Sprintf("[::]:%d", s.OutboundPort), "-mark", fmt.Sprint(s.TunnelMark))
	if err != nil {
		return nil, err
	}
	// The listener first: from the moment the pod is enrolled, a captured
	// SYN without a listener is dropped.
	if _, err := relay.waitLine(ctx, "ready", 10*time.Second); err != nil {
		return nil, err
	}
	root := filepath.Join(r.TempDir(), "bpf-capture")
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	r.Cleanup(func() {
		if err := loader.Uninstall(context.Background(), root, s, quiet); err != nil {
			r.Logf("cleanup: uninstall capture-only pins %s: %v", root, err)
		}
		_ = unix.Unmount(root, unix.MNT_DETACH)
	})
	l, err := loader.Load(ctx, loader.Config{PinRoot: root, Settings: s, Logger: quiet})
	if err != nil {
		return nil, err
	}
	defer l.Close() // the pinned links keep capturing
	if _, err := l.AttachPod(ctx, loader.Pod{UID: "uid-bench-" + p.Name, Namespace: "bench", Name: p.Name,
		NetNS: p.Path(), Addrs: p.Addrs(), CaptureInbound: false}); err != nil {
		return nil, err
	}
	return relay, nil
}
