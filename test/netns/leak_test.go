package netnstest

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/pkg/nodeagent"
)

func openFDs(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(entries)
}

// TestAddRemoveCyclesLeakNothing enrolls and unenrolls one pod through the
// reconciler (real loader, real tunnel listeners) many times and counts what
// is left: file descriptors, pins, tcx links, listeners, map entries.
func TestAddRemoveCyclesLeakNothing(t *testing.T) {
	cycles := 1000
	if testing.Short() {
		cycles = 100
	}
	tp := New(t, 1)
	pod := tp.Nodes[0].AddPod("churn")
	root := filepath.Join(t.TempDir(), "bpf")
	t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	ld, err := loader.Load(ctx, loader.Config{PinRoot: root, Settings: loader.DefaultSettings(), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer ld.Close()
	tun, _ := FileCATunnel(t, log)
	rec := nodeagent.NewReconciler(ld, tun, netns.DefaultFinder(), log)
	want := []loader.Pod{{UID: "uid-churn", Namespace: "shop", Name: "churn", NetNS: pod.Path(), Addrs: pod.Addrs(), CaptureInbound: true}}

	// One warm-up cycle, so lazily opened descriptors are in the baseline.
	rec.Reconcile(ctx, want, false)
	rec.Reconcile(ctx, nil, false)
	baseFDs := openFDs(t)
	start := time.Now()
	for i := 0; i < cycles; i++ {
		if res := rec.Reconcile(ctx, want, false); len(res.Errors) > 0 || len(res.Attached) != 1 {
			t.Fatalf("cycle %d attach: %+v", i, res)
		}
		if res := rec.Reconcile(ctx, nil, false); len(res.Errors) > 0 || len(res.Detached) != 1 {
			t.Fatalf("cycle %d detach: %+v", i, res)
		}
	}
	t.Logf("%d add/remove cycles in %s", cycles, time.Since(start).Round(time.Millisecond))

	if fds := openFDs(t); fds > baseFDs+2 {
		t.Errorf("file descriptors grew from %d to %d over %d cycles", baseFDs, fds, cycles)
	}
	if entries, _ := os.ReadDir(filepath.Join(root, "pods")); len(entries) != 0 {
		t.Errorf("%d pod pin dirs left", len(entries))
	}
	if pods, _ := ld.Maps().ListPods(); len(pods) != 0 {
		t.Errorf("%d enrollment entries left", len(pods))
	}
	if metas, _ := ld.Maps().ListMeta(); len(metas) != 0 {
		t.Errorf("%d pod records left", len(metas))
	}
	if counters, _ := ld.Maps().AllCounters(); len(counters) != 0 {
		t.Errorf("%d counter entries left", len(counters))
	}
	if served := tun.ServedPods(); len(served) != 0 {
		t.Errorf("tunnel still serves %v", served)
	}
	err = netns.Do(pod.Path(), func() error {
		iface, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: iface.Attrs().Index, Attach: at})
			if err != nil {
				return err
			}
			if len(res.Programs) != 0 {
				t.Errorf("%d programs left on eth0 (%s)", len(res.Programs), at)
			}
		}
		for _, f := range []string{"/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"} {
			b, err := os.ReadFile(f)
			if err != nil {
				return err
			}
			for _, line := range strings.Split(string(b), "\n")[1:] {
				if fields := strings.Fields(line); len(fields) > 3 && fields[3] == "0A" {
					t.Errorf("listener left in the pod: %s", line)
				}
			}
		}
		rules, err := netlink.RuleList(netlink.FAMILY_ALL)
		if err != nil {
			return err
		}
		for _, r := range rules {
			if r.Table == loader.DefaultSettings().RouteTable {
				t.Errorf("rule left: %v", r)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
