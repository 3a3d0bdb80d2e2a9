package hbone

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"io"
	"math/big"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// expiringPKI is a CA with three certificates for the same identity: a
// leaf valid for an hour, one that expires within seconds, and one valid
// for an hour under an intermediate that expires within seconds (a CA
// that does not clamp a leaf to its issuer's end).
type expiringPKI struct {
	pool                   *x509.CertPool
	lasting, expiring, via tls.Certificate
}

func newExpiringPKI(t *testing.T, life time.Duration) *expiringPKI {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "expiry-ca"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	id, _ := url.Parse("spiffe://cluster.local/ns/default/sa/test")
	interKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	interTmpl := &x509.Certificate{SerialNumber: big.NewInt(4), Subject: pkix.Name{CommonName: "expiring-intermediate"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(life),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	interDER, err := x509.CreateCertificate(rand.Reader, interTmpl, ca, &interKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	inter, err := x509.ParseCertificate(interDER)
	if err != nil {
		t.Fatal(err)
	}
	leaf := func(serial int64, notAfter time.Time, issuer *x509.Certificate, issuerKey *ecdsa.PrivateKey) tls.Certificate {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), NotBefore: now.Add(-time.Hour), NotAfter: notAfter,
			KeyUsage:    x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
			DNSNames:    []string{"hbone.test"}, URIs: []*url.URL{id}}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, issuer, &key.PublicKey, issuerKey)
		if err != nil {
			t.Fatal(err)
		}
		parsed, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatal(err)
		}
		chain := [][]byte{der}
		if issuer != ca {
			chain = append(chain, issuer.Raw)
		}
		return tls.Certificate{Certificate: chain, PrivateKey: key, Leaf: parsed}
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	return &expiringPKI{pool: pool, lasting: leaf(2, now.Add(time.Hour), ca, caKey), expiring: leaf(3, now.Add(life), ca, caKey),
		via: leaf(5, now.Add(time.Hour), inter, interKey)}
}

// endingFor is the certificate a test of mode presents ("static
// intermediate": the one whose intermediate ends; otherwise the leaf that
// ends) and the time its chain ends.
func (p *expiringPKI) endingFor(mode string) (tls.Certificate, time.Time) {
	if mode == "static intermediate" {
		return p.via, p.expiring.Leaf.NotAfter // the intermediate's too
	}
	return p.expiring, p.expiring.Leaf.NotAfter
}

func (p *expiringPKI) config(cert tls.Certificate, server bool) *tls.Config {
	c := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}}
	if server {
		c.ClientCAs, c.ClientAuth = p.pool, tls.RequireAndVerifyClientCert
	} else {
		c.RootCAs, c.ServerName = p.pool, "hbone.test"
	}
	return c
}

// A connection is verified once, at its handshake, and may carry streams
// for days. Once the peer's certificate has expired, a new stream must not
// travel on it as if the peer still held that identity: both ends drain the
// connection at the peer's expiry, so the next stream needs a new
// handshake, which an expired certificate cannot pass.
//
// The end is that of the chain the peer presented, not only of its leaf:
// past its intermediate's end the leaf verifies no more.
func TestNoStreamsAfterPeerCertificateExpired(t *testing.T) {
	for _, expiring := range []string{"client", "server", "client intermediate", "server intermediate"} {
		t.Run(expiring, func(t *testing.T) {
			pki := newExpiringPKI(t, 2*time.Second)
			short := pki.expiring
			if strings.HasSuffix(expiring, "intermediate") {
				short = pki.via
			}
			e, connect := expiryEnv(t, pki, short, strings.HasPrefix(expiring, "client"))
			// One stream stays open across the expiry: it runs to its end.
			open, err := connect()
			if err != nil {
				t.Fatal(err)
			}
			defer open.Close()
			time.Sleep(time.Until(pki.expiring.Leaf.NotAfter) + 500*time.Millisecond)

			s, err := connect()
			if err == nil {
				s.Close()
				t.Fatalf("a stream opened %s after the %s certificate expired", time.Since(pki.expiring.Leaf.NotAfter).Round(time.Millisecond), expiring)
			}
			t.Logf("after the expiry: %v", err)
			wantRedialed(t, e)
			wantEcho(t, open)
		})
	}
}

