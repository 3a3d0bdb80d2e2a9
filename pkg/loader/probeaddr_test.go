package loader_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/loader/loadertest"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// TestAttachRefusesProbeSNATAddress: the capture never captures the
// host-probe SNAT address (as a source on ingress, with the host program's
// mark, and as a destination on egress). HOST_PROBE_SNAT_IPV6 only has to
// be unicast, so an operator can set it inside the pod range: the pod that
// then gets that address was enrolled, and what it sent to that address or
// was sent uncaptured. AttachPod refuses such a pod, naming the setting,
// and leaves nothing behind.
func TestAttachRefusesProbeSNATAddress(t *testing.T) {
	topo := netnstest.New(t, 1)
	pod := topo.Nodes[0].AddPod("pod")
	settings := loader.DefaultSettings()
	settings.ProbeSNATv6 = pod.IPv6
	l, err := loader.Load(context.Background(), loader.Config{PinRoot: loadertest.TempBPFFS(t), Settings: settings, Logger: slog.Default()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, err = l.AttachPod(context.Background(), loadertest.PodOf(pod, true))
	if err == nil || !strings.Contains(err.Error(), "HOST_PROBE_SNAT_IPV6") || !strings.Contains(err.Error(), pod.IPv6.String()) {
		t.Fatalf("AttachPod error %v, want one naming HOST_PROBE_SNAT_IPV6 and %s", err, pod.IPv6)
	}
	pods, _ := l.Pods()
	entries, _ := l.Maps().ListPods()
	if len(pods) != 0 || len(entries) != 0 {
		t.Errorf("partial state left: pods %+v entries %+v", pods, entries)
	}
}
