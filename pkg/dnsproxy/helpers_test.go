package dnsproxy

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// The mesh of the tests: a client pod in namespace mesh, services there
// and in namespace other, ServiceEntry hosts, headless services.
var (
	client      = &workload.Workload{Namespace: "mesh", Name: "app-1", UID: "uid-app-1", CanonicalName: "app", CanonicalRevision: "v1"}
	otherClient = &workload.Workload{Namespace: "other", Name: "web-1", UID: "uid-web-1", CanonicalName: "web", CanonicalRevision: "v2"}

	reviewsVIP = netip.MustParseAddr("10.96.0.10")
	dualVIP4   = netip.MustParseAddr("10.96.0.11")
	dualVIP6   = netip.MustParseAddr("fd00::11")
	ratingsVIP = netip.MustParseAddr("10.96.0.20")
	apiVIP     = netip.MustParseAddr("240.240.0.1")
	wildVIP    = netip.MustParseAddr("240.240.0.2")
)

// bigHeadlessEndpoints is more A records than fit 512 bytes.
const bigHeadlessEndpoints = 100

func testServices() []*workload.Service {
	ep := func(a string, ready bool) workload.Endpoint {
		return workload.Endpoint{Addr: netip.MustParseAddr(a), Ready: ready}
	}
	var big []workload.Endpoint
	for i := range bigHeadlessEndpoints {
		big = append(big, workload.Endpoint{Addr: netip.AddrFrom4([4]byte{10, 1, byte(i / 250), byte(1 + i%250)}), Ready: true})
	}
	return []*workload.Service{
		{Name: "reviews", Namespace: "mesh", Hostname: workload.ClusterHostname("reviews", "mesh"), VIPs: []netip.Addr{reviewsVIP}},
		{Name: "dual", Namespace: "mesh", Hostname: workload.ClusterHostname("dual", "mesh"), VIPs: []netip.Addr{dualVIP4, dualVIP6}},
		{Name: "ratings", Namespace: "other", Hostname: workload.ClusterHostname("ratings", "other"), VIPs: []netip.Addr{ratingsVIP}},
		// A ServiceEntry exported to its own namespace only.
		{Name: "api", Namespace: "other", Hostname: "api.example.com", VIPs: []netip.Addr{apiVIP}, NamespaceOnly: true},
		{Name: "wild", Namespace: "mesh", Hostname: "*.wild.example.com", VIPs: []netip.Addr{wildVIP}},
		// Headless: its ready endpoints are the answer.
		{Name: "db", Namespace: "mesh", Hostname: workload.ClusterHostname("db", "mesh"), Endpoints: []workload.Endpoint{
			ep("10.0.0.1", true), ep("10.0.0.2", true), ep("10.0.0.3", true), ep("10.0.0.4", false), ep("fd00::1", true)}},
		{Name: "big", Namespace: "mesh", Hostname: workload.ClusterHostname("big", "mesh"), Endpoints: big},
		// A ServiceEntry without VIPs (resolution DNS): not the mesh's to answer.
		{Name: "ext", Namespace: "mesh", Hostname: "ext.example.net", Endpoints: []workload.Endpoint{ep("192.0.2.99", true)}},
	}
}

func testDirectory(t testing.TB) *workload.Directory {
	dir, errs := workload.NewDirectory([]*workload.Workload{client, otherClient}, testServices())
	if len(errs) > 0 {
		t.Fatalf("directory: %v", errs)
	}
	return dir
}

func newProxy(t testing.TB, cfg Config) (*Proxy, *Metrics) {
	t.Helper()
	dir := testDirectory(t)
	m := NewMetrics(nil)
	p, err := New(cfg, func() *workload.Directory { return dir }, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p, m
}

// dialLoopback dials as the tunnel's Dialer would, here from the test's
// own network namespace (loopback only).
func dialLoopback(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, network, addr)
}

// upstreamAnswers is what the kube-dns stand-in knows.
var upstreamAnswers = map[string]string{
	"outside.example.org.": "192.0.2.1",
	"api.example.com.":     "192.0.2.53", // what the world outside the mesh says
	"ext.example.net.":     "192.0.2.98",
	"wild.example.com.":    "192.0.2.77",
}

