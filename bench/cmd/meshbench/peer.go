package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/redirector-mesh/redirector/pkg/netns"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// The peer variant: a mature TLS relay pair doing the mesh's job between
// the direct variant's two pods, so the mesh can be compared with what users
// would otherwise deploy. Debian's stunnel4 (OpenSSL), mutual TLS 1.3 with
// AES-128-GCM, certificates made here:
//
//	dclient: app -> 127.0.0.1:<port> stunnel (client mode) ==TLS==>
//	plain:   stunnel (server mode) <plain>:1<port> -> 127.0.0.1:<port> app
//
// The app connects to the stunnel in its own pod (stunnel cannot serve a
// transparent capture: its `transparent = destination` needs a conntrack
// entry, which neither the eBPF capture nor TPROXY makes), so each side has
// the mesh's hops: app to proxy inside the client pod, proxy to proxy
// across the nodes with TLS, proxy to app inside the server pod.

// peerPorts are the application ports the peer carries; the server-side
// stunnel listens on peerTLSPort(port) for each.
var peerPorts = []int{iperfPort, fortioPort, echoPort}

func peerTLSPort(port int) int { return 10000 + port }

// The names in the peer's certificates.
const (
	peerServerName = "peer-server.bench"
	peerClientName = "peer-client.bench"
)

// peerCerts are PEM files for the stunnel pair: one CA, a server and a
// client certificate it signed (ECDSA P-256, as the mesh's workload
// certificates).
type peerCerts struct {
	CA, ServerCert, ServerKey, ClientCert, ClientKey string
}

// makePeerCerts writes a CA and two leaf certificates into dir.
func makePeerCerts(dir string, serverIP netip.Addr) (peerCerts, error) {
	pc := peerCerts{
		CA:         filepath.Join(dir, "ca.pem"),
		ServerCert: filepath.Join(dir, "server.pem"), ServerKey: filepath.Join(dir, "server-key.pem"),
		ClientCert: filepath.Join(dir, "client.pem"), ClientKey: filepath.Join(dir, "client-key.pem"),
	}
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return pc, err
	}
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "meshbench peer CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return pc, fmt.Errorf("peer CA: %w", err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return pc, err
	}
	if err := writePEM(pc.CA, "CERTIFICATE", caDER); err != nil {
		return pc, err
	}
	leaf := func(serial int64, name string, usage x509.ExtKeyUsage, ips []netip.Addr, certFile, keyFile string) error {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		}
		for _, ip := range ips {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip.AsSlice())
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
		if err != nil {
			return fmt.Errorf("peer certificate %s: %w", name, err)
		}
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return err
		}
		if err := writePEM(certFile, "CERTIFICATE", der); err != nil {
			return err
		}
		return writePEM(keyFile, "PRIVATE KEY", keyDER)
	}
	if err := leaf(2, peerServerName, x509.ExtKeyUsageServerAuth, []netip.Addr{serverIP}, pc.ServerCert, pc.ServerKey); err != nil {
		return pc, err
	}
	if err := leaf(3, peerClientName, x509.ExtKeyUsageClientAuth, nil, pc.ClientCert, pc.ClientKey); err != nil {
		return pc, err
	}
	return pc, nil
}

