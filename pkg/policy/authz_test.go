package policy

import (
	"net/netip"
	"strings"
	"testing"
)

var (
	dbTarget = Target{Namespace: "shop", Labels: map[string]string{"app": "db"}, Port: 5432, Addr: netip.MustParseAddr("10.1.0.7")}

	webPeer  = Peer{Principal: "cluster.local/ns/shop/sa/web", Namespace: "shop", Addr: netip.MustParseAddr("10.0.0.5"), Authenticated: true}
	cartPeer = Peer{Principal: "cluster.local/ns/shop/sa/cart", Namespace: "shop", Addr: netip.MustParseAddr("10.0.0.6"), Authenticated: true}
	blogPeer = Peer{Principal: "cluster.local/ns/prod-blog/sa/writer", Namespace: "prod-blog", Addr: netip.MustParseAddr("10.0.2.8"), Authenticated: true}
	// plainPeer claims an identity but did not prove it: it must count
	// for nothing.
	plainPeer  = Peer{Principal: "cluster.local/ns/shop/sa/web", Namespace: "shop", Addr: netip.MustParseAddr("10.0.0.9")}
	v6Peer     = Peer{Addr: netip.MustParseAddr("fd00::1:5")}
	mappedPeer = Peer{Addr: netip.MustParseAddr("::ffff:10.0.0.5")}
)

func onPort(t Target, port uint16) Target { t.Port = port; return t }

