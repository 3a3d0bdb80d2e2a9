package hbone

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"net/netip"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// Throughput benchmarks write 64 KiB per iteration into a sink that
// discards and, at EOF, reports how much it got.

const benchChunk = 64 << 10

// sink counts bytes until EOF and answers with the count.
func sink(c *net.TCPConn) {
	n, _ := io.Copy(io.Discard, c)
	_ = binary.Write(c, binary.BigEndian, n)
}

// pump writes b.N chunks to w, half-closes and checks the sink's count.
func pump(b *testing.B, w io.Writer, closeWrite func() error, r io.Reader) {
	b.Helper()
	buf := make([]byte, benchChunk)
	b.SetBytes(benchChunk)
	b.ResetTimer()
	cpu0 := cpuTime()
	for range b.N {
		if _, err := w.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	if err := closeWrite(); err != nil {
		b.Fatal(err)
	}
	var got int64
	if err := binary.Read(r, binary.BigEndian, &got); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	// CPU time (all threads: sender, proxies, sink) per MiB is steadier than
	// MB/s on a shared machine.
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N)/(float64(benchChunk)/(1<<20)), "cpu-ns/MiB")
	if got != int64(b.N)*benchChunk {
		b.Fatalf("sink got %d bytes, want %d", got, int64(b.N)*benchChunk)
	}
}

// BenchmarkTCPCopy is the baseline: plain TCP over loopback.
func BenchmarkTCPCopy(b *testing.B) {
	app := startUpstream(b, sink)
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(app))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	pump(b, c, c.CloseWrite, c)
}

// BenchmarkTLSCopy is the ceiling for one TLS connection: TLS 1.3 over
// loopback, no HTTP/2, no relay.
func BenchmarkTLSCopy(b *testing.B) {
	l, clientTLS := tlsLoopback(b)
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		n, _ := io.Copy(io.Discard, c)
		_ = binary.Write(c, binary.BigEndian, n)
	}()
	c, err := tls.Dial("tcp", l.Addr().String(), clientTLS)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	pump(b, c, c.CloseWrite, c)
}

// BenchmarkStreamCopy: a client Stream -> HBONE server -> in-memory sink,
// the cost of the HBONE layer alone (TLS, HTTP/2, both ends).
func BenchmarkStreamCopy(b *testing.B) {
	e := newEnv(b, func(ctx context.Context, req *ServerRequest) Response {
		return Response{Upstream: newSinkConn()}
	}, ServerOptions{}, PoolOptions{})
	s, err := e.connect(context.Background(), netip.MustParseAddrPort("10.0.0.1:80"))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	pump(b, s, s.CloseWrite, s)
}

// BenchmarkXNetStreamCopy is BenchmarkStreamCopy with x/net/http2's
// Transport and Server (request body through io.Pipe, large windows and
// frames), the "naive" design this package replaces.
func BenchmarkXNetStreamCopy(b *testing.B) {
	l, clientTLS := tlsLoopback(b)
	h2s := &http2.Server{MaxReadFrameSize: maxReadFrameSize, MaxUploadBufferPerConnection: connWindow, MaxUploadBufferPerStream: streamWindow}
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		n, _ := io.Copy(io.Discard, r.Body)
		_ = binary.Write(w, binary.BigEndian, n)
	})
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		_ = c.(*tls.Conn).Handshake()
		h2s.ServeConn(c, &http2.ServeConnOpts{Handler: handler})
	}()
	tr := &http2.Transport{TLSClientConfig: clientTLS, MaxReadFrameSize: maxReadFrameSize}
	defer tr.CloseIdleConnections()
	pr, pw := io.Pipe()
	req, _ := http.NewRequest(http.MethodConnect, "https://"+l.Addr().String(), pr)
	req.Host = "10.0.0.1:80"
	resp, err := tr.RoundTrip(req)
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	pump(b, pw, pw.Close, resp.Body)
}

// tlsLoopback listens on loopback with the good PKI's server certificate,
// for the baselines that measure TLS without this package's server; the
// listener closes when b ends. It returns the client config to dial it with.
func tlsLoopback(b *testing.B) (net.Listener, *tls.Config) {
	b.Helper()
	good, _ := pkis()
	l, err := tls.Listen("tcp", "127.0.0.1:0", good.serverTLS())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { l.Close() })
	return l, good.clientTLS()
}

