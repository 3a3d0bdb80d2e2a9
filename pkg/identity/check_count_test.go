package identity

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"testing"
	"time"
)

// TestCertificateChecksAreNoHandshakes: the HBONE server and pool ask the
// TLS callbacks what a new handshake would present, to stop connections
// whose certificate was renewed or lost (hbone's presented.go: the server
// at most once a second on a new stream, the pool once per Connect that
// finds a pooled connection), with infos that carry no context, as
// crypto/tls gives every handshake's. Such a check finding no certificate
// is no handshake failing closed; counted, it added one to
// redirector_certificate_unavailable_total per connection checked, next to
// the handshakes that did fail, and an identity that lost its certificate
// read as twice the failures it had.
func TestCertificateChecksAreNoHandshakes(t *testing.T) {
	m := newManager(t, newCA(t, "cluster.local"), time.Hour)
	idGone := ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "gone"}
	server, client := ServerConfig(m, idGone), ClientConfig(m, idGone, idCart)

	if _, err := server.GetCertificate(&tls.ClientHelloInfo{SupportedVersions: []uint16{tls.VersionTLS13}}); !errors.Is(err, ErrNoCertificate) {
		t.Errorf("server check of an identity not kept: err = %v, want ErrNoCertificate", err)
	}
	if _, err := client.GetClientCertificate(&tls.CertificateRequestInfo{Version: tls.VersionTLS13}); !errors.Is(err, ErrNoCertificate) {
		t.Errorf("client check of an identity not kept: err = %v, want ErrNoCertificate", err)
	}
	if got := unavailable(m, UnavailableNotKept); got != 0 {
		t.Errorf("unavailable{not_enrolled} = %v after two checks and no handshake, want 0", got)
	}

	// Handshakes are counted, each side's.
	if r := handshake(t, ClientConfig(m, idWeb, idGone), server); r.serverErr == nil {
		t.Fatal("server handshake without a certificate succeeded")
	}
	if got := unavailable(m, UnavailableNotKept); got != 1 {
		t.Errorf("unavailable{not_enrolled} = %v after a server handshake failed closed, want 1", got)
	}
	if err := clientHandshake(t, client, ServerConfig(m, idCart)); err == nil {
		t.Fatal("client handshake without a certificate succeeded")
	}
	if got := unavailable(m, UnavailableNotKept); got != 2 {
		t.Errorf("unavailable{not_enrolled} = %v after a client handshake failed closed too, want 2", got)
	}

	// A check still learns the certificate there is.
	if c, err := ServerConfig(m, idCart).GetCertificate(&tls.ClientHelloInfo{}); err != nil || c == nil {
		t.Errorf("server check of a kept identity: %v, %v", c != nil, err)
	}
	if c, err := ClientConfig(m, idWeb, idCart).GetClientCertificate(&tls.CertificateRequestInfo{}); err != nil || c == nil {
		t.Errorf("client check of a kept identity: %v, %v", c != nil, err)
	}
}

// clientHandshake runs a client handshake with clientCfg against a server
// with serverCfg over loopback and returns the client's error; the client's
// socket is closed as soon as its handshake ends, so a server waiting for a
// certificate the client failed to give is not waited for.
func clientHandshake(t *testing.T, clientCfg, serverCfg *tls.Config) error {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		raw, err := ln.Accept()
		if err != nil {
			return
		}
		defer raw.Close()
		_ = tls.Server(raw, serverCfg).HandshakeContext(ctx)
	}()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	err = tls.Client(raw, clientCfg).HandshakeContext(ctx)
	raw.Close()
	<-done
	return err
}
