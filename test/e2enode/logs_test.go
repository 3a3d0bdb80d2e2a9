//go:build e2enode && linux

package e2enode

import (
	"strings"
	"testing"
)

func TestLogExcerpt(t *testing.T) {
	log := strings.Join([]string{
		"I1201 10:00:00.000000 1 server.go:1] starting",
		"F1201 10:00:01.000000 1 kubelet.go:2] failed to start ContainerManager",
		"panic: boom",
		"",
		"goroutine 1 [running]:",
		"main.main()",
		"created by k8s.io/kubernetes/pkg/kubelet/cm/dra/plugin.NewDRAPluginManager in goroutine 329",
		"e2enode: kubelet exited unasked (exit status 2); starting it again (restart 1 of 3)",
		"I1201 10:00:03.000000 1 server.go:1] starting",
	}, "\n")
	got := logExcerpt(log, 2)
	for _, want := range []string{"fatal: F1201", "fatal: panic: boom", "fatal: e2enode: kubelet exited unasked"} {
		if !strings.Contains(got, want) {
			t.Errorf("excerpt lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "created by") || strings.Contains(got, "main.main") {
		t.Errorf("excerpt shows the goroutine dump:\n%s", got)
	}
	if !strings.HasSuffix(got, "server.go:1] starting") {
		t.Errorf("excerpt does not end with the last run's lines:\n%s", got)
	}
	if got := logExcerpt("a\nb\nc", 2); got != "b\nc" {
		t.Errorf("plain log: got %q, want the last two lines", got)
	}
}
