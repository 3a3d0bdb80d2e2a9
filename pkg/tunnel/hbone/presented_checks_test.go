package hbone

import (
	"context"
	"crypto/tls"
	"sync/atomic"
	"testing"
	"time"
)

// contextCalls counts a TLS callback's calls with and without a context.
type contextCalls struct{ with, without atomic.Int32 }

func (cc *contextCalls) note(hasContext bool) {
	if hasContext {
		cc.with.Add(1)
	} else {
		cc.without.Add(1)
	}
}

// The pool and the server ask the TLS callbacks what a new handshake would
// present (presented.go) with infos that carry no context, where
// crypto/tls gives every handshake's one: identity's callbacks count a
// certificate missing at a handshake as a handshake failed closed
// (redirector_certificate_unavailable_total), and one missing at a check
// is none.
func TestPresentedChecksAskWithoutHandshakeContext(t *testing.T) {
	t.Run("pool", func(t *testing.T) {
		good, _ := pkis()
		e := newPresentedEnv(t, good.leaf, 0, good.pool)
		app := startUpstream(t, echo)
		var calls contextCalls
		client := good.clientTLS()
		client.Certificates = nil
		client.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
			calls.note(cri.Context() != nil)
			return &good.leaf, nil
		}
		for range 2 {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			s, err := e.pool.Connect(ctx, e.key, tcpDial, client, Request{Authority: app, Forwarded: `for="10.0.0.1"`})
			cancel()
			if err != nil {
				t.Fatal(err)
			}
			s.Close()
		}
		if st := e.pool.Stats(); st.DialsTotal != 1 {
			t.Fatalf("dials = %d, want 1: the second Connect takes the pooled connection", st.DialsTotal)
		}
		if w, wo := calls.with.Load(), calls.without.Load(); w != 1 || wo != 1 {
			t.Errorf("GetClientCertificate asked %d times with a context and %d without, want 1 (the handshake) and 1 (the second Connect's check)", w, wo)
		}
	})
	t.Run("server", func(t *testing.T) {
		defer func(d time.Duration) { ownCertRecheck = d }(ownCertRecheck)
		ownCertRecheck = time.Millisecond
		good, _ := pkis()
		var calls contextCalls
		conf := good.serverTLS()
		conf.Certificates = nil
		conf.GetCertificate = func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			calls.note(hello.Context() != nil)
			return &good.leaf, nil
		}
		_, addr := serveLoopback(t, ServerOptions{TLSConfig: conf, Handler: dialTarget})
		app := startUpstream(t, echo).String()
		rc, err := rawTLSClient(t, addr, good.leaf)
		if err != nil {
			t.Fatal(err)
		}
		for id := uint32(1); id <= 3; id += 2 {
			time.Sleep(5 * time.Millisecond) // past ownCertRecheck: the stream's check asks
			if err := rc.connect(id, app); err != nil {
				t.Fatal(err)
			}
			rc.wantOpened(id)
		}
		if w, wo := calls.with.Load(), calls.without.Load(); w != 1 || wo < 1 {
			t.Errorf("GetCertificate asked %d times with a context and %d without, want 1 (the handshake) and some (the streams' checks)", w, wo)
		}
	})
}
