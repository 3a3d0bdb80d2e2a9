package tunnel

import (
	"crypto/x509"
	"encoding/pem"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redirector-mesh/redirector/pkg/identity"
)

// The tests here drive the inbound HBONE listener (the production TLS
// config, identity.ServerConfig) with clients this project did not write.
// A client missing is a failure, not a skip: `make deps` installs them.

// realClient returns the path of a third-party client the test needs.
func realClient(t *testing.T, name, pkg string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s not found (make deps; apt-get install %s): %v", name, pkg, err)
	}
	return p
}

// hboneRig serves the pod "server" and writes the PEM files a client
// needs: a certificate of the mesh for mesh/client and its key.
type hboneRig struct {
	addr          string // host:port of the HBONE listener
	app           string // host:port of the echo app behind it
	cert, key, ca string // PEM files
}

func newHBONERig(t *testing.T) *hboneRig {
	t.Helper()
	rig := newTwoRoots(t)
	serverID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "server-sa"}
	clientID := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: "client"}
	l, app := servedEchoPod(t, rig.manager(rig.kept, serverID))
	cc, err := rig.manager(rig.kept, clientID).Certificate(clientID)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	r := &hboneRig{addr: l.Addr().String(), app: app.Addr().String(),
		cert: filepath.Join(dir, "client.pem"), key: filepath.Join(dir, "client-key.pem"), ca: filepath.Join(dir, "ca.pem")}
	var certPEM []byte
	for _, der := range cc.Certificate {
		certPEM = append(certPEM, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(cc.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: rig.kept.Certificate().Raw})
	for path, data := range map[string][]byte{r.cert: certPEM, r.key: pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), r.ca: caPEM} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// run runs a client to its end (each has its own time limit) and returns
// what it printed, both streams.
func run(t *testing.T, name string, args ...string) (string, error) {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	return string(out), err
}

// TestCurlPlaintextToHBONEPort: curl speaking plaintext HTTP to the HBONE
// port, a GET and a CONNECT (`--proxytunnel`: HBONE configured without
// TLS), is told in HTTP what the port speaks. Before, the server closed the
// connection without a word, and curl reported "Empty reply from server".
func TestCurlPlaintextToHBONEPort(t *testing.T) {
	curl := realClient(t, "curl", "curl")
	r := newHBONERig(t)
	out, err := run(t, curl, "-sS", "-i", "--max-time", "10", "http://"+r.addr+"/")
	if err != nil || !strings.Contains(out, " 400 ") || !strings.Contains(out, "HBONE") {
		t.Errorf("curl http://%s: %v\n%s\nwant a 400 that says the port speaks HBONE", r.addr, err, out)
	}
	out, err = run(t, curl, "-sS", "-v", "--max-time", "10", "--proxytunnel", "-x", "http://"+r.addr, "http://"+r.app+"/")
	if err == nil || !strings.Contains(out, "< HTTP/1.0 400") || !strings.Contains(out, "HBONE") {
		t.Errorf("curl CONNECT in plaintext: %v\n%s\nwant the CONNECT refused with a 400 that says the port speaks HBONE", err, out)
	}
}

// TestTLSClientWithoutH2ToHBONEPort: a client of the mesh (its certificate
// verifies) that does not offer ALPN h2 is told that the port needs it:
// curl --http1.1 gets an HTTP/1.1 505 saying so, and openssl s_client (no
// ALPN at all) reads the same text. Before, the handshake failed with the
// alert bad_certificate (42), which sent the operator after a certificate
// that was fine. A client without a certificate still learns nothing but
// certificate_required.
func TestTLSClientWithoutH2ToHBONEPort(t *testing.T) {
	curl := realClient(t, "curl", "curl")
	openssl := realClient(t, "openssl", "openssl")
	r := newHBONERig(t)
	out, err := run(t, curl, "-sS", "-i", "--max-time", "10", "--http1.1", "-k", "--cert", r.cert, "--key", r.key, "https://"+r.addr+"/")
	if err != nil || !strings.Contains(out, "HTTP/1.1 505") || !strings.Contains(out, "ALPN h2") {
		t.Errorf("curl --http1.1 with the mesh's certificate: %v\n%s\nwant a 505 that says HBONE needs HTTP/2 (ALPN h2)", err, out)
	}
	cmd := exec.Command(openssl, "s_client", "-connect", r.addr, "-cert", r.cert, "-key", r.key, "-ign_eof")
	cmd.Stdin = strings.NewReader("")
	b, _ := cmd.CombinedOutput()
	if out := string(b); !strings.Contains(out, "ALPN h2") || strings.Contains(out, "bad certificate") {
		t.Errorf("openssl s_client without ALPN:\n%s\nwant the text that says HBONE needs ALPN h2, not a bad_certificate alert", out)
	}
	out, err = run(t, curl, "-sS", "-i", "--max-time", "10", "--http1.1", "-k", "https://"+r.addr+"/")
	if err == nil || strings.Contains(out, "ALPN h2") || strings.Contains(out, "HTTP/1.1") {
		t.Errorf("curl --http1.1 without a certificate: %v\n%s\nwant the handshake refused, no answer", err, out)
	}
}
