package netnstest

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/url"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/test/kubetest"
)

// createPod creates p in ns on node1 and writes its status as a kubelet
// would once the sandbox has its network.
func createPod(t *testing.T, cs kubernetes.Interface, p *Pod, ns string) {
	t.Helper()
	ctx := t.Context()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: ns},
		Spec: corev1.PodSpec{NodeName: fmt.Sprintf("node%d", p.Node.Index), ServiceAccountName: "default",
			Containers: []corev1.Container{{Name: "app", Image: "app"}}},
	}
	created, err := cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	created.Status = corev1.PodStatus{Phase: corev1.PodPending, PodIP: p.IPv4.String(),
		PodIPs: []corev1.PodIP{{IP: p.IPv4.String()}, {IP: p.IPv6.String()}}}
	if _, err := cs.CoreV1().Pods(ns).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func annotation(cs kubernetes.Interface, ns, name string) (string, error) {
	p, err := cs.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	return p.Annotations["ambient.istio.io/redirection"], nil
}

func wantAnnotation(t *testing.T, cs kubernetes.Interface, ns, name, want string, timeout time.Duration) {
	t.Helper()
	Eventually(t, timeout, func() error {
		got, err := annotation(cs, ns, name)
		if err != nil {
			return err
		}
		if got != want {
			return fmt.Errorf("pod %s/%s redirection annotation %q, want %q", ns, name, got, want)
		}
		return nil
	})
}

func TestKubernetesSource(t *testing.T) {
	cluster := kubetest.Start(t)
	cs := cluster.Client(t)
	tp := New(t, 1)
	node := tp.Nodes[0]
	a, server, late := node.AddPod("a"), node.AddPod("server"), node.AddPod("late")
	ctx := t.Context()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{"istio.io/dataplane-mode": "ambient"}}}
	if _, err := cs.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	createPod(t, cs, a, "shop")
	ca := t.TempDir() + "/ca"
	initCA(t, ca)
	forwardLoopback(t, node.Path(), cluster.Config.Host)
	ag := StartAgent(t, node, AgentOptions{Binary: redirectorBin(), CADir: ca, Args: []string{"--source", "kubernetes", "--kubeconfig", cluster.Kubeconfig}})
	// Enrolled while still Pending: the annotation appears, capture works.
	wantAnnotation(t, cs, "shop", "a", "enabled", 15*time.Second)
	waitEnrolled(t, ag.BPFRoot, 5*time.Second, "shop/a")
	HTTPApp(t, server, 8080, "server")
	Eventually(t, 5*time.Second, func() error { _, err := Curl(a, URL(server.IPv4, 8080)); return err })

	// Namespace label removed: unenrolled, annotation removed.
	got, err := cs.CoreV1().Namespaces().Get(ctx, "shop", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	delete(got.Labels, "istio.io/dataplane-mode")
	if _, err := cs.CoreV1().Namespaces().Update(ctx, got, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	wantAnnotation(t, cs, "shop", "a", "", 5*time.Second)
	waitEnrolled(t, ag.BPFRoot, 2*time.Second)

	// The apiserver restarts; what happens after it is not lost.
	cluster.Restart(t)
	got, err = cs.CoreV1().Namespaces().Get(ctx, "shop", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got.Labels["istio.io/dataplane-mode"] = "ambient"
	if _, err := cs.CoreV1().Namespaces().Update(ctx, got, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	createPod(t, cs, late, "shop")
	wantAnnotation(t, cs, "shop", "late", "enabled", 30*time.Second)
	wantAnnotation(t, cs, "shop", "a", "enabled", 5*time.Second)
	waitEnrolled(t, ag.BPFRoot, 5*time.Second, "shop/a", "shop/late")
}

// forwardLoopback makes the apiserver, which listens on the root
// namespace's loopback, reachable at the same address from the node
// namespace's loopback, where the agent runs. Loopback to loopback only.
func forwardLoopback(t *testing.T, nsPath, host string) {
	t.Helper()
	u, err := url.Parse(host)
	if err != nil {
		t.Fatal(err)
	}
	l, err := netns.Listen(t.Context(), nsPath, "tcp", u.Host, netns.SocketOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ServeConns(t, l, func(c net.Conn) {
		up, err := net.Dial("tcp", u.Host)
		if err != nil {
			return
		}
		defer up.Close()
		go func() { io.Copy(up, c); up.(*net.TCPConn).CloseWrite() }()
		io.Copy(c, up)
	})
}
