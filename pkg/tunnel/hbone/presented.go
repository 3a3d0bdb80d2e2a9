package hbone

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// A connection carries new streams as the identity of the certificate
// this end presented in its handshake, for as long as it lives. The peer
// checked that certificate then, and our own ends drain a connection at
// their peer's chain end or trust change, but a peer that does not
// (another implementation, a waypoint, curl) would go on opening or taking
// streams as an identity whose certificate expired or whose root was
// removed. So both the pool and the server record what each connection
// presented and give it no new stream once that certificate's chain has
// ended, once a new handshake would present another certificate (renewed,
// or replaced because its root was removed), or once a trust change
// refuses it (DrainPresented). The next stream goes on a new connection,
// whose handshake presents the current certificate; streams in flight run
// to their end. The pool checks at each Connect; the server at each new
// stream (HEADERS), which it refuses with REFUSED_STREAM under a GOAWAY so
// that the client retries it on a new connection.

// presentedCert is what a connection presented in its handshake.
type presentedCert struct {
	cert *tls.Certificate
	// at is when it was presented: a server's view of its current
	// certificate older than that may predate a renewal (servingCert).
	at time.Time
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
	pc := &presentedCert{cert: cert, at: time.Now()}
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
	record := func(cert *tls.Certificate) (*tls.Certificate, error) { return record(cert, got, "client") }
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

// record notes cert as what a handshake presents, in *got, unless its
// chain has ended: then the handshake fails, naming its end. side names
// our end in the error.
func record(cert *tls.Certificate, got **presentedCert, side string) (*tls.Certificate, error) {
	pc := newPresented(cert)
	if pc.endedAt(time.Now()) {
		return nil, fmt.Errorf("the %s certificate's chain ended at %s", side, pc.end.UTC().Format(time.RFC3339))
	}
	*got = pc
	return cert, nil
}

// serving returns conf for one server connection, with what crypto/tls
// presents to the client recorded in *got; a certificate whose chain has
// ended is not presented (the handshake fails, naming its end). A
// GetConfigForClient's config is wrapped the same way. conf is not
// changed.
func serving(conf *tls.Config, got **presentedCert) *tls.Config {
	c := conf.Clone()
	recordServed(c, conf, got)
	if gcc := conf.GetConfigForClient; gcc != nil {
		c.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			inner, err := gcc(hello)
			if err != nil || inner == nil {
				return inner, err // nil: crypto/tls goes on with c
			}
			ic := inner.Clone()
			recordServed(ic, inner, got)
			return ic, nil
		}
	}
	return c
}

// recordServed makes into present what from would, recorded.
func recordServed(into, from *tls.Config, got **presentedCert) {
	into.Certificates = nil
	into.GetCertificate = func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
		cert, err := serverCert(from, hello)
		if err != nil {
			return nil, err
		}
		return record(cert, got, "server")
	}
}

// serverCert is crypto/tls's choice of the certificate conf presents to
// hello (Config.getCertificate), without the deprecated NameToCertificate.
func serverCert(conf *tls.Config, hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
	if conf.GetCertificate != nil && (len(conf.Certificates) == 0 || hello.ServerName != "") {
		cert, err := conf.GetCertificate(hello)
		if cert != nil || err != nil {
			return cert, err
		}
	}
	switch len(conf.Certificates) {
	case 0:
		return nil, errors.New("no server certificate configured")
	case 1:
		return &conf.Certificates[0], nil
	}
	for i := range conf.Certificates {
		if hello.SupportsCertificate(&conf.Certificates[i]) == nil {
			return &conf.Certificates[i], nil
		}
	}
	return &conf.Certificates[0], nil
}

// ownCertRecheck is how long a server takes its view of its current
// certificate as current (servingCert): a renewal (every half life, 12 h
// by default) reaches a connection's new streams within it. A variable
// for the tests.
var ownCertRecheck = time.Second

