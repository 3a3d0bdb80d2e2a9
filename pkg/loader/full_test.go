package loader_test

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	"github.com/redirector-mesh/redirector/pkg/maps"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestAttachPastFullMapRefusedCleanly: rd_pods holds one entry per enrolled
// address, 4096 in all, so pods past the bound (2048 dual-stack pods) are
// refused: with an error that names the map and its bound (the kernel's
// E2BIG reads "argument list too long"), and with nothing of the pod left
// behind (no half-enrolled pod with one address captured). Once there is
// room, the pod is attached.
func TestAttachPastFullMapRefusedCleanly(t *testing.T) {
	topo := netnstest.New(t, 1)
	p := topo.Nodes[0].AddPod("p")
	ctx := context.Background()
	root := loadertest.TempBPFFS(t)
	l := loadertest.Load(t, root)
	defer l.Close()
	m := l.Maps()
	// Every slot but one taken: the pod's second address finds none.
	n := int(m.Pods.MaxEntries()) - 1
	filler := func(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 254, byte(i >> 8), byte(i)}) }
	for i := range n {
		if err := m.SetPod(filler(i), maps.PodSettings{CaptureOutbound: true, PodID: 9999}); err != nil {
			t.Fatalf("filler %d: %v", i, err)
		}
	}
	pod := loadertest.PodOf(p, true)
	_, err := l.AttachPod(ctx, pod)
	t.Logf("attach past the bound: %v", err)
	if !errors.Is(err, maps.ErrFull) || !strings.Contains(err.Error(), maps.PodsName) {
		t.Errorf("attach past the bound: %v, want an error naming %s as full", err, maps.PodsName)
	}
	if _, ok, _ := l.PodState(pod.UID); ok {
		t.Errorf("pod recorded as attached after a refused attach")
	}
	for _, a := range pod.Addrs {
		if _, ok, _ := m.Pod(a); ok {
			t.Errorf("address %s enrolled after a refused attach", a)
		}
	}
	if e, _ := m.ListPodNetNS(); len(e) != 0 {
		t.Errorf("rd_pod_netns entries left: %v", e)
	}
	if progs := loadertest.TCXPrograms(t, p.Path()); len(progs) != 0 {
		t.Errorf("programs left on the refused pod's eth0: %v", progs)
	}
	if entries, _ := os.ReadDir(filepath.Join(root, "pods")); len(entries) != 0 {
		t.Errorf("%d pod pin dirs left", len(entries))
	}
	if pods, _ := m.ListPods(); len(pods) != n {
		t.Errorf("%d entries after the refused attach, want the %d others untouched", len(pods), n)
	}
	// Room for one more address: the pod is attached.
	if err := m.DeletePod(filler(0)); err != nil {
		t.Fatal(err)
	}
	if _, err := l.AttachPod(ctx, pod); err != nil {
		t.Errorf("attach with room: %v", err)
	}
	if err := l.DetachPod(ctx, pod.UID); err != nil {
		t.Error(err)
	}
}
