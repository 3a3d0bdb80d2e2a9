package istiotest

import (
	"testing"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/redirector-mesh/redirector/test/kubetest"
)

// AgentAccount is the service account (namespace/name) a test's node agent runs as;
// StartControlPlane makes istiod trust it as a node agent.
const AgentAccount = Namespace + "/redirector"

// ControlPlane is a test kube-apiserver with istiod running against it, and clients of the
// API server to make the objects istiod turns into xDS.
type ControlPlane struct {
	Cluster *kubetest.Cluster
	Istiod  *Istiod
	Client  kubernetes.Interface
	// Dynamic writes Istio's own kinds (ServiceEntries, policies), through Cluster.Kubeconfig.
	Dynamic dynamic.Interface
}

// StartControlPlane starts a kube-apiserver and an istiod that trusts AgentAccount's tokens
// to ask for the identities of pods on their own node: the start every test of a client of
// a real istiod shares. Under -short it skips the test, as both servers take seconds to
// start (and minutes to build on a cold cache).
func StartControlPlane(t testing.TB) *ControlPlane {
	t.Helper()
	if testing.Short() {
		t.Skip("runs kube-apiserver and istiod")
	}
	cluster := kubetest.Start(t)
	cp := &ControlPlane{Cluster: cluster, Client: cluster.Client(t)}
	cp.Istiod = Start(t, cluster, Options{TrustedNodeAccounts: []string{AgentAccount}})
	rc, err := clientcmd.BuildConfigFromFlags("", cluster.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	if cp.Dynamic, err = dynamic.NewForConfig(rc); err != nil {
		t.Fatal(err)
	}
	return cp
}
