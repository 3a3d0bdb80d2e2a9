package dnsproxy

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
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

// TestNodeBoundSharedFairly: one pod holding the node's whole bound of
// queries in flight (names whose upstream never answers) and of TCP
// connections (a query sent within each idle timeout keeps one open)
// does not lock the node's other pods out of DNS: under the full bound,
// the oldest query or connection of the pod holding the most is ended
// for the pod holding fewer, and counted. Before, every other pod's
// query, for a name of the mesh too, was REFUSED for as long as the
// first kept its share.
func TestNodeBoundSharedFairly(t *testing.T) {
	k := startKubeDNS(t)
	hold := make(chan struct{})
	release := sync.OnceFunc(func() { close(hold) })
	defer release()
	k.mu.Lock()
	k.hold = hold
	k.mu.Unlock()
	p, m := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}, MaxInFlightPerPod: 4, MaxInFlight: 4, MaxConnsPerPod: 2, MaxConns: 2})

	results := make(chan *dns.Msg, 4)
	for id := range uint16(4) {
		go func() {
			m := new(dns.Msg)
			m.Unpack(p.Answer(context.Background(), client, "udp", query(t, "hold.example.org.", dns.TypeA, id), dialLoopback))
			results <- m
		}()
		// In order, so the first is the oldest.
		waitFor(t, func() bool { return k.held.Load() == int32(id)+1 }, "query held upstream")
	}
	start := time.Now()
	resp := unpack(t, p.Answer(context.Background(), otherClient, "udp", query(t, "ratings.other.", dns.TypeA, 9), dialLoopback))
	if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
		t.Errorf("other pod's query under a full node bound one pod holds: %s, %d answers, want answered", dns.RcodeToString[resp.Rcode], len(resp.Answer))
	}
	select {
	case r := <-results:
		if r.Id != 0 || r.Rcode != dns.RcodeRefused {
			t.Errorf("evicted query: id %d %s, want the oldest (0) REFUSED", r.Id, dns.RcodeToString[r.Rcode])
		}
	case <-time.After(2 * time.Second):
		t.Errorf("no query of the pod holding the node's bound ended after %v", time.Since(start))
	}
	if got := testutil.ToFloat64(m.evicted.WithLabelValues("node")); got != 1 {
		t.Errorf(`redirector_dns_evicted_total{limit="node"} = %v, want 1`, got)
	}
	if got := testutil.ToFloat64(m.refused.WithLabelValues("node")); got != 0 {
		t.Errorf(`redirector_dns_refused_total{limit="node"} = %v, want 0`, got)
	}
	if got := testutil.ToFloat64(m.upstreamFailures.WithLabelValues(labels(dns.TypeA, "udp", client)...)); got != 0 {
		t.Errorf("istio_dns_upstream_failures_total = %v after an eviction, want 0: no upstream failed", got)
	}
	// Shares converge and then hold: the other pod takes a second slot
	// by eviction (3:1 after its first held query, 2:2 after this), and
	// neither pod then evicts the other.
	for _, id := range []uint16{10, 11} {
		go func() {
			m := new(dns.Msg)
			m.Unpack(p.Answer(context.Background(), otherClient, "udp", query(t, "hold.example.org.", dns.TypeA, id), dialLoopback))
			results <- m
		}()
		waitFor(t, func() bool { return k.held.Load() == int32(id)-5 }, "other pod's query held")
	}
	select {
	case r := <-results:
		if r.Id != 1 || r.Rcode != dns.RcodeRefused {
			t.Errorf("second evicted query: id %d %s, want 1 REFUSED", r.Id, dns.RcodeToString[r.Rcode])
		}
	case <-time.After(2 * time.Second):
		t.Error("no second query evicted")
	}
	for _, who := range []*workload.Workload{otherClient, client} {
		if resp := unpack(t, p.Answer(context.Background(), who, "udp", query(t, "ratings.other.", dns.TypeA, 12), dialLoopback)); resp.Rcode != dns.RcodeRefused {
			t.Errorf("%s's query with the node full, shares 2:2: %s, want REFUSED", who.Name, dns.RcodeToString[resp.Rcode])
		}
	}
	if got := testutil.ToFloat64(m.evicted.WithLabelValues("node")); got != 2 {
		t.Errorf(`redirector_dns_evicted_total{limit="node"} = %v, want 2`, got)
	}

	release()
	for range 4 {
		if r := <-results; r.Rcode != dns.RcodeSuccess {
			t.Errorf("held query %d: %s", r.Id, dns.RcodeToString[r.Rcode])
		}
	}

	// TCP connections.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var peers []net.Conn
	served := make(chan int, 3)
	serveConn := func(who *workload.Workload, i int) net.Conn {
		c, peer := net.Pipe()
		t.Cleanup(func() { peer.Close() })
		go func() { p.ServeConn(ctx, who, c, dialLoopback); served <- i }()
		peer.SetDeadline(time.Now().Add(5 * time.Second))
		peer.Write(frame(query(t, "ratings.other.", dns.TypeA, uint16(100+i))))
		if r := readFrame(t, peer); r.Id != uint16(100+i) || len(r.Answer) != 1 {
			t.Errorf("connection %d: %v", i, r)
		}
		return peer
	}
	for i := range 2 {
		peers = append(peers, serveConn(client, i))
	}
	peers = append(peers, serveConn(otherClient, 2))
	select {
	case i := <-served:
		if i != 0 {
			t.Errorf("connection %d closed, want the oldest of the pod holding the node's bound (0)", i)
		}
	case <-time.After(2 * time.Second):
		t.Error("no connection of the pod holding the node's bound closed")
	}
	if got := testutil.ToFloat64(m.evicted.WithLabelValues("conns_node")); got != 1 {
		t.Errorf(`redirector_dns_evicted_total{limit="conns_node"} = %v, want 1`, got)
	}
	if got := testutil.ToFloat64(m.refused.WithLabelValues("conns_node")); got != 0 {
		t.Errorf(`redirector_dns_refused_total{limit="conns_node"} = %v, want 0`, got)
	}
	// Both pods' remaining connections are still served.
	for i, peer := range peers[1:] {
		peer.Write(frame(query(t, "ratings.other.", dns.TypeA, uint16(200+i))))
		if r := readFrame(t, peer); r.Id != uint16(200+i) {
			t.Errorf("connection %d after the eviction: %v", i+1, r)
		}
	}
}
