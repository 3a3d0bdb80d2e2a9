package netnstest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// TestLinkPinsRepaired: with the real agent, a pod's removed link pins (its
// own and the host-probe ones) are back at once, and links detached
// underneath at the next link check (every 750 ms); the pod's traffic
// works afterwards. Before, all of this waited for the next full reconcile.
// The waits are generous (a loaded CI VM): with a 5 minute reconcile
// period, only the link repair can act within them.
func TestLinkPinsRepaired(t *testing.T) {
	tp := New(t, 1)
	a, server := tp.Nodes[0].AddPod("a"), tp.Nodes[0].AddPod("server")
	dir := t.TempDir()
	manifest, ca := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "ca")
	m := (&Manifest{}).Namespace("shop", "istio.io/dataplane-mode=ambient").Pod(a, "shop", "a")
	if err := m.Write(manifest); err != nil {
		t.Fatal(err)
	}
	initCA(t, ca)
	// A long full-reconcile period, so that only the link repair can act.
	ag := StartAgent(t, tp.Nodes[0], AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: ca, Args: []string{"--reconcile-period", "5m"}})
	waitEnrolled(t, ag.BPFRoot, 10*time.Second, "shop/a")
	podDir := filepath.Join(ag.BPFRoot, "pods", fmt.Sprint(mustEnrolledNames(t, ag.BPFRoot)["shop/a"]))
	pins := []string{"ingress", "egress", "host-ingress", "host-egress"}
	for i, p := range pins {
		pins[i] = filepath.Join(podDir, p)
	}
	attached := func() error {
		for _, p := range pins {
			lk, err := link.LoadPinnedLink(p, &ebpf.LoadPinOptions{})
			if err != nil {
				return err
			}
			info, err := lk.Info()
			lk.Close()
			if err != nil || info.TCX() == nil || info.TCX().Ifindex == 0 {
				return fmt.Errorf("%s: not attached (%v)", p, err)
			}
		}
		return nil
	}
	if err := attached(); err != nil {
		t.Fatal(err)
	}
	HTTPApp(t, server, 8080, "server")
	works := func(when string) {
		t.Helper()
		Eventually(t, 5*time.Second, func() error {
			out, err := Curl(a, URL(server.IPv4, 8080))
			if err == nil && !strings.Contains(out, "server") {
				err = fmt.Errorf("answer %q", out)
			}
			return err
		})
	}
	works("before")

	for _, p := range pins {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	Eventually(t, 10*time.Second, attached)
	works("pins removed")

	for _, p := range pins[:2] {
		lk, err := link.LoadPinnedLink(p, &ebpf.LoadPinOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := lk.Detach(); err != nil {
			t.Fatal(err)
		}
		lk.Close()
	}
	detachedAt := time.Now()
	Eventually(t, 10*time.Second, attached)
	t.Logf("detached links replaced after %v", time.Since(detachedAt).Round(time.Millisecond))
	works("links detached")
	ag.WaitLog(t, "pod repaired", 10*time.Second)
}
