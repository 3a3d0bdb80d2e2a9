package kubernetes_test

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"

	"github.com/redirector-mesh/redirector/pkg/policy"
	"github.com/redirector-mesh/redirector/pkg/source"
	"github.com/redirector-mesh/redirector/pkg/source/kubernetes"
)

// installCRDsServing installs the stand-in Istio CRDs serving only version (instead of v1).
func installCRDsServing(t *testing.T, dyn dynamic.Interface, version string) {
	t.Helper()
	for _, f := range []string{"testdata/crd-peerauthentication.yaml", "testdata/crd-authorizationpolicy.yaml"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		manifest := strings.Replace(string(b), "    - name: v1\n", "    - name: "+version+"\n", 1)
		if manifest == string(b) {
			t.Fatalf("%s: no version v1 to replace", f)
		}
		createObject(t, dyn, crdGVR, manifest)
	}
}

// TestSourceReadsV1beta1OnlyCRDs: a cluster whose Istio CRDs serve security.istio.io/v1beta1
// and not v1 (Istio before 1.22, or a CRD an operator pinned) has its policies in v1beta1,
// which is the same schema. Before, discovery of v1 answered 404 and the CRD did not serve
// v1, so the source took the kinds as "not installed" and delivered snapshots without any
// policy: the DENY policy and the STRICT PeerAuthentication were dropped (allow-all,
// plaintext admitted) without an error.
func TestSourceReadsV1beta1OnlyCRDs(t *testing.T) {
	t.Parallel()
	c, client, dyn := startWithPolicyCRDs(t, "v1beta1")
	createNamespace(t, client, "shop", ambient)
	createStrictPeerAuthentication(t, dyn, "v1beta1", "shop")
	createDenyAll(t, dyn, "v1beta1", "shop", "deny-all")
	waitServed(t, c.Config, policyGVR("v1beta1", "peerauthentications"))
	waitServed(t, c.Config, policyGVR("v1beta1", "authorizationpolicies"))

	w := runSource(t, c.Config)
	first := w.first(t)
	if !slices.ContainsFunc(first.PeerAuthentications, named[policy.PeerAuthentication]("shop", "strict")) {
		t.Errorf("first snapshot lacks the v1beta1 PeerAuthentication (STRICT dropped): %+v", first.PeerAuthentications)
	}
	i := slices.IndexFunc(first.AuthorizationPolicies, named[policy.AuthorizationPolicy]("shop", "deny-all"))
	if i < 0 {
		t.Fatalf("first snapshot lacks the v1beta1 DENY AuthorizationPolicy: %+v", first.AuthorizationPolicies)
	}
	if a := first.AuthorizationPolicies[i].Spec.Action; a != policy.ActionDeny {
		t.Errorf("action %q, want DENY", a)
	}

	// A change made in v1beta1 reaches snapshots too.
	createDenyAll(t, dyn, "v1beta1", "shop", "deny-more")
	w.waitFor(t, "the second DENY policy", func(s source.Snapshot) bool {
		return slices.ContainsFunc(s.AuthorizationPolicies, named[policy.AuthorizationPolicy]("shop", "deny-more"))
	})
}

// TestSourceRefusesCRDsOfUnknownVersion: Istio policy CRDs that serve only a version the agent
// cannot read (neither v1 nor v1beta1) hold policies it cannot see. Taking the kinds as not
// installed would deliver snapshots without them (fail open); the source delivers nothing,
// with the discovery error counted, until a version it reads is served.
func TestSourceRefusesCRDsOfUnknownVersion(t *testing.T) {
	t.Parallel()
	c, client, dyn := startWithPolicyCRDs(t, "v2alpha1")
	createNamespace(t, client, "shop", ambient)
	createStrictPeerAuthentication(t, dyn, "v2alpha1", "shop")
	waitServed(t, c.Config, policyGVR("v2alpha1", "peerauthentications"))

	m := source.NewMetrics(nil)
	w := runSourceWith(t, kubernetes.Config{RestConfig: c.Config, Metrics: m, PolicyRecheck: 200 * time.Millisecond})
	time.Sleep(3 * time.Second)
	if n := w.count(); n != 0 {
		t.Fatalf("%d snapshots delivered while the policy CRDs serve only a version the agent cannot read", n)
	}
	if errorCount(t, m, source.ReasonDiscovery) == 0 {
		t.Error("no discovery error counted")
	}
}

