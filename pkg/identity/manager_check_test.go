package identity

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
)

// answerSigner answers every request with what answer makes of it; it
// counts calls.
type answerSigner struct {
	answer func(id ID, ttl time.Duration) (*tls.Certificate, error)
	calls  atomic.Int32
}

func (a *answerSigner) Name() string { return "answer" }

func (a *answerSigner) Sign(_ context.Context, id ID, ttl time.Duration) (*tls.Certificate, error) {
	a.calls.Add(1)
	return a.answer(id, ttl)
}

// mint signs a leaf for id with ca's key as a CA might answer: edit
// changes the template first. The private key returned is the leaf's.
func mint(t *testing.T, ca *CA, id ID, edit func(*x509.Certificate)) *tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := randomSerial()
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		NotBefore:             now.Add(-time.Minute),
		NotAfter:              now.Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		URIs:                  []*url.URL{{Scheme: "spiffe", Host: id.TrustDomain, Path: "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount}},
	}
	if edit != nil {
		edit(tmpl)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
}

// TestManagerChecksEveryAnswer: whatever the signer, a certificate this
// node would present wrongly (not for its key, usable on one side of a
// tunnel only, an outsized chain, a CA certificate, another identity or
// trust domain) is refused, counted by reason, and never served.
func TestManagerChecksEveryAnswer(t *testing.T) {
	ca := newCA(t, "cluster.local")
	for name, tc := range map[string]struct {
		answer func(t *testing.T) *tls.Certificate
		reason string
	}{
		"not the key it came with": {func(t *testing.T) *tls.Certificate {
			c := mint(t, ca, idWeb, nil)
			c.PrivateKey = mint(t, ca, idWeb, nil).PrivateKey
			return c
		}, ReasonBadResponse},
		"client usage only": {func(t *testing.T) *tls.Certificate {
			return mint(t, ca, idWeb, func(c *x509.Certificate) { c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth} })
		}, ReasonUntrustedChain},
		"server usage only": {func(t *testing.T) *tls.Certificate {
			return mint(t, ca, idWeb, func(c *x509.Certificate) { c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth} })
		}, ReasonUntrustedChain},
		"outsized chain": {func(t *testing.T) *tls.Certificate {
			c := mint(t, ca, idWeb, nil)
			for range 64 {
				c.Certificate = append(c.Certificate, ca.cert.Raw)
			}
			return c
		}, ReasonBadResponse},
		"leaf not first": {func(t *testing.T) *tls.Certificate {
			c := mint(t, ca, idWeb, nil)
			c.Certificate = [][]byte{ca.cert.Raw, c.Certificate[0]}
			return c
		}, ReasonBadResponse},
		"a CA certificate": {func(t *testing.T) *tls.Certificate {
			return mint(t, ca, idWeb, func(c *x509.Certificate) { c.IsCA = true })
		}, ReasonWrongIdentity},
		"an extra URI SAN": {func(t *testing.T) *tls.Certificate {
			return mint(t, ca, idWeb, func(c *x509.Certificate) {
				c.URIs = append(c.URIs, &url.URL{Scheme: "spiffe", Host: "cluster.local", Path: "/ns/shop/sa/cart"})
			})
		}, ReasonWrongIdentity},
		"another trust domain": {func(t *testing.T) *tls.Certificate {
			return mint(t, ca, ID{TrustDomain: "other.local", Namespace: "shop", ServiceAccount: "web"}, nil)
		}, ReasonWrongIdentity},
		"not yet valid": {func(t *testing.T) *tls.Certificate {
			return mint(t, ca, idWeb, func(c *x509.Certificate) {
				c.NotBefore = time.Now().Add(time.Hour)
				c.NotAfter = time.Now().Add(2 * time.Hour)
			})
		}, ReasonNotYetValid},
		"expired": {func(t *testing.T) *tls.Certificate {
			return mint(t, ca, idWeb, func(c *x509.Certificate) {
				c.NotBefore = time.Now().Add(-2 * time.Hour)
				c.NotAfter = time.Now().Add(-time.Hour)
			})
		}, ReasonUntrustedChain},
	} {
		t.Run(name, func(t *testing.T) {
			cert := tc.answer(t)
			s := &answerSigner{answer: func(ID, time.Duration) (*tls.Certificate, error) { return cert, nil }}
			m := New(ManagerOptions{Signer: s, Trust: ca, TTL: time.Hour, BackoffMin: time.Hour})
			defer m.Close()
			m.Add(idWeb)
			waitfor.Until(t, "the refusal", func() bool { return stateOf(m, idWeb).State == StateFailing })
			if c, err := m.Certificate(idWeb); err == nil {
				t.Fatalf("served a refused certificate (serial %s)", c.Leaf.SerialNumber)
			}
			if got := testutil.ToFloat64(m.metrics.failures.WithLabelValues(tc.reason)); got != 1 {
				t.Errorf("failures{%s} = %v, want 1 (last error: %s)", tc.reason, got, stateOf(m, idWeb).LastError)
			}
		})
	}
}

