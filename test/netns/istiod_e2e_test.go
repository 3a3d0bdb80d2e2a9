package netnstest

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/redirector-mesh/redirector/pkg/admin"
	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/netns"
	"github.com/redirector-mesh/redirector/test/istiotest"
)

// TestIstiodIdentity runs two nodes' agents with istiod as their CA (real istiod, real
// kube-apiserver, real agents in network namespaces, no signing key on any node):
//
//   - the agents get their pods' certificates from istiod and meshed traffic works with them;
//   - the node-1 agent asking for the identity of a pod that runs only on node 2 (its own
//     view of the cluster claims otherwise, as a compromised node's would) is refused by
//     istiod, logged and counted;
//   - with a 2-minute lifetime certificates rotate without breaking an open connection;
//   - istiod stopped: open connections and unexpired certificates keep working, a new pod
//     whose identity has no certificate fails closed, counted; istiod back: it recovers
//     without an agent restart;
//   - the last pod of an identity leaves: its certificate is no longer served (kept, in its
//     grace period, for a replacement pod, then forgotten).
func TestIstiodIdentity(t *testing.T) {
	cp := istiotest.StartControlPlane(t)
	cs, istiod := cp.Client, cp.Istiod

	tp := New(t, 2)
	client, rogue, late := tp.Nodes[0].AddPod("client"), tp.Nodes[0].AddPod("rogue"), tp.Nodes[0].AddPod("late")
	server := tp.Nodes[1].AddPod("server")

	// What the API server says runs where: istiod authorizes by this.
	ctx := context.Background()
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "mesh"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	istiotest.CreatePod(t, cs, "mesh", "client", "client-sa", "node1", client.IPv4.String(), client.IPv6.String())
	istiotest.CreatePod(t, cs, "mesh", "server", "server-sa", "node2", server.IPv4.String(), server.IPv6.String())
	istiotest.CreatePod(t, cs, "mesh", "db", "db-sa", "node2", tp.Nodes[1].PodAddr4(200).String())

	// What the agents are told: the node-1 agent believes a db-sa pod ("rogue") runs on it.
	manifest := filepath.Join(t.TempDir(), "cluster.yaml")
	write := func(withLate bool) {
		m := (&Manifest{}).Namespace("mesh", "istio.io/dataplane-mode=ambient").
			Pod(client, "mesh", "client-sa").Pod(rogue, "mesh", "db-sa").Pod(server, "mesh", "server-sa")
		if withLate {
			m.Pod(late, "mesh", "late-sa")
		}
		if err := m.Write(manifest); err != nil {
			t.Fatal(err)
		}
	}
	write(false)

	var agents []*Agent
	for _, n := range tp.Nodes {
		forwardLoopback(t, n.Path(), "grpc://"+istiod.Addr)
		token := istiotest.AgentToken(t, cs, istiotest.AgentAccount, fmt.Sprintf("node%d", n.Index), istiotest.Audience)
		agents = append(agents, StartAgent(t, n, AgentOptions{Binary: redirectorBin(), Manifest: manifest, Args: []string{
			"--ca-address", istiod.Addr, "--ca-token-file", token, "--ca-root-cert", istiod.RootCertFile,
			"--cluster-id", istiotest.ClusterID, "--cert-ttl", "2m",
		}}))
	}
	node1, node2 := agents[0], agents[1]
	for _, a := range agents {
		a.WaitLog(t, "certificates from istiod", 10*time.Second)
		a.WaitLog(t, "pod enrolled", 15*time.Second)
	}
	if strings.Contains(node1.Log(), "standalone") {
		t.Error("node-1 agent runs a file CA")
	}

	clientID, serverID := "spiffe://cluster.local/ns/mesh/sa/client-sa", "spiffe://cluster.local/ns/mesh/sa/server-sa"
	dbID, lateID := "spiffe://cluster.local/ns/mesh/sa/db-sa", "spiffe://cluster.local/ns/mesh/sa/late-sa"
	waitCert(t, node1, clientID, "valid", 30*time.Second)
	waitCert(t, node2, serverID, "valid", 30*time.Second)

	// Meshed traffic with istiod's certificates; the app sees the client's address.
	HTTPApp(t, server, 8080, "server")
	url := URL(server.IPv4, 8080)
	var out string
	Eventually(t, 15*time.Second, func() error { var err error; out, err = Curl(client, url); return err })
	if want := "server peer=" + client.IPv4.String(); !strings.Contains(out, want) {
		t.Errorf("curl answered %q, want %q", out, want)
	}
	node2.WaitLog(t, clientID, 5*time.Second)
	c := certOf(t, node1, clientID)
	if !strings.HasPrefix(c.CA, "istiod:") || c.Issuer != "O=cluster.local" {
		t.Errorf("client-sa certificate from %q issued by %q, want istiod's root O=cluster.local", c.CA, c.Issuer)
	}

	// The node-1 agent asked istiod for db-sa, which runs only on node 2: refused, logged, counted.
	c = waitCert(t, node1, dbID, "failing", 30*time.Second)
	if !strings.Contains(c.LastError, "Unauthenticated") {
		t.Errorf("db-sa last error %q, want istiod's Unauthenticated refusal", c.LastError)
	}
	node1.WaitLog(t, "reason=unauthenticated", 5*time.Second)
	// As an operator sees it.
	inspect, err := Exec(ctx, tp.Nodes[0].Path(), redirectorBin(), "inspect", "certs")
	if err != nil {
		t.Fatalf("inspect certs: %v: %s", err, inspect)
	}
	for _, want := range []string{regexp.QuoteMeta(clientID) + ` +valid +istiod:`, regexp.QuoteMeta(dbID) + ` +failing .*Unauthenticated`} {
		if !regexp.MustCompile(want).Match(inspect) {
			t.Errorf("inspect certs lacks %q:\n%s", want, inspect)
		}
	}
	if v := metric(t, node1, `redirector_ca_request_failures_total{reason="unauthenticated"}`); v < 1 {
		t.Errorf("unauthenticated failures counted %v, want >= 1", v)
	}

	// An open connection, to check across rotation and istiod's absence.
	ServeTCP(t, server, 9000, func(c net.Conn) { io.Copy(c, c) })
	var conn net.Conn
	Eventually(t, 10*time.Second, func() error {
		var err error
		conn, err = netns.Dial(ctx, client.Path(), "tcp", net.JoinHostPort(server.IPv4.String(), "9000"), netns.SocketOptions{})
		if err == nil {
			if err = echo(conn, "hello"); err != nil {
				conn.Close()
			}
		}
		return err
	})
	defer conn.Close()

	// Rotation at about half of the 2-minute lifetime, the open connection untouched.
	before := certOf(t, node1, clientID).Serial
	serverBefore := certOf(t, node2, serverID).Serial
	Eventually(t, 100*time.Second, func() error {
		if err := echo(conn, "during rotation"); err != nil {
			t.Fatalf("open connection broke during rotation: %v", err)
		}
		if s := certOf(t, node1, clientID).Serial; s == before {
			return fmt.Errorf("client-sa certificate %s not rotated yet", s)
		}
		if s := certOf(t, node2, serverID).Serial; s == serverBefore {
			return fmt.Errorf("server-sa certificate %s not rotated yet", s)
		}
		return nil
	})
	if _, err := Curl(client, url); err != nil {
		t.Errorf("new connection after rotation: %v", err)
	}

	// istiod stopped: what exists keeps working.
	istiod.Stop()
	if err := echo(conn, "istiod down"); err != nil {
		t.Errorf("open connection with istiod down: %v", err)
	}
	if _, err := Curl(client, url); err != nil {
		t.Errorf("new connection of an identity with a certificate, istiod down: %v", err)
	}
	// A new pod whose identity has no certificate yet fails closed, counted.
	istiotest.CreatePod(t, cs, "mesh", "late", "late-sa", "node1", late.IPv4.String(), late.IPv6.String())
	write(true)
	waitEnrolled(t, node1.BPFRoot, 15*time.Second, "mesh/client", "mesh/rogue", "mesh/late")
	waitCert(t, node1, lateID, "failing", 30*time.Second)
	if out, err := Curl(late, url); err == nil {
		t.Errorf("pod without a certificate reached the server: %q", out)
	}
	if v := metric(t, node1, `redirector_certificate_unavailable_total{reason="ca_failing"}`); v < 1 {
		t.Errorf("handshakes refused for want of a certificate counted %v, want >= 1", v)
	}
	if v := metric(t, node1, `redirector_ca_request_failures_total{reason="unavailable"}`); v < 1 {
		t.Errorf("unavailable failures counted %v, want >= 1", v)
	}

	// istiod back: the agent recovers on its own.
	istiod.Restart(t)
	waitCert(t, node1, lateID, "valid", 60*time.Second)
	Eventually(t, 10*time.Second, func() error {
		out, err := Curl(late, url)
		if err == nil && !strings.Contains(out, "server peer="+late.IPv4.String()) {
			err = fmt.Errorf("answer %q", out)
		}
		return err
	})
	if err := echo(conn, "after"); err != nil {
		t.Errorf("open connection after istiod came back: %v", err)
	}
	// The last late-sa pod leaves node 1: its certificate is no longer served there (kept
	// for a replacement pod for the 2-minute grace period, not presented).
	write(false)
	Eventually(t, 15*time.Second, func() error {
		if c := certOf(t, node1, lateID); c.Identity != "" && c.State != string(identity.StateGrace) {
			return fmt.Errorf("%s still served (%s) after its last pod left", lateID, c.State)
		}
		return nil
	})
	// The certificate of the pod that is not on node 1 was never issued.
	if c := certOf(t, node1, dbID); c.Serial != "" {
		t.Errorf("node-1 agent holds a certificate for %s (serial %s)", dbID, c.Serial)
	}
	// And nothing on node 1 could sign one: no CA key among the agent's files.
	if ents, _ := os.ReadDir(filepath.Dir(node1.BPFRoot)); len(ents) > 0 {
		for _, e := range ents {
			if strings.HasSuffix(e.Name(), "key.pem") {
				t.Errorf("a key file %s in the agent's directory", e.Name())
			}
		}
	}
}

