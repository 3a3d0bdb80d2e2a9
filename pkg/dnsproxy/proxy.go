// Package dnsproxy is the resolver of the agent's DNS proxy, ztunnel's
// (src/dns): a pod's queries to port 53, captured and handed over by the
// tunnel, are answered here. Names of the mesh (Kubernetes services in
// every search form, ServiceEntry hosts, wildcards among them) get A and
// AAAA records from the directory, authoritatively, without a round trip;
// everything else is forwarded, as the client sent it, to the upstream
// resolvers (kube-dns) from the client pod's network namespace.
//
// Everything a pod can make the proxy hold is bounded and counted: queries
// in flight (each may hold a socket to each configured upstream, each for
// up to Config.Timeout), TCP connections (each holds a goroutine, and closes when idle),
// and the size of what it reads. Malformed input is answered cheaply
// (FORMERR, NOTIMP, BADVERS) or dropped, never forwarded.
package dnsproxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// Config configures a Proxy. Zero values take the defaults below.
type Config struct {
	// Upstreams are the resolvers names outside the mesh are forwarded
	// to, ranked by health and speed, alike ones in this order (see
	// upstream); with none, those names get SERVFAIL.
	Upstreams []netip.AddrPort
	// Timeout bounds one forwarded query's exchange with one upstream
	// (UDP, and TCP when that answer is truncated). The next upstream is
	// asked too once one has not answered within its hedge delay (200 ms
	// to 2 s, from its RTT), so a query asks every upstream within a few
	// seconds and takes at most Timeout after the last was asked.
	// Default DefaultTimeout.
	Timeout time.Duration
	// MaxInFlight and MaxInFlightPerPod bound the queries being answered
	// at once, node-wide and per client pod; a query over either is
	// answered REFUSED. Defaults DefaultMaxInFlight, DefaultMaxInFlightPerPod.
	MaxInFlight, MaxInFlightPerPod int
	// MaxConns and MaxConnsPerPod bound the TCP connections ServeConn
	// serves at once; one over either is closed at once. Defaults
	// DefaultMaxConns, DefaultMaxConnsPerPod.
	MaxConns, MaxConnsPerPod int
	// TCPIdleTimeout is how long ServeConn waits for the next query, and
	// for the rest of one it has started to read. Default
	// DefaultTCPIdleTimeout.
	TCPIdleTimeout time.Duration
}

// Defaults. A forwarded query normally takes a millisecond or so: 64 at
// once is far more than one pod's resolver has outstanding (glibc sends A
// and AAAA together), 1024 more than a node's pods need, and each holds at
// most a socket and a 64 KiB buffer per upstream (two only while the first
// is slow to answer). 5 s is glibc's own retry timeout (and
// hickory's per-server one): waiting longer only overlaps the client's
// retry. 5 s idle is ztunnel's TCP request timeout.
const (
	DefaultTimeout           = 5 * time.Second
	DefaultMaxInFlight       = 1024
	DefaultMaxInFlightPerPod = 64
	DefaultMaxConns          = 512
	DefaultMaxConnsPerPod    = 32
	DefaultTCPIdleTimeout    = 5 * time.Second
)

// MaxQueryLen bounds a query's size. A real one is a header, one name of
// at most 255 bytes and an OPT record: a few hundred bytes, padded (RFC
// 8467) to a few more.
const MaxQueryLen = 4096

// Dialer opens a connection to an upstream resolver ("udp" or "tcp") from
// the client pod's network namespace; the caller marks the socket so the
// capture lets it out.
type Dialer func(ctx context.Context, network, addr string) (net.Conn, error)

// Proxy answers DNS queries of the node's pods. It is safe for concurrent
// use; the directory is read afresh for every query.
type Proxy struct {
	cfg     Config
	dir     func() *workload.Directory
	m       *Metrics
	log     *slog.Logger
	ups     []*upstream // Config.Upstreams, once each
	queries *limiter    // queries in flight
	conns   *limiter    // TCP connections served
	index   atomic.Pointer[hostIndex]
	// indexMu serialises building index, so the queries that arrive
	// together after a directory change share one build (see hosts).
	indexMu sync.Mutex
}

