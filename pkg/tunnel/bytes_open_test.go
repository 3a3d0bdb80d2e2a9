package tunnel

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redirector-mesh/redirector/internal/promtest"
	"github.com/redirector-mesh/redirector/internal/waitfor"
	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/identity/identitytest"
	"github.com/redirector-mesh/redirector/pkg/tunnel/hbone"
	"github.com/redirector-mesh/redirector/pkg/workload"
)

// origDstConn is a loopback TCP socket that reports other addresses: a pod's
// as its remote, and as its local the original destination a capture
// listener's socket has. It keeps the socket's own paths (SyscallConn,
// RawWriteConn) for the relay.
type origDstConn struct {
	*net.TCPConn
	local, remote net.Addr
}

func (c *origDstConn) LocalAddr() net.Addr                    { return c.local }
func (c *origDstConn) RemoteAddr() net.Addr                   { return c.remote }
func (c *origDstConn) RawWriteConn() (syscall.RawConn, error) { return c.TCPConn.SyscallConn() }

// capturedPair returns the app's end of a loopback TCP connection and the
// tunnel's, which reports dst as its local address and src as its remote.
func capturedPair(t *testing.T, src, dst string) (app *net.TCPConn, tunnelSide *origDstConn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	app, err = net.DialTCP("tcp", nil, l.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { app.Close() })
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return app, &origDstConn{TCPConn: c.(*net.TCPConn), local: net.TCPAddrFromAddrPort(netip.MustParseAddrPort(dst)),
		remote: net.TCPAddrFromAddrPort(netip.MustParseAddrPort(src))}
}

// meshRig is a client pod's tunnel and a server pod's, each with its own
// metrics, the server's HBONE listener on loopback and an echo app behind
// it, as two nodes see one connection.
type meshRig struct {
	client, server   *Tunnel
	clientP, serverP *pod
	app              netip.AddrPort // the echo app, at the server pod's address
	vip              netip.AddrPort // a service over the app
}

func newMeshRig(t *testing.T) *meshRig {
	t.Helper()
	pki := identitytest.NewPKI(t, "ecdsa")
	ca, err := identity.LoadCAFor(identitytest.WriteCacerts(t, pki), "cluster.local")
	if err != nil {
		t.Fatal(err)
	}
	certs := identity.NewManager(ca, time.Hour, nil)
	t.Cleanup(certs.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, sa := range []string{"client", "server-sa"} {
		id := identity.ID{TrustDomain: "cluster.local", Namespace: "mesh", ServiceAccount: sa}
		certs.Add(id)
		if err := certs.Wait(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	app := echoListener(t).Addr().(*net.TCPAddr).AddrPort()
	clientW := podObj("mesh", "client", "client", "127.0.0.3", nil)
	serverW := podObj("mesh", "server", "server-sa", "127.0.0.1", nil)
	svc := &workload.Service{Name: "echo", Namespace: "mesh", Hostname: "echo.mesh.svc.cluster.local",
		VIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.30")},
		Ports:     []workload.ServicePort{{Name: "tcp", Port: 80, TargetPort: int32(app.Port())}},
		Endpoints: []workload.Endpoint{{Addr: app.Addr(), Ready: true}}}
	dir, errs := workload.NewDirectory([]*workload.Workload{clientW, serverW}, []*workload.Service{svc})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	r := &meshRig{app: app, vip: netip.MustParseAddrPort("10.96.0.30:80")}

	r.server = New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006, HBONEPort: 15008,
		Certs: certs, Metrics: NewMetrics(prometheus.NewRegistry()), NoAccessLog: true})
	r.server.Update(&State{Dir: dir})
	r.serverP = testPod(r.server, serverW.Key(), netip.MustParseAddr("127.0.0.1"))
	inOwnNamespace(t, r.serverP)
	if r.serverP.hbone, err = r.server.newHBONEServer(r.serverP); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go r.serverP.hbone.Serve(l)

	pool := hbone.NewPool(hbone.PoolOptions{})
	r.client = New(Config{TrustDomain: "cluster.local", OutboundPort: 15001, InboundPort: 15006,
		HBONEPort: uint16(l.Addr().(*net.TCPAddr).Port), TunnelMark: testMark,
		Certs: certs, Pool: pool, Metrics: NewMetrics(prometheus.NewRegistry()), NoAccessLog: true})
	r.client.Update(&State{Dir: dir})
	r.clientP = testPod(r.client, clientW.Key(), netip.MustParseAddr("127.0.0.3"))
	inOwnNamespace(t, r.clientP)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		r.clientP.stop(ctx)
		r.serverP.stop(ctx)
		r.serverP.hbone.Close()
		pool.Close()
	})
	return r
}