// kubeDNS is a stand-in for kube-dns on 127.0.0.1 (UDP and TCP, one port),
// built with miekg/dns's server. It answers upstreamAnswers, 100 A
// records for big.example.org (truncated over UDP as a server must), MX
// for anything, NXDOMAIN for the rest, and records what it was asked and
// the bytes it answered.
type kubeDNS struct {
	addr netip.AddrPort

	mu      sync.Mutex
	asked   []string // "udp name type", "tcp name type"
	replies [][]byte
	hold    chan struct{} // if set, queries for hold.example.org wait on it
	held    atomic.Int32
}

// listenBoth opens a UDP socket and a TCP listener on one loopback port,
// as a DNS server takes both.
func listenBoth(t testing.TB) (net.PacketConn, net.Listener, int) {
	t.Helper()
	// The UDP port's TCP twin may be another process's: try other ports.
	var last error
	for range 20 {
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := pc.LocalAddr().(*net.UDPAddr).Port
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err == nil {
			return pc, ln, port
		}
		pc.Close()
		last = err
	}
	t.Fatalf("no port free for both UDP and TCP: %v", last)
	return nil, nil, 0
}

func startKubeDNS(t testing.TB) *kubeDNS {
	t.Helper()
	k := &kubeDNS{}
	pc, ln, port := listenBoth(t)
	k.addr = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))
	for _, srv := range []*dns.Server{{PacketConn: pc, Handler: k}, {Listener: ln, Handler: k}} {
		started := make(chan struct{})
		srv.NotifyStartedFunc = func() { close(started) }
		go srv.ActivateAndServe()
		<-started
		t.Cleanup(func() { srv.Shutdown() })
	}
	return k
}

func (k *kubeDNS) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	network := w.LocalAddr().Network()
	q := r.Question[0]
	k.mu.Lock()
	k.asked = append(k.asked, network+" "+q.Name+" "+dns.TypeToString[q.Qtype])
	hold := k.hold
	k.mu.Unlock()
	if hold != nil && q.Name == "hold.example.org." {
		k.held.Add(1)
		<-hold
	}
	resp := new(dns.Msg).SetReply(r)
	resp.RecursionAvailable = true
	name := strings.ToLower(q.Name)
	switch {
	case q.Qtype == dns.TypeMX:
		resp.Answer = append(resp.Answer, &dns.MX{Hdr: hdr(q.Name, dns.TypeMX), Preference: 10, Mx: "mail.example.org."})
	case name == "big.example.org." && q.Qtype == dns.TypeA:
		for i := range 100 {
			resp.Answer = append(resp.Answer, &dns.A{Hdr: hdr(q.Name, dns.TypeA), A: net.IPv4(198, 51, 100, byte(i+1))})
		}
	case upstreamAnswers[name] != "" && q.Qtype == dns.TypeA:
		resp.Answer = append(resp.Answer, &dns.A{Hdr: hdr(q.Name, dns.TypeA), A: net.ParseIP(upstreamAnswers[name])})
	case upstreamAnswers[name] != "" || name == "hold.example.org.":
	default:
		resp.Rcode = dns.RcodeNameError
	}
	if opt := r.IsEdns0(); opt != nil {
		resp.SetEdns0(opt.UDPSize(), false)
	}
	if network == "udp" {
		size := dns.MinMsgSize
		if opt := r.IsEdns0(); opt != nil {
			size = int(opt.UDPSize())
		}
		resp.Truncate(size)
	}
	b, err := resp.Pack()
	if err != nil {
		panic(err)
	}
	k.mu.Lock()
	k.replies = append(k.replies, b)
	k.mu.Unlock()
	w.Write(b)
}

func hdr(name string, t uint16) dns.RR_Header {
	return dns.RR_Header{Name: name, Rrtype: t, Class: dns.ClassINET, Ttl: 300}
}

