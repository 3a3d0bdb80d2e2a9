// Package kubetest runs a real kube-apiserver and etcd on loopback for tests, without Docker,
// kind or a kubelet. Tests talk to a real API server (admission, validation, watch semantics,
// resource versions) instead of a fake clientset that agrees with whatever the code expects.
//
// What runs is only the API server: no controller-manager (no ServiceAccount tokens, no
// garbage collection, a deleted Namespace stays Terminating: use fresh names), no scheduler
// and no kubelet (set spec.nodeName yourself and write status.podIP(s) and phase with
// UpdateStatus). The ServiceAccount admission plugin is disabled so pods need no "default"
// ServiceAccount. Services get ClusterIPs from 10.96.0.0/16 and fd00:10:96::/108 (dual-stack).
//
// The binaries come from REDIRECTOR_K8S_BIN, or from the cache folder of hack/k8s-binaries.sh,
// which builds them (5-7 minutes cold, on 2 cores) when missing. Run that script once
// beforehand, or give go test a -timeout larger than the default 10m, on a fresh machine.
package kubetest

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/test/testbin"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Timeouts of a start; generous because the machine may be busy with other builds.
const (
	etcdStartTimeout      = 30 * time.Second
	apiserverStartTimeout = 90 * time.Second
	apiserverStopGrace    = 10 * time.Second
)

// ServiceCIDRs are the ClusterIP ranges of the test API server (dual-stack, IPv4 first).
const ServiceCIDRs = "10.96.0.0/16,fd00:10:96::/108"

// Cluster is a running etcd and kube-apiserver, stopped by the test's cleanup.
type Cluster struct {
	// Config reaches the API server as a member of system:masters (bearer token). It is
	// shared: rest.CopyConfig it before changing fields.
	Config *rest.Config
	// Kubeconfig is a kubeconfig file with the same server and credentials, for code under
	// test that loads one.
	Kubeconfig string

	bins          binaries
	dir           string
	url           string
	token         string
	apiserverArgs []string
	etcd          *process
	apiserver     *process
}

// Start runs etcd and kube-apiserver on free loopback ports and waits until the API server is
// ready. Both processes and their files go away in t.Cleanup, also when the test fails (then
// the tails of their logs are logged first).
func Start(t testing.TB) *Cluster {
	t.Helper()
	c := &Cluster{bins: findBinaries(t), dir: t.TempDir()}
	t.Cleanup(func() { c.stop(t) }) // registered after TempDir: runs before its removal

	var etcdURL string
	retryOnTakenPort(t, func() (*process, error) {
		etcdURL = "http://127.0.0.1:" + strconv.Itoa(mustFreePort(t))
		peerURL := "http://127.0.0.1:" + strconv.Itoa(mustFreePort(t))
		// A try that could not bind may have begun a member with its URLs.
		if err := os.RemoveAll(filepath.Join(c.dir, "etcd")); err != nil {
			return nil, err
		}
		var err error
		c.etcd, err = startProcess("etcd", c.bins.etcd, []string{
			"--name=kubetest",
			"--data-dir=" + filepath.Join(c.dir, "etcd"),
			"--listen-client-urls=" + etcdURL,
			"--advertise-client-urls=" + etcdURL,
			"--listen-peer-urls=" + peerURL,
			"--initial-advertise-peer-urls=" + peerURL,
			"--initial-cluster=kubetest=" + peerURL,
			"--unsafe-no-fsync", // the data dies with the test; fsync only costs time
			"--log-level=warn",
		}, filepath.Join(c.dir, "etcd.log"))
		if err != nil {
			return nil, err
		}
		err = c.etcd.waitHealthy(&http.Client{Timeout: 5 * time.Second}, etcdURL+"/health", nil, etcdStartTimeout)
		return c.etcd, err
	})

	c.token = rand.Text()
	certDir := filepath.Join(c.dir, "certs")
	saKey := filepath.Join(c.dir, "sa.key")
	tokens := filepath.Join(c.dir, "tokens.csv")
	writeFile(t, saKey, rsaKeyPEM(t))
	writeFile(t, tokens, []byte(c.token+`,kubetest-admin,kubetest-admin,"system:masters"`+"\n"))

	retryOnTakenPort(t, func() (*process, error) {
		port := mustFreePort(t)
		c.url = "https://127.0.0.1:" + strconv.Itoa(port)
		c.apiserverArgs = apiserverArgs(etcdURL, port, certDir, saKey, tokens)
		err := c.tryStartAPIServer()
		return c.apiserver, err
	})

	ca, err := os.ReadFile(filepath.Join(certDir, "apiserver.crt"))
	if err != nil {
		t.Fatalf("read apiserver serving certificate: %v", err)
	}
	c.Config = &rest.Config{
		Host:            c.url,
		BearerToken:     c.token,
		TLSClientConfig: rest.TLSClientConfig{CAData: ca},
		QPS:             100, // tests create objects in bursts; client-side throttling only slows them
		Burst:           200,
	}
	c.Kubeconfig = filepath.Join(c.dir, "kubeconfig")
	if err := writeKubeconfig(c.Kubeconfig, c.url, ca, c.token); err != nil {
		t.Fatal(err)
	}
	return c
}

