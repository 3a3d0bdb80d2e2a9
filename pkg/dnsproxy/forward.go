package dnsproxy

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

var errNoUpstream = errors.New("no upstream resolver configured")

// errClientSocket marks a failure to make the socket a query goes out on,
// in the client pod's namespace (its ports or routes: EAGAIN from a
// narrowed net.ipv4.ip_local_port_range, ENETUNREACH): nothing was sent,
// and it is the pod's, not the upstream's.
var errClientSocket = errors.New("socket in the client's namespace")

// forward sends query upstream and returns the answer for the client:
// the upstream's, its ID the client's, fitted to the client's buffer; or
// SERVFAIL when no upstream answered.
func (p *Proxy) forward(ctx context.Context, client *workload.Workload, l []string, req *dns.Msg, query []byte, tcp bool, dial Dialer) []byte {
	start := time.Now()
	answer, err := p.exchange(ctx, req, query, tcp, dial)
	// A query ended on our side (evicted for another pod's, its pod
	// stopping) is no upstream's failure.
	p.m.upstream(l, time.Since(start), err != nil && !errors.Is(ctx.Err(), context.Canceled))
	if err != nil {
		p.log.Debug("dns: forwarding failed", "client", clientName(client), "name", req.Question[0].Name,
			"type", dns.TypeToString[req.Question[0].Qtype], "error", err)
	}
	if answer == nil {
		return p.pack(replyTo(req, dns.RcodeServerFailure), req, tcp)
	}
	binary.BigEndian.PutUint16(answer, req.Id)
	if bareError(answer) {
		// The client's resolver matches an answer to its query by the
		// question too (glibc's, Go's): the upstream's rcode with the
		// client's question.
		return p.pack(replyTo(req, rcode(answer)), req, tcp)
	}
	if size := clientSize(req, tcp); len(answer) > size {
		// Only an answer re-asked over TCP for a TCP client, or an
		// upstream ignoring the client's size, gets here.
		m := new(dns.Msg)
		if err := m.Unpack(answer); err != nil {
			// A truncated answer cut mid-record (answers took it by its
			// header and question): the client is to ask over TCP.
			r := replyTo(req, rcode(answer))
			r.Truncated = true
			return p.pack(r, req, tcp)
		}
		return p.pack(m, req, tcp)
	}
	return answer
}

// exchange asks the upstreams, ranked (see upstream), and returns the
// first answer that is not SERVFAIL or REFUSED (hickory moves to the next
// server on those too); failing that the last such answer, with an error,
// or nil and an error. Each upstream is asked within Config.Timeout; when
// one has not answered within its hedge delay (from its RTT, 200 ms to
// 2 s) the next is asked too, its answer still taken, and when one fails
// (refused, timed out, SERVFAIL) the next is asked at once. Before, each
// was asked in turn for up to 5 s: with the first upstream dead every
// forwarded query waited 5 s, and with two dead the third was never asked
// within the query's 10 s. The query goes as the client sent it, under a
// fresh random ID; an answer over UDP with TC set is asked again over TCP
// when the client came over TCP (a UDP client gets the truncated answer
// and retries over TCP itself, as it would talking to the upstream).
// Every exchange it starts has ended when it returns.
func (p *Proxy) exchange(ctx context.Context, req *dns.Msg, query []byte, tcp bool, dial Dialer) ([]byte, error) {
	if len(p.ups) == 0 {
		return nil, errNoUpstream
	}
	id := uint16(rand.N(1 << 16))
	out := slices.Clone(query)
	binary.BigEndian.PutUint16(out, id)
	q := req.Question[0]

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		u        *upstream
		sent     time.Time
		answer   []byte
		answered bool // the upstream answered, over UDP at least
		err      error
	}
	order := rank(p.ups, time.Now())
	results := make(chan result, len(order))
	var (
		next, pending int
		sent          time.Time // of the latest exchange started
		struck        = map[*upstream]bool{}
		hedge         = time.NewTimer(time.Hour)
	)
	defer hedge.Stop()
	start := func() {
		u := order[next]
		next++
		pending++
		sent = time.Now()
		hedge.Reset(u.hedge())
		run := func(sent time.Time) {
			answer, answered, err := p.ask(ctx, u, out, id, q, tcp, dial)
			results <- result{u, sent, answer, answered, err}
		}
		if len(order) == 1 {
			// Nothing to hedge to: on this goroutine, a query holding
			// one goroutine as before (the tunnel bounds them per pod).
			run(sent)
			return
		}
		go run(sent)
	}
	// fail counts an exchange that got nothing against its upstream, once.
	fail := func(u *upstream, sent time.Time) {
		if !struck[u] && u.failed(time.Now(), sent) {
			struck[u] = true
			p.m.upstreamStruck(u.addr)
		}
	}
	start()
	var failed, answer []byte
	var errs []error
	for pending > 0 && answer == nil {
		select {
		case r := <-results:
			pending--
			if r.answered {
				p.m.upstreamRTT(r.u.addr, r.u.srttNow())
			}
			if r.err != nil {
				errs = append(errs, fmt.Errorf("upstream %s: %w", r.u.addr, r.err))
				if !r.answered && ctx.Err() == nil && !errors.Is(r.err, errClientSocket) {
					// Its own timeout, or refused or unreachable: not the
					// query's end, nor a socket the client's namespace
					// would not give (counted against the upstream, one
					// pod's narrowed port range put every upstream on
					// probation for the node's pods).
					p.m.upstreamUnanswered(r.u.addr)
					fail(r.u, r.sent)
				}
			} else if rc := rcode(r.answer); rc == dns.RcodeServerFailure || rc == dns.RcodeRefused {
				failed = r.answer
				errs = append(errs, fmt.Errorf("upstream %s: answered %s", r.u.addr, dns.RcodeToString[rc]))
			} else {
				answer = r.answer
				continue
			}
			if next < len(order) && ctx.Err() == nil {
				start()
			}
		case <-hedge.C:
			if next < len(order) && ctx.Err() == nil {
				// The latest has not answered in its time: ask the next too.
				u := order[next-1]
				p.m.upstreamHedged(u.addr)
				fail(u, sent)
				start()
			}
		}
	}
	// The others asked are no longer waited for; their sockets close.
	cancel()
	for ; pending > 0; pending-- {
		if r := <-results; r.answered {
			p.m.upstreamRTT(r.u.addr, r.u.srttNow())
		}
	}
	if answer != nil {
		return answer, nil
	}
	return failed, errors.Join(errs...)
}