// servingCert is what a new handshake with a server's config would
// present, shared by its connections. It is asked at most once per
// ownCertRecheck, and again for a connection whose certificate differs
// from an answer older than its handshake (a renewal in between), so a new
// stream costs a clock read, an atomic load and a leaf comparison (a
// pointer's, for the identity manager's cached certificate), not a
// callback.
type servingCert struct {
	conf *tls.Config
	mu   sync.Mutex // one ask at a time
	last atomic.Pointer[servedCert]
}

type servedCert struct {
	at    time.Time // when asked
	cert  *tls.Certificate
	known bool
}

// get returns what a new handshake would present at now, for a connection
// on nc that presented pc; known is false when that cannot be told (static
// certificates chosen by the client's hello), and cert is nil when it
// would present none (a callback failed).
func (sc *servingCert) get(now time.Time, nc net.Conn, pc *presentedCert) (cert *tls.Certificate, known bool) {
	if st := sc.last.Load(); st != nil && now.Sub(st.at) < ownCertRecheck && (st.at.After(pc.at) || sameLeaf(st.cert, pc.cert)) {
		return st.cert, st.known
	}
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if st := sc.last.Load(); st != nil && !st.at.Before(now) {
		return st.cert, st.known // asked since we looked
	}
	at := time.Now()
	cert, known = servedNow(sc.conf, nc)
	sc.last.Store(&servedCert{at: at, cert: cert, known: known})
	return cert, known
}

// servedNow asks conf what a handshake would present. The callbacks
// (GetConfigForClient, GetCertificate) get a hello that carries only the
// connection and TLS 1.3: they must not choose by the client's hello, as
// identity.ServerConfig's does not. Its Context() is nil, where crypto/tls
// gives every handshake's one: identity's callbacks count a certificate
// missing at a handshake, not at this check. A server with several static
// certificates chooses by the hello: unknown.
func servedNow(conf *tls.Config, nc net.Conn) (*tls.Certificate, bool) {
	hello := &tls.ClientHelloInfo{SupportedVersions: []uint16{tls.VersionTLS13}, Conn: nc}
	if gcc := conf.GetConfigForClient; gcc != nil {
		inner, err := gcc(hello)
		if err != nil {
			return nil, true // a handshake would fail
		}
		if inner != nil {
			conf = inner
		}
	}
	if conf.GetCertificate == nil && len(conf.Certificates) > 1 {
		return nil, false
	}
	cert, err := serverCert(conf, hello)
	if err != nil {
		cert = nil
	}
	return cert, true
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
			// as identity.ClientConfig's does. Its Context() is nil, as no
			// handshake's is (see servedNow). An error is a certificate
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
// at now, with current telling what a new handshake would present (known
// false: cannot tell), asked only if the chain has not ended; "" if it
// may. Reasons are log values.
func (pc *presentedCert) staleReason(now time.Time, current func() (*tls.Certificate, bool)) string {
	if pc.endedAt(now) {
		return "presented certificate expired"
	}
	if cert, known := current(); known && !sameLeaf(cert, pc.cert) {
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
// pooled (or registered with its server) after DrainPresented went through
// the connections is checked with the latest keep once there.
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

// reasonTrustRefuses is the log reason of a drain by DrainPresented.
const reasonTrustRefuses = "trust change refuses the presented certificate"

// drainRefusedPresented stops, with stop, the conns whose presented
// certificate keep refuses, asking keep once per distinct certificate, and
// returns how many it stopped.
func drainRefusedPresented(conns []*conn, keep func(*tls.Certificate) bool, stop func(*conn, string) bool) int {
	verdicts := map[*tls.Certificate]bool{}
	n := 0
	for _, c := range conns {
		if c.presented == nil {
			continue
		}
		kept, ok := verdicts[c.presented.cert]
		if !ok {
			kept = keep(c.presented.cert)
			verdicts[c.presented.cert] = kept
		}
		if !kept && stop(c, reasonTrustRefuses) {
			n++
		}
	}
	return n
}

// markStopped takes c out of service for its certificate, once; false if
// it was already, or is closed or draining.
func (c *conn) markStopped() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil || c.goAway || c.presented.stopped.Load() {
		// Closed, or carrying no new stream already.
		return false
	}
	c.presented.stopped.Store(true)
	c.goAway = true
	return true
}
