package kubernetes

import (
	"context"
	"errors"
	"log/slog"
	"runtime"
	"testing"
	"time"

	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	k8stesting "k8s.io/client-go/testing"
)

// TestMovedPolicyKindLeavesNoGoroutine: a policy kind whose watched
// version stops being served is watched in another one, or dropped when
// its CRD is gone; the informer of the old version stops, and so does
// what waited for it to sync (seen failing: a waiter per move, for an
// informer that never synced, stayed until the agent stopped, each
// polling its informer ten times a second).
func TestMovedPolicyKindLeavesNoGoroutine(t *testing.T) {
	gvr := func(v string) schema.GroupVersionResource {
		return schema.GroupVersionResource{Group: istioSecurityGroup, Version: v, Resource: "authorizationpolicies"}
	}
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(k8sruntime.NewScheme(), map[schema.GroupVersionResource]string{
		gvr("v1"): "AuthorizationPolicyList", gvr("v1beta1"): "AuthorizationPolicyList",
	})
	// The API server answers no list: the informers never sync.
	dyn.PrependReactor("list", "authorizationpolicies", func(k8stesting.Action) (bool, k8sruntime.Object, error) {
		return true, nil, errors.New("unavailable")
	})
	s := &Source{dynamic: dyn, log: slog.New(slog.DiscardHandler), cfg: Config{Resync: time.Hour}}
	k := &policyKind{resource: "authorizationpolicies"}
	w := &policyWatch{s: s, kinds: []*policyKind{k}, notify: func() {}}
	ctx, cancel := context.WithCancel(t.Context())
	defer func() { cancel(); w.wait() }()

	settle := func() int {
		time.Sleep(300 * time.Millisecond)
		return runtime.NumGoroutine()
	}
	base := settle()
	w.start(ctx, map[string]found{k.resource: {version: "v1"}})
	for _, f := range []found{{version: "v1beta1"}, {version: "v1"}, {version: "v1beta1"}, {absent: true}} {
		k.gone.Store(true)
		w.start(ctx, map[string]found{k.resource: f})
	}
	if k.informer != nil {
		t.Fatal("the kind whose CRD is gone is still watched")
	}
	deadline := time.Now().Add(5 * time.Second)
	n := settle()
	for n > base && time.Now().Before(deadline) {
		n = settle()
	}
	if n > base {
		t.Errorf("%d goroutines after the kind was dropped, %d before it was first watched", n, base)
	}
}