// apiserverArgs are kube-apiserver's flags for a test cluster.
func apiserverArgs(etcdURL string, port int, certDir, saKey, tokens string) []string {
	return []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		// Without an advertise address the server looks for a default route, which a
		// sandbox may not have. Endpoints may not hold loopback addresses, so the
		// "kubernetes" Service gets no endpoints instead of the host's address.
		"--advertise-address=127.0.0.1",
		"--endpoint-reconciler-type=none",
		"--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + certDir, // self-signed serving cert, reused across Restart
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + saKey,
		"--service-account-signing-key-file=" + saKey,
		"--token-auth-file=" + tokens,
		"--authorization-mode=RBAC",
		"--disable-admission-plugins=ServiceAccount", // no controller-manager creates "default" SAs
		"--service-cluster-ip-range=" + ServiceCIDRs,
		"--allow-privileged=true",
		"--profiling=false",
		"--shutdown-watch-termination-grace-period=2s",
	}
}

// retryOnTakenPort runs start, which picks free ports and starts a process
// on them, again (at most three times) when the process could not bind
// one: a port found free can be taken by a parallel test before the
// process binds it. Any other failure fails the test.
func retryOnTakenPort(t testing.TB, start func() (*process, error)) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		p, err := start()
		if err == nil {
			return
		}
		if p == nil || attempt == 3 || !strings.Contains(p.logTail(30), "address already in use") {
			t.Fatal(err) // cleanup logs the end of the log
		}
		t.Logf("%s could not bind its port, retrying on another: %v", p.name, err)
		p.stop(apiserverStopGrace)
	}
}

// Restart stops the API server and starts it again on the same port, with the same etcd and
// certificates: clients keep their Config, and their watches must reconnect and resume.
func (c *Cluster) Restart(t testing.TB) {
	t.Helper()
	c.apiserver.stop(apiserverStopGrace)
	c.startAPIServer(t)
}

// Client returns a clientset for c.Config.
func (c *Cluster) Client(t testing.TB) kubernetes.Interface {
	t.Helper()
	cs, err := kubernetes.NewForConfig(c.Config)
	if err != nil {
		t.Fatalf("kubernetes client: %v", err)
	}
	return cs
}

func (c *Cluster) startAPIServer(t testing.TB) {
	t.Helper()
	if err := c.tryStartAPIServer(); err != nil {
		t.Fatal(err) // cleanup logs the end of the log
	}
}

// tryStartAPIServer starts kube-apiserver with c's flags and waits until it
// is ready.
func (c *Cluster) tryStartAPIServer() error {
	var err error
	c.apiserver, err = startProcess("kube-apiserver", c.bins.apiserver, c.apiserverArgs, filepath.Join(c.dir, "kube-apiserver.log"))
	if err != nil {
		return err
	}
	// The serving certificate is not known before the server writes it: skip verification
	// for the readiness probe only.
	client := &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}},
	}
	defer client.CloseIdleConnections()
	header := http.Header{"Authorization": {"Bearer " + c.token}}
	return c.apiserver.waitHealthy(client, c.url+"/readyz", header, apiserverStartTimeout)
}

// stop ends both processes; on a failed test it logs the ends of their logs first.
func (c *Cluster) stop(t testing.TB) {
	for _, p := range []*process{c.apiserver, c.etcd} {
		if p == nil {
			continue
		}
		if t.Failed() {
			t.Logf("--- last lines of %s log:\n%s", p.name, p.logTail(30))
		}
		p.stop(apiserverStopGrace)
	}
}

func writeKubeconfig(path, server string, ca []byte, token string) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca}
	kc.AuthInfos["kubetest-admin"] = &clientcmdapi.AuthInfo{Token: token}
	kc.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: "kubetest-admin"}
	kc.CurrentContext = "kubetest"
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	return nil
}

func rsaKeyPEM(t testing.TB) []byte {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatalf("generate service account key: %v", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)})
}

func writeFile(t testing.TB, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// freePort finds a free loopback port (a variable for the test that
// hands out a taken one).
var freePort = testbin.FreePort

func mustFreePort(t testing.TB) int {
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	return port
}
