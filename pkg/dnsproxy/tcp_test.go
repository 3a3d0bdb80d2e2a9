package dnsproxy

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

func frame(q []byte) []byte {
	return append(binary.BigEndian.AppendUint16(nil, uint16(len(q))), q...)
}

func readFrame(t *testing.T, conn net.Conn) *dns.Msg {
	t.Helper()
	var n [2]byte
	if _, err := io.ReadFull(conn, n[:]); err != nil {
		t.Fatalf("read length: %v", err)
	}
	b := make([]byte, binary.BigEndian.Uint16(n[:]))
	if _, err := io.ReadFull(conn, b); err != nil {
		t.Fatalf("read answer: %v", err)
	}
	return unpack(t, b)
}

// TestTCPTwoQueriesOneConnection: two queries written back to back on one
// connection (as glibc sends A and AAAA) get two answers, in order, on
// it; one from the mesh, one forwarded.
func TestTCPTwoQueriesOneConnection(t *testing.T) {
	k := startKubeDNS(t)
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}})
	addr := serve(t, p, client)
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	both := append(frame(query(t, "reviews.mesh.svc.cluster.local.", dns.TypeA, 1)), frame(query(t, "outside.example.org.", dns.TypeA, 2))...)
	if _, err := conn.Write(both); err != nil {
		t.Fatal(err)
	}
	first, second := readFrame(t, conn), readFrame(t, conn)
	if first.Id != 1 || !slices.Equal(addrsOf(first), []string{reviewsVIP.String()}) {
		t.Errorf("first: id %d %v", first.Id, addrsOf(first))
	}
	if second.Id != 2 || !slices.Equal(addrsOf(second), []string{"192.0.2.1"}) {
		t.Errorf("second: id %d %v", second.Id, addrsOf(second))
	}
	// And a third, later, on the same connection.
	conn.Write(frame(query(t, "dual.mesh.", dns.TypeAAAA, 3)))
	if third := readFrame(t, conn); third.Id != 3 || !slices.Equal(addrsOf(third), []string{dualVIP6.String()}) {
		t.Errorf("third: id %d %v", third.Id, addrsOf(third))
	}
}

// TestTCPSlowAndBadClients: ServeConn returns, closing the connection,
// when a client sends nothing, stops halfway through a query, announces
// a frame too long or too short, or ctx ends: nothing holds its goroutine
// beyond TCPIdleTimeout.
func TestTCPSlowAndBadClients(t *testing.T) {
	p, m := newProxy(t, Config{TCPIdleTimeout: 200 * time.Millisecond})
	q := frame(query(t, "reviews.mesh.svc.cluster.local.", dns.TypeA, 1))
	for _, c := range []struct {
		name   string
		send   []byte
		cancel bool
	}{
		{name: "silent"},
		{name: "one byte of the length", send: q[:1]},
		{name: "half a query", send: q[:len(q)/2]},
		{name: "a query then silence", send: q},
		{name: "frame too long", send: []byte{0xff, 0xff, 1, 2, 3}},
		{name: "frame too short", send: []byte{0, 3, 1, 2, 3}},
		{name: "context ends", cancel: true},
	} {
		ctx, cancel := context.WithCancel(context.Background())
		ours, theirs := net.Pipe()
		done := make(chan struct{})
		go func() {
			p.ServeConn(ctx, client, ours, dialLoopback)
			close(done)
		}()
		go io.Copy(io.Discard, theirs)
		theirs.Write(c.send)
		if c.cancel {
			cancel()
		}
		select {
		case <-done:
		case <-time.After(3 * time.Second):
			t.Errorf("%s: ServeConn still running after 3s with a 200ms idle timeout", c.name)
		}
		if _, err := ours.Write([]byte{0}); err == nil {
			t.Errorf("%s: connection left open", c.name)
		}
		cancel()
		theirs.Close()
	}
	if got := testutil.ToFloat64(m.rejected.WithLabelValues("oversized")) + testutil.ToFloat64(m.rejected.WithLabelValues("short")); got != 2 {
		t.Errorf("rejected frames counted %v, want 2", got)
	}
}

