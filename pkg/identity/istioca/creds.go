package istioca

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc/credentials"

	"github.com/redirector-mesh/redirector/pkg/identity"
)

// Credentials are the gRPC transport credentials for a connection to
// istiod (its CA and its xDS): TLS verifying istiod's serving certificate
// against trust's current roots and serverName, at the handshake and again
// whenever the roots change (when trust reports changes, as
// identity.Bundle does): a connection whose istiod no longer verifies is
// closed, and the next one must verify against the new roots. TLS checks a
// peer at the handshake only, and a stream to istiod lives for days: a
// root removed from the bundle (a rotation away from a leaked key) left
// whoever stood as istiod under it serving the node its workloads,
// policies and certificates for as long as the connection lasted. For the
// same reason a connection is verified again when istiod's chain expires,
// and closed then unless it still verifies: gRPC reconnects, and the new
// handshake must present a valid certificate.
func Credentials(trust identity.Trust, serverName string, log *slog.Logger) credentials.TransportCredentials {
	if log == nil {
		log = slog.Default()
	}
	w := &watchedCreds{trust: trust, serverName: serverName, log: log, conns: map[*watchedConn]struct{}{}}
	w.TransportCredentials = credentials.NewTLS(&tls.Config{
		MinVersion: tls.VersionTLS12,
		ServerName: serverName,
		// Verified in VerifyConnection against the current roots, which a
		// reloaded bundle may change: the pool is read at each handshake.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, err := w.verify(cs.PeerCertificates)
			return err
		},
	})
	if t, ok := trust.(interface{ OnChange(func()) }); ok {
		t.OnChange(w.recheck)
	}
	return w
}

// watchedCreds keeps the connections it made, to verify them again
// (recheck).
type watchedCreds struct {
	credentials.TransportCredentials
	trust      identity.Trust
	serverName string
	log        *slog.Logger

	mu sync.Mutex
	// changes counts the roots' changes, so a handshake that ran across
	// one is verified again once registered.
	changes uint64
	conns   map[*watchedConn]struct{}
}

// watchedConn is a connection to istiod and the chain it presented.
type watchedConn struct {
	net.Conn
	w     *watchedCreds
	chain []*x509.Certificate
	// expiry verifies the connection again when its chain stops being
	// valid (guarded by w.mu).
	expiry *time.Timer
}

// Close forgets c before closing it.
func (c *watchedConn) Close() error {
	c.w.mu.Lock()
	delete(c.w.conns, c)
	if c.expiry != nil {
		c.expiry.Stop()
	}
	c.w.mu.Unlock()
	return c.Conn.Close()
}

// verify checks istiod's chain against the current roots and its name,
// and returns when it stops being valid.
func (w *watchedCreds) verify(chain []*x509.Certificate) (time.Time, error) {
	roots, err := identity.TrustRoots(w.trust)
	if err != nil {
		return time.Time{}, fmt.Errorf("istiod's serving certificate: %w", err)
	}
	return verifyServer(chain, roots, w.serverName)
}

// expiryGrace is how long after the end of validity of istiod's chain its
// connection is verified again: past the second x509 checks at.
const expiryGrace = time.Second

// expireAt has c verified again, and closed unless it still verifies, once
// its chain's validity ends at until. Call with w.mu held.
func (w *watchedCreds) expireAt(c *watchedConn, until time.Time) {
	if _, open := w.conns[c]; !open {
		return
	}
	d := time.Until(until) + expiryGrace
	if c.expiry != nil {
		c.expiry.Reset(d)
		return
	}
	c.expiry = time.AfterFunc(d, func() { w.checkConn(c, "istiod's serving certificate expired") })
}

// checkConn verifies c again: it is closed if it no longer verifies, and
// watched until its new end of validity if it does.
func (w *watchedCreds) checkConn(c *watchedConn, why string) {
	until, err := w.verify(c.chain)
	if err != nil {
		w.log.Warn(why+": closing the connection to istiod, whose serving certificate no longer verifies", "istiod", c.RemoteAddr().String(), "error", err)
		c.Close()
		return
	}
	w.mu.Lock()
	w.expireAt(c, until)
	w.mu.Unlock()
}

// ClientHandshake implements credentials.TransportCredentials.
func (w *watchedCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	w.mu.Lock()
	changes := w.changes
	w.mu.Unlock()
	conn, info, err := w.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if err != nil {
		return nil, nil, err
	}
	ti, ok := info.(credentials.TLSInfo)
	if !ok {
		conn.Close()
		return nil, nil, fmt.Errorf("istiod handshake: got %T, want TLS", info)
	}
	c := &watchedConn{Conn: conn, w: w, chain: ti.State.PeerCertificates}
	// Verified against the roots of its start: checked again if they
	// changed meanwhile, as the pass over the registered ones missed it;
	// and again when the chain expires.
	until, err := w.verify(c.chain)
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	w.mu.Lock()
	w.conns[c] = struct{}{}
	changed := w.changes != changes
	w.expireAt(c, until)
	w.mu.Unlock()
	if changed {
		if until, err = w.verify(c.chain); err != nil {
			c.Close()
			return nil, nil, err
		}
		w.mu.Lock()
		w.expireAt(c, until)
		w.mu.Unlock()
	}
	return c, info, nil
}

// recheck closes every connection whose istiod no longer verifies against
// the current roots; gRPC then fails what was under way on it (a CA request
// is retried by the manager, the xDS stream reconnects).
func (w *watchedCreds) recheck() {
	w.mu.Lock()
	w.changes++
	conns := make([]*watchedConn, 0, len(w.conns))
	for c := range w.conns {
		conns = append(conns, c)
	}
	w.mu.Unlock()
	for _, c := range conns {
		w.checkConn(c, "trust bundle changed")
	}
}

// Clone implements credentials.TransportCredentials; the clone watches
// with w.
func (w *watchedCreds) Clone() credentials.TransportCredentials { return w }