// sinkConn is an in-memory upstream: it discards what it is sent and,
// after CloseWrite, answers with the byte count, like sink.
type sinkConn struct {
	n      int64
	ended  chan struct{}
	closed chan struct{}
	once   sync.Once
	reply  []byte
}

func newSinkConn() *sinkConn {
	return &sinkConn{ended: make(chan struct{}), closed: make(chan struct{})}
}

func (c *sinkConn) Write(p []byte) (int, error) { c.n += int64(len(p)); return len(p), nil }
func (c *sinkConn) CloseWrite() error           { close(c.ended); return nil }
func (c *sinkConn) Close() error                { c.once.Do(func() { close(c.closed) }); return nil }

func (c *sinkConn) Read(p []byte) (int, error) {
	select {
	case <-c.ended:
	case <-c.closed:
		return 0, io.EOF
	}
	if c.reply == nil {
		c.reply = binary.BigEndian.AppendUint64(make([]byte, 0, 8), uint64(c.n))
	}
	if len(c.reply) == 0 {
		return 0, io.EOF
	}
	n := copy(p, c.reply)
	c.reply = c.reply[n:]
	return n, nil
}

func (c *sinkConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *sinkConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *sinkConn) SetDeadline(time.Time) error      { return nil }
func (c *sinkConn) SetReadDeadline(time.Time) error  { return nil }
func (c *sinkConn) SetWriteDeadline(time.Time) error { return nil }

// BenchmarkPairCopy is the whole tunnel as an application sees it: TCP ->
// Relay -> Stream -> HBONE server -> Relay -> TCP sink, both proxies in
// this process (as on one node with the source and destination pods).
func BenchmarkPairCopy(b *testing.B) {
	e := newEnv(b, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(b, sink)
	c := viaRelay(b, func() (io.ReadWriteCloser, error) {
		s, err := e.connect(context.Background(), app)
		if err != nil {
			return nil, err
		}
		return s, nil
	})
	pump(b, c, c.CloseWrite, c)
}

// BenchmarkTCPRelayCopy is the plain TCP proxy for comparison with
// BenchmarkPairCopy: TCP -> Relay (splice) -> TCP sink.
func BenchmarkTCPRelayCopy(b *testing.B) {
	checkGoroutines(b)
	c := viaTCPRelay(b, startUpstream(b, sink))
	pump(b, c, c.CloseWrite, c)
}

// viaTCPRelay returns a connection to app through a TCP-to-TCP Relay
// (splice) on loopback, closed with its listener when b ends.
func viaTCPRelay(b *testing.B, app netip.AddrPort) *net.TCPConn {
	b.Helper()
	return viaRelay(b, func() (io.ReadWriteCloser, error) { return net.Dial("tcp", app.String()) })
}

// viaRelay returns a loopback connection whose accepted end a Relay joins
// to what dial opens then, as a proxy does; the connection and its listener
// close when b ends.
func viaRelay(b *testing.B, dial func() (io.ReadWriteCloser, error)) *net.TCPConn {
	b.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		u, err := dial()
		if err != nil {
			c.Close()
			return
		}
		_, _, _ = Relay(c, u)
	}()
	c, err := net.DialTCP("tcp", nil, l.Addr().(*net.TCPAddr))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	return c
}

// pipeHandler accepts every stream with an in-memory upstream that
// discards, so stream setup is measured without an application dial.
func pipeHandler(ctx context.Context, req *ServerRequest) Response {
	up, app := net.Pipe()
	go func() {
		_, _ = io.Copy(io.Discard, app)
		app.Close()
	}()
	return Response{Upstream: up}
}

// BenchmarkPoolConnect opens and closes a stream on a pooled connection:
// HEADERS, the 200, and RST_STREAM.
func BenchmarkPoolConnect(b *testing.B) {
	e := newEnv(b, pipeHandler, ServerOptions{}, PoolOptions{})
	target := netip.MustParseAddrPort("10.0.0.1:80")
	s, err := e.connect(context.Background(), target) // dial outside the loop
	if err != nil {
		b.Fatal(err)
	}
	s.Close()
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		s, err := e.connect(context.Background(), target)
		if err != nil {
			b.Fatal(err)
		}
		s.Close()
	}
	b.StopTimer()
	if st := e.pool.Stats(); st.DialsTotal != 1 {
		b.Fatalf("pool dialled %d times", st.DialsTotal)
	}
}

