package nodepods

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/cache"

	"github.com/redirector-mesh/redirector/internal/promtest"
	"github.com/redirector-mesh/redirector/pkg/source"
)

// TestWatchErrorCountsFailuresOnly: a watch that ended (EOF) or expired (410) is the informer
// working, not a failure; a refused list is one, counted and logged naming the informer.
func TestWatchErrorCountsFailuresOnly(t *testing.T) {
	var logs bytes.Buffer
	m := source.NewMetrics(nil)
	w := NewForClient(nil, "node-a", slog.New(slog.NewTextHandler(&logs, nil)), m)
	r := cache.NewReflector(&cache.ListWatch{}, &corev1.Namespace{}, cache.NewStore(cache.MetaNamespaceKeyFunc), 0)
	count := func() float64 {
		return promtest.Scrape(t, m)[`redirector_source_errors_total{reason="`+source.ReasonListWatch+`",source="nodepods"}`]
	}
	ctx := context.Background()
	w.watchError(ctx, r, io.EOF)
	w.watchError(ctx, r, apierrors.NewResourceExpired("too old resource version"))
	if n := count(); n != 0 {
		t.Errorf("%v list_watch errors counted for a watch that ended and one that expired, want 0", n)
	}
	w.watchError(ctx, r, apierrors.NewForbidden(schema.GroupResource{Resource: "namespaces"}, "", nil))
	if n := count(); n != 1 {
		t.Errorf("%v list_watch errors counted for a refused list, want 1", n)
	}
	if !strings.Contains(logs.String(), "informer=*v1.Namespace") {
		t.Errorf("log does not name the informer: %s", logs.String())
	}
}
