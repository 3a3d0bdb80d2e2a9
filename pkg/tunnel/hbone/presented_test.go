package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// presentedEnv is a pool against a stand-in for a server that never drains
// a connection for its client's certificate (another implementation): our
// Server with the client's chain end put off for a day and no DrainPeers.
// Its handshake still verifies the client's certificate, against any of
// roots (a bundle holding an old and a new root), on its clock, which is
// skew off ours. It records the leaf each stream's connection presented.
type presentedEnv struct {
	*testEnv
	mu     sync.Mutex
	leaves [][]byte
}

func newPresentedEnv(t *testing.T, server tls.Certificate, skew time.Duration, roots ...*x509.CertPool) *presentedEnv {
	t.Helper()
	pe := &presentedEnv{}
	handler := func(ctx context.Context, req *ServerRequest) Response {
		pe.mu.Lock()
		pe.leaves = append(pe.leaves, req.TLS.PeerCertificates[0].Raw)
		pe.mu.Unlock()
		return dialTarget(ctx, req)
	}
	verify := func(raw [][]byte, _ [][]*x509.Certificate) error {
		leaf, err := x509.ParseCertificate(raw[0])
		if err != nil {
			return err
		}
		inter := x509.NewCertPool()
		for _, der := range raw[1:] {
			c, err := x509.ParseCertificate(der)
			if err != nil {
				return err
			}
			inter.AddCert(c)
		}
		for _, r := range roots {
			opts := x509.VerifyOptions{Roots: r, Intermediates: inter, CurrentTime: time.Now().Add(skew), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
			if _, err = leaf.Verify(opts); err == nil {
				return nil
			}
		}
		return err
	}
	stc := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{server}, NextProtos: []string{"h2"},
		ClientAuth: tls.RequireAnyClientCert, VerifyPeerCertificate: verify}
	never := func(tls.ConnectionState) time.Time { return time.Now().Add(24 * time.Hour) }
	pe.testEnv = newEnv(t, handler, ServerOptions{TLSConfig: stc, PeerExpiry: never}, PoolOptions{})
	return pe
}

// connector returns a function that opens a stream through the pool,
// presenting client's certificate, to app.
func (pe *presentedEnv) connector(client *tls.Config, app netip.AddrPort) func() (*Stream, error) {
	return func() (*Stream, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return pe.pool.Connect(ctx, pe.key, tcpDial, client, Request{Authority: app, Forwarded: `for="10.0.0.1"`})
	}
}

// presentedLast reports whether the last stream's connection presented
// cert's leaf.
func (pe *presentedEnv) presentedLast(cert tls.Certificate) bool {
	pe.mu.Lock()
	defer pe.mu.Unlock()
	return len(pe.leaves) > 0 && bytes.Equal(pe.leaves[len(pe.leaves)-1], cert.Certificate[0])
}

// A pooled connection carries new streams as the identity of the
// certificate it presented. Once that certificate's chain has ended, a
// server that does not drain the connection itself would go on taking
// streams as that identity: the pool gives it none after the presented
// chain's end (an intermediate's, if earlier than the leaf's), and the
// next stream dials anew. With a callback (as the identity manager's)
// holding a renewed certificate, the new connection presents it; with only
// the ended one (static), the new handshake fails rather than a stream
// travelling as that identity. The stream open across the end runs on.
func TestNoStreamsAfterOwnCertificateExpired(t *testing.T) {
	for _, mode := range []string{"renewed", "static", "static intermediate"} {
		t.Run(mode, func(t *testing.T) {
			pki := newExpiringPKI(t, 2*time.Second)
			short, end := pki.endingFor(mode)
			e := newPresentedEnv(t, pki.lasting, 0, pki.pool)
			app := startUpstream(t, echo)
			client := pki.config(short, false)
			if mode == "renewed" {
				client.Certificates = nil
				client.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
					if time.Now().Before(end) {
						return &short, nil
					}
					return &pki.lasting, nil
				}
			}
			connect := e.connector(client, app)
			open, err := connect()
			if err != nil {
				t.Fatal(err)
			}
			defer open.Close()
			if !e.presentedLast(short) {
				t.Fatal("the first stream's connection did not present the short certificate")
			}
			waitfor.Until(t, "the presented chain's end", func() bool { return !time.Now().Before(end) })

			s, err := connect()
			if mode == "renewed" {
				if err != nil {
					t.Fatalf("after the end: %v", err)
				}
				s.Close()
				if !e.presentedLast(pki.lasting) {
					t.Fatal("the stream after the presented chain's end went on a connection that did not present the renewed certificate")
				}
			} else {
				if err == nil {
					s.Close()
					t.Fatalf("a stream opened after the end of the chain its connection presented (presented it: %v)", e.presentedLast(short))
				}
				t.Logf("after the end, with no other certificate: %v", err)
			}
			wantRedialed(t, e.testEnv)
			if st := e.pool.Stats(); st.OwnCertificateDrains != 1 {
				t.Errorf("OwnCertificateDrains = %d, want 1", st.OwnCertificateDrains)
			}
			wantEcho(t, open)
		})
	}
}

