package kubernetes_test

import (
	"log/slog"

	"k8s.io/client-go/rest"

	"github.com/redirector-mesh/redirector/pkg/selection"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubernetes"
)

// newScaleSource is the agent's Kubernetes source as cmd/redirector builds it. It is alone in
// this file so that BenchmarkKubernetesSourceScale can run against an older source with only this file replaced
// (BENCHMARKS.md, Kubernetes source at scale).
func newScaleSource(rc *rest.Config, node string, sel selection.Config, log *slog.Logger) (source.Source, error) {
	return kubernetes.New(kubernetes.Config{RestConfig: rc, NodeName: node, Logger: log, Selection: sel})
}
