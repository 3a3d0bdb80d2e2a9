package kubetest_test

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/redirector-mesh/redirector/test/kubetest"
)

// TestStart checks what tests rely on: the kubeconfig works, dual-stack Services get both
// ClusterIPs, and objects survive Restart.
func TestStart(t *testing.T) {
	c := kubetest.Start(t)
	ctx := t.Context()

	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		t.Fatalf("load kubeconfig: %v", err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kubetest"}}
	if _, err := client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace: %v", err)
	}

	policy := corev1.IPFamilyPolicyRequireDualStack
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "kubetest", Name: "svc"},
		Spec: corev1.ServiceSpec{
			IPFamilyPolicy: &policy,
			Ports:          []corev1.ServicePort{{Port: 80}},
		},
	}
	svc, err = client.CoreV1().Services("kubetest").Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create dual-stack service: %v", err)
	}
	if len(svc.Spec.ClusterIPs) != 2 {
		t.Errorf("ClusterIPs = %v, want one per family", svc.Spec.ClusterIPs)
	}

	c.Restart(t)
	if _, err := c.Client(t).CoreV1().Namespaces().Get(context.Background(), "kubetest", metav1.GetOptions{}); err != nil {
		t.Fatalf("namespace after restart: %v", err)
	}
}