// BenchmarkHandshake measures a new connection: TCP, TLS 1.3 with client
// certificates, HTTP/2 preface, and the first stream.
func BenchmarkHandshake(b *testing.B) {
	// Every connection comes from 127.0.0.1: lift the per-source rate.
	lim := NewConnLimiter(ConnLimits{HandshakeRatePerSource: 1 << 20})
	e := newEnv(b, pipeHandler, ServerOptions{Limiter: lim}, PoolOptions{})
	good, _ := pkis()
	conf := good.clientTLS()
	target := netip.MustParseAddrPort("10.0.0.1:80")
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		p := NewPool(PoolOptions{})
		s, err := p.Connect(context.Background(), e.key, tcpDial, conf, Request{Authority: target})
		if err != nil {
			b.Fatal(err)
		}
		s.Close()
		p.Close()
	}
}

// BenchmarkStreamRoundTrip is a 1-byte echo through a stream: the latency
// HBONE adds per request/response, compared with BenchmarkTCPRoundTrip.
func BenchmarkStreamRoundTrip(b *testing.B) {
	e := newEnv(b, dialTarget, ServerOptions{}, PoolOptions{})
	s, err := e.connect(context.Background(), startUpstream(b, echo))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	roundTrips(b, s)
}

func BenchmarkTCPRoundTrip(b *testing.B) {
	c, err := net.Dial("tcp", startUpstream(b, echo).String())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	roundTrips(b, c)
}

func roundTrips(b *testing.B, c io.ReadWriter) {
	b.Helper()
	buf := []byte{1}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			b.Fatal(err)
		}
	}
}

// cpuTime is the process's user+system CPU time in nanoseconds.
func cpuTime() int64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// BenchmarkIdleConnMemory is what an open but idle tunnelled connection
// costs the two proxies: each iteration opens one more app connection
// through Relay -> Stream -> HBONE server -> Relay -> TCP echo, proves it
// with a 1-byte echo and leaves it open. The same connections made straight
// to the echo server are subtracted, so only the proxies' share remains.
func BenchmarkIdleConnMemory(b *testing.B) {
	e := newEnv(b, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(b, tinyEcho)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				s, err := e.connect(context.Background(), app)
				if err != nil {
					c.Close()
					return
				}
				// Relay on a fresh goroutine, as the tunnel does.
				go Relay(c, s)
			}()
		}
	}()
	direct := idleMemory(b, app)
	meshed := idleMemory(b, l.Addr().(*net.TCPAddr).AddrPort())
	b.ReportMetric(float64(meshed.heap+meshed.stack-direct.heap-direct.stack), "B/conn")
	b.ReportMetric(float64(meshed.heap-direct.heap), "heap-B/conn")
	b.ReportMetric(float64(meshed.stack-direct.stack), "stack-B/conn")
	b.ReportMetric(0, "ns/op")
}

// memUse is heap in use and goroutine stacks, in bytes.
type memUse struct{ heap, stack int64 }

// idleMemory opens b.N connections to addr, each proven with a 1-byte
// echo, and returns the growth of heap and stacks per connection.
func idleMemory(b *testing.B, addr netip.AddrPort) memUse {
	b.Helper()
	before := liveBytes()
	conns := make([]*net.TCPConn, 0, b.N)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	var one [1]byte
	for range b.N {
		c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(addr))
		if err != nil {
			b.Fatal(err)
		}
		conns = append(conns, c)
		if _, err := c.Write(one[:]); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, one[:]); err != nil {
			b.Fatal(err)
		}
	}
	after := liveBytes()
	return memUse{(after.heap - before.heap) / int64(b.N), (after.stack - before.stack) / int64(b.N)}
}

// liveBytes measures memory in use after a GC.
func liveBytes() memUse {
	for range 6 {
		runtime.GC()
	}
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return memUse{int64(m.HeapInuse), int64(m.StackInuse)}
}

// tinyEcho echoes with a small buffer, so the upstream's own share of
// BenchmarkIdleConnMemory stays small and equal for both paths.
func tinyEcho(c *net.TCPConn) {
	var buf [64]byte
	for {
		n, err := c.Read(buf[:])
		if err != nil {
			return
		}
		if _, err := c.Write(buf[:n]); err != nil {
			return
		}
	}
}