// TestManagerRenewalFollowsTheAskedLifetime: a CA that grants years does
// not keep one key in use for years (renewal at about half of the TTL asked
// for), and one that grants seconds is not asked again every second.
func TestManagerRenewalFollowsTheAskedLifetime(t *testing.T) {
	ca := newCA(t, "cluster.local")
	t.Run("too long", func(t *testing.T) {
		s := &answerSigner{answer: func(id ID, _ time.Duration) (*tls.Certificate, error) {
			return mint(t, ca, id, func(c *x509.Certificate) { c.NotAfter = time.Now().Add(5 * 365 * 24 * time.Hour) }), nil
		}}
		m := New(ManagerOptions{Signer: s, Trust: ca, TTL: time.Hour})
		defer m.Close()
		addAndWait(t, m, idWeb)
		if at := stateOf(m, idWeb).RefreshAt; at.After(time.Now().Add(31 * time.Minute)) {
			t.Fatalf("refresh at %s, over half of the 1h asked for from now", at)
		}
	})
	t.Run("too short", func(t *testing.T) {
		s := &answerSigner{answer: func(id ID, _ time.Duration) (*tls.Certificate, error) {
			return mint(t, ca, id, func(c *x509.Certificate) { c.NotAfter = time.Now().Add(2 * time.Second) }), nil
		}}
		m := New(ManagerOptions{Signer: s, Trust: ca, TTL: time.Hour})
		defer m.Close()
		m.Add(idWeb)
		time.Sleep(3 * time.Second)
		if n := s.calls.Load(); n != 1 {
			t.Fatalf("%d CA requests in 3s for certificates granted 2s of the 1h asked, want 1 (then at most one per %s)", n, DefaultBackoffMax)
		}
	})
}

// TestManagerChainEnd: a certificate lives as long as its chain. A CA
// that does not clamp a leaf to its intermediate's end answers a leaf of
// an hour under an intermediate of ten minutes: past those ten minutes no
// peer verifies it, so it is not presented (fail closed, counted as
// expired), and it is renewed at about half of the chain's life, not of
// the leaf's.
func TestManagerChainEnd(t *testing.T) {
	rootKey := identitytest.NewKey(t, "ecdsa")
	root := identitytest.MakeCACert(t, pkix.Name{CommonName: "root"}, rootKey, nil, nil)
	pool := x509.NewCertPool()
	pool.AddCert(root)
	interKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	clock := newFakeClock()
	interDER, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "short intermediate"},
		NotBefore: clock.Now().Add(-time.Hour), NotAfter: clock.Now().Add(10 * time.Minute),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
	}, root, interKey.Public(), rootKey)
	if err != nil {
		t.Fatal(err)
	}
	inter, err := x509.ParseCertificate(interDER)
	if err != nil {
		t.Fatal(err)
	}
	s := &answerSigner{answer: func(id ID, _ time.Duration) (*tls.Certificate, error) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, err
		}
		der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
			SerialNumber: big.NewInt(3), NotBefore: clock.Now().Add(-time.Minute), NotAfter: clock.Now().Add(time.Hour),
			KeyUsage:    x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
			URIs:        []*url.URL{{Scheme: "spiffe", Host: id.TrustDomain, Path: "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount}},
		}, inter, &key.PublicKey, interKey)
		if err != nil {
			return nil, err
		}
		leaf, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, err
		}
		return &tls.Certificate{Certificate: [][]byte{der, inter.Raw}, PrivateKey: key, Leaf: leaf}, nil
	}}
	m := New(ManagerOptions{Signer: s, Trust: poolTrust{pool}, TTL: time.Hour, Clock: clock.Now})
	defer m.Close()
	m.clockCheck = time.Hour // the renewal must not run in this test
	addAndWait(t, m, idWeb)
	if at := stateOf(m, idWeb).RefreshAt; at.After(clock.Now().Add(5 * time.Minute)) {
		t.Errorf("refresh at %s from now, past half of the chain's 10 minutes", at.Sub(clock.Now()))
	}
	clock.Advance(11 * time.Minute)
	if c, err := m.Certificate(idWeb); err == nil {
		t.Fatalf("presented a certificate (serial %s) whose intermediate expired", c.Leaf.SerialNumber)
	}
	if got := unavailable(m, UnavailableExpired); got != 1 {
		t.Errorf("unavailable{expired} = %v, want 1", got)
	}
	if st := stateOf(m, idWeb).State; st != StateExpired {
		t.Errorf("state = %s, want expired", st)
	}
}