// TestSourceTrimsPolicies: every node caches every policy of the cluster, and a tenant who
// may write AuthorizationPolicies in its namespace decides their size. Annotations alone may
// take 256 KiB an object, which the informer cache kept and every decoded copy held again
// (policy.Meta carries annotations): a thousand such policies cost half a GiB on every node.
// Only istio.io/dry-run is read; the rest is dropped before the cache, as for pods.
func TestSourceTrimsPolicies(t *testing.T) {
	t.Parallel()
	c, client, dyn := startWithPolicyCRDs(t, "v1")
	createNamespace(t, client, "shop", ambient)
	big := strings.Repeat("x", 200<<10)
	createObject(t, dyn, authzGVR, `
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  namespace: shop
  name: deny-dry
  labels: {team: shop}
  annotations: {istio.io/dry-run: "true", padding: "`+big+`"}
spec: {action: DENY, rules: [{}]}
`)
	waitServed(t, c.Config, authzGVR)

	w := runSource(t, c.Config)
	snap := w.waitFor(t, "the policy", func(s source.Snapshot) bool {
		return slices.ContainsFunc(s.AuthorizationPolicies, named[policy.AuthorizationPolicy]("shop", "deny-dry"))
	})
	ap := snap.AuthorizationPolicies[slices.IndexFunc(snap.AuthorizationPolicies, named[policy.AuthorizationPolicy]("shop", "deny-dry"))]
	if _, ok := ap.Annotations["padding"]; ok {
		t.Errorf("the policy holds an annotation nothing reads (%d bytes)", len(ap.Annotations["padding"]))
	}
	if ap.Annotations[policy.DryRunAnnotation] != "true" || ap.Labels["team"] != "shop" || ap.Spec.Action != policy.ActionDeny || ap.UID == "" || ap.CreationTimestamp.IsZero() {
		t.Errorf("trimmed too much: %+v", ap)
	}
}

// serveOnly makes the stand-in Istio CRDs serve (and store) only version, keeping the
// version they served before as a version not served, as an operator does once every object
// is read in the new one.
func serveOnly(t *testing.T, dyn dynamic.Interface, version string) {
	t.Helper()
	for _, name := range []string{"peerauthentications.security.istio.io", "authorizationpolicies.security.istio.io"} {
		crd, err := dyn.Resource(crdGVR).Get(t.Context(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		versions, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
		old := versions[0].(map[string]any)
		next := runtime.DeepCopyJSONValue(old).(map[string]any)
		next["name"], next["served"], next["storage"] = version, true, true
		old["served"], old["storage"] = false, false
		if err := unstructured.SetNestedSlice(crd.Object, []any{next, old}, "spec", "versions"); err != nil {
			t.Fatal(err)
		}
		if _, err := dyn.Resource(crdGVR).Update(t.Context(), crd, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("update CRD %s: %v", name, err)
		}
	}
}

// TestSourceFollowsPolicyVersionChange: an agent started while the Istio CRDs served only
// v1beta1 watches v1beta1. Istio upgraded serves v1, and once v1beta1 is no longer served
// the agent's lists of v1beta1 answer 404. Before, its informers retried v1beta1 for ever:
// a policy created since (a DENY, a STRICT) never reached a snapshot, and one deleted stayed
// in force, with only a list error counted. The kind is looked up again and watched in v1.
func TestSourceFollowsPolicyVersionChange(t *testing.T) {
	t.Parallel()
	c, client, dyn := startWithPolicyCRDs(t, "v1beta1")
	createNamespace(t, client, "shop", ambient)
	createDenyAll(t, dyn, "v1beta1", "shop", "deny-old")
	waitServed(t, c.Config, policyGVR("v1beta1", "authorizationpolicies"))
	waitServed(t, c.Config, policyGVR("v1beta1", "peerauthentications"))

	w := runSource(t, c.Config)
	w.waitFor(t, "the v1beta1 DENY policy", func(s source.Snapshot) bool {
		return slices.ContainsFunc(s.AuthorizationPolicies, named[policy.AuthorizationPolicy]("shop", "deny-old"))
	})

	serveOnly(t, dyn, "v1")
	waitServed(t, c.Config, authzGVR)
	waitServed(t, c.Config, peerAuthGVR)
	createStrictPeerAuthentication(t, dyn, "v1", "shop")
	if err := dyn.Resource(authzGVR).Namespace("shop").Delete(t.Context(), "deny-old", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor(t, "the STRICT PeerAuthentication created in v1, without the deleted DENY", func(s source.Snapshot) bool {
		return slices.ContainsFunc(s.PeerAuthentications, named[policy.PeerAuthentication]("shop", "strict")) &&
			!slices.ContainsFunc(s.AuthorizationPolicies, named[policy.AuthorizationPolicy]("shop", "deny-old"))
	})
}
