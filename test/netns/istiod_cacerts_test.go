package netnstest

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
)

// TestFileCAIstioCacerts runs the agents standalone on Istio's plug-in CA layout (cacerts:
// an intermediate under a root, as Istio's tools/certs make them), RSA and ECDSA: meshed
// traffic works and the presented chain is the leaf and the intermediate.
func TestFileCAIstioCacerts(t *testing.T) {
	for _, alg := range []string{"rsa", "ecdsa"} {
		t.Run(alg, func(t *testing.T) {
			dir := identitytest.WriteCacerts(t, identitytest.NewPKI(t, alg))
			tp := New(t, 2)
			client, server := tp.Nodes[0].AddPod("client"), tp.Nodes[1].AddPod("server")
			manifest := filepath.Join(t.TempDir(), "cluster.yaml")
			m := (&Manifest{}).Namespace("mesh", "istio.io/dataplane-mode=ambient").Pod(client, "mesh", "client-sa").Pod(server, "mesh", "server-sa")
			if err := m.Write(manifest); err != nil {
				t.Fatal(err)
			}
			var agents []*Agent
			for _, n := range tp.Nodes {
				agents = append(agents, StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: manifest, CADir: dir}))
			}
			HTTPApp(t, server, 8080, "server")
			Eventually(t, 15*time.Second, func() error {
				out, err := Curl(client, URL(server.IPv4, 8080))
				if err == nil && !strings.Contains(out, "server peer="+client.IPv4.String()) {
					t.Fatalf("answer %q", out)
				}
				return err
			})
			c := waitCert(t, agents[0], "spiffe://cluster.local/ns/mesh/sa/client-sa", "valid", 5*time.Second)
			if c.Issuer != "CN=Intermediate CA,O=Istio" || len(c.Chain) != 2 || c.Chain[1].Subject != "CN=Intermediate CA,O=Istio" {
				t.Errorf("certificate issued by %q with chain %+v, want leaf + the intermediate", c.Issuer, c.Chain)
			}
		})
	}
}