func (k *kubeDNS) queries() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.asked...)
}

func (k *kubeDNS) lastReply() []byte {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.replies) == 0 {
		return nil
	}
	return k.replies[len(k.replies)-1]
}

// udpUpstream is a bare upstream resolver on 127.0.0.1 (UDP only) that
// sends, for each query it can parse, the datagrams answer returns for it
// (raw is the query as received), in order: for upstreams that misbehave
// in ways kubeDNS's server will not.
func udpUpstream(t testing.TB, answer func(q *dns.Msg, raw []byte) [][]byte) netip.AddrPort {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	serveUDP(t, pc, answer)
	return pc.LocalAddr().(*net.UDPAddr).AddrPort()
}

// serveUDP answers the queries pc receives as udpUpstream does, until the
// test ends.
func serveUDP(t testing.TB, pc net.PacketConn, answer func(q *dns.Msg, raw []byte) [][]byte) {
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 4096)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			q := new(dns.Msg)
			if q.Unpack(buf[:n]) != nil {
				continue
			}
			for _, b := range answer(q, buf[:n]) {
				pc.WriteTo(b, from)
			}
		}
	}()
}

// serve runs a tiny DNS server on 127.0.0.1 (UDP and TCP, one port) that
// hands every query to p as the tunnel does: datagrams to Answer,
// connections to ServeConn, all from the pod who.
func serve(t testing.TB, p *Proxy, who *workload.Workload) string {
	t.Helper()
	return serveObserved(t, p, who, nil)
}

// serveObserved is serve, showing each UDP query to seen first.
func serveObserved(t testing.TB, p *Proxy, who *workload.Workload, seen func(query []byte)) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pc, ln, port := listenBoth(t)
	var wg sync.WaitGroup
	wg.Go(func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			query := append([]byte(nil), buf[:n]...)
			if seen != nil {
				seen(query)
			}
			wg.Go(func() {
				if answer := p.Answer(ctx, who, "udp", query, dialLoopback); answer != nil {
					pc.WriteTo(answer, from)
				}
			})
		}
	})
	wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { p.ServeConn(ctx, who, conn, dialLoopback) })
		}
	})
	t.Cleanup(func() {
		cancel()
		pc.Close()
		ln.Close()
		wg.Wait()
	})
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}

// ask sends one query with miekg/dns's client over network to addr.
func ask(t testing.TB, network, addr, name string, qtype uint16, edns uint16) *dns.Msg {
	t.Helper()
	q := new(dns.Msg).SetQuestion(name, qtype)
	if edns > 0 {
		q.SetEdns0(edns, false)
	}
	c := &dns.Client{Net: network, Timeout: 5 * time.Second, UDPSize: 65535}
	resp, _, err := c.Exchange(q, addr)
	if err != nil && (resp == nil || !resp.Truncated) {
		t.Fatalf("%s %s %s: %v", network, name, dns.TypeToString[qtype], err)
	}
	if resp.Id != q.Id {
		t.Fatalf("%s %s: answer ID %d, query ID %d", network, name, resp.Id, q.Id)
	}
	return resp
}

// query packs a query for name and qtype with ID id.
func query(t testing.TB, name string, qtype uint16, id uint16) []byte {
	t.Helper()
	q := new(dns.Msg).SetQuestion(name, qtype)
	q.Id = id
	b, err := q.Pack()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func unpack(t testing.TB, b []byte) *dns.Msg {
	t.Helper()
	if b == nil {
		t.Fatal("no answer")
	}
	m := new(dns.Msg)
	if err := m.Unpack(b); err != nil {
		t.Fatalf("answer does not parse: %v", err)
	}
	return m
}

// addrsOf lists the A/AAAA addresses of answers, sorted as strings.
func addrsOf(m *dns.Msg) []string {
	var out []string
	for _, rr := range m.Answer {
		switch rr := rr.(type) {
		case *dns.A:
			out = append(out, rr.A.String())
		case *dns.AAAA:
			out = append(out, rr.AAAA.String())
		}
	}
	slices.Sort(out)
	return out
}