// A root rotation: the certificate a pooled connection presented was
// issued under a root the new bundle no longer holds. A server holding
// both roots, or one that does not drain for the client's trust change,
// would go on taking streams as that identity on it.
//   - renewed: the identity manager replaced the certificate (it no longer
//     chains to the roots): the next stream goes on a new connection
//     presenting the new one.
//   - trust change: DrainPresented (the node's trust change) drains the
//     connections whose presented certificate no longer verifies, and only
//     them; the next stream needs a new handshake, which a server holding
//     the new roots refuses.
//   - trust change during the handshake: a connection whose certificate
//     was fetched before the change and pooled after DrainPresented went
//     through the pool is drained once pooled; the Connect that dialled it
//     retries on a new one, as for any drain before its stream opened.
//
// Streams open on the drained connection run on.
func TestNoStreamsAsReplacedOwnCertificate(t *testing.T) {
	good, other := pkis()
	for _, mode := range []string{"renewed", "trust change", "trust change during the handshake"} {
		t.Run(mode, func(t *testing.T) {
			e := newPresentedEnv(t, good.leaf, 0, good.pool, other.pool)
			app := startUpstream(t, echo)
			var cur atomic.Pointer[tls.Certificate]
			cur.Store(&good.leaf)
			refuseOld := func(c *tls.Certificate) bool { return !bytes.Equal(c.Certificate[0], good.leaf.Certificate[0]) }
			var changeInHandshake atomic.Bool
			changeInHandshake.Store(mode == "trust change during the handshake")
			client := good.clientTLS()
			client.Certificates = nil
			client.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
				c := cur.Load()
				if changeInHandshake.CompareAndSwap(true, false) {
					if n := e.pool.DrainPresented(refuseOld); n != 0 {
						t.Errorf("DrainPresented before any connection was pooled drained %d", n)
					}
				}
				return c, nil
			}
			connect := e.connector(client, app)
			open, err := connect()
			if err != nil {
				t.Fatal(err)
			}
			defer open.Close()
			switch mode {
			case "renewed":
				cur.Store(&other.leaf)
			case "trust change":
				if n := e.pool.DrainPresented(func(*tls.Certificate) bool { return true }); n != 0 {
					t.Fatalf("DrainPresented keeping all drained %d", n)
				}
				if n := e.pool.DrainPresented(refuseOld); n != 1 {
					t.Fatalf("DrainPresented refusing the presented certificate drained %d, want 1", n)
				}
			}
			if st := e.pool.Stats(); mode != "renewed" && st.OwnCertificateDrains != 1 {
				t.Fatalf("OwnCertificateDrains = %d after the trust change, want 1", st.OwnCertificateDrains)
			}

			s, err := connect()
			if err != nil {
				t.Fatal(err)
			}
			s.Close()
			if st := e.pool.Stats(); st.DialsTotal != 2 || st.OwnCertificateDrains != 1 {
				t.Errorf("dials = %d, OwnCertificateDrains = %d, want 2 and 1: the stream after the change must need a new handshake", st.DialsTotal, st.OwnCertificateDrains)
			}
			if mode == "renewed" && !e.presentedLast(other.leaf) {
				t.Error("the stream after the renewal went on a connection that presented the old certificate")
			}
			wantEcho(t, open)
		})
	}
}

// A certificate whose chain has already ended is not presented, even to a
// server that would take it (its clock runs behind): the dial fails,
// naming the end, rather than the stream it was dialled for going as that
// identity.
func TestOwnCertificateEndedNotPresented(t *testing.T) {
	pki := newExpiringPKI(t, -time.Minute)
	e := newPresentedEnv(t, pki.lasting, -2*time.Minute, pki.pool)
	app := startUpstream(t, echo)
	s, err := e.pool.Connect(context.Background(), e.key, tcpDial, pki.config(pki.expiring, false), Request{Authority: app, Forwarded: `for="10.0.0.1"`})
	if err == nil {
		s.Close()
		t.Fatal("a stream opened on a connection that presented a certificate whose chain had ended")
	}
	if !strings.Contains(err.Error(), "chain ended at") {
		t.Errorf("error %q does not name the certificate's end", err)
	}
	t.Logf("refused: %v", err)
}

// The certificate a connection presented is compared with the current one
// by leaf, not by pointer: a callback that builds a new tls.Certificate
// for the same certificate at each call must not make every Connect drain
// its connection and dial another.
func TestSameOwnCertificateKeepsConnection(t *testing.T) {
	good, _ := pkis()
	e := newPresentedEnv(t, good.leaf, 0, good.pool)
	app := startUpstream(t, echo)
	client := good.clientTLS()
	client.Certificates = nil
	client.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
		c := good.leaf
		c.Certificate = [][]byte{bytes.Clone(good.leaf.Certificate[0])}
		return &c, nil
	}
	for range 3 {
		s, err := e.pool.Connect(context.Background(), e.key, tcpDial, client, Request{Authority: app, Forwarded: `for="10.0.0.1"`})
		if err != nil {
			t.Fatal(err)
		}
		s.Close()
	}
	if st := e.pool.Stats(); st.DialsTotal != 1 || st.OwnCertificateDrains != 0 {
		t.Errorf("dials = %d, OwnCertificateDrains = %d, want 1 and 0", st.DialsTotal, st.OwnCertificateDrains)
	}
}