// istioSums sums the istio_tcp_* series of m with the reporter given, as a
// scrape shows them.
func istioSums(t *testing.T, m *Metrics, reporter string) map[string]float64 {
	t.Helper()
	sums := map[string]float64{}
	for k, v := range promtest.Scrape(t, m.series.collector()) {
		if name, _, ok := strings.Cut(k, "{"); ok && strings.HasPrefix(name, "istio_tcp_") && strings.Contains(k, `reporter="`+reporter+`"`) {
			sums[name] += v
		}
	}
	return sums
}

// bytesSeen waits until m's series of reporter show want bytes each way
// with no connection closed, and fails the test if they do not.
func bytesSeen(t *testing.T, m *Metrics, reporter string, want float64, closed float64) {
	t.Helper()
	deadline := time.Now().Add(waitfor.Timeout)
	for {
		got := istioSums(t, m, reporter)
		if got["istio_tcp_received_bytes_total"] == want && got["istio_tcp_sent_bytes_total"] == want &&
			got["istio_tcp_connections_closed_total"] == closed {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s reporter, %v connections closed: want %v bytes each way, got %v", reporter, closed, want, got)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// echo writes n bytes into app and reads their echo back.
func echo(t *testing.T, app net.Conn, n int) {
	t.Helper()
	msg := bytes.Repeat([]byte("x"), n)
	errc := make(chan error, 1)
	go func() { _, err := app.Write(msg); errc <- err }()
	got := make([]byte, n)
	_ = app.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(app, got); err != nil {
		t.Fatalf("echo of %d bytes: %v", n, err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("write %d bytes: %v", n, err)
	}
}

// A long-lived connection's bytes show in istio_tcp_sent_bytes_total and
// istio_tcp_received_bytes_total while it is open, on every path the
// tunnel relays: before, they were added only when it closed, so Kiali's
// graph, which shows bytes, did not see a long-lived connection until it
// ended. At the close the series hold exactly the connection's totals:
// nothing counted twice.
func TestBytesCountedWhileOpen(t *testing.T) {
	const n = 300 << 10 // several frames and reads each way
	for _, tc := range []struct {
		name string
		// open relays a connection from the app's end and returns the
		// metrics and reporters that count it.
		open func(t *testing.T, r *meshRig, app *net.TCPConn, tunnelSide *origDstConn) map[string]*Metrics
		dst  func(r *meshRig) netip.AddrPort
	}{
		{"outbound HBONE and inbound HBONE", func(t *testing.T, r *meshRig, app *net.TCPConn, c *origDstConn) map[string]*Metrics {
			go r.clientP.handleOutbound(c)
			return map[string]*Metrics{"source": r.client.cfg.Metrics, "destination": r.server.cfg.Metrics}
		}, func(r *meshRig) netip.AddrPort { return r.app }},
		{"service endpoint over HBONE", func(t *testing.T, r *meshRig, app *net.TCPConn, c *origDstConn) map[string]*Metrics {
			go r.clientP.handleOutbound(c)
			return map[string]*Metrics{"source": r.client.cfg.Metrics, "destination": r.server.cfg.Metrics}
		}, func(r *meshRig) netip.AddrPort { return r.vip }},
		{"outbound plain TCP", func(t *testing.T, r *meshRig, app *net.TCPConn, c *origDstConn) map[string]*Metrics {
			st := r.client.State()
			dir, errs := workload.NewDirectory([]*workload.Workload{mustPod(t, st.Dir, "127.0.0.3")}, nil)
			if len(errs) > 0 {
				t.Fatal(errs)
			}
			r.client.Update(&State{Dir: dir}) // the app's address is outside the mesh
			go r.clientP.handleOutbound(c)
			return map[string]*Metrics{"source": r.client.cfg.Metrics}
		}, func(r *meshRig) netip.AddrPort { return r.app }},
		{"inbound plaintext", func(t *testing.T, r *meshRig, app *net.TCPConn, c *origDstConn) map[string]*Metrics {
			go r.serverP.handleInboundPlaintext(c)
			return map[string]*Metrics{"destination": r.server.cfg.Metrics}
		}, func(r *meshRig) netip.AddrPort { return r.app }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newMeshRig(t)
			app, c := capturedPair(t, "127.0.0.3:40000", tc.dst(r).String())
			counted := tc.open(t, r, app, c)
			// The first bytes wait for the tunnel: none go early, so
			// what is counted is what the relay moved.
			echo(t, app, n)
			echo(t, app, n)
			for reporter, m := range counted {
				bytesSeen(t, m, reporter, 2*n, 0)
			}
			app.Close()
			for reporter, m := range counted {
				bytesSeen(t, m, reporter, 2*n, 1)
			}
		})
	}
}

// Scrapes folding the open connections' bytes race the relays adding to
// them and the closes folding their totals: the series end with exactly the
// bytes moved, whatever the interleaving (run with -race).
func TestBytesFoldRacesClose(t *testing.T) {
	m := NewMetrics(nil)
	c := connInfo{reporter: "source", src: podObj("mesh", "a", "a", "10.1.0.1", nil), dst: podObj("mesh", "b", "b", "10.1.0.2", nil)}
	const conns, writes = 50, 200
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var scrapes sync.WaitGroup
	scrapes.Add(1)
	go func() {
		defer scrapes.Done()
		for {
			select {
			case <-stop:
				return
			default:
				m.series.foldOpen()
			}
		}
	}()
	for range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := m.open(c, "")
			counts := r.counts()
			for i := range writes {
				counts.AToB.Add(int64(i))
				counts.BToA.Add(1)
			}
			r.close(context.Background(), counts.AToB.Load(), counts.BToA.Load(), nil)
		}()
	}
	wg.Wait()
	close(stop)
	scrapes.Wait()
	sums := istioSums(t, m, "source")
	wantReq, wantResp := float64(conns*writes*(writes-1)/2), float64(conns*writes)
	if sums["istio_tcp_received_bytes_total"] != wantReq || sums["istio_tcp_sent_bytes_total"] != wantResp || sums["istio_tcp_connections_closed_total"] != conns {
		t.Errorf("after %d connections closed: %v; want %v request and %v response bytes", conns, sums, wantReq, wantResp)
	}
	m.series.mu.Lock()
	defer m.series.mu.Unlock()
	if f := m.series.flows.next; f != &m.series.flows {
		t.Error("a closed connection's flow is still folded at each scrape")
	}
}

// What the app sent before its tunnel was up goes with the CONNECT as early
// data, consumed from the app's socket before the relay starts: it is the
// connection's first request bytes and counts in the source reporter's
// istio_tcp_received_bytes_total (and the access log's bytes_sent), as the
// destination reporter counts it. Before, the source reporter left it out:
// a request that fit in the early data (most HTTP/1 requests) was counted
// as zero bytes sent.
func TestEarlyDataCounted(t *testing.T) {
	r := newMeshRig(t)
	app, c := capturedPair(t, "127.0.0.3:40000", r.app.String())
	msg := []byte("GET / HTTP/1.1\r\nHost: server\r\n\r\n")
	if _, err := app.Write(msg); err != nil {
		t.Fatal(err)
	}
	waitfor.Until(t, "the request in the tunnel's socket", func() bool { return len(peek(c, make([]byte, 64))) == len(msg) })
	go r.clientP.handleOutbound(c)
	if _, err := io.ReadFull(app, make([]byte, len(msg))); err != nil {
		t.Fatal(err)
	}
	echo(t, app, 1000)
	n := float64(len(msg) + 1000)
	bytesSeen(t, r.client.cfg.Metrics, "source", n, 0)
	bytesSeen(t, r.server.cfg.Metrics, "destination", n, 0)
	app.Close()
	bytesSeen(t, r.client.cfg.Metrics, "source", n, 1)
	bytesSeen(t, r.server.cfg.Metrics, "destination", n, 1)
}

// BenchmarkFoldOpen is a scrape's fold of 30,000 open connections (the
// default node limit of one listener kind) over 100 series, each having
// moved bytes since the last scrape: the time the series lock is held.
func BenchmarkFoldOpen(b *testing.B) {
	m := NewMetrics(nil)
	const conns = 30000
	results := make([]*connResult, 0, conns)
	for i := range conns {
		c := connInfo{reporter: "source", src: podObj("mesh", fmt.Sprint("a", i%100), "a", "10.1.0.1", nil)}
		results = append(results, m.open(c, ""))
	}
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		for _, r := range results {
			r.counts().AToB.Add(100)
		}
		b.StartTimer()
		m.series.foldOpen()
	}
	b.StopTimer()
	for _, r := range results {
		r.close(context.Background(), r.counts().AToB.Load(), 0, nil)
	}
}
