// Package istiotest runs a real istiod (pilot-discovery, built by hack/istio-binaries.sh)
// against the test kube-apiserver of test/kubetest, on loopback, as the CA of the agents
// under test: Istio's CRDs applied, its self-signed root, and CA_TRUSTED_NODE_ACCOUNTS
// naming the agents' service account, so that its node authorizer signs an agent only the
// identities of pods on the agent's own node.
//
// Every port istiod opens is on 127.0.0.1 (its defaults are all interfaces). The process
// and its files go away in t.Cleanup.
package istiotest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/redirector-mesh/redirector/test/kubetest"
	"github.com/redirector-mesh/redirector/test/testbin"
)

// Namespace is istiod's namespace, where the agents' service account lives too.
const Namespace = "istio-system"

// ServerName is the DNS name in istiod's serving certificate that clients check.
const ServerName = "istiod.istio-system.svc"

// Audience is the token audience istiod's CA accepts.
const Audience = "istio-ca"

// ClusterID is istiod's name for the test cluster.
const ClusterID = "Kubernetes"

const readyTimeout = 90 * time.Second // generous: the machine may be busy with builds

// Options configure Start.
type Options struct {
	// TrustedNodeAccounts are namespace/name service accounts whose tokens may ask for
	// the identities of pods on their own node (CA_TRUSTED_NODE_ACCOUNTS).
	TrustedNodeAccounts []string
}

// Istiod is a running pilot-discovery.
type Istiod struct {
	// Addr is istiod's CA (secured gRPC, 15012 in a cluster), 127.0.0.1:port.
	Addr string
	// RootCert is the PEM root-cert.pem of the istio-ca-root-cert ConfigMap; RootCertFile
	// holds the same.
	RootCert     []byte
	RootCertFile string

	bins    binaries
	dir     string
	args    []string
	env     []string
	httpURL string
	cmd     *exec.Cmd
	done    chan struct{}
}

// Start applies Istio's CRDs and an istio-system namespace to the cluster, runs istiod, and
// waits until it is ready and has published its root.
func Start(t testing.TB, c *kubetest.Cluster, o Options) *Istiod {
	t.Helper()
	i := &Istiod{bins: findBinaries(t), dir: t.TempDir()}
	ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
	defer cancel()
	cs := c.Client(t)
	if err := applyCRDs(ctx, c, i.bins.crds); err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: Namespace}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}

	ports := make([]int, 6)
	for k := range ports {
		ports[k] = freePort(t)
	}
	addr := func(p int) string { return "127.0.0.1:" + strconv.Itoa(p) }
	i.Addr = addr(ports[1])
	i.httpURL = "http://" + addr(ports[2])
	i.args = []string{"discovery", "--kubeconfig", c.Kubeconfig,
		"--grpcAddr=" + addr(ports[0]), "--secureGRPCAddr=" + i.Addr, "--httpAddr=" + addr(ports[2]),
		"--httpsAddr=" + addr(ports[3]), "--monitoringAddr=" + addr(ports[4]),
		"--ctrlz_address=127.0.0.1", "--ctrlz_port=" + strconv.Itoa(ports[5]),
	}
	i.env = append(os.Environ(),
		"POD_NAMESPACE="+Namespace, "POD_NAME=istiod-test", "REVISION=default",
		"PILOT_CERT_PROVIDER=istiod", "ENABLE_CA_SERVER=true", "CLUSTER_ID="+ClusterID,
		"CA_TRUSTED_NODE_ACCOUNTS="+strings.Join(o.TrustedNodeAccounts, ","),
		"PILOT_ENABLE_AMBIENT=true",
	)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("--- last lines of istiod log:\n%s", i.logTail(40))
		}
		i.Stop()
	})
	i.start(t)

	// The root istiod made (or found in istio-ca-secret) and published.
	var root []byte
	err := poll(ctx, func() error {
		cm, err := cs.CoreV1().ConfigMaps(Namespace).Get(ctx, "istio-ca-root-cert", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if root = []byte(cm.Data["root-cert.pem"]); len(root) == 0 {
			return errors.New("istio-ca-root-cert has no root-cert.pem")
		}
		return nil
	})
	if err != nil {
		t.Fatalf("istiod published no root: %v", err)
	}
	i.RootCert = root
	i.RootCertFile = filepath.Join(i.dir, "root-cert.pem")
	if err := os.WriteFile(i.RootCertFile, root, 0o644); err != nil {
		t.Fatal(err)
	}
	return i
}

