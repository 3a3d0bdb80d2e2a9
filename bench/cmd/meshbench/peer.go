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

// The peer variants: a mature TLS relay pair doing the mesh's job between
// the direct variant's two pods, so the mesh can be compared with what users
// would otherwise deploy. Debian's stunnel4 and HAProxy (both OpenSSL),
// mutual TLS 1.3 with AES-128-GCM, certificates made here:
//
//	dclient: app -> 127.0.0.<k>:<port> relay (client side) ==TLS==>
//	plain:   relay (server side) <plain>:<base+port> -> 127.0.0.1:<port> app
//
// The app connects to the relay in its own pod (stunnel cannot serve a
// transparent capture: its `transparent = destination` needs a conntrack
// entry, which neither the eBPF capture nor TPROXY makes), so each side has
// the mesh's hops: app to proxy inside the client pod, proxy to proxy
// across the nodes with TLS, proxy to app inside the server pod.

// peerPorts are the application ports the peers carry.
var peerPorts = []int{iperfPort, fortioPort, echoPort}

// peerRelay is one kind of peer: where its client side listens in the
// client pod, the port its server side listens on for each application port
// (TLS, but for the plain pair), its two configurations and how to run it in
// the foreground.
type peerRelay struct {
	variant string
	local   netip.Addr
	tls     bool
	hopBase int
	configs func(pc peerCerts, server netip.Addr, hopPort func(int) int, local netip.Addr) (clientConf, serverConf string)
	argv    func(conf string) (string, []string)
}

func (p peerRelay) hopPort(port int) int { return p.hopBase + port }

var (
	stunnelPeer = peerRelay{variant: "peer-stunnel", local: netip.MustParseAddr("127.0.0.1"), tls: true, hopBase: 10000,
		configs: stunnelConfigs, argv: func(conf string) (string, []string) { return "stunnel", []string{conf} }}
	haproxyPeer = peerRelay{variant: "peer-haproxy", local: netip.MustParseAddr("127.0.0.2"), tls: true, hopBase: 20000,
		configs: haproxyConfigs, argv: haproxyArgv}
	// plainPair is HAProxy's pair without TLS: not a peer the mesh competes
	// with but the floor under every relay pair's latency here, the cost of
	// two user-space processes on the path with no cryptography.
	plainPair = peerRelay{variant: "plain-pair", local: netip.MustParseAddr("127.0.0.3"), hopBase: 30000,
		configs: haproxyPlainConfigs, argv: haproxyArgv}
	// relayPairs are the pairs the suite runs, TLS peers first.
	relayPairs = []peerRelay{stunnelPeer, haproxyPeer, plainPair}
)

func haproxyArgv(conf string) (string, []string) { return "haproxy", []string{"-db", "-f", conf} }

// The names in the peer's certificates.
const (
	peerServerName = "peer-server.bench"
	peerClientName = "peer-client.bench"
)

// peerCerts are PEM files for the peer pairs: one CA, a server and a
// client certificate it signed (ECDSA P-256, as the mesh's workload
// certificates).
type peerCerts struct {
	CA, ServerCert, ServerKey, ClientCert, ClientKey string
	// ServerPEM and ClientPEM hold certificate and key in one file, as
	// HAProxy reads them.
	ServerPEM, ClientPEM string
}