// ask asks the upstream u, over UDP and then TCP if the answer is
// truncated and retry says so, within Config.Timeout; answered says u
// answered (over UDP), its RTT noted in u.
func (p *Proxy) ask(ctx context.Context, u *upstream, query []byte, id uint16, q dns.Question, retry bool, dial Dialer) (answer []byte, answered bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.Timeout)
	defer cancel()
	addr := u.addr.String()
	start := time.Now()
	answer, err = askUDP(ctx, dial, addr, query, id, q)
	if err != nil {
		return nil, false, err
	}
	now := time.Now()
	u.answered(now, now.Sub(start))
	if answer[2]&0x02 == 0 || !retry {
		return answer, true, nil
	}
	answer, err = askTCP(ctx, dial, addr, query, id, q)
	if err != nil {
		return nil, true, fmt.Errorf("retry over tcp of a truncated answer: %w", err)
	}
	return answer, true, nil
}

// askUDP sends query to addr over UDP and waits for its answer, ignoring
// datagrams that are not (another ID or question, not a response), as a
// stub resolver does against spoofing. An answer larger than the client's
// size is taken (forward truncates it): an upstream ignoring that size
// still answers, rather than leaving the client to wait for the timeout.
func askUDP(ctx context.Context, dial Dialer, addr string, query []byte, id uint16, q dns.Question) ([]byte, error) {
	conn, err := dialUpstream(ctx, dial, "udp", addr)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	if _, err := conn.Write(query); err != nil {
		return nil, fmt.Errorf("send: %w", err)
	}
	bp := udpBufs.Get().(*[]byte)
	defer udpBufs.Put(bp)
	buf := *bp
	for {
		n, err := conn.Read(buf)
		if err != nil {
			return nil, fmt.Errorf("receive: %w", err)
		}
		if answers(buf[:n], id, q) {
			return slices.Clone(buf[:n]), nil
		}
	}
}

// udpBufs are receive buffers for upstream answers, each the largest
// datagram: one per query in flight at most.
var udpBufs = sync.Pool{New: func() any {
	b := make([]byte, dns.MaxMsgSize)
	return &b
}}

