package policy

import (
	"errors"
	"strings"
	"testing"
)

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		policy string
		want   []string // substrings of the error; none means valid
	}{
		{name: "valid", policy: `
metadata: {name: ok, namespace: shop}
spec:
  action: DENY
  selector: {matchLabels: {app: db}}
  rules:
  - from: [{source: {principals: ["*"], ipBlocks: ["10.0.0.0/8", "fd00::1"], notIpBlocks: ["10.1.0.0/16"]}}]
    to: [{operation: {ports: ["80", "65535"], notPorts: ["1"]}}]
    when: [{key: destination.port, values: ["5432"]}, {key: "request.headers[x]", notValues: [y]}]`},
		{name: "allow nothing is valid", policy: `
metadata: {name: nothing, namespace: shop}
spec: {}`},
		{name: "l7-only deny is valid", policy: `
metadata: {name: l7, namespace: shop}
spec: {action: DENY, rules: [{to: [{operation: {methods: [GET]}}]}]}`},
		{name: "unknown action", policy: `
metadata: {name: typo, namespace: shop}
spec: {action: deny}`,
			want: []string{"shop/typo", "spec.action", `unknown action "deny"`}},
		{name: "malformed ip blocks", policy: `
metadata: {name: ips, namespace: shop}
spec:
  rules:
  - from:
    - source: {ipBlocks: ["10.0.0.0/8", "10.0.0.0/33"]}
    - source: {notIpBlocks: ["10.0.0.256"], remoteIpBlocks: ["fe80::1%eth0"]}`,
			want: []string{
				"shop/ips",
				`spec.rules[0].from[0].source.ipBlocks[1]: malformed ip block "10.0.0.0/33"`,
				`spec.rules[0].from[1].source.notIpBlocks[0]: malformed ip block "10.0.0.256"`,
				`spec.rules[0].from[1].source.remoteIpBlocks[0]: malformed ip block "fe80::1%eth0"`,
			}},
		{name: "trust domains", policy: `
metadata: {name: td, namespace: shop}
spec:
  rules:
  - from:
    - source: {trustDomains: ["*.example", "ok", ""]}
    - source: {notTrustDomains: ["a*b", "td/ns", "**"]}`,
			want: []string{
				`spec.rules[0].from[0].source.trustDomains[2]: empty value`,
				`spec.rules[0].from[1].source.notTrustDomains[0]: "a*b"`,
				`spec.rules[0].from[1].source.notTrustDomains[1]: "td/ns"`,
				`spec.rules[0].from[1].source.notTrustDomains[2]: "**"`,
			}},
		{name: "trust domains alone make a source", policy: `
metadata: {name: td, namespace: shop}
spec: {rules: [{from: [{source: {notTrustDomains: ["*.example"]}}]}]}`},
		{name: "custom with a provider is valid", policy: `
metadata: {name: ext, namespace: shop}
spec: {action: CUSTOM, provider: {name: ext-authz}, rules: [{}]}`},
		{name: "provider without custom", policy: `
metadata: {name: ext, namespace: shop}
spec: {action: DENY, provider: {name: ext-authz}, rules: [{}]}`,
			want: []string{`spec.provider: is only for action CUSTOM, not "DENY"`}},
		{name: "bad ports", policy: `
metadata: {name: ports, namespace: shop}
spec:
  rules:
  - to: [{operation: {ports: ["0", "65536", "http", "-1"], notPorts: ["8o"]}}]
    when: [{key: destination.port, values: ["70000"]}]`,
			want: []string{
				`spec.rules[0].to[0].operation.ports[0]: "0" is not a port number in 1..65535`,
				`spec.rules[0].to[0].operation.ports[1]: "65536"`,
				`spec.rules[0].to[0].operation.ports[2]: "http"`,
				`spec.rules[0].to[0].operation.ports[3]: "-1"`,
				`spec.rules[0].to[0].operation.notPorts[0]: "8o"`,
				`spec.rules[0].when[0].values[0]: "70000"`,
			}},
		{name: "empty and missing blocks", policy: `
metadata: {name: empty, namespace: shop}
spec:
  rules:
  - from: []
    to: []
  - from: [{}, {source: {}}]
    to: [{}, {operation: {}}]
    when: [{key: ""}, {key: source.ip}]
  - from: [{source: {principals: [""]}}]`,
			want: []string{
				"spec.rules[0].from: must not be empty",
				"spec.rules[0].to: must not be empty",
				"spec.rules[1].from[0].source: must be set",
				"spec.rules[1].from[1].source: must not be empty",
				"spec.rules[1].to[0].operation: must be set",
				"spec.rules[1].to[1].operation: must not be empty",
				"spec.rules[1].when[0].key: must be set",
				`spec.rules[1].when[1]: at least one of values and notValues must be set for key "source.ip"`,
				"spec.rules[2].from[0].source.principals[0]: empty value",
			}},
		{name: "service accounts", policy: `
metadata: {name: sas, namespace: shop}
spec:
  rules:
  - from: [{source: {serviceAccounts: ["a/b/c", "/x", "*"], namespaces: [shop]}}]`,
			want: []string{
				"serviceAccounts cannot be combined with principals or namespaces",
				`serviceAccounts[0]: "a/b/c"`,
				`serviceAccounts[1]: "/x"`,
				`serviceAccounts[2]: "*"`,
			}},
		{name: "selector with targetRefs", policy: `
metadata: {name: both, namespace: shop}
spec:
  selector: {matchLabels: {app: db}}
  targetRefs: [{kind: Service, name: db}]`,
			want: []string{"only one of selector, targetRef and targetRefs"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ap := decodeAll[AuthorizationPolicy](t, tc.policy)[0]
			err := Validate(ap)
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("Validate: err = %v, want ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), "authorizationpolicy "+ap.Namespace+"/"+ap.Name) {
				t.Errorf("error %q does not name the policy", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
		})
	}
}

func TestValidatePA(t *testing.T) {
	for _, tc := range []struct {
		name   string
		policy string
		want   []string
	}{
		{name: "valid mesh", policy: `
metadata: {name: default, namespace: istio-system}
spec: {mtls: {mode: STRICT}}`},
		{name: "valid workload ports", policy: `
metadata: {name: db, namespace: shop}
spec: {selector: {matchLabels: {app: db}}, portLevelMtls: {5432: {mode: DISABLE}, 80: {}}}`},
		{name: "unknown modes", policy: `
metadata: {name: typo, namespace: shop}
spec: {selector: {matchLabels: {app: db}}, mtls: {mode: STRICTER}, portLevelMtls: {80: {mode: permissive}}}`,
			want: []string{
				"peerauthentication shop/typo",
				`spec.mtls.mode: unknown mode "STRICTER"`,
				`spec.portLevelMtls[80].mode: unknown mode "permissive"`,
			}},
		{name: "port level without selector", policy: `
metadata: {name: default, namespace: shop}
spec: {mtls: {mode: STRICT}, portLevelMtls: {80: {mode: DISABLE}}}`,
			want: []string{"spec.portLevelMtls: needs a selector"}},
		{name: "port level with empty selector", policy: `
metadata: {name: default, namespace: shop}
spec: {selector: {matchLabels: {}}, portLevelMtls: {80: {mode: DISABLE}}}`,
			want: []string{"spec.portLevelMtls: needs a selector"}},
		{name: "ports out of range", policy: `
metadata: {name: db, namespace: shop}
spec: {selector: {matchLabels: {app: db}}, portLevelMtls: {0: {mode: STRICT}, 70000: {mode: STRICT}}}`,
			want: []string{
				"spec.portLevelMtls[0]: not a port number in 1..65535",
				"spec.portLevelMtls[70000]: not a port number in 1..65535",
			}},
		{name: "empty port level", policy: `
metadata: {name: db, namespace: shop}
spec: {selector: {matchLabels: {app: db}}, portLevelMtls: {}}`,
			want: []string{"spec.portLevelMtls: must have at least one port"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pa := decodeAll[PeerAuthentication](t, tc.policy)[0]
			err := ValidatePA(pa)
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("ValidatePA: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ValidatePA: err = %v, want ErrInvalid", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
		})
	}
}