// makePeerCerts writes a CA and two leaf certificates into dir.
func makePeerCerts(dir string, serverIP netip.Addr) (peerCerts, error) {
	pc := peerCerts{
		CA:         filepath.Join(dir, "ca.pem"),
		ServerCert: filepath.Join(dir, "server.pem"), ServerKey: filepath.Join(dir, "server-key.pem"),
		ClientCert: filepath.Join(dir, "client.pem"), ClientKey: filepath.Join(dir, "client-key.pem"),
		ServerPEM: filepath.Join(dir, "server-both.pem"), ClientPEM: filepath.Join(dir, "client-both.pem"),
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
	for _, both := range [][3]string{{pc.ServerCert, pc.ServerKey, pc.ServerPEM}, {pc.ClientCert, pc.ClientKey, pc.ClientPEM}} {
		c, err := os.ReadFile(both[0])
		if err != nil {
			return pc, err
		}
		k, err := os.ReadFile(both[1])
		if err != nil {
			return pc, err
		}
		if err := os.WriteFile(both[2], append(c, k...), 0o600); err != nil {
			return pc, err
		}
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
func stunnelConfigs(pc peerCerts, server netip.Addr, hopPort func(int) int, local netip.Addr) (clientConf, serverConf string) {
	var c, s strings.Builder
	c.WriteString(stunnelGlobal)
	c.WriteString("client = yes\n")
	c.WriteString(stunnelTLS(pc, pc.ClientCert, pc.ClientKey))
	c.WriteString("checkHost = " + peerServerName + "\n")
	s.WriteString(stunnelGlobal)
	s.WriteString(stunnelTLS(pc, pc.ServerCert, pc.ServerKey))
	s.WriteString("checkHost = " + peerClientName + "\n")
	for _, p := range peerPorts {
		fmt.Fprintf(&c, "\n[app%d]\naccept = %s\nconnect = %s\n", p, hostPort(local, p), hostPort(server, hopPort(p)))
		fmt.Fprintf(&s, "\n[app%d]\naccept = %s\nconnect = 127.0.0.1:%d\n", p, hostPort(server, hopPort(p)), p)
	}
	return c.String(), s.String()
}

// haproxyConfigs returns HAProxy's client-side and server-side
// configuration: TCP mode, TLS 1.3 only with AES-128-GCM on both ends,
// each side verifying the other's chain and name, no logging.
func haproxyConfigs(pc peerCerts, server netip.Addr, hopPort func(int) int, local netip.Addr) (clientConf, serverConf string) {
	tlsOpts := "ssl-min-ver TLSv1.3 ssl-max-ver TLSv1.3 ciphersuites TLS_AES_128_GCM_SHA256"
	clientTLS := fmt.Sprintf(" ssl crt %s ca-file %s verify required verifyhost %s %s", pc.ClientPEM, pc.CA, peerServerName, tlsOpts)
	serverTLS := fmt.Sprintf(" ssl crt %s ca-file %s verify required %s", pc.ServerPEM, pc.CA, tlsOpts)
	serverCheck := fmt.Sprintf("    tcp-request session reject unless { ssl_c_s_dn(CN) -m str %s }\n", peerClientName)
	return haproxyPairConfigs(server, hopPort, local, clientTLS, serverTLS, serverCheck)
}

// haproxyPlainConfigs is haproxyConfigs without TLS: the same processes,
// hops and settings, carrying plaintext.
func haproxyPlainConfigs(_ peerCerts, server netip.Addr, hopPort func(int) int, local netip.Addr) (clientConf, serverConf string) {
	return haproxyPairConfigs(server, hopPort, local, "", "", "")
}

// haproxyPairConfigs writes the pair's two configurations in TCP mode, the
// client side's server line ending in clientTLS, the server side's bind line
// in serverTLS followed by serverCheck.
func haproxyPairConfigs(server netip.Addr, hopPort func(int) int, local netip.Addr, clientTLS, serverTLS, serverCheck string) (clientConf, serverConf string) {
	const head = `global
    maxconn 4096
defaults
    mode tcp
    timeout connect 5s
    timeout client 5m
    timeout server 5m
`
	var c, s strings.Builder
	c.WriteString(head)
	s.WriteString(head)
	for _, p := range peerPorts {
		fmt.Fprintf(&c, "listen app%d\n    bind %s\n    server peer %s%s\n", p, hostPort(local, p), hostPort(server, hopPort(p)), clientTLS)
		fmt.Fprintf(&s, "listen hop%d\n    bind %s%s\n%s    server app 127.0.0.1:%d\n", p, hostPort(server, hopPort(p)), serverTLS, serverCheck, p)
	}
	return c.String(), s.String()
}

// setupPeer starts a peer pair: the server side in pod server, the client
// side in pod client. It returns both processes, client first.
func setupPeer(ctx context.Context, r *netnstest.Runner, kind peerRelay, pc peerCerts, dir string, client, server *netnstest.Pod) ([]*child, error) {
	cconf, sconf := kind.configs(pc, server.IPv4, kind.hopPort, kind.local)
	var children []*child
	for _, side := range []struct {
		name, conf string
		pod        *netnstest.Pod
		addr       netip.Addr
		port       func(int) int
	}{
		{"server", sconf, server, server.IPv4, kind.hopPort},
		{"client", cconf, client, kind.local, func(p int) int { return p }},
	} {
		file := filepath.Join(dir, kind.variant+"-"+side.name+".conf")
		if err := os.WriteFile(file, []byte(side.conf), 0o600); err != nil {
			return nil, err
		}
		prog, args := kind.argv(file)
		if _, err := exec.LookPath(prog); err != nil {
			return nil, fmt.Errorf("%s needs %s (make bench installs it): %w", kind.variant, prog, err)
		}
		ch, err := startChild(r, side.pod.Path(), kind.variant+" "+side.name+" side", prog, args...)
		if err != nil {
			return nil, err
		}
		for _, p := range peerPorts {
			if err := waitAddr(ctx, side.pod.Path(), hostPort(side.addr, side.port(p)), 10*time.Second); err != nil {
				return nil, fmt.Errorf("%s %s side: %w (log: %s)", kind.variant, side.name, err, ch.stderr.String())
			}
		}
		children = append(children, ch)
	}
	slices.Reverse(children)
	return children, nil
}

// waitAddr waits until something accepts on addr inside the namespace.
func waitAddr(ctx context.Context, nsPath, addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		dctx, cancel := context.WithTimeout(ctx, time.Second)
		c, err := netns.Dial(dctx, nsPath, "tcp", addr, netns.SocketOptions{})
		cancel()
		if err == nil {
			c.Close()
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("nothing listens on %s: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkPeerTLS proves, from the client pod, that the server side speaks
// TLS 1.3 with AES-128-GCM, presents the certificate the client side
// verifies, and refuses a client without a certificate: the variant really
// is mutual TLS with the cipher the comparison claims.
func checkPeerTLS(ctx context.Context, kind peerRelay, pc peerCerts, client *netnstest.Pod, server netip.Addr) error {
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
	addr := hostPort(server, kind.hopPort(echoPort))
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
		return fmt.Errorf(kind.variant+": echo over TLS with the client certificate: %w", err)
	}
	if st.Version != tls.VersionTLS13 || st.CipherSuite != tls.TLS_AES_128_GCM_SHA256 {
		return fmt.Errorf(kind.variant+": negotiated %s %s, want TLS 1.3 TLS_AES_128_GCM_SHA256",
			tls.VersionName(st.Version), tls.CipherSuiteName(st.CipherSuite))
	}
	if _, err := echo(false); err == nil {
		return errors.New(kind.variant + ": the server side echoed for a client without a certificate: it does not verify its peer")
	}
	return nil
}
