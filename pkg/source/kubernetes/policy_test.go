package kubernetes

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

func mustUnstructured(t *testing.T, manifest string) *unstructured.Unstructured {
	t.Helper()
	u := &unstructured.Unstructured{}
	if err := yaml.Unmarshal([]byte(manifest), &u.Object); err != nil {
		t.Fatal(err)
	}
	return u
}

func TestDecodePortLevelMTLS(t *testing.T) {
	u := mustUnstructured(t, `
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {namespace: ns, name: pa}
spec:
  selector: {matchLabels: {app: web}}
  mtls: {mode: STRICT}
  portLevelMtls: {"8080": {mode: DISABLE}}
`)
	pa, err := decode[policy.PeerAuthentication](u)
	if err != nil {
		t.Fatal(err)
	}
	if pa.Namespace != "ns" || pa.Spec.MTLS.Mode != policy.ModeStrict ||
		pa.Spec.PortLevelMTLS[8080].Mode != policy.ModeDisable || pa.Spec.Selector.MatchLabels["app"] != "web" {
		t.Errorf("decoded %+v", pa)
	}
	if leftOut, err := checkSpec[policy.PeerAuthenticationSpec](u); leftOut || err != nil {
		t.Errorf("checkSpec = %v, %v; want false, nil", leftOut, err)
	}
}

// A field the policy types do not know is dropped in decoding; checkSpec must say so, since
// a rule without one of its conditions matches more than its author meant.
func TestCheckSpecReportsIgnoredFields(t *testing.T) {
	u := mustUnstructured(t, `
spec:
  action: ALLOW
  rules:
  - to:
    - operation: {ports: ["80"], methods: [GET], portRange: "80-90"}
`)
	leftOut, err := checkSpec[policy.AuthorizationPolicySpec](u)
	if leftOut || err == nil || !strings.Contains(err.Error(), "portRange") {
		t.Errorf("checkSpec = %v, %v; want false and an error naming portRange", leftOut, err)
	}
}

func TestCheckSpecLeavesOutUndecodable(t *testing.T) {
	u := mustUnstructured(t, `
spec:
  action: [ALLOW]
`)
	if leftOut, err := checkSpec[policy.AuthorizationPolicySpec](u); !leftOut || err == nil {
		t.Errorf("checkSpec = %v, %v; want true and an error", leftOut, err)
	}
	if _, err := decode[policy.AuthorizationPolicy](u); err == nil {
		t.Error("decode succeeded, want an error")
	}
}