// New returns a Proxy answering from the directory dir returns (nil: an
// empty one). m nil: metrics not registered; log nil: discarded.
func New(cfg Config, dir func() *workload.Directory, m *Metrics, log *slog.Logger) (*Proxy, error) {
	if dir == nil {
		return nil, errors.New("dns proxy: no directory")
	}
	for _, f := range []struct {
		name string
		v    *int
		def  int
	}{
		{"max in flight", &cfg.MaxInFlight, DefaultMaxInFlight},
		{"max in flight per pod", &cfg.MaxInFlightPerPod, DefaultMaxInFlightPerPod},
		{"max connections", &cfg.MaxConns, DefaultMaxConns},
		{"max connections per pod", &cfg.MaxConnsPerPod, DefaultMaxConnsPerPod},
	} {
		if *f.v < 0 {
			return nil, fmt.Errorf("dns proxy: %s is %d, want at least 1 (0: default %d)", f.name, *f.v, f.def)
		}
		if *f.v == 0 {
			*f.v = f.def
		}
	}
	if cfg.Timeout < 0 || cfg.TCPIdleTimeout < 0 {
		return nil, fmt.Errorf("dns proxy: negative timeout (upstream %v, tcp idle %v)", cfg.Timeout, cfg.TCPIdleTimeout)
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.TCPIdleTimeout == 0 {
		cfg.TCPIdleTimeout = DefaultTCPIdleTimeout
	}
	for _, u := range cfg.Upstreams {
		if !u.IsValid() || !u.Addr().IsValid() || u.Port() == 0 {
			return nil, fmt.Errorf("dns proxy: upstream resolver %q is not an address and port", u)
		}
	}
	if m == nil {
		m = NewMetrics(nil)
	}
	m.watch(dir)
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ups := newUpstreams(cfg.Upstreams)
	for _, u := range ups {
		m.upstreamKnown(u.addr)
	}
	return &Proxy{
		cfg: cfg, dir: dir, m: m, log: log, ups: ups,
		queries: newLimiter(cfg.MaxInFlight, cfg.MaxInFlightPerPod),
		conns:   newLimiter(cfg.MaxConns, cfg.MaxConnsPerPod),
	}, nil
}

// Answer answers one query in wire format that client sent over proto
// ("udp" or "tcp"). nil means send nothing: the query is too short to
// carry an ID (counted in redirector_dns_rejected_total). Names of the mesh
// are answered from the directory; other names and other query types are
// forwarded upstream through dial, the answer passed on unchanged but for
// its ID (an upstream's bare error gets the client's question). Over udp
// the answer fits the client's buffer (512 bytes, or its EDNS0 size, at
// most a datagram), truncated with TC set when it does not. A query over a
// bound (Config.MaxInFlight*) is answered REFUSED, and so is one ended for
// another pod's when the node's bound is full and its pod holds the most
// (see limiter); a malformed one FORMERR,
// one with another opcode NOTIMP, all without going upstream.
func (p *Proxy) Answer(ctx context.Context, client *workload.Workload, proto string, query []byte, dial Dialer) []byte {
	tcp := protoLabel(proto) == "tcp"
	req, reply := p.check(query, tcp)
	if req == nil {
		return reply
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	h, by, evicted := p.queries.take(podKey(client), cancel)
	if by != "" {
		p.m.refuse(by)
		return p.pack(replyTo(req, dns.RcodeRefused), req, tcp)
	}
	if evicted {
		p.m.evict("node")
	}
	p.m.inFlight.Inc()
	defer func() {
		p.m.inFlight.Dec()
		h.release()
	}()

	q := req.Question[0]
	l := labels(q.Qtype, proto, client)
	p.m.request(l)
	if client == nil {
		// As ztunnel: a query from no pod we know is no one's to answer.
		return p.pack(replyTo(req, dns.RcodeServerFailure), req, tcp)
	}
	if resp := p.fromMesh(client, req); resp != nil {
		return p.pack(resp, req, tcp)
	}
	answer := p.forward(ctx, client, l, req, query, tcp, dial)
	if h.wasEvicted() {
		// Ended for another pod's query (see limiter): over the node's
		// bound, as if refused when it came.
		return p.pack(replyTo(req, dns.RcodeRefused), req, tcp)
	}
	return answer
}

// check parses query and judges it. A query to answer comes back as req;
// otherwise reply is what to send instead (nil: nothing), counted by
// reason.
func (p *Proxy) check(query []byte, tcp bool) (req *dns.Msg, reply []byte) {
	if len(query) < headerLen {
		p.m.reject("short")
		return nil, nil
	}
	reject := func(reason string, rcode int) (*dns.Msg, []byte) {
		p.m.reject(reason)
		return nil, headerReply(query, rcode)
	}
	switch {
	case len(query) > MaxQueryLen:
		return reject("oversized", dns.RcodeFormatError)
	case query[2]&0x80 != 0:
		// A response sent as a query: ztunnel answers FORMERR.
		return reject("response", dns.RcodeFormatError)
	case opcode(query) != dns.OpcodeQuery:
		return reject("opcode", dns.RcodeNotImplemented)
	}
	req = new(dns.Msg)
	if err := req.Unpack(query); err != nil {
		return reject("malformed", dns.RcodeFormatError)
	}
	if len(req.Question) != 1 {
		return reject("question_count", dns.RcodeFormatError)
	}
	opts := 0
	for _, rr := range req.Extra {
		if rr.Header().Rrtype == dns.TypeOPT {
			opts++
		}
	}
	if opts > 1 {
		// RFC 6891 6.1.1: more than one OPT is FORMERR.
		return reject("malformed", dns.RcodeFormatError)
	}
	if !validName(req.Question[0].Name) {
		p.m.reject("invalid_name")
		return nil, p.pack(replyTo(req, dns.RcodeFormatError), req, tcp)
	}
	if opt := req.IsEdns0(); opt != nil && opt.Version() != 0 {
		// RFC 6891 6.1.3: we speak EDNS version 0 only.
		p.m.reject("edns_version")
		return nil, p.pack(replyTo(req, dns.RcodeBadVers), req, tcp)
	}
	return req, nil
}

const headerLen = 12

func opcode(msg []byte) int { return int(msg[2]>>3) & 0xf }

// headerReply is a bare header answering msg with rcode: for a message
// whose question cannot be trusted or parsed.
func headerReply(msg []byte, rcode int) []byte {
	r := make([]byte, headerLen)
	copy(r[:2], msg[:2])
	r[2] = 0x80 | msg[2]&0x78 | msg[2]&0x01 // QR, the opcode, RD
	r[3] = byte(rcode & 0xf)
	return r
}

// validName says whether name (miekg's presentation form) is a host name
// (RFC 1123, with underscores as SRV and DKIM names use them) or a
// wildcard: any other byte in a label (miekg escapes it with a backslash)
// makes the query FORMERR, never forwarded.
func validName(name string) bool {
	if name == "." {
		return true
	}
	if !strings.HasSuffix(name, ".") {
		return false
	}
	for label := range strings.SplitSeq(name[:len(name)-1], ".") {
		if label == "*" {
			continue
		}
		if label == "" {
			return false
		}
		for i := 0; i < len(label); i++ {
			switch c := label[i]; {
			case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_':
			default:
				return false
			}
		}
	}
	return true
}

// replyTo is an empty answer to req with rcode, recursion available (as
// ztunnel says), with an OPT record if req has one.
func replyTo(req *dns.Msg, rcode int) *dns.Msg {
	resp := new(dns.Msg).SetRcode(req, rcode)
	resp.RecursionAvailable = true
	if opt := req.IsEdns0(); opt != nil {
		// As ztunnel (handler.rs response_edns): the client's size, at
		// least 512, and its DO bit.
		resp.SetEdns0(max(dns.MinMsgSize, opt.UDPSize()), opt.Do())
	}
	return resp
}

// clientSize is the largest answer the client of req takes: a TCP frame,
// or over UDP 512 bytes or its EDNS0 size, at most what a datagram carries.
func clientSize(req *dns.Msg, tcp bool) int {
	if tcp {
		return dns.MaxMsgSize
	}
	if opt := req.IsEdns0(); opt != nil {
		return min(maxUDPPayload, max(dns.MinMsgSize, int(opt.UDPSize())))
	}
	return dns.MinMsgSize
}

// pack encodes resp to fit req's client, truncated (TC) if need be.
func (p *Proxy) pack(resp *dns.Msg, req *dns.Msg, tcp bool) []byte {
	size := clientSize(req, tcp)
	resp.Truncate(size)
	b, err := resp.Pack()
	if err == nil && len(b) > size {
		// Truncate leaves an answer with a TSIG record whole and cannot
		// cut an OPT record (an upstream's): the header and question, TC
		// set, for the client to ask over TCP.
		r := replyTo(req, resp.Rcode)
		r.Truncated = true
		b, err = r.Pack()
	}
	if err != nil {
		p.log.Warn("dns proxy: cannot encode answer", "name", req.Question[0].Name, "error", err)
		b, _ = replyTo(req, dns.RcodeServerFailure).Pack()
	}
	return b
}

// podKey is what the per-pod bounds count a client under.
func podKey(client *workload.Workload) string {
	if client == nil {
		return ""
	}
	return client.Key()
}

// maxUDPPayload is the most a UDP datagram over IPv4 carries (65535 less
// the IPv4 and UDP headers): a client announcing a larger EDNS0 size gets
// at most this.
const maxUDPPayload = 65507