// start runs the process and waits for /ready.
func (i *Istiod) start(t testing.TB) {
	t.Helper()
	logFile, err := os.OpenFile(filepath.Join(i.dir, "istiod.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	i.cmd = exec.Command(i.bins.istiod, i.args...)
	i.cmd.Env = i.env
	i.cmd.Dir = i.dir // istiod writes a few files relative to its working directory
	i.cmd.Stdout, i.cmd.Stderr = logFile, logFile
	if err := testbin.Spawn(i.cmd); err != nil {
		t.Fatalf("start istiod: %v", err)
	}
	i.done = make(chan struct{})
	done := i.done
	cmd := i.cmd
	go func() { _ = cmd.Wait(); close(done) }()

	ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
	defer cancel()
	client := &http.Client{Timeout: 2 * time.Second}
	err = poll(ctx, func() error {
		select {
		case <-done:
			return fmt.Errorf("istiod exited: %v", cmd.ProcessState)
		default:
		}
		resp, err := client.Get(i.httpURL + "/ready")
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/ready: %s", resp.Status)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("istiod not ready: %v", err)
	}
}

// Stop ends istiod (SIGTERM, then SIGKILL after a grace period). Connections to it break.
func (i *Istiod) Stop() {
	if i.cmd == nil || i.cmd.Process == nil {
		return
	}
	select {
	case <-i.done:
		return
	default:
	}
	pgid := i.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-i.done:
	case <-time.After(5 * time.Second):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-i.done
	}
}

// Restart starts a stopped istiod again on the same ports; it finds its root in
// istio-ca-secret, so certificates it issued before stay valid.
func (i *Istiod) Restart(t testing.TB) {
	t.Helper()
	i.Stop()
	i.start(t)
}

func (i *Istiod) logTail(n int) string {
	b, _ := os.ReadFile(filepath.Join(i.dir, "istiod.log"))
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// applyCRDs server-side applies every CRD in path and waits until all are established.
func applyCRDs(ctx context.Context, c *kubetest.Cluster, path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(c.Config)
	if err != nil {
		return err
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var names []string
	for {
		var obj map[string]any
		if err := dec.Decode(&obj); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return fmt.Errorf("decode %s: %w", path, err)
		}
		if obj == nil {
			continue
		}
		u := &unstructured.Unstructured{Object: obj}
		if u.GetKind() != "CustomResourceDefinition" {
			continue
		}
		if _, err := dyn.Resource(crdGVR).Apply(ctx, u.GetName(), u, metav1.ApplyOptions{FieldManager: "istiotest", Force: true}); err != nil {
			return fmt.Errorf("apply crd %s: %w", u.GetName(), err)
		}
		names = append(names, u.GetName())
	}
	if len(names) == 0 {
		return fmt.Errorf("%s: no CustomResourceDefinition", path)
	}
	return poll(ctx, func() error {
		for _, n := range names {
			u, err := dyn.Resource(crdGVR).Get(ctx, n, metav1.GetOptions{})
			if err != nil {
				return err
			}
			conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
			established := false
			for _, cd := range conds {
				m, _ := cd.(map[string]any)
				if m["type"] == "Established" && m["status"] == "True" {
					established = true
				}
			}
			if !established {
				return fmt.Errorf("crd %s not established", n)
			}
		}
		return nil
	})
}

// AgentToken makes what a node agent's Pod has in a cluster: its service account
// (namespace/name), a Pod of the agent on node, and a token for it from the TokenRequest
// API with audience istio-ca, bound to that Pod (what istiod's node authorizer checks). It
// writes the token to a file and returns its path.
func AgentToken(t testing.TB, cs kubernetes.Interface, account, node, audience string) string {
	t.Helper()
	ctx := context.Background()
	ns, sa, ok := strings.Cut(account, "/")
	if !ok {
		t.Fatalf("account %q is not namespace/name", account)
	}
	if _, err := cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	name := sa + "-" + node
	pod, err := cs.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		pod, err = cs.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app": sa}},
			Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa, HostNetwork: true,
				Containers: []corev1.Container{{Name: "agent", Image: "redirector"}}},
		}, metav1.CreateOptions{})
	}
	if err != nil {
		t.Fatal(err)
	}
	tr, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		Audiences:      []string{audience},
		BoundObjectRef: &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token for %s on %s: %v", account, node, err)
	}
	path := filepath.Join(t.TempDir(), "istio-token")
	if err := os.WriteFile(path, []byte(tr.Status.Token), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// CreatePod creates a workload pod running as service account sa on node, with status.podIP
// written through the status subresource as a kubelet would (istiod indexes pods by it).
func CreatePod(t testing.TB, cs kubernetes.Interface, ns, name, sa, node string, ips ...string) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	if _, err := cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	p, err := cs.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa,
			Containers: []corev1.Container{{Name: "app", Image: "app"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ips[0]}
	for _, ip := range ips {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	p, err = cs.CoreV1().Pods(ns).UpdateStatus(ctx, p, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func poll(ctx context.Context, f func() error) error {
	var err error
	for {
		if err = f(); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %w", ctx.Err(), err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func freePort(t testing.TB) int {
	t.Helper()
	p, err := testbin.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return p
}