// The drain timer runs on the monotonic clock, which stops while the
// machine is suspended and ignores a step of the wall clock: it may fire
// long after the peer's certificate expired. Here it never fires, and
// still no new stream travels on a connection whose peer's certificate
// has expired by the wall clock: the server refuses it (REFUSED_STREAM
// and GOAWAY, so the client retries on a new connection), the pool picks
// another connection. The retry's handshake fails on the expired
// certificate.
func TestNoStreamsAfterPeerCertificateExpiredTimerLate(t *testing.T) {
	late := func(time.Duration, func()) *time.Timer { return time.AfterFunc(24*time.Hour, func() {}) }
	defer func(f func(time.Duration, func()) *time.Timer) { expiryAfterFunc = f }(expiryAfterFunc)
	expiryAfterFunc = late
	// "idle": no stream is open at the expiry, so the server's drain
	// closes the connection at once.
	for _, expiring := range []string{"client", "server", "client idle"} {
		t.Run(expiring, func(t *testing.T) {
			pki := newExpiringPKI(t, 2*time.Second)
			e, connect := expiryEnv(t, pki, pki.expiring, strings.HasPrefix(expiring, "client"))
			open, err := connect()
			if err != nil {
				t.Fatal(err)
			}
			defer open.Close()
			if strings.HasSuffix(expiring, "idle") {
				open.Close()
				waitfor.Until(t, "the stream's end", func() bool { return e.pool.Stats().ActiveStreams == 0 })
			}
			time.Sleep(time.Until(pki.expiring.Leaf.NotAfter) + 500*time.Millisecond)

			if s, err := connect(); err == nil {
				s.Close()
				t.Fatalf("a stream opened on the old connection %s after the %s certificate expired (drain timer late)", time.Since(pki.expiring.Leaf.NotAfter).Round(time.Millisecond), expiring)
			}
			wantRedialed(t, e)
			if strings.HasSuffix(expiring, "idle") {
				return
			}
			wantEcho(t, open)
		})
	}
}

// DrainPeers (on a trust bundle change) drains exactly the connections
// whose peer keep refuses: their open streams run on, the next stream
// needs a new handshake. Connections keep accepts are left alone.
func TestDrainPeers(t *testing.T) {
	for _, side := range []string{"server", "pool"} {
		t.Run(side, func(t *testing.T) {
			e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
			app := startUpstream(t, echo)
			drain := func(keep func(tls.ConnectionState) bool) int {
				if side == "server" {
					return e.srv.DrainPeers(keep)
				}
				return e.pool.DrainPeers(keep)
			}
			open, err := e.connect(context.Background(), app)
			if err != nil {
				t.Fatal(err)
			}
			defer open.Close()
			var seen []string
			if n := drain(func(cs tls.ConnectionState) bool {
				seen = append(seen, cs.PeerCertificates[0].URIs[0].String())
				return true
			}); n != 0 || len(seen) != 1 || seen[0] != "spiffe://cluster.local/ns/default/sa/test" {
				t.Fatalf("keep all: drained %d, keep saw %v", n, seen)
			}
			if n := drain(func(tls.ConnectionState) bool { return false }); n != 1 {
				t.Fatalf("keep none: drained %d, want 1", n)
			}
			msg := []byte("still here")
			if _, err := open.Write(msg); err != nil {
				t.Fatalf("stream open at the drain: write: %v", err)
			}
			buf := make([]byte, len(msg))
			if _, err := io.ReadFull(open, buf); err != nil || string(buf) != string(msg) {
				t.Fatalf("stream open at the drain: read %q, %v", buf, err)
			}
			// The drained side's GOAWAY reaches the other before the next
			// stream, which then dials.
			time.Sleep(100 * time.Millisecond)
			s, err := e.connect(context.Background(), app)
			if err != nil {
				t.Fatal(err)
			}
			s.Close()
			if st := e.pool.Stats(); st.DialsTotal != 2 {
				t.Errorf("dials = %d, want 2: the stream after the drain must need a new handshake", st.DialsTotal)
			}
		})
	}
}

// A peer whose certificate has expired by the wall clock but passed the
// handshake (its verifier's clock runs behind) is drained at once; the
// pooled connection must still leave the pool when its last stream ends,
// not stay listed, closed, for good.
func TestPeerExpiredAtHandshakeLeavesPool(t *testing.T) {
	pki := newExpiringPKI(t, -time.Minute)
	e := newEnv(t, dialTarget, ServerOptions{TLSConfig: pki.config(pki.expiring, true)}, PoolOptions{})
	app := startUpstream(t, echo)
	client := pki.config(pki.lasting, false)
	client.Time = func() time.Time { return time.Now().Add(-2 * time.Minute) }
	s, err := e.pool.Connect(context.Background(), e.key, tcpDial, client, Request{Authority: app, Forwarded: `for="10.0.0.1"`})
	if err == nil {
		s.Close()
	}
	waitfor.Until(t, "the drained conn leaves the pool", func() bool { return e.pool.Stats().Conns == 0 })
}