func writePEM(file, typ string, der []byte) error {
	return os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// stunnelTLS is the TLS part of both sides' configuration: TLS 1.3 only,
// AES-128-GCM (what Go's crypto/tls picks for the mesh on this CPU), and
// each side verifies the other's certificate chain against the CA.
func stunnelTLS(pc peerCerts, cert, key string) string {
	return fmt.Sprintf(`sslVersionMin = TLSv1.3
sslVersionMax = TLSv1.3
ciphersuites = TLS_AES_128_GCM_SHA256
CAfile = %s
cert = %s
key = %s
verifyChain = yes
requireCert = yes
`, pc.CA, cert, key)
}

// stunnelGlobal runs stunnel in the foreground (its process is the one we
// start, so its CPU is measured like an agent's), without a pid file or
// syslog, logging warnings and errors to standard error: no line per
// connection (the agents write one access-log line per connection per
// side; BENCHMARKS.md measured that at no cost across nodes).
const stunnelGlobal = `foreground = yes
syslog = no
pid =
debug = warning
`

// stunnelConfigs returns the client-side and server-side configuration.
func stunnelConfigs(pc peerCerts, server netip.Addr) (clientConf, serverConf string) {
	var c, s strings.Builder
	c.WriteString(stunnelGlobal)
	c.WriteString("client = yes\n")
	c.WriteString(stunnelTLS(pc, pc.ClientCert, pc.ClientKey))
	c.WriteString("checkHost = " + peerServerName + "\n")
	s.WriteString(stunnelGlobal)
	s.WriteString(stunnelTLS(pc, pc.ServerCert, pc.ServerKey))
	s.WriteString("checkHost = " + peerClientName + "\n")
	for _, p := range peerPorts {
		fmt.Fprintf(&c, "\n[app%d]\naccept = 127.0.0.1:%d\nconnect = %s\n", p, p, hostPort(server, peerTLSPort(p)))
		fmt.Fprintf(&s, "\n[app%d]\naccept = %s\nconnect = 127.0.0.1:%d\n", p, hostPort(server, peerTLSPort(p)), p)
	}
	return c.String(), s.String()
}

// setupPeer starts the stunnel pair: the server side in pod server, the
// client side in pod client. It returns both processes, client first.
func setupPeer(ctx context.Context, r *netnstest.Runner, client, server *netnstest.Pod) (peerCerts, []*child, error) {
	if _, err := exec.LookPath("stunnel"); err != nil {
		return peerCerts{}, nil, fmt.Errorf("the peer variant needs stunnel (Debian stunnel4; make bench installs it): %w", err)
	}
	dir := filepath.Join(r.TempDir(), "peer")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return peerCerts{}, nil, err
	}
	pc, err := makePeerCerts(dir, server.IPv4)
	if err != nil {
		return pc, nil, err
	}
	cconf, sconf := stunnelConfigs(pc, server.IPv4)
	var children []*child
	for _, side := range []struct {
		name, conf string
		pod        *netnstest.Pod
		port       func(int) int
	}{
		{"server", sconf, server, peerTLSPort},
		{"client", cconf, client, func(p int) int { return p }},
	} {
		file := filepath.Join(dir, side.name+".conf")
		if err := os.WriteFile(file, []byte(side.conf), 0o600); err != nil {
			return pc, nil, err
		}
		ch, err := startChild(r, side.pod.Path(), "stunnel "+side.name+" side", "stunnel", file)
		if err != nil {
			return pc, nil, err
		}
		for _, p := range peerPorts {
			if err := waitPortAt(ctx, side.pod.Path(), side.name, side.pod, side.port(p), 10*time.Second); err != nil {
				return pc, nil, fmt.Errorf("stunnel %s side: %w (log: %s)", side.name, err, ch.stderr.String())
			}
		}
		children = append(children, ch)
	}
	slices.Reverse(children)
	return pc, children, nil
}

// waitPortAt waits for the server side on its pod address, the client side
// on loopback.
func waitPortAt(ctx context.Context, nsPath, side string, pod *netnstest.Pod, port int, timeout time.Duration) error {
	if side == "client" {
		return waitPort(ctx, nsPath, port, timeout)
	}
	deadline := time.Now().Add(timeout)
	for {
		dctx, cancel := context.WithTimeout(ctx, time.Second)
		c, err := netns.Dial(dctx, nsPath, "tcp", hostPort(pod.IPv4, port), netns.SocketOptions{})
		cancel()
		if err == nil {
			c.Close()
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("nothing listens on %s: %w", hostPort(pod.IPv4, port), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkPeerTLS proves, from the client pod, that the server side speaks
// TLS 1.3 with AES-128-GCM, presents the certificate the client side
// verifies, and refuses a client without a certificate: the variant really
// is mutual TLS with the cipher the comparison claims.
func checkPeerTLS(ctx context.Context, pc peerCerts, client *netnstest.Pod, server netip.Addr) error {
	caPEM, err := os.ReadFile(pc.CA)
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return errors.New("peer CA: no certificate")
	}
	cert, err := tls.LoadX509KeyPair(pc.ClientCert, pc.ClientKey)
	if err != nil {
		return err
	}
	addr := hostPort(server, peerTLSPort(echoPort))
	echo := func(withCert bool) (tls.ConnectionState, error) {
		cfg := &tls.Config{RootCAs: roots, ServerName: peerServerName, MinVersion: tls.VersionTLS13}
		if withCert {
			cfg.Certificates = []tls.Certificate{cert}
		}
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		raw, err := netns.Dial(ctx, client.Path(), "tcp", addr, netns.SocketOptions{})
		if err != nil {
			return tls.ConnectionState{}, err
		}
		defer raw.Close()
		_ = raw.SetDeadline(time.Now().Add(5 * time.Second))
		c := tls.Client(raw, cfg)
		if err := c.HandshakeContext(ctx); err != nil {
			return tls.ConnectionState{}, err
		}
		// In TLS 1.3 the server's verdict on the client certificate comes
		// after the client's handshake ends: a round trip shows it.
		b := []byte{'x'}
		if _, err := c.Write(b); err != nil {
			return c.ConnectionState(), err
		}
		_, err = io.ReadFull(c, b)
		return c.ConnectionState(), err
	}
	st, err := echo(true)
	if err != nil {
		return fmt.Errorf("peer: echo over TLS with the client certificate: %w", err)
	}
	if st.Version != tls.VersionTLS13 || st.CipherSuite != tls.TLS_AES_128_GCM_SHA256 {
		return fmt.Errorf("peer: negotiated %s %s, want TLS 1.3 TLS_AES_128_GCM_SHA256",
			tls.VersionName(st.Version), tls.CipherSuiteName(st.CipherSuite))
	}
	if _, err := echo(false); err == nil {
		return errors.New("peer: the server side echoed for a client without a certificate: it does not verify its peer")
	}
	return nil
}
