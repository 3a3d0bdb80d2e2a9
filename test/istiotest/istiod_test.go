package istiotest

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/identity/istioca"
	"github.com/redirector-mesh/redirector/test/kubetest"
)

const agentAccount = Namespace + "/redirector"

// TestIstiodSignsOnlyTheCallersNode asks the real istiod, through the agent's CA client, for
// identities of pods on the caller's node and on another node, and with credentials istiod
// must refuse.
func TestIstiodSignsOnlyTheCallersNode(t *testing.T) {
	cluster := kubetest.Start(t)
	cs := cluster.Client(t)
	istiod := Start(t, cluster, Options{TrustedNodeAccounts: []string{agentAccount}})
	ctx := context.Background()
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	CreatePod(t, cs, "shop", "web", "web", "node1", "10.1.1.2")
	CreatePod(t, cs, "shop", "db", "db", "node2", "10.1.2.2")
	web := identity.ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "web"}
	db := identity.ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "db"}
	bundle, err := identity.LoadBundle(istiod.RootCertFile, "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	client := func(tokenFile, clusterID string) *istioca.Client {
		c, err := istioca.New(istioca.Config{Addr: istiod.Addr, TokenFile: tokenFile, ClusterID: clusterID, Trust: bundle})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	sign := func(c *istioca.Client, id identity.ID) (*identity.ID, time.Duration, error) {
		ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		cert, err := c.Sign(ctx, id, 10*time.Minute)
		if err != nil {
			return nil, 0, err
		}
		got, err := identity.ParseID(cert.Leaf.URIs[0].String())
		return &got, time.Until(cert.Leaf.NotAfter), err
	}

	node1 := client(AgentToken(t, cs, agentAccount, "node1", Audience), ClusterID)
	// istiod's informers may take a moment to see the pods.
	var lastErr error
	deadline := time.Now().Add(30 * time.Second)
	for {
		got, left, err := sign(node1, web)
		if err == nil {
			if *got != web || left > 11*time.Minute || left < 8*time.Minute {
				t.Fatalf("istiod issued %s valid for %s, want %s for about 10m", got, left, web)
			}
			break
		}
		lastErr = err
		if time.Now().After(deadline) {
			t.Fatalf("node-1 agent asking for its own pod's identity: %v", lastErr)
		}
		time.Sleep(300 * time.Millisecond)
	}

	// The identity of a pod that runs only on node 2: refused by istiod's node authorizer.
	if _, _, err := sign(node1, db); identity.ReasonOf(err) != identity.ReasonUnauthenticated {
		t.Errorf("node-1 agent asking for node-2's identity: err = %v (reason %s), want unauthenticated", err, identity.ReasonOf(err))
	} else {
		t.Logf("refused as expected: %v", err)
	}
	for name, c := range map[string]*istioca.Client{
		"wrong audience":     client(AgentToken(t, cs, agentAccount, "node1", "kubernetes"), ClusterID),
		"untrusted account":  client(AgentToken(t, cs, Namespace+"/intruder", "node1", Audience), ClusterID),
		"unknown cluster id": client(AgentToken(t, cs, agentAccount, "node1", Audience), "elsewhere"),
	} {
		if _, _, err := sign(c, web); err == nil {
			t.Errorf("%s: istiod signed", name)
		} else if r := identity.ReasonOf(err); r != identity.ReasonUnauthenticated && r != identity.ReasonPermissionDenied {
			t.Errorf("%s: err = %v (reason %s)", name, err, r)
		}
	}
}