func TestAuthorize(t *testing.T) {
	for _, tc := range []struct {
		name       string
		policies   string
		root       string
		dst        Target
		allowed    map[*Peer]bool
		wantPolicy string // for the first peer that is allowed/denied by a policy, checked when set
	}{
		{
			name:    "no policy allows",
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &plainPeer: true},
		},
		{
			name: "allow names exactly who",
			policies: `
metadata: {name: allow-web, namespace: shop}
spec:
  action: ALLOW
  rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false, &plainPeer: false, &blogPeer: false},
		},
		{
			name: "empty action means allow",
			policies: `
metadata: {name: allow-web, namespace: shop}
spec: {rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false},
		},
		{
			name: "allow nothing",
			policies: `
metadata: {name: allow-nothing, namespace: shop}
spec: {}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &plainPeer: false},
		},
		{
			name: "allow all",
			policies: `
metadata: {name: allow-all, namespace: shop}
spec: {rules: [{}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &plainPeer: true},
		},
		{
			name: "allow only named ports",
			policies: `
metadata: {name: allow-5432, namespace: shop}
spec: {rules: [{to: [{operation: {ports: ["5432"]}}]}]}`,
			dst:     onPort(dbTarget, 9090),
			allowed: map[*Peer]bool{&webPeer: false, &plainPeer: false},
		},
		{
			name: "from and to must both match",
			policies: `
metadata: {name: web-5432, namespace: shop}
spec:
  rules:
  - from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]
    to: [{operation: {ports: ["5432"]}}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false},
		},
		{
			name: "from and to must both match, wrong port",
			policies: `
metadata: {name: web-5432, namespace: shop}
spec:
  rules:
  - from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]
    to: [{operation: {ports: ["5432"]}}]`,
			dst:     onPort(dbTarget, 8080),
			allowed: map[*Peer]bool{&webPeer: false},
		},
		{
			name: "entries and rules are alternatives",
			policies: `
metadata: {name: two, namespace: shop}
spec:
  rules:
  - from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}, {source: {ipBlocks: ["10.0.2.0/24"]}}]
  - from: [{source: {principals: ["cluster.local/ns/shop/sa/cart"]}}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: true, &blogPeer: true, &plainPeer: false},
		},
		{
			name: "fields within a source must all match",
			policies: `
metadata: {name: both, namespace: shop}
spec:
  rules: [{from: [{source: {namespaces: [shop], ipBlocks: ["10.0.0.5"]}}]}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false},
		},
		{
			name: "deny wins over allow",
			policies: `
metadata: {name: allow-all, namespace: shop}
spec: {rules: [{}]}
---
metadata: {name: deny-cart, namespace: shop}
spec:
  action: DENY
  rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/cart"]}}]}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false},
		},
		{
			name: "deny alone leaves the rest allowed",
			policies: `
metadata: {name: deny-blog, namespace: shop}
spec:
  action: DENY
  rules: [{from: [{source: {namespaces: ["prod-*"]}}]}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &blogPeer: false, &plainPeer: true},
		},
		{
			name: "deny without rules matches nothing",
			policies: `
metadata: {name: deny-none, namespace: shop}
spec: {action: DENY}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &plainPeer: true},
		},
		{
			name: "require mtls with notPrincipals star",
			policies: `
metadata: {name: require-mtls, namespace: shop}
spec:
  action: DENY
  rules: [{from: [{source: {notPrincipals: ["*"]}}]}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &blogPeer: true, &plainPeer: false, &v6Peer: false},
		},
		{
			name: "principal star is any authenticated peer",
			policies: `
metadata: {name: any-mtls, namespace: shop}
spec: {rules: [{from: [{source: {principals: ["*"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &blogPeer: true, &plainPeer: false},
		},
		{
			name: "principal prefix and suffix wildcards",
			policies: `
metadata: {name: wild, namespace: shop}
spec:
  rules: [{from: [{source: {principals: ["cluster.local/ns/prod-*", "*/sa/cart"]}}]}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &cartPeer: true, &blogPeer: true, &plainPeer: false},
		},
		{
			name: "namespaces need authentication",
			policies: `
metadata: {name: from-shop, namespace: shop}
spec: {rules: [{from: [{source: {namespaces: [shop]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: true, &blogPeer: false, &plainPeer: false},
		},
		{
			name: "namespace star and wildcards",
			policies: `
metadata: {name: ns-wild, namespace: shop}
spec: {rules: [{from: [{source: {namespaces: ["*-blog", "sh*"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &blogPeer: true, &plainPeer: false},
		},
		{
			name: "notNamespaces admits unauthenticated peers, as ztunnel does",
			policies: `
metadata: {name: not-shop, namespace: shop}
spec: {rules: [{from: [{source: {notNamespaces: [shop]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &blogPeer: true, &plainPeer: true},
		},
		{
			name: "notPrincipals",
			policies: `
metadata: {name: not-web, namespace: shop}
spec: {rules: [{from: [{source: {principals: ["*"], notPrincipals: ["cluster.local/ns/shop/sa/web"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &cartPeer: true, &plainPeer: false},
		},
		{
			name: "serviceAccounts qualified and in the policy namespace",
			policies: `
metadata: {name: sas, namespace: shop}
spec: {rules: [{from: [{source: {serviceAccounts: [cart, "prod-blog/writer"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &cartPeer: true, &blogPeer: true, &plainPeer: false},
		},
		{
			name: "notServiceAccounts",
			policies: `
metadata: {name: not-sas, namespace: shop}
spec: {action: DENY, rules: [{from: [{source: {notServiceAccounts: [web]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false, &plainPeer: false},
		},
		{
			name: "ipBlocks v4 cidr, single address, mapped source",
			policies: `
metadata: {name: ips, namespace: shop}
spec: {rules: [{from: [{source: {ipBlocks: ["10.0.0.0/30", "10.0.2.8"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &blogPeer: true, &mappedPeer: false, &v6Peer: false, &plainPeer: false},
		},
		{
			name: "ipBlocks v4 matches a v4-mapped v6 source",
			policies: `
metadata: {name: ips, namespace: shop}
spec: {rules: [{from: [{source: {ipBlocks: ["10.0.0.4/30"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &mappedPeer: true, &v6Peer: false, &plainPeer: false},
		},
		{
			// istiod sends such a block as the 16 bytes it parses to,
			// and the xDS source unmaps them: the same here, so a DENY
			// of ::ffff:10.0.0.5 denies 10.0.0.5 whichever source the
			// policy came from.
			name: "ipBlocks written IPv4-mapped match the IPv4 peer",
			policies: `
metadata: {name: mapped-deny, namespace: shop}
spec: {action: DENY, rules: [{from: [{source: {ipBlocks: ["::ffff:10.0.0.4/126"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &mappedPeer: false, &v6Peer: true, &plainPeer: true},
		},
		{
			// ztunnel matches IPv4 peers against such a block as IPv6:
			// never. Read as IPv4 here, as before, an ALLOW of
			// ::ffff:0:0/96 admitted every IPv4 client that Istio refuses.
			// Only the readings that refuse more take the IPv4 block: a
			// negative block of an ALLOW rule does.
			name: "ipBlocks written IPv4-mapped admit no IPv4 peer, as ztunnel",
			policies: `
metadata: {name: mapped-allow, namespace: shop}
spec:
  rules:
  - from: [{source: {ipBlocks: ["::ffff:0:0/96", "::ffff:10.0.0.4/126"]}}]
  - from: [{source: {namespaces: [shop, prod-blog], notIpBlocks: ["::ffff:10.0.0.4/126"]}}]
  - when: [{key: source.ip, values: ["::ffff:10.0.0.5"]}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &mappedPeer: false, &cartPeer: false, &plainPeer: false, &blogPeer: true},
		},
		{
			name: "negative blocks written IPv4-mapped in a DENY rule except no IPv4 peer, as ztunnel",
			policies: `
metadata: {name: mapped-deny-not, namespace: shop}
spec: {action: DENY, rules: [{from: [{source: {notIpBlocks: ["::ffff:10.0.0.4/126"]}}]}, {when: [{key: destination.ip, notValues: ["::ffff:0:0/96"]}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &cartPeer: false},
		},
		{
			name: "ipBlocks v6",
			policies: `
metadata: {name: ips6, namespace: shop}
spec: {rules: [{from: [{source: {ipBlocks: ["fd00::/64"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&v6Peer: true, &webPeer: false},
		},
		{
			name: "notIpBlocks",
			policies: `
metadata: {name: not-ips, namespace: shop}
spec: {action: DENY, rules: [{from: [{source: {notIpBlocks: ["10.0.0.0/16", "fd00::1:5/128"]}}]}]}`,
			dst: dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &plainPeer: true, &v6Peer: true, &blogPeer: true,
				&Peer{Addr: netip.MustParseAddr("192.168.1.1")}: false, &Peer{Addr: netip.MustParseAddr("fd00::1:6")}: false},
		},
		{
			name: "notPorts",
			policies: `
metadata: {name: not-admin, namespace: shop}
spec: {action: DENY, rules: [{to: [{operation: {notPorts: ["5432"]}}]}]}`,
			dst:     onPort(dbTarget, 9187),
			allowed: map[*Peer]bool{&webPeer: false},
		},
		{
			name: "notPorts lets the named port through",
			policies: `
metadata: {name: not-admin, namespace: shop}
spec: {action: DENY, rules: [{to: [{operation: {notPorts: ["5432"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true},
		},
		{
			name: "selector that does not match leaves the pod alone",
			policies: `
metadata: {name: web-only, namespace: shop}
spec: {selector: {matchLabels: {app: web}}, rules: [{from: [{source: {principals: [nobody]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true},
		},
		{
			name: "selector that matches",
			policies: `
metadata: {name: db-only, namespace: shop}
spec: {selector: {matchLabels: {app: db}}, rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false},
		},
		{
			name: "policy in another namespace does not apply",
			policies: `
metadata: {name: deny-all, namespace: blog}
spec: {action: DENY, rules: [{}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true},
		},
		{
			name: "root namespace policy applies everywhere",
			policies: `
metadata: {name: deny-plain, namespace: istio-system}
spec: {action: DENY, rules: [{from: [{source: {notPrincipals: ["*"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &plainPeer: false},
		},
		{
			name: "root namespace selector applies across namespaces",
			policies: `
metadata: {name: dbs, namespace: istio-system}
spec: {selector: {matchLabels: {app: db}}, rules: [{from: [{source: {namespaces: [shop]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &blogPeer: false},
		},
		{
			name: "custom root namespace",
			root: "mesh-root",
			policies: `
metadata: {name: deny-all, namespace: mesh-root}
spec: {action: DENY, rules: [{}]}
---
metadata: {name: deny-all, namespace: istio-system}
spec: {action: DENY, rules: [{from: [{source: {namespaces: [shop]}}]}]}`,
			dst:     Target{Namespace: "blog", Port: 80},
			allowed: map[*Peer]bool{&webPeer: false, &plainPeer: false},
		},
		{
			name: "targetRefs belong to waypoints",
			policies: `
metadata: {name: waypoint, namespace: shop}
spec:
  targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]
  rules: [{to: [{operation: {methods: [GET]}}]}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true},
		},
		{
			name: "audit and custom are not enforced at L4",
			policies: `
metadata: {name: audit, namespace: shop}
spec: {action: AUDIT, rules: [{}]}
---
metadata: {name: ext, namespace: shop}
spec: {action: CUSTOM, rules: [{}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true},
		},
		{
			name: "allow rule with L7 fields never matches",
			policies: `
metadata: {name: get-only, namespace: shop}
spec:
  rules:
  - from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]
    to: [{operation: {methods: [GET]}}]
  - from: [{source: {requestPrincipals: ["*"]}}]
  - when: [{key: "request.headers[x-user]", values: [admin]}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &cartPeer: false, &plainPeer: false},
		},
		{
			name: "allow rules without L7 still match beside one with L7",
			policies: `
metadata: {name: mixed, namespace: shop}
spec:
  rules:
  - to: [{operation: {paths: ["/admin"]}}]
  - from: [{source: {principals: ["cluster.local/ns/shop/sa/cart"]}}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&cartPeer: true, &webPeer: false},
		},
		{
			name: "deny with only L7 fields denies everything it selects",
			policies: `
metadata: {name: no-delete, namespace: shop}
spec: {action: DENY, rules: [{to: [{operation: {methods: [DELETE]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &plainPeer: false},
		},
		{
			name: "deny with L7 fields keeps its L4 fields",
			policies: `
metadata: {name: no-cart-delete, namespace: shop}
spec:
  action: DENY
  rules:
  - from: [{source: {principals: ["cluster.local/ns/shop/sa/cart"], remoteIpBlocks: ["1.2.3.4"]}}]
    to: [{operation: {ports: ["5432"], methods: [DELETE]}}]
    when: [{key: "request.auth.claims[group]", values: [x]}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false},
		},
		{
			name: "when on L4 keys",
			policies: `
metadata: {name: when-l4, namespace: shop}
spec:
  rules:
  - when:
    - {key: source.ip, values: ["10.0.0.0/24"]}
    - {key: source.principal, notValues: ["cluster.local/ns/shop/sa/cart"]}
    - {key: destination.port, values: ["5432"]}
    - {key: destination.ip, values: ["10.1.0.0/16"]}
    - {key: source.namespace, values: [shop]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false, &plainPeer: false, &blogPeer: false},
		},
		{
			name: "when on destination ip that does not match",
			policies: `
metadata: {name: when-dst, namespace: shop}
spec: {rules: [{when: [{key: destination.ip, values: ["10.9.0.0/16"]}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false},
		},
		{
			name: "invalid deny denies all it selects",
			policies: `
metadata: {name: bad-deny, namespace: shop}
spec: {action: DENY, rules: [{from: [{source: {ipBlocks: ["10.0.0.0/33"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &plainPeer: false},
		},
		{
			name: "invalid deny elsewhere changes nothing",
			policies: `
metadata: {name: bad-deny, namespace: blog}
spec: {action: DENY, rules: [{from: [{source: {ipBlocks: ["nope"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true},
		},
		{
			name: "unknown action denies all it selects",
			policies: `
metadata: {name: typo, namespace: shop}
spec: {action: ALOW, rules: [{}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false},
		},
		{
			name: "invalid allow admits nothing but still counts",
			policies: `
metadata: {name: bad-allow, namespace: shop}
spec: {rules: [{from: [{source: {principals: ["*"]}}], to: [{operation: {ports: ["99999"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &plainPeer: false},
		},
		{
			name: "invalid allow beside a valid one",
			policies: `
metadata: {name: bad-allow, namespace: shop}
spec: {rules: [{from: [{source: {principals: ["*"], ipBlocks: ["bad"]}}]}]}
---
metadata: {name: good-allow, namespace: shop}
spec: {rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false},
		},
		{
			// istiod does not give ztunnel a dry-run policy to enforce; an
			// enforced dry-run ALLOW would admit what the real one does not.
			name: "dry-run policies are not enforced",
			policies: `
metadata: {name: allow-web, namespace: shop}
spec: {rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]}]}
---
metadata: {name: try-allow-all, namespace: shop, annotations: {istio.io/dry-run: "true"}}
spec: {rules: [{}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false, &plainPeer: false},
		},
		{
			name: "dry-run deny is not enforced",
			policies: `
metadata: {name: try-deny-all, namespace: shop, annotations: {istio.io/dry-run: "True"}}
spec: {action: DENY, rules: [{}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &plainPeer: true},
		},
		{
			name: "a dry-run annotation that does not parse leaves the policy enforced, as istiod",
			policies: `
metadata: {name: deny-cart, namespace: shop, annotations: {istio.io/dry-run: "yes"}}
spec: {action: DENY, rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/cart"]}}]}]}
---
metadata: {name: not-dry, namespace: shop, annotations: {istio.io/dry-run: "false"}}
spec: {action: DENY, rules: [{from: [{source: {principals: ["cluster.local/ns/prod-blog/sa/writer"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false, &blogPeer: false},
		},
		{
			// istiod gives it workload-selector scope and no workload
			// lists it; applying it would admit cart here.
			name: "allow with a selector without matchLabels applies to no workload, as istiod",
			policies: `
metadata: {name: allow-web, namespace: shop}
spec: {rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]}]}
---
metadata: {name: empty-selector, namespace: shop}
spec: {selector: {}, rules: [{}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false},
		},
		{
			// istiod decodes `matchLabels: {}` as an empty map (jsonpb),
			// which selects every workload in scope: the policy applies.
			// Skipping it, as before, admitted web and cart here, whom
			// Istio refuses.
			name: "allow with empty matchLabels applies to every workload in scope, as istiod",
			policies: `
metadata: {name: only-blog, namespace: shop}
spec: {selector: {matchLabels: {}}, rules: [{from: [{source: {namespaces: [prod-blog]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &cartPeer: false, &blogPeer: true},
		},
		{
			name: "allow with empty matchLabels in the root namespace applies mesh-wide, as istiod",
			policies: `
metadata: {name: only-blog, namespace: istio-system}
spec: {selector: {matchLabels: {}}, rules: [{from: [{source: {namespaces: [prod-blog]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &blogPeer: true},
		},
		{
			name: "deny with an empty selector denies in its whole scope",
			policies: `
metadata: {name: empty-selector, namespace: shop}
spec: {selector: {}, action: DENY, rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/cart"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false},
		},
		{
			// istiod leaves trustDomains out of ztunnel's policies: they
			// count as L7 fields, so an ALLOW rule with them admits
			// nothing and a DENY rule applies without them.
			name: "trustDomains are not L4: allow rule never matches",
			policies: `
metadata: {name: td, namespace: shop}
spec:
  rules:
  - from: [{source: {principals: ["*"], trustDomains: [cluster.local]}}]
  - from: [{source: {notTrustDomains: [evil.example]}}]
  - from: [{source: {principals: ["cluster.local/ns/shop/sa/cart"]}}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false, &blogPeer: false, &plainPeer: false, &cartPeer: true},
		},
		{
			name: "trustDomains are not L4: deny rule applies without them",
			policies: `
metadata: {name: td, namespace: shop}
spec:
  action: DENY
  rules:
  - from: [{source: {namespaces: [prod-blog], notTrustDomains: [cluster.local]}}]
  - from: [{source: {trustDomains: [evil.example]}}]
    to: [{operation: {ports: ["9090"]}}]`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &blogPeer: false, &plainPeer: true},
		},
		{
			name: "CUSTOM with its provider decodes and is not enforced at L4",
			policies: `
metadata: {name: ext-authz, namespace: shop}
spec: {action: CUSTOM, provider: {name: my-authz}, rules: [{to: [{operation: {paths: ["/admin"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &plainPeer: true},
		},
		{
			name: "provider on an ALLOW policy is invalid: it admits nothing",
			policies: `
metadata: {name: odd, namespace: shop}
spec: {provider: {name: my-authz}, rules: [{}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: false},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkVerdicts(t, decodeAll[AuthorizationPolicy](t, tc.policies), tc.root, tc.dst, tc.allowed)
		})
	}
}

// checkVerdicts authorizes each peer of allowed to dst under aps and fails
// where the verdict is not the one listed, or gives no reason.
func checkVerdicts(t *testing.T, aps []AuthorizationPolicy, root string, dst Target, allowed map[*Peer]bool) {
	t.Helper()
	for peer, want := range allowed {
		v := Authorize(aps, root, dst, *peer)
		if v.Allowed != want {
			t.Errorf("peer %s@%s authenticated=%v: allowed=%v (%s), want %v",
				peer.Principal, peer.Addr, peer.Authenticated, v.Allowed, v.Reason, want)
		}
		if v.Reason == "" {
			t.Errorf("peer %s: empty reason", peer.Principal)
		}
	}
}

func TestAuthorizeVerdictNamesPolicy(t *testing.T) {
	aps := decodeAll[AuthorizationPolicy](t, `
metadata: {name: allow-web, namespace: shop}
spec:
  rules:
  - from: [{source: {principals: [nobody]}}]
  - from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]
---
metadata: {name: deny-blog, namespace: shop}
spec: {action: DENY, rules: [{from: [{source: {namespaces: [prod-blog]}}]}]}
---
metadata: {name: bad, namespace: shop}
spec: {rules: [{to: [{operation: {ports: ["0"]}}]}]}`)

	v := Authorize(aps, "", dbTarget, webPeer)
	if !v.Allowed || v.Policy != "shop/allow-web" || !strings.Contains(v.Reason, "rule 1") {
		t.Errorf("web: %+v", v)
	}
	v = Authorize(aps, "", dbTarget, blogPeer)
	if v.Allowed || v.Policy != "shop/deny-blog" || !strings.Contains(v.Reason, "DENY policy shop/deny-blog") {
		t.Errorf("blog: %+v", v)
	}
	v = Authorize(aps, "", dbTarget, cartPeer)
	if v.Allowed || v.Policy != "" || !strings.Contains(v.Reason, "shop/allow-web, shop/bad (invalid)") {
		t.Errorf("cart: %+v", v)
	}
	v = Authorize(nil, "", dbTarget, cartPeer)
	if !v.Allowed || v.Policy != "" || v.Reason != "no ALLOW policy applies" {
		t.Errorf("no policy: %+v", v)
	}

	bad := decodeAll[AuthorizationPolicy](t, `
metadata: {name: bad-deny, namespace: shop}
spec: {action: DENY, rules: [{from: [{source: {ipBlocks: ["300.0.0.1"]}}]}]}`)
	v = Authorize(bad, "", dbTarget, webPeer)
	if v.Allowed || v.Policy != "shop/bad-deny" || !strings.Contains(v.Reason, "ipBlocks[0]") {
		t.Errorf("invalid deny: %+v", v)
	}
}

// TestAuthorizeUnrecognizedFailsClosed: a policy a source marked as
// having fields these types do not know (dropped in decoding, so its rules
// may be wider than written) admits nothing as an ALLOW and denies all it
// selects as a DENY.
func TestAuthorizeUnrecognizedFailsClosed(t *testing.T) {
	aps := decodeAll[AuthorizationPolicy](t, `
metadata: {name: allow-web, namespace: shop}
spec: {rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]}]}`)
	aps[0].Unrecognized = `decode spec: json: unknown field "sourceLabels"`
	v := Authorize(aps, "", dbTarget, webPeer)
	if v.Allowed || !strings.Contains(v.Reason, "shop/allow-web (invalid)") {
		t.Errorf("allow with an unknown field: %+v", v)
	}
	if err := Validate(aps[0]); err == nil || !strings.Contains(err.Error(), "sourceLabels") {
		t.Errorf("Validate = %v, want an error naming the unknown field", err)
	}

	aps[0].Spec.Action = ActionDeny
	v = Authorize(aps, "", dbTarget, cartPeer)
	if v.Allowed || v.Policy != "shop/allow-web" || !strings.Contains(v.Reason, "sourceLabels") {
		t.Errorf("deny with an unknown field: %+v", v)
	}
}

// TestAuthorizeUnlabelledPodTakesSelectorPolicies copies istiod's
// attachment of workload-selector policies to a pod with no labels at all.
// istiod (pilot/pkg/serviceregistry/kube/controller/ambient,
// buildWorkloadPolicies) lists for a workload every AuthorizationPolicy of
// its namespace and of the root namespace that krt.FilterSelects(labels)
// keeps and whose matchLabels is set; FilterSelects does not filter when
// the labels are nil (pkg/kube/krt filter.go: `f.selects != nil && ...`),
// and a pod without labels has nil ones. ztunnel (src/state.rs
// assert_rbac) then enforces every policy the workload lists. Before, the
// agent applied a selector only to pods whose labels matched it, so such a
// pod was open to peers a DENY (or an ALLOW naming others) refuses under
// ztunnel.
func TestAuthorizeUnlabelledPodTakesSelectorPolicies(t *testing.T) {
	unlabelled := Target{Namespace: "shop", Port: 5432, Addr: netip.MustParseAddr("10.1.0.9")}
	emptyLabels := unlabelled
	emptyLabels.Labels = map[string]string{} // as a manifest's `labels: {}`: the API server keeps none
	for _, tc := range []struct {
		name     string
		policies string
		dst      Target
		allowed  map[*Peer]bool
	}{
		{
			name: "deny selecting app=db in the pod's namespace",
			policies: `
metadata: {name: deny-cart, namespace: shop}
spec: {selector: {matchLabels: {app: db}}, action: DENY, rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/cart"]}}]}]}`,
			dst:     unlabelled,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false},
		},
		{
			name: "deny selecting app=db in the root namespace",
			policies: `
metadata: {name: deny-plain, namespace: istio-system}
spec: {selector: {matchLabels: {app: db}}, action: DENY, rules: [{from: [{source: {notPrincipals: ["*"]}}]}]}`,
			dst:     emptyLabels,
			allowed: map[*Peer]bool{&webPeer: true, &plainPeer: false},
		},
		{
			name: "allow selecting app=web restricts the pod to whom it names",
			policies: `
metadata: {name: only-web, namespace: shop}
spec: {selector: {matchLabels: {app: web}}, rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]}]}`,
			dst:     unlabelled,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: false, &plainPeer: false},
		},
		{
			name: "a selector policy of another namespace does not attach",
			policies: `
metadata: {name: deny-all, namespace: prod-blog}
spec: {selector: {matchLabels: {app: db}}, action: DENY, rules: [{}]}`,
			dst:     unlabelled,
			allowed: map[*Peer]bool{&webPeer: true, &plainPeer: true},
		},
		{
			// `selector: {}` has nil matchLabels: istiod lists it for no
			// workload, labelled or not.
			name: "an allow with selector {} still attaches to none",
			policies: `
metadata: {name: empty-selector, namespace: shop}
spec: {selector: {}, rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/web"]}}]}]}`,
			dst:     unlabelled,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: true},
		},
		{
			name: "a labelled pod keeps the selector rule",
			policies: `
metadata: {name: deny-cart, namespace: shop}
spec: {selector: {matchLabels: {app: web}}, action: DENY, rules: [{from: [{source: {principals: ["cluster.local/ns/shop/sa/cart"]}}]}]}`,
			dst:     dbTarget,
			allowed: map[*Peer]bool{&webPeer: true, &cartPeer: true},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkVerdicts(t, decodeAll[AuthorizationPolicy](t, tc.policies), "", tc.dst, tc.allowed)
		})
	}
}
