package policy

import (
	"slices"
	"strings"
	"testing"
)

func TestEffectiveMode(t *testing.T) {
	const (
		meshStrict = `
metadata: {name: default, namespace: istio-system, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {mtls: {mode: STRICT}}`
		meshUnset = `
metadata: {name: default, namespace: istio-system, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {mtls: {mode: UNSET}}`
		nsPermissive = `
metadata: {name: default, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {mtls: {mode: PERMISSIVE}}`
		nsStrict = `
metadata: {name: default, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {mtls: {mode: STRICT}}`
		nsUnset = `
metadata: {name: default, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {}`
		dbPermissive = `
metadata: {name: db, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {selector: {matchLabels: {app: db}}, mtls: {mode: PERMISSIVE}}`
		dbPorts = `
metadata: {name: db-ports, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}
spec:
  selector: {matchLabels: {app: db}}
  mtls: {mode: PERMISSIVE}
  portLevelMtls:
    5432: {mode: STRICT}
    9000: {mode: UNSET}
    9100: {mode: DISABLE}`
		dbUnsetPorts = `
metadata: {name: db-unset, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}
spec:
  selector: {matchLabels: {app: db}}
  portLevelMtls:
    5432: {mode: STRICT}`
	)
	const (
		meshYoungStrict = `
metadata: {name: young, namespace: istio-system, creationTimestamp: "2024-06-01T00:00:00Z"}
spec: {mtls: {mode: STRICT}}`
		meshOldEmptySelector = `
metadata: {name: old-empty, namespace: istio-system, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {selector: {}, mtls: {mode: PERMISSIVE}}`
	)
	db := map[string]string{"app": "db", "tier": "data"}
	web := map[string]string{"app": "web"}

	for _, tc := range []struct {
		name       string
		pas        string
		root, ns   string
		labels     map[string]string
		port       uint16
		want       MTLSMode
		wantSource string
	}{
		{name: "no policy", ns: "shop", labels: db, port: 80, want: ModePermissive, wantSource: "default (no policy)"},
		{name: "mesh", pas: meshStrict, ns: "shop", labels: db, port: 80, want: ModeStrict, wantSource: "istio-system/default (mesh)"},
		{name: "mesh unset is the default", pas: meshUnset, ns: "shop", labels: db, port: 80, want: ModePermissive, wantSource: "default (no policy)"},
		{name: "namespace beats mesh", pas: meshStrict + "\n---\n" + nsPermissive, ns: "shop", labels: db, port: 80,
			want: ModePermissive, wantSource: "shop/default (namespace)"},
		{name: "namespace unset inherits mesh", pas: meshStrict + "\n---\n" + nsUnset, ns: "shop", labels: db, port: 80,
			want: ModeStrict, wantSource: "istio-system/default (mesh)"},
		{name: "other namespace's policy ignored", pas: nsStrict, ns: "blog", labels: db, port: 80,
			want: ModePermissive, wantSource: "default (no policy)"},
		{name: "workload beats namespace", pas: nsStrict + "\n---\n" + dbPermissive, ns: "shop", labels: db, port: 80,
			want: ModePermissive, wantSource: "shop/db (workload)"},
		{name: "workload not selecting", pas: nsStrict + "\n---\n" + dbPermissive, ns: "shop", labels: web, port: 80,
			want: ModeStrict, wantSource: "shop/default (namespace)"},
		{name: "workload policy of another namespace", pas: dbPermissive, ns: "blog", labels: db, port: 80,
			want: ModePermissive, wantSource: "default (no policy)"},
		{name: "selector policy in root namespace ignored", pas: meshStrict + `
---
metadata: {name: db, namespace: istio-system}
spec: {selector: {matchLabels: {app: db}}, mtls: {mode: DISABLE}}`, ns: "shop", labels: db, port: 80,
			want: ModeStrict, wantSource: "istio-system/default (mesh)"},
		{name: "selector policy in root namespace ignored for its own pods", pas: meshStrict + `
---
metadata: {name: db, namespace: istio-system}
spec: {selector: {matchLabels: {app: db}}, mtls: {mode: DISABLE}}`, ns: "istio-system", labels: db, port: 80,
			want: ModeStrict, wantSource: "istio-system/default (mesh)"},
		{name: "port level overrides", pas: nsStrict + "\n---\n" + dbPorts, ns: "shop", labels: db, port: 5432,
			want: ModeStrict, wantSource: "shop/db-ports (workload, port 5432)"},
		{name: "port level leaves other ports", pas: nsStrict + "\n---\n" + dbPorts, ns: "shop", labels: db, port: 80,
			want: ModePermissive, wantSource: "shop/db-ports (workload)"},
		{name: "port level unset inherits workload", pas: nsStrict + "\n---\n" + dbPorts, ns: "shop", labels: db, port: 9000,
			want: ModePermissive, wantSource: "shop/db-ports (workload)"},
		{name: "port level disable", pas: meshStrict + "\n---\n" + dbPorts, ns: "shop", labels: db, port: 9100,
			want: ModeDisable, wantSource: "shop/db-ports (workload, port 9100)"},
		{name: "workload unset with strict port", pas: nsPermissive + "\n---\n" + dbUnsetPorts, ns: "shop", labels: db, port: 5432,
			want: ModeStrict, wantSource: "shop/db-unset (workload, port 5432)"},
		{name: "workload unset inherits namespace", pas: nsPermissive + "\n---\n" + dbUnsetPorts, ns: "shop", labels: db, port: 80,
			want: ModePermissive, wantSource: "shop/default (namespace)"},
		// istiod keeps its static STRICT policy for such a workload: the
		// DISABLE port is not exempted, unless a PERMISSIVE port is there.
		{name: "port disable under a workload policy without a mode stays strict, as istiod", pas: nsStrict + `
---
metadata: {name: db-disable, namespace: shop}
spec: {selector: {matchLabels: {app: db}}, portLevelMtls: {9100: {mode: DISABLE}}}`, ns: "shop", labels: db, port: 9100,
			want: ModeStrict, wantSource: "shop/default (namespace); port 9100 DISABLE of shop/db-disable not applied: that policy sets no mode of its own and no PERMISSIVE port, as istiod"},
		{name: "port disable beside a permissive port is applied, as istiod", pas: meshStrict + `
---
metadata: {name: db-both, namespace: shop}
spec: {selector: {matchLabels: {app: db}}, mtls: {mode: UNSET}, portLevelMtls: {9100: {mode: DISABLE}, 9200: {mode: PERMISSIVE}}}`, ns: "shop", labels: db, port: 9100,
			want: ModeDisable, wantSource: "shop/db-both (workload, port 9100)"},
		{name: "port disable under a permissive namespace", pas: nsPermissive + `
---
metadata: {name: db-disable, namespace: shop}
spec: {selector: {matchLabels: {app: db}}, portLevelMtls: {9100: {mode: DISABLE}}}`, ns: "shop", labels: db, port: 9100,
			want: ModeDisable, wantSource: "shop/db-disable (workload, port 9100)"},
		{name: "port level on namespace policy ignored", pas: `
metadata: {name: default, namespace: shop}
spec: {mtls: {mode: STRICT}, portLevelMtls: {8080: {mode: DISABLE}}}`, ns: "shop", labels: db, port: 8080,
			want: ModeStrict, wantSource: "shop/default (namespace)"},
		{name: "empty matchLabels is namespace-wide", pas: `
metadata: {name: all, namespace: shop}
spec: {selector: {matchLabels: {}}, mtls: {mode: STRICT}}`, ns: "shop", labels: web, port: 80,
			want: ModeStrict, wantSource: "shop/all (namespace)"},
		// istiod takes the mesh policy of other namespaces' pods only from
		// root-namespace policies without a selector: an older
		// `selector: {}` PERMISSIVE one there must not undo STRICT.
		{name: "empty selector in root namespace is not mesh-wide", pas: meshYoungStrict + "\n---\n" + meshOldEmptySelector, ns: "shop", labels: db, port: 80,
			want: ModeStrict, wantSource: "istio-system/young (mesh)"},
		{name: "empty selector in root namespace for its own pods", pas: meshYoungStrict + "\n---\n" + meshOldEmptySelector, ns: "istio-system", labels: db, port: 80,
			want: ModePermissive, wantSource: "istio-system/old-empty (mesh)"},
		{name: "custom root namespace", root: "mesh-root", pas: meshStrict + `
---
metadata: {name: default, namespace: mesh-root}
spec: {mtls: {mode: DISABLE}}`, ns: "shop", labels: db, port: 80,
			want: ModeDisable, wantSource: "mesh-root/default (mesh)"},
		{name: "pod in root namespace", pas: meshStrict, ns: "istio-system", labels: db, port: 80,
			want: ModeStrict, wantSource: "istio-system/default (mesh)"},
		{name: "invalid mode fails closed", pas: `
metadata: {name: typo, namespace: shop}
spec: {mtls: {mode: strict}}`, ns: "shop", labels: db, port: 80,
			want: ModeStrict, wantSource: `shop/typo (namespace, invalid mode "strict" read as STRICT)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pas := decodeAll[PeerAuthentication](t, tc.pas)
			got := EffectiveMode(pas, tc.root, tc.ns, tc.labels, tc.port)
			if got.Mode != tc.want || got.Source != tc.wantSource {
				t.Errorf("got %+v, want {%s %s}", got, tc.want, tc.wantSource)
			}
			// The answer must not depend on the order policies are listed in.
			slices.Reverse(pas)
			if rev := EffectiveMode(pas, tc.root, tc.ns, tc.labels, tc.port); rev != got {
				t.Errorf("reversed list gave %+v, want %+v", rev, got)
			}
		})
	}
}

func TestEffectiveModeOldestWins(t *testing.T) {
	pas := decodeAll[PeerAuthentication](t, `
metadata: {name: young, namespace: shop, creationTimestamp: "2024-06-01T00:00:00Z"}
spec: {selector: {matchLabels: {app: db}}, mtls: {mode: DISABLE}}
---
metadata: {name: old, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {selector: {matchLabels: {app: db}}, mtls: {mode: STRICT}}
---
metadata: {name: b-twin, namespace: istio-system, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {mtls: {mode: STRICT}}
---
metadata: {name: a-twin, namespace: istio-system, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {mtls: {mode: PERMISSIVE}}
`)
	for range 2 {
		if d := EffectiveMode(pas, "", "shop", map[string]string{"app": "db"}, 80); d.Source != "shop/old (workload)" || d.Mode != ModeStrict {
			t.Errorf("workload: got %+v, want shop/old STRICT", d)
		}
		// Same age: the first by name wins.
		if d := EffectiveMode(pas, "", "blog", nil, 80); d.Source != "istio-system/a-twin (mesh)" || d.Mode != ModePermissive {
			t.Errorf("mesh: got %+v, want istio-system/a-twin PERMISSIVE", d)
		}
		slices.Reverse(pas)
	}
}

func TestDecisionStrict(t *testing.T) {
	for mode, want := range map[MTLSMode]bool{ModeStrict: true, ModePermissive: false, ModeDisable: false} {
		if got := (Decision{Mode: mode}).Strict(); got != want {
			t.Errorf("%s: Strict() = %v", mode, got)
		}
	}
}

// TestEffectiveModeUnrecognizedIsStrict: a PeerAuthentication a source
// marked as having a field these types do not know decides its level as
// STRICT, whatever mode it sets (or none) and on every port, and
// ValidatePA names the field; the same policy unmarked keeps its modes.
func TestEffectiveModeUnrecognizedIsStrict(t *testing.T) {
	pas := decodeAll[PeerAuthentication](t, `
metadata: {name: default, namespace: istio-system, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {mtls: {mode: PERMISSIVE}}
---
metadata: {name: db, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}
spec:
  selector: {matchLabels: {app: db}}
  mtls: {mode: PERMISSIVE}
  portLevelMtls: {9100: {mode: DISABLE}}
---
metadata: {name: default, namespace: blog, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {}
`)
	db := map[string]string{"app": "db"}
	for _, port := range []uint16{80, 9100} {
		if d := EffectiveMode(pas, "", "shop", db, port); d.Strict() {
			t.Fatalf("control, port %d: %+v, want PERMISSIVE or DISABLE", port, d)
		}
	}
	if d := EffectiveMode(pas, "", "blog", nil, 80); d.Strict() {
		t.Fatalf("control, blog: %+v, want PERMISSIVE from the mesh", d)
	}

	for i := range pas {
		pas[i].Unrecognized = `decode spec: json: unknown field "targetRef"`
	}
	for _, port := range []uint16{80, 9100} {
		if d := EffectiveMode(pas, "", "shop", db, port); !d.Strict() || d.Source != "shop/db (workload, has a field this agent does not know, read as STRICT)" {
			t.Errorf("workload, port %d: %+v, want STRICT from shop/db", port, d)
		}
	}
	if d := EffectiveMode(pas, "", "blog", nil, 80); !d.Strict() || d.Source != "blog/default (namespace, has a field this agent does not know, read as STRICT)" {
		t.Errorf("namespace policy without a mode: %+v, want STRICT from blog/default", d)
	}
	if d := EffectiveMode(pas, "", "news", nil, 80); !d.Strict() || d.Source != "istio-system/default (mesh, has a field this agent does not know, read as STRICT)" {
		t.Errorf("mesh: %+v, want STRICT from istio-system/default", d)
	}
	if err := ValidatePA(pas[1]); err == nil || !strings.Contains(err.Error(), "targetRef") {
		t.Errorf("ValidatePA = %v, want an error naming the unknown field", err)
	}
}

// TestEffectiveModePortLevelAgainstSelectorlessNamespacePolicy copies how
// istiod converts a workload PeerAuthentication with portLevelMtls for
// ztunnel when a namespace holds two namespace-wide policies, an older one
// written `selector: {}` and a newer one with no selector. istiod
// (pilot/pkg/serviceregistry/kube/controller/ambient/authorization.go)
// picks the namespace level for the workload's policy list among both
// (convertedSelectorPeerAuthentications: no selector or no matchLabels),
// but converts the port-level policy against the namespace policies
// without a selector only (PolicyCollections' PeerAuthByNamespace index:
// `GetSelector() == nil`). Here the list names the converted policy (the
// older PERMISSIVE namespace policy leaves port 80 the only STRICT one), and
// the conversion, made under the STRICT namespace policy, denies plaintext
// on every port but 8080, which ztunnel enforces. Before, the agent read
// port 9090 as PERMISSIVE and admitted plaintext ztunnel refuses.
func TestEffectiveModePortLevelAgainstSelectorlessNamespacePolicy(t *testing.T) {
	pas := decodeAll[PeerAuthentication](t, `
metadata: {name: old-wide, namespace: shop, creationTimestamp: "2024-01-01T00:00:00Z"}
spec: {selector: {}, mtls: {mode: PERMISSIVE}}
---
metadata: {name: default, namespace: shop, creationTimestamp: "2024-06-01T00:00:00Z"}
spec: {mtls: {mode: STRICT}}
---
metadata: {name: db, namespace: shop, creationTimestamp: "2024-06-01T00:00:00Z"}
spec:
  selector: {matchLabels: {app: db}}
  portLevelMtls:
    80: {mode: STRICT}
    8080: {mode: PERMISSIVE}`)
	db := map[string]string{"app": "db"}
	for _, tc := range []struct {
		labels map[string]string
		port   uint16
		strict bool
	}{
		{db, 80, true},
		{db, 8080, false},
		{db, 9090, true},
		// Without a workload policy the list decides alone: the older
		// namespace policy, PERMISSIVE, as istiod.
		{map[string]string{"app": "web"}, 9090, false},
	} {
		if d := EffectiveMode(pas, "", "shop", tc.labels, tc.port); d.Strict() != tc.strict {
			t.Errorf("labels %v port %d: %s (%s), want strict=%v", tc.labels, tc.port, d.Mode, d.Source, tc.strict)
		}
	}
}
