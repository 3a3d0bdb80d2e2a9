package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"

	"golang.org/x/net/http2"
)

// These tests check the wire protocol against x/net/http2, an independent
// HTTP/2 implementation: our server with its client, our client with its
// server.

func TestXNetClientToServer(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)
	tr := &http2.Transport{TLSClientConfig: mustClientTLS()}
	defer tr.CloseIdleConnections()
	pr, pw := io.Pipe()
	req, _ := http.NewRequest(http.MethodConnect, "https://"+e.addr.String(), pr)
	req.Host = app.String()
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	go func() {
		_, _ = pw.Write([]byte("ping"))
		_ = pw.Close()
	}()
	got, err := io.ReadAll(resp.Body)
	if err != nil || string(got) != "ping" {
		t.Fatalf("read %q, %v", got, err)
	}
}

// startXNetServer serves handler with x/net's HTTP/2 server over TLS.
func startXNetServer(t *testing.T, handler http.HandlerFunc) netip.AddrPort {
	t.Helper()
	good, _ := pkis()
	l, err := tls.Listen("tcp", "127.0.0.1:0", good.serverTLS())
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	h2s := &http2.Server{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := c.(*tls.Conn).Handshake(); err != nil {
					c.Close()
					return
				}
				h2s.ServeConn(c, &http2.ServeConnOpts{Handler: handler})
			}()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		wg.Wait()
	})
	return l.Addr().(*net.TCPAddr).AddrPort()
}

func TestPoolToXNetServer(t *testing.T) {
	checkGoroutines(t)
	addr := startXNetServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Host == "10.0.0.9:80" {
			w.WriteHeader(http.StatusForbidden)
			_, _ = io.WriteString(w, "nope, from the body\n")
			return
		}
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		buf := make([]byte, 1024)
		for {
			n, err := r.Body.Read(buf)
			if n > 0 {
				_, _ = w.Write(buf[:n])
				w.(http.Flusher).Flush()
			}
			if err != nil {
				return
			}
		}
	})
	p := NewPool(PoolOptions{})
	defer p.Close()
	key := PoolKey{DstAddr: addr}

	s, err := p.Connect(context.Background(), key, tcpDial, mustClientTLS(), Request{Authority: netip.MustParseAddrPort("10.0.0.1:80")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	_ = s.CloseWrite()
	got, err := io.ReadAll(s)
	if err != nil || string(got) != "hello" {
		t.Fatalf("read %q, %v", got, err)
	}
	s.Close()

	_, err = p.Connect(context.Background(), key, tcpDial, mustClientTLS(), Request{Authority: netip.MustParseAddrPort("10.0.0.9:80")})
	var se *StatusError
	if !errors.As(err, &se) || se.Status != 403 || se.Reason != "nope, from the body" {
		t.Fatalf("err = %v, want 403 with the body as reason", err)
	}
}