// TestManagerKeepsCertificateOverShortRenewal: a renewal answered with a
// certificate that expires before it could be renewed (a hostile or broken
// CA granting seconds) must not take the place of the certificate in use,
// which has half an hour left: before, it did, and from its expiry until
// the next request (paced at a quarter of the TTL asked for, up to
// BackoffMax) the identity had no certificate and every handshake failed
// closed. The short answer is a failure, named and counted; the CA is not
// asked again sooner than that pace.
func TestManagerKeepsCertificateOverShortRenewal(t *testing.T) {
	ca := newCA(t, "cluster.local")
	clock := newFakeClock()
	var short atomic.Bool
	s := &answerSigner{answer: func(id ID, _ time.Duration) (*tls.Certificate, error) {
		life := time.Hour
		if short.Load() {
			life = 2 * time.Second
		}
		return mint(t, ca, id, func(c *x509.Certificate) {
			c.NotBefore, c.NotAfter = clock.Now().Add(-time.Minute), clock.Now().Add(life)
		}), nil
	}}
	m := New(ManagerOptions{Signer: s, Trust: ca, TTL: time.Hour, Clock: clock.Now, BackoffMax: time.Hour})
	defer m.Close()
	m.clockCheck = 10 * time.Millisecond
	addAndWait(t, m, idWeb)
	good := stateOf(m, idWeb)

	short.Store(true)
	clock.Advance(31 * time.Minute) // past the refresh time (about half of the hour)
	waitfor.Until(t, "the renewal", func() bool { return s.calls.Load() == 2 })
	waitfor.Until(t, "the renewal's outcome", func() bool { return stateOf(m, idWeb).State != StateRefreshing })
	clock.Advance(3 * time.Second) // the short certificate has expired; the first has 29 minutes left
	c, err := m.Certificate(idWeb)
	if err != nil {
		t.Fatalf("no certificate with the first one (serial %s) 29 minutes from its end: %v", good.Serial, err)
	}
	if got := c.Leaf.SerialNumber.Text(16); got != good.Serial {
		t.Errorf("serving serial %s, want the first certificate's %s", got, good.Serial)
	}
	st := stateOf(m, idWeb)
	if st.State != StateFailing || !strings.Contains(st.LastError, "renewed") {
		t.Errorf("state %s, last error %q: want failing, naming the short lifetime", st.State, st.LastError)
	}
	if got := testutil.ToFloat64(m.metrics.failures.WithLabelValues(ReasonShortLifetime)); got != 1 {
		t.Errorf("failures{%s} = %v, want 1", ReasonShortLifetime, got)
	}
	time.Sleep(time.Second)
	if n := s.calls.Load(); n != 2 {
		t.Errorf("%d CA requests, want 2: a short answer is retried at the renewal pace, not the backoff's", n)
	}
}

// TestManagerNamesClockSkew: istiod backdates NotBefore by 2 minutes, so
// a node whose clock is further behind istiod's is answered with
// certificates not valid yet, every time. The refusal says so, and
// names the clocks; before, it read as an untrusted chain ("untrusted
// peer certificate: x509: certificate has expired or is not yet valid"),
// counted as untrusted_chain, as a certificate from a foreign CA is.
func TestManagerNamesClockSkew(t *testing.T) {
	ca := newCA(t, "cluster.local")
	clock := newFakeClock()
	clock.Advance(-5 * time.Minute) // this node is 5 minutes behind the CA
	m := New(ManagerOptions{Signer: ca, Trust: ca, TTL: time.Hour, BackoffMin: time.Hour, Clock: clock.Now})
	defer m.Close()
	m.Add(idWeb)
	waitfor.Until(t, "the refusal", func() bool { return stateOf(m, idWeb).State == StateFailing })
	st := stateOf(m, idWeb)
	if !strings.Contains(st.LastError, "not valid before") || !strings.Contains(st.LastError, "clock") {
		t.Errorf("last error %q does not name the clocks", st.LastError)
	}
	if got := testutil.ToFloat64(m.metrics.failures.WithLabelValues(ReasonNotYetValid)); got != 1 {
		t.Errorf("failures{%s} = %v, want 1", ReasonNotYetValid, got)
	}
}
