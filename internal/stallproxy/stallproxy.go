// Package stallproxy is a test helper: a TCP proxy on loopback whose
// connections can be made to go silent while staying open, as behind a
// load balancer whose backend vanished. TCP keepalive sees nothing wrong
// there; only a check at the application's level can.
package stallproxy

import (
	"io"
	"net"
	"sync"
	"testing"
)

// Proxy forwards connections to a backend until Stall.
type Proxy struct {
	Addr    string
	mu      sync.Mutex
	stalled chan struct{} // closed by Stall; replaced for new connections
	done    chan struct{}
}

// New starts a proxy to backend on 127.0.0.1, closed with the test.
func New(t testing.TB, backend string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{Addr: ln.Addr().String(), stalled: make(chan struct{}), done: make(chan struct{})}
	var conns []net.Conn
	var mu sync.Mutex
	t.Cleanup(func() {
		close(p.done)
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
	go func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", backend)
			if err != nil {
				in.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, in, out)
			mu.Unlock()
			p.mu.Lock()
			stalled := p.stalled
			p.mu.Unlock()
			go p.pipe(in, out, stalled)
			go p.pipe(out, in, stalled)
		}
	}()
	return p
}

// Stall makes the connections open now forward nothing more (and keep
// them open); later connections are forwarded.
func (p *Proxy) Stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	close(p.stalled)
	p.stalled = make(chan struct{})
}

func (p *Proxy) pipe(dst io.Writer, src io.Reader, stalled <-chan struct{}) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		select {
		case <-stalled:
			<-p.done // swallow this and everything after, silently
			return
		default:
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