// askTCP sends query to addr over TCP (RFC 1035 4.2.2 framing) and reads
// its answer, which must be one.
func askTCP(ctx context.Context, dial Dialer, addr string, query []byte, id uint16, q dns.Question) ([]byte, error) {
	conn, err := dialUpstream(ctx, dial, "tcp", addr)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	msg := binary.BigEndian.AppendUint16(make([]byte, 0, 2+len(query)), uint16(len(query)))
	if _, err := conn.Write(append(msg, query...)); err != nil {
		return nil, fmt.Errorf("send: %w", err)
	}
	var n [2]byte
	if _, err := io.ReadFull(conn, n[:]); err != nil {
		return nil, fmt.Errorf("receive: %w", err)
	}
	answer := make([]byte, binary.BigEndian.Uint16(n[:]))
	if _, err := io.ReadFull(conn, answer); err != nil {
		return nil, fmt.Errorf("receive: %w", err)
	}
	if !answers(answer, id, q) {
		return nil, errors.New("answer does not match the query")
	}
	return answer, nil
}

// dialUpstream dials addr and ties the connection to ctx: its deadline,
// and closing it when ctx ends.
func dialUpstream(ctx context.Context, dial Dialer, network, addr string) (net.Conn, error) {
	if dial == nil {
		return nil, errors.New("no dialer")
	}
	conn, err := dial(ctx, network, addr)
	if err != nil {
		return nil, fmt.Errorf("%w: dial %s: %w", errClientSocket, network, err)
	}
	if d, ok := ctx.Deadline(); ok {
		if err := conn.SetDeadline(d); err != nil {
			conn.Close()
			return nil, fmt.Errorf("set deadline: %w", err)
		}
	}
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	return closeStopping{conn, stop}, nil
}

// closeStopping closes its conn and drops the close on ctx's end.
type closeStopping struct {
	net.Conn
	stop func() bool
}

func (c closeStopping) Close() error {
	c.stop()
	return c.Conn.Close()
}

// answers says whether msg answers the query with id and question q, as
// a stub resolver judges it against spoofing (RFC 5452 9.1): a response,
// opcode QUERY, with the ID and the question (its name in any case). Only
// then is it passed on. Its records must parse too, but for two answers
// whose records do not matter, lest a real answer be ignored and the client
// wait for the timeout and a SERVFAIL: one with TC set, whose records the
// client discards (RFC 2181 9) and which may be cut mid-record, is judged
// by its header and question; and a bare error (bareError) is taken as
// hickory, ztunnel's forwarder, takes it.
func answers(msg []byte, id uint16, q dns.Question) bool {
	if len(msg) < headerLen || binary.BigEndian.Uint16(msg) != id || msg[2]&0x80 == 0 || opcode(msg) != dns.OpcodeQuery {
		return false
	}
	if bareError(msg) {
		return true
	}
	if binary.BigEndian.Uint16(msg[4:]) != 1 {
		return false
	}
	if msg[2]&0x02 != 0 {
		name, off, err := dns.UnpackDomainName(msg, headerLen)
		if err != nil || off+4 > len(msg) {
			return false
		}
		return binary.BigEndian.Uint16(msg[off:]) == q.Qtype && binary.BigEndian.Uint16(msg[off+2:]) == q.Qclass &&
			strings.EqualFold(name, q.Name)
	}
	var m dns.Msg
	if err := m.Unpack(msg); err != nil || len(m.Question) != 1 {
		return false
	}
	a := m.Question[0]
	return a.Qtype == q.Qtype && a.Qclass == q.Qclass && strings.EqualFold(a.Name, q.Name)
}

// bareError says whether msg is an error answer without question or
// records but an OPT record: FORMERR, SERVFAIL, NOTIMP or REFUSED, as
// servers refuse a query they will not parse (miekg's server, so CoreDNS,
// one with more than one answer or authority record or two additional
// ones; unbound one with any answer record). A bare answer claiming
// success, or an error with records, is no answer.
func bareError(msg []byte) bool {
	if len(msg) < headerLen {
		return false
	}
	switch rcode(msg) {
	case dns.RcodeFormatError, dns.RcodeServerFailure, dns.RcodeNotImplemented, dns.RcodeRefused:
	default:
		return false
	}
	counts := msg[4:headerLen]
	return binary.BigEndian.Uint16(counts[0:]) == 0 && binary.BigEndian.Uint16(counts[2:]) == 0 &&
		binary.BigEndian.Uint16(counts[4:]) == 0 && binary.BigEndian.Uint16(counts[6:]) <= 1
}

// rcode is msg's header rcode (the low four bits).
func rcode(msg []byte) int { return int(msg[3] & 0xf) }