// echo writes msg on conn and reads it back.
func echo(conn net.Conn, msg string) error {
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	defer conn.SetDeadline(time.Time{})
	if _, err := conn.Write([]byte(msg + "\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(io.LimitReader(conn, int64(len(msg)+1))).ReadString('\n')
	if err != nil {
		return err
	}
	if strings.TrimSpace(line) != msg {
		return fmt.Errorf("echoed %q, want %q", line, msg)
	}
	return nil
}

// certs reads the agent's certificates from its config dump.
func certs(a *Agent) ([]admin.CertRow, error) {
	out, err := CurlFrom(a.Node.Path(), "http://127.0.0.1:15000/config_dump")
	if err != nil {
		return nil, err
	}
	var dump map[string]json.RawMessage
	if err := json.Unmarshal([]byte(out), &dump); err != nil {
		return nil, fmt.Errorf("config dump: %w", err)
	}
	var rows []admin.CertRow
	if err := json.Unmarshal(dump[admin.SectionCerts], &rows); err != nil {
		return nil, fmt.Errorf("certs: %w", err)
	}
	return rows, nil
}

func certOf(t *testing.T, a *Agent, id string) admin.CertRow {
	t.Helper()
	rows, err := certs(a)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.Identity == id {
			return r
		}
	}
	return admin.CertRow{}
}

func waitCert(t *testing.T, a *Agent, id, state string, timeout time.Duration) admin.CertRow {
	t.Helper()
	var got admin.CertRow
	Eventually(t, timeout, func() error {
		rows, err := certs(a)
		if err != nil {
			return err
		}
		for _, r := range rows {
			if r.Identity == id {
				got = r
				if r.State == state {
					return nil
				}
				return fmt.Errorf("%s on %s is %s (last error %q), want %s", id, a.Node.Name, r.State, r.LastError, state)
			}
		}
		return fmt.Errorf("%s not kept on %s", id, a.Node.Name)
	})
	return got
}

// metric reads one series' value from the agent's /metrics.
func metric(t *testing.T, a *Agent, series string) float64 {
	t.Helper()
	out, err := CurlFrom(a.Node.Path(), "http://127.0.0.1:15020/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return f
		}
	}
	return 0
}