// TestPeerChainEnd: the end of a peer's chain is that of the certificates
// the leaf verifies through, followed by issuer from the leaf. A
// certificate the peer sent that the chain does not go through (an old,
// expired cross-signed intermediate left in its CA's answer) must not end
// the connection: with it counted, every new connection would count as
// expired at once, and every stream be refused and retried in vain.
func TestPeerChainEnd(t *testing.T) {
	now := time.Now().Truncate(time.Second)
	cert := func(subject, issuer string, notAfter time.Time) *x509.Certificate {
		c := &x509.Certificate{NotAfter: notAfter}
		c.RawSubject, _ = asn1.Marshal(pkix.Name{CommonName: subject}.ToRDNSequence())
		c.RawIssuer, _ = asn1.Marshal(pkix.Name{CommonName: issuer}.ToRDNSequence())
		return c
	}
	leaf := cert("leaf", "inter", now.Add(time.Hour))
	inter := cert("inter", "root", now.Add(30*time.Minute))
	oldInter := cert("inter", "old-root", now.Add(-time.Hour)) // same name, expired, cross-signed
	unrelated := cert("other", "root", now.Add(-time.Hour))
	for name, tc := range map[string]struct {
		chain []*x509.Certificate
		want  time.Time
	}{
		"leaf alone":                   {[]*x509.Certificate{leaf}, leaf.NotAfter},
		"through its intermediate":     {[]*x509.Certificate{leaf, inter}, inter.NotAfter},
		"an unrelated expired extra":   {[]*x509.Certificate{leaf, unrelated, inter}, inter.NotAfter},
		"an expired cross-signed twin": {[]*x509.Certificate{leaf, oldInter, inter}, inter.NotAfter},
		"only the expired twin":        {[]*x509.Certificate{leaf, oldInter}, oldInter.NotAfter},
		"a root it goes through":       {[]*x509.Certificate{leaf, cert("root", "root", now.Add(10*time.Minute)), inter}, now.Add(10 * time.Minute)},
	} {
		if got := peerChainEnd(tc.chain); !got.Equal(tc.want) {
			t.Errorf("%s: end %s, want %s", name, got.Sub(now), tc.want.Sub(now))
		}
	}
}

// wantRedialed checks that the stream after an expiry needed a new
// handshake. Two dials or more: a TLS 1.3 client ends its handshake before
// the server refuses its certificate, so the refusal may close the new
// connection before the stream is opened on it, which retries on one more.
func wantRedialed(t *testing.T, e *testEnv) {
	t.Helper()
	if st := e.pool.Stats(); st.DialsTotal < 2 {
		t.Errorf("dials = %d, want 2 or more: the stream after the expiry must need a new handshake", st.DialsTotal)
	}
}

// wantEcho checks that a stream open across the expiry still carries data
// to its echo upstream and back.
func wantEcho(t *testing.T, open *Stream) {
	t.Helper()
	msg := []byte("still here")
	if _, err := open.Write(msg); err != nil {
		t.Fatalf("stream open at the expiry: write: %v", err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(open, buf); err != nil || string(buf) != string(msg) {
		t.Fatalf("stream open at the expiry: read %q, %v", buf, err)
	}
}

// expiryEnv starts a server and pool whose one side (the client's when
// clientExpires, else the server's) presents short and the other pki's
// lasting certificate, and an echo upstream; connect opens a stream to it.
func expiryEnv(t *testing.T, pki *expiringPKI, short tls.Certificate, clientExpires bool) (e *testEnv, connect func() (*Stream, error)) {
	t.Helper()
	clientCert, serverCert := pki.lasting, short
	if clientExpires {
		clientCert, serverCert = short, pki.lasting
	}
	e = newEnv(t, dialTarget, ServerOptions{TLSConfig: pki.config(serverCert, true)}, PoolOptions{})
	app := startUpstream(t, echo)
	return e, func() (*Stream, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return e.pool.Connect(ctx, e.key, tcpDial, pki.config(clientCert, false), Request{Authority: app, Forwarded: `for="10.0.0.1"`})
	}
}
