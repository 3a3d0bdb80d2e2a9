package hbone

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"math/big"
	"net"
	"net/netip"
	"net/url"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// testPKI is a throwaway CA with one leaf usable as client and server.
type testPKI struct {
	pool *x509.CertPool
	leaf tls.Certificate
}

var (
	pkiOnce  sync.Once
	pkiGood  *testPKI
	pkiOther *testPKI
)

func newTestPKI(name string) *testPKI {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		panic(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		panic(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		panic(err)
	}
	id, _ := url.Parse("spiffe://cluster.local/ns/default/sa/test")
	leafTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     []string{"hbone.test"},
		URIs:         []*url.URL{id},
	}
	leafDER, err := x509.CreateCertificate(rand.Reader, leafTmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		panic(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	return &testPKI{pool: pool, leaf: tls.Certificate{Certificate: [][]byte{leafDER}, PrivateKey: key}}
}

func pkis() (good, other *testPKI) {
	pkiOnce.Do(func() {
		pkiGood = newTestPKI("good-ca")
		pkiOther = newTestPKI("other-ca")
	})
	return pkiGood, pkiOther
}

func (p *testPKI) serverTLS() *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{p.leaf},
		ClientCAs:    p.pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		NextProtos:   []string{"h2"},
	}
}

func (p *testPKI) clientTLS() *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{p.leaf},
		RootCAs:      p.pool,
		ServerName:   "hbone.test",
	}
}

func tcpDial(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, network, addr)
}

// testEnv is a server on loopback and a pool pointed at it.
type testEnv struct {
	t    testing.TB
	srv  *Server
	addr netip.AddrPort
	pool *Pool
	key  PoolKey
}

// newEnv starts a server with handler and returns a pool for it; both are
// closed, and goroutines checked for leaks, when the test ends.
func newEnv(t testing.TB, handler Handler, sopts ServerOptions, popts PoolOptions) *testEnv {
	t.Helper()
	checkGoroutines(t)
	good, _ := pkis()
	if sopts.TLSConfig == nil {
		sopts.TLSConfig = good.serverTLS()
	}
	sopts.Handler = handler
	srv, err := NewServer(sopts)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	pool := NewPool(popts)
	e := &testEnv{
		t:    t,
		srv:  srv,
		addr: l.Addr().(*net.TCPAddr).AddrPort(),
		pool: pool,
	}
	e.key = PoolKey{SrcIdentity: "a", DstIdentity: "b", DstAddr: e.addr}
	t.Cleanup(func() {
		_ = pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		if err := <-served; !errors.Is(err, ErrServerClosed) {
			t.Errorf("serve returned %v, want ErrServerClosed", err)
		}
	})
	return e
}

func (e *testEnv) connect(ctx context.Context, target netip.AddrPort) (*Stream, error) {
	good, _ := pkis()
	return e.pool.Connect(ctx, e.key, tcpDial, good.clientTLS(), Request{
		Authority: target,
		Forwarded: `for="10.0.0.1"`,
	})
}

// startUpstream runs serve for every connection accepted on a loopback
// listener, closed at test end.
func startUpstream(t testing.TB, serve func(*net.TCPConn)) netip.AddrPort {
	t.Helper()
	l, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns = map[*net.TCPConn]bool{}
	)
	wg.Add(1) // the accept loop, so conn Adds never race Wait at zero
	go func() {
		defer wg.Done()
		for {
			c, err := l.AcceptTCP()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				serve(c)
			}()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return l.Addr().(*net.TCPAddr).AddrPort()
}

// echo copies a connection back to itself, half-closing at EOF.
func echo(c *net.TCPConn) {
	_, _ = io.Copy(c, c)
	_ = c.CloseWrite()
	_, _ = io.Copy(io.Discard, c)
}

// dialTarget is a Handler that dials req.Target, like the inbound path.
func dialTarget(ctx context.Context, req *ServerRequest) Response {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", req.Target.String())
	if err != nil {
		return Response{Status: 503, Reason: "dial application: " + err.Error()}
	}
	return Response{Upstream: c}
}

// checkGoroutines fails the test if goroutines started during it are still
// running a few seconds after it ended (cleanups run in reverse order, so
// this check runs after every cleanup registered later).
func checkGoroutines(t testing.TB) {
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for {
			n := runtime.NumGoroutine()
			if n <= before {
				return
			}
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Errorf("goroutine leak: %d running, %d before the test\n%s", n, before, buf)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

func contains(s, sub string) bool { return strings.Contains(s, sub) }

// set installs f as the hook's function until the test ends.
func (h *testHook[F]) set(t *testing.T, f F) {
	h.f.Store(&f)
	t.Cleanup(func() { h.f.Store(nil) })
}
