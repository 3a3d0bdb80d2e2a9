package nodepods_test

import (
	"context"
	"strings"
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

// TestKeepsOnlyWhatEnrollmentReads: a tenant decides how large its pods
// are (annotations up to 256 KiB, environment and command up to the
// object's 1.5 MiB), and the watcher kept every local pod whole, as it did
// every namespace. It keeps what translation reads, as the Kubernetes
// source's cache does (kubeobj.CompactPod, kubeobj.TrimNamespace).
func TestKeepsOnlyWhatEnrollmentReads(t *testing.T) {
	cluster := kubetest.Start(t)
	cs := cluster.Client(t)
	ctx := context.Background()
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop",
		Labels:      map[string]string{"istio.io/dataplane-mode": "ambient"},
		Annotations: map[string]string{"padding": strings.Repeat("n", 100<<10)}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	big := strings.Repeat("x", 200<<10)
	if _, err := cs.CoreV1().Pods("shop").Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web", Labels: map[string]string{"app": "web"},
		Annotations: map[string]string{"padding": big, "ambient.istio.io/bypass-inbound-capture": "true"}},
		Spec: corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "app", Image: "app",
			Env:   []corev1.EnvVar{{Name: "PADDING", Value: big}},
			Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}}}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
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
	var s nodepods.State
	select {
	case s = <-states:
	case <-time.After(20 * time.Second):
		t.Fatal("no state")
	}
	if len(s.Pods) != 1 {
		t.Fatalf("pods %+v", s.Pods)
	}
	p := s.Pods[0]
	if _, ok := p.Annotations["padding"]; ok {
		t.Errorf("the pod's cached annotations hold %d bytes nothing reads", len(p.Annotations["padding"]))
	}
	for _, c := range p.Spec.Containers {
		if len(c.Env) > 0 {
			t.Errorf("the pod's cached container %q keeps its environment", c.Name)
		}
	}
	if p.Labels["app"] != "web" || p.Annotations["ambient.istio.io/bypass-inbound-capture"] != "true" || len(p.Spec.Containers) != 1 || p.Spec.Containers[0].Ports[0].ContainerPort != 8080 {
		t.Errorf("trimmed too much: %+v", p)
	}
	for _, n := range s.Namespaces {
		if n.Name == "shop" && (n.Annotations["padding"] != "" || n.Labels["istio.io/dataplane-mode"] != "ambient") {
			t.Errorf("namespace shop: annotations %d bytes, labels %v; want only the labels read", len(n.Annotations["padding"]), n.Labels)
		}
	}
}
