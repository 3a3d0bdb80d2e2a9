package nodepods_test

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/pkg/source/nodepods"
	"github.com/redirector-mesh/redirector/test/kubetest"
)

// TestWatchesOnlyItsNode runs the watcher against a real kube-apiserver:
// it sees every namespace but only the pods whose spec.nodeName is its
// node, and follows changes.
func TestWatchesOnlyItsNode(t *testing.T) {
	cluster := kubetest.Start(t)
	cs := cluster.Client(t)
	ctx := context.Background()
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	create := func(name, node string) {
		t.Helper()
		if _, err := cs.CoreV1().Pods("shop").Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "app", Image: "app"}}}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	create("here-1", "node-a")
	create("there-1", "node-b")

	states := make(chan nodepods.State, 16)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- nodepods.NewForClient(cs, "node-a", nil, nil).Run(runCtx, func(s nodepods.State) { states <- s })
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	wait := func(want ...string) {
		t.Helper()
		deadline := time.After(20 * time.Second)
		var got []string
		for {
			select {
			case s := <-states:
				got = got[:0]
				for _, p := range s.Pods {
					got = append(got, p.Name)
				}
				hasShop := false
				for _, n := range s.Namespaces {
					hasShop = hasShop || n.Name == "shop"
				}
				if hasShop && equal(got, want) {
					return
				}
			case <-deadline:
				t.Fatalf("pods %v, want %v (and namespace shop)", got, want)
			}
		}
	}
	wait("here-1")
	create("there-2", "node-b")
	create("here-2", "node-a")
	wait("here-1", "here-2")
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	seen := map[string]bool{}
	for _, x := range a {
		seen[x] = true
	}
	for _, x := range b {
		if !seen[x] {
			return false
		}
	}
	return true
}