// TestBounds: a pod with MaxInFlightPerPod queries in flight gets
// REFUSED for the next one, at once and without going upstream, counted
// as refused by the pod limit; another pod is still answered; the slots
// come back when the queries finish. A TCP connection over
// MaxConnsPerPod is closed at once.
func TestBounds(t *testing.T) {
	k := startKubeDNS(t)
	hold := make(chan struct{})
	k.mu.Lock()
	k.hold = hold
	k.mu.Unlock()
	p, m := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}, MaxInFlightPerPod: 2, MaxInFlight: 3, MaxConnsPerPod: 1})

	results := make(chan *dns.Msg, 3)
	ask := func(who *workload.Workload, id uint16) {
		b := p.Answer(context.Background(), who, "udp", query(t, "hold.example.org.", dns.TypeA, id), dialLoopback)
		m := new(dns.Msg)
		m.Unpack(b)
		results <- m
	}
	go ask(client, 1)
	go ask(client, 2)
	waitFor(t, func() bool { return k.held.Load() == 2 }, "two queries held upstream")

	start := time.Now()
	resp := unpack(t, p.Answer(context.Background(), client, "udp", query(t, "hold.example.org.", dns.TypeA, 3), dialLoopback))
	if resp.Rcode != dns.RcodeRefused || resp.Id != 3 || time.Since(start) > time.Second {
		t.Errorf("third query of the pod: %s id %d after %v, want REFUSED at once", dns.RcodeToString[resp.Rcode], resp.Id, time.Since(start))
	}
	if got := testutil.ToFloat64(m.refused.WithLabelValues("pod")); got != 1 {
		t.Errorf(`redirector_dns_refused_total{limit="pod"} = %v, want 1`, got)
	}
	if q := k.queries(); len(q) != 2 {
		t.Errorf("upstream asked %d times, want 2 (the refused one not)", len(q))
	}
	// Another pod has its own budget, within the node's (3).
	if resp := unpack(t, p.Answer(context.Background(), otherClient, "udp", query(t, "ratings.other.", dns.TypeA, 4), dialLoopback)); resp.Rcode != dns.RcodeSuccess {
		t.Errorf("other pod: %s, want answered", dns.RcodeToString[resp.Rcode])
	}
	go ask(otherClient, 5)
	waitFor(t, func() bool { return k.held.Load() == 3 }, "three queries held upstream")
	if resp := unpack(t, p.Answer(context.Background(), otherClient, "udp", query(t, "ratings.other.", dns.TypeA, 6), dialLoopback)); resp.Rcode != dns.RcodeRefused {
		t.Errorf("node full: %s, want REFUSED", dns.RcodeToString[resp.Rcode])
	}
	if got := testutil.ToFloat64(m.refused.WithLabelValues("node")); got != 1 {
		t.Errorf(`redirector_dns_refused_total{limit="node"} = %v, want 1`, got)
	}
	close(hold)
	for range 3 {
		if r := <-results; r.Rcode != dns.RcodeSuccess {
			t.Errorf("held query %d: %s", r.Id, dns.RcodeToString[r.Rcode])
		}
	}
	if resp := unpack(t, p.Answer(context.Background(), client, "udp", query(t, "hold.example.org.", dns.TypeA, 7), dialLoopback)); resp.Rcode != dns.RcodeSuccess {
		t.Errorf("after release: %s, want answered", dns.RcodeToString[resp.Rcode])
	}
	if got := testutil.ToFloat64(m.inFlight); got != 0 {
		t.Errorf("redirector_dns_queries_in_flight = %v after all finished", got)
	}

	// TCP connections per pod.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first, firstPeer := net.Pipe()
	defer firstPeer.Close()
	go p.ServeConn(ctx, client, first, dialLoopback)
	// The first is served (and so holds its slot before the second
	// starts: both started at once, either could take it).
	firstPeer.SetDeadline(time.Now().Add(5 * time.Second))
	firstPeer.Write(frame(query(t, "reviews.", dns.TypeA, 9)))
	if r := readFrame(t, firstPeer); r.Id != 9 || len(r.Answer) != 1 {
		t.Errorf("first connection: %v", r)
	}
	second, secondPeer := net.Pipe()
	done := make(chan struct{})
	go func() { p.ServeConn(ctx, client, second, dialLoopback); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Fatal("second TCP connection of the pod served, want closed at once")
	}
	secondPeer.Close()
	if got := testutil.ToFloat64(m.refused.WithLabelValues("conns_pod")); got != 1 {
		t.Errorf(`redirector_dns_refused_total{limit="conns_pod"} = %v, want 1`, got)
	}
	// The first is still served.
	firstPeer.Write(frame(query(t, "reviews.", dns.TypeA, 10)))
	if r := readFrame(t, firstPeer); r.Id != 10 || len(r.Answer) != 1 {
		t.Errorf("first connection: %v", r)
	}
}

func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}
