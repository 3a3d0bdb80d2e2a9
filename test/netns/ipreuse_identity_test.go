package netnstest

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestIPReuseNeverCarriesOldIdentity: pod A (mesh/client-sa), which a
// server's ALLOW policy admits, is deleted and pod B of another namespace
// and service account is created on the same node with A's addresses (and
// its namespace path), the manifest saying so before the new sandbox
// exists, or after. A's pooled HBONE connection to the server, its
// certificate and its policy must not serve B: B's connections are refused
// by the server as B's identity, never admitted as A's; none leaves in
// plaintext meanwhile (the server is STRICT).
func TestIPReuseNeverCarriesOldIdentity(t *testing.T) {
	const allow = `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow-client, namespace: mesh}
spec:
  selector: {matchLabels: {app: server}}
  action: ALLOW
  rules:
  - from:
    - source: {principals: ["cluster.local/ns/mesh/sa/client-sa"]}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: mesh}
spec:
  mtls: {mode: STRICT}`
	for _, order := range []string{"manifest-first", "sandbox-first"} {
		t.Run(order, func(t *testing.T) {
			ms, client, server, plain := meshed(t, allow)
			Eventually(t, 10*time.Second, func() error {
				out, err := Curl(client, URL(server.IPv4, 8080))
				if err == nil && !strings.Contains(out, "server peer="+client.IPv4.String()) {
					return fmt.Errorf("unexpected answer %q", out)
				}
				return err
			})
			enrolled := strings.Count(ms.agents[0].Log(), "pod enrolled")
			// B: the client's addresses and path, another namespace and
			// service account (and so another uid).
			m := &Manifest{}
			m.Namespace("mesh", "istio.io/dataplane-mode=ambient").Namespace("plain").
				Namespace("other", "istio.io/dataplane-mode=ambient").
				Pod(client, "other", "intruder-sa", "app=client").
				Pod(server, "mesh", "server-sa", "app=server").
				Pod(plain, "plain", "default").Raw(allow)
			if order == "sandbox-first" {
				client.Node.RecreatePod(client)
			}
			if err := m.Write(ms.manifest); err != nil {
				t.Fatal(err)
			}
			if order == "manifest-first" {
				// A's sandbox lives on a moment, then B's replaces it.
				time.Sleep(300 * time.Millisecond)
				client.Node.RecreatePod(client)
			}
			// B's connections go over HBONE as B and are refused as B: the
			// client's agent reports the server's 403 for src other/client.
			refusedAsB := func() bool {
				for _, l := range strings.Split(ms.agents[0].Log(), "\n") {
					if strings.Contains(l, "src=other/client") && strings.Contains(l, "403") {
						return true
					}
				}
				return false
			}
			admitted := ""
			Eventually(t, 20*time.Second, func() error {
				// Whenever it comes, the answer must be a refusal.
				if out, err := Curl(client, URL(server.IPv4, 8080)); err == nil {
					admitted = out
					return nil
				}
				if strings.Count(ms.agents[0].Log(), "pod enrolled") == enrolled {
					return errors.New("pod B is not enrolled yet")
				}
				if !refusedAsB() {
					return errors.New("the server has not refused B's identity yet")
				}
				return nil
			})
			if admitted != "" {
				t.Fatalf("pod B reached the server, which admits only A's identity: %q", admitted)
			}
			for range 5 {
				if out, err := Curl(client, URL(server.IPv4, 8080)); err == nil {
					t.Fatalf("pod B reached the server, which admits only A's identity: %q", out)
				}
			}
		})
	}
}
