package hbone

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// A pooled connection carries new streams as the identity of the
// certificate this end presented in its handshake, for as long as it is
// pooled. The server checked that certificate then, and our own server
// drains a connection at its client's chain end or trust change, but a
// server that does not (another implementation, a waypoint) would go on
// taking streams as an identity whose certificate expired or whose root
// was removed. So the pool records what each connection presented and
// gives it no new stream once that certificate's chain has ended, once a
// new handshake would present another certificate (renewed, or replaced
// because its root was removed), or once a trust change refuses it
// (DrainPresented). The next stream dials anew, presenting the current
// certificate; streams in flight run to their end.

// presentedCert is what a client connection presented in its handshake.
type presentedCert struct {
	cert *tls.Certificate
	// end is the first NotAfter along the presented chain (peerChainEnd):
	// past an intermediate's end the leaf verifies no more. Zero: the
	// chain did not parse, and only a replacement stops the conn.
	end time.Time
	// stopped: the pool stopped the conn for its certificate, set under
	// the conn's mu so that it is counted and logged once; read without it
	// to skip such a conn.
	stopped atomic.Bool
}

// newPresented records cert as presented; nil if nothing was (the server
// asked for no certificate, or the client had none to give).
func newPresented(cert *tls.Certificate) *presentedCert {
	if cert == nil || len(cert.Certificate) == 0 {
		return nil
	}
	pc := &presentedCert{cert: cert}
	chain := make([]*x509.Certificate, 0, len(cert.Certificate))
	for i, der := range cert.Certificate {
		if i == 0 && cert.Leaf != nil && bytes.Equal(cert.Leaf.Raw, der) {
			chain = append(chain, cert.Leaf)
			continue
		}
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return pc
		}
		chain = append(chain, c)
	}
	pc.end = peerChainEnd(chain)
	return pc
}

// endedAt says whether the presented chain has ended at now.
func (pc *presentedCert) endedAt(now time.Time) bool {
	return pc != nil && !pc.end.IsZero() && !now.Before(pc.end)
}

// presenting returns conf, offering ALPN h2, with what crypto/tls
// presents to the server recorded in *got. A certificate whose chain has
// ended is not presented: the handshake fails, naming its end, so that not
// even the stream a connection is dialled for goes as an identity whose
// certificate ended, whatever the server would take. conf is not changed.
func presenting(conf *tls.Config, got **presentedCert) *tls.Config {
	c := withH2(conf)
	if c == conf {
		c = conf.Clone()
	}
	record := func(cert *tls.Certificate) (*tls.Certificate, error) {
		pc := newPresented(cert)
		if pc.endedAt(time.Now()) {
			return nil, fmt.Errorf("the client certificate's chain ended at %s", pc.end.UTC().Format(time.RFC3339))
		}
		*got = pc
		return cert, nil
	}
	if get := conf.GetClientCertificate; get != nil {
		c.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
			cert, err := get(cri)
			if err != nil {
				return nil, err
			}
			return record(cert)
		}
		return c
	}
	// crypto/tls's own choice among static certificates.
	certs := conf.Certificates
	c.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
		for i := range certs {
			if cri.SupportsCertificate(&certs[i]) == nil {
				return record(&certs[i])
			}
		}
		return new(tls.Certificate), nil
	}
	return c
}

// currentCert is what a new handshake with a config would present now,
// asked at most once per Connect and only if a pooled conn presented
// something. A config with static certificates has no later one: its
// conns stop at their chain's end only.
type currentCert struct {
	conf  *tls.Config
	asked bool
	cert  *tls.Certificate
	known bool
}

func (cc *currentCert) get() (*tls.Certificate, bool) {
	if !cc.asked {
		cc.asked = true
		if get := cc.conf.GetClientCertificate; get != nil {
			// The request info is not the server's: the callback is
			// expected to give a workload's certificate whatever it holds,
			// as identity.ClientConfig's does. An error is a certificate
			// this node no longer has (expired unrenewed, forgotten): the
			// handshake would present none.
			cert, err := get(&tls.CertificateRequestInfo{Version: tls.VersionTLS13})
			cc.cert, cc.known = cert, true
			if err != nil {
				cc.cert = nil
			}
		}
	}
	return cc.cert, cc.known
}

// staleReason says why a conn that presented pc must carry no new stream
// at now, with cur the certificate a new handshake would present; "" if it
// may. Reasons are log values.
func (pc *presentedCert) staleReason(now time.Time, cur *currentCert) string {
	if pc.endedAt(now) {
		return "presented certificate expired"
	}
	if cert, known := cur.get(); known && !sameLeaf(cert, pc.cert) {
		return "presented certificate replaced"
	}
	return ""
}

// sameLeaf compares leaves, not pointers: a callback may build a new
// tls.Certificate per call for the same certificate.
func sameLeaf(a, b *tls.Certificate) bool {
	if a == b {
		return true
	}
	return a != nil && b != nil && len(a.Certificate) > 0 && len(b.Certificate) > 0 && bytes.Equal(a.Certificate[0], b.Certificate[0])
}

// presentedChanges is trustChanges for DrainPresented: a connection whose
// handshake fetched its certificate before a trust change and that was
// pooled after DrainPresented went through the pool is checked with the
// latest keep once pooled.
type presentedChanges struct {
	mu   sync.Mutex
	gen  uint64
	keep func(*tls.Certificate) bool
}

func (t *presentedChanges) generation() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.gen
}

func (t *presentedChanges) changed(keep func(*tls.Certificate) bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.gen++
	t.keep = keep
}

// refuses reports whether a change came since gen whose keep refuses cert.
func (t *presentedChanges) refuses(gen uint64, cert *tls.Certificate) bool {
	t.mu.Lock()
	keep, changed := t.keep, t.gen != gen
	t.mu.Unlock()
	return changed && keep != nil && !keep(cert)
}
