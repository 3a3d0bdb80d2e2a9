package loader_test

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/maps"
)

// TestLoaderYieldsToNewerClaim: two agents overlap on a root; once the
// newer one claimed the node, the older one's attach, detach and link pin
// repair change nothing, whenever its own loop would have noticed.
func TestLoaderYieldsToNewerClaim(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	root := loadertest.TempBPFFS(t)
	old := loadertest.Load(t, root)
	defer old.Close()
	oldClaim, err := maps.ClaimNode(context.Background(), root, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer oldClaim.Close()
	old.SetClaim(oldClaim)

	next := loadertest.Load(t, root)
	defer next.Close()
	nextClaim, err := maps.ClaimNode(context.Background(), root, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer nextClaim.Close()
	next.SetClaim(nextClaim)

	p := loader.Pod{UID: "uid-late", Namespace: "test", Name: "late", NetNS: "/proc/self/ns/net",
		Interface: "lo", Addrs: []netip.Addr{netip.MustParseAddr("10.250.0.9")}}
	if _, err := old.AttachPod(context.Background(), p); !errors.Is(err, maps.ErrNotHeld) {
		t.Fatalf("old agent's attach after the claim: %v, want ErrNotHeld", err)
	}
	if metas, err := next.Maps().ListMeta(); err != nil || len(metas) != 0 {
		t.Fatalf("metadata after the refused attach: %v (%v), want none", metas, err)
	}
	if err := old.DetachPod(context.Background(), "uid-any"); !errors.Is(err, maps.ErrNotHeld) {
		t.Fatalf("old agent's detach after the claim: %v, want ErrNotHeld", err)
	}
	if c := old.CheckLinks(context.Background(), true); len(c.Errors) != 1 || !errors.Is(c.Errors[0], maps.ErrNotHeld) || c.Repinned != 0 {
		t.Fatalf("old agent's link check with pins: %+v, want only ErrNotHeld", c)
	}
}

// TestLoadRefillsMissingPodsMap: an rd_pods pin that is gone while the pods'
// metadata stays is recreated with their entries before the new programs
// run, so the pods are never left uncaptured (plaintext) until the first
// reconcile.
func TestLoadRefillsMissingPodsMap(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	root := loadertest.TempBPFFS(t)
	first := loadertest.Load(t, root)
	a4, a6 := netip.MustParseAddr("10.250.0.7"), netip.MustParseAddr("fd00:250::7")
	want := maps.PodSettings{CaptureOutbound: true, CaptureInbound: true, PodID: 3}
	if err := first.Maps().PutMeta(3, maps.PodMeta{UID: "uid-3", Namespace: "test", Name: "p3", NetNS: "/proc/self/ns/net",
		Interface: "eth0", Addrs: []netip.Addr{a4, a6}, Settings: want, AttachMode: maps.AttachTCLegacy, AcceptLocal: -1, RPFilter: -1}); err != nil {
		t.Fatal(err)
	}
	first.Close()
	if err := os.Remove(filepath.Join(root, maps.PodsName)); err != nil {
		t.Fatal(err)
	}
	second := loadertest.Load(t, root)
	defer second.Close()
	for _, a := range []netip.Addr{a4, a6} {
		got, ok, err := second.Maps().Pod(a)
		if err != nil || !ok || got != want {
			t.Errorf("entry of %s after the load: %+v present %v (%v), want %+v", a, got, ok, err, want)
		}
	}
	// No Uninstall: the made-up pod names this process's own namespace,
	// whose routing a detach would touch. The bpffs goes with the test.
}
