package dnsproxy

import (
	"context"
	"net"
	"net/netip"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// TestDig resolves through the proxy with the real dig (Debian's
// bind9-dnsutils), against a tiny UDP+TCP server on 127.0.0.1 that hands
// queries to Answer and connections to ServeConn as the tunnel does, so a
// real client's queries are proven: EDNS0 with a cookie (dig's default),
// +tcp, +norecurse, no EDNS at all, names with and without the trailing
// dot, a truncated answer dig retries over TCP, and a forwarded name.
// dig missing is a failure, not a skip: `make deps` installs it.
func TestDig(t *testing.T) {
	digPath, err := exec.LookPath("dig")
	if err != nil {
		t.Fatalf("dig not found (apt-get install bind9-dnsutils): %v", err)
	}
	k := startKubeDNS(t)
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{k.addr}})
	var cookies atomic.Int32 // UDP queries that carried a client cookie
	addr := serveObserved(t, p, client, func(query []byte) {
		m := new(dns.Msg)
		if m.Unpack(query) != nil || m.IsEdns0() == nil {
			return
		}
		for _, o := range m.IsEdns0().Option {
			if o.Option() == dns.EDNS0COOKIE {
				cookies.Add(1)
			}
		}
	})
	host, port, _ := net.SplitHostPort(addr)

	for _, c := range []struct {
		args    []string
		status  string
		flags   string   // dig's ";; flags:" line, exactly
		answers []string // "name type address" of the ANSWER section, in any order
		also    []string // further text the output must hold
	}{
		{args: []string{"reviews.mesh.svc.cluster.local"}, status: "NOERROR", flags: "qr aa rd ra",
			answers: []string{"reviews.mesh.svc.cluster.local. A 10.96.0.10"}, also: []string{"; EDNS: version: 0"}},
		{args: []string{"reviews.mesh.svc.cluster.local.", "+tcp"}, status: "NOERROR", flags: "qr aa rd ra",
			answers: []string{"reviews.mesh.svc.cluster.local. A 10.96.0.10"}},
		{args: []string{"reviews", "+norecurse"}, status: "NOERROR", flags: "qr aa ra",
			answers: []string{"reviews. A 10.96.0.10"}},
		{args: []string{"reviews.", "+noedns", "+nocookie"}, status: "NOERROR", flags: "qr aa rd ra",
			answers: []string{"reviews. A 10.96.0.10"}},
		{args: []string{"reviews.mesh", "+tcp", "+norecurse"}, status: "NOERROR", flags: "qr aa ra",
			answers: []string{"reviews.mesh. A 10.96.0.10"}},
		{args: []string{"reviews.mesh.mesh.svc.cluster.local"}, status: "NOERROR", flags: "qr aa rd ra",
			answers: []string{"reviews.mesh.mesh.svc.cluster.local. CNAME reviews.mesh.", "reviews.mesh. A 10.96.0.10"}},
		{args: []string{"reviews.mesh.svc.cluster.local", "AAAA"}, status: "NOERROR", flags: "qr aa rd ra",
			also: []string{"ANSWER: 0,"}},
		{args: []string{"dual.mesh", "AAAA", "+tcp"}, status: "NOERROR", flags: "qr aa rd ra",
			answers: []string{"dual.mesh. AAAA fd00::11"}},
		{args: []string{"foo.wild.example.com"}, status: "NOERROR", flags: "qr aa rd ra",
			answers: []string{"foo.wild.example.com. A 240.240.0.2"}},
		// 100 records: over 512 bytes, dig gets TC and retries over TCP.
		{args: []string{"big.mesh.svc.cluster.local", "+noedns"}, status: "NOERROR", flags: "qr aa rd ra",
			also: []string{"Truncated, retrying in TCP mode.", "ANSWER: 100,"}},
		{args: []string{"outside.example.org"}, status: "NOERROR", flags: "qr rd ra",
			answers: []string{"outside.example.org. A 192.0.2.1"}},
		{args: []string{"outside.example.org", "+tcp", "+norecurse"}, status: "NOERROR", flags: "qr ra",
			answers: []string{"outside.example.org. A 192.0.2.1"}},
		{args: []string{"nowhere.example.org"}, status: "NXDOMAIN", flags: "qr rd ra"},
	} {
		name := strings.Join(c.args, " ")
		args := append([]string{"@" + host, "-p", port, "+tries=1", "+time=5"}, c.args...)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		out, err := exec.CommandContext(ctx, digPath, args...).CombinedOutput()
		cancel()
		text := string(out)
		if err != nil {
			t.Errorf("dig %s: %v\n%s", name, err, text)
			continue
		}
		if !strings.Contains(text, "status: "+c.status+",") {
			t.Errorf("dig %s: want status %s\n%s", name, c.status, text)
		}
		if m := regexp.MustCompile(`;; flags: ([a-z ]*);`).FindStringSubmatch(text); m == nil || m[1] != c.flags {
			t.Errorf("dig %s: flags %q, want %q\n%s", name, m, c.flags, text)
		}
		got := answerSection(text)
		if !sameSet(got, c.answers) && c.answers != nil {
			t.Errorf("dig %s: answers %q, want %q\n%s", name, got, c.answers, text)
		}
		if slices.Contains(c.args, "+tcp") && !strings.Contains(text, "(TCP)") {
			t.Errorf("dig %s: not over TCP\n%s", name, text)
		}
		for _, s := range c.also {
			if !strings.Contains(text, s) {
				t.Errorf("dig %s: output lacks %q\n%s", name, s, text)
			}
		}
		// dig warns of names under .local (mDNS) itself; any other warning
		// (a cookie mismatch, a malformed answer) is the proxy's.
		if w := strings.ReplaceAll(text, "WARNING: .local is reserved for Multicast DNS", ""); strings.Contains(w, "WARNING") || strings.Contains(w, "mismatch") {
			t.Errorf("dig %s: warned\n%s", name, text)
		}
	}
	if cookies.Load() == 0 {
		t.Error("dig sent no EDNS0 cookie: its default queries were not proven")
	}
}

// answerSection returns dig's ANSWER SECTION as "name type data" lines.
func answerSection(out string) []string {
	var lines []string
	in := false
	for line := range strings.Lines(out) {
		line = strings.TrimSpace(line)
		switch {
		case line == ";; ANSWER SECTION:":
			in = true
		case in && line == "":
			return lines
		case in:
			f := strings.Fields(line) // name ttl class type data
			if len(f) == 5 {
				lines = append(lines, f[0]+" "+f[3]+" "+f[4])
			}
		}
	}
	return lines
}

func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// TestDigThroughUpstreamShortcuts: the real dig, through the proxy, of an
// upstream that answers over UDP with a truncated answer cut mid-record
// (and whole over TCP), and refuses one name with a bare FORMERR (no
// question). dig gets the truncated answer, retries over TCP and gets
// every record; and gets FORMERR for the other name; both at once. Before,
// the proxy ignored both answers, and dig timed out.
func TestDigThroughUpstreamShortcuts(t *testing.T) {
	digPath, err := exec.LookPath("dig")
	if err != nil {
		t.Fatalf("dig not found (apt-get install bind9-dnsutils): %v", err)
	}
	pc, ln, upPort := listenBoth(t)
	full := func(q *dns.Msg) *dns.Msg {
		r := new(dns.Msg).SetReply(q)
		for i := range 100 {
			r.Answer = append(r.Answer, &dns.A{Hdr: hdr(q.Question[0].Name, dns.TypeA), A: net.IPv4(192, 0, 2, byte(i+1))})
		}
		return r
	}
	serveUDP(t, pc, func(q *dns.Msg, _ []byte) [][]byte {
		if q.Question[0].Name == "formerr.example.org." {
			bare := new(dns.Msg)
			bare.Id, bare.Response, bare.Rcode = q.Id, true, dns.RcodeFormatError
			b, _ := bare.Pack()
			return [][]byte{b}
		}
		r := full(q)
		r.Truncated = true
		b, _ := r.Pack()
		return [][]byte{b[:500]}
	})
	tcp := &dns.Server{Listener: ln, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) { w.WriteMsg(full(q)) })}
	started := make(chan struct{})
	tcp.NotifyStartedFunc = func() { close(started) }
	go tcp.ActivateAndServe()
	<-started
	t.Cleanup(func() { tcp.Shutdown() })

	up := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(upPort))
	p, _ := newProxy(t, Config{Upstreams: []netip.AddrPort{up}, Timeout: 3 * time.Second})
	host, port, _ := net.SplitHostPort(serve(t, p, client))
	for _, c := range []struct {
		name string
		want []string
	}{
		{"cut.example.org", []string{"Truncated, retrying in TCP mode.", "status: NOERROR,", "ANSWER: 100,"}},
		{"formerr.example.org", []string{"status: FORMERR,", "QUERY: 1,"}},
	} {
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		out, err := exec.CommandContext(ctx, digPath, "@"+host, "-p", port, "+tries=1", "+time=2", c.name).CombinedOutput()
		cancel()
		took := time.Since(start)
		if err != nil {
			t.Errorf("dig %s: %v after %v\n%s", c.name, err, took, out)
			continue
		}
		for _, s := range c.want {
			if !strings.Contains(string(out), s) {
				t.Errorf("dig %s: output lacks %q\n%s", c.name, s, out)
			}
		}
		if took > time.Second {
			t.Errorf("dig %s: took %v, want at once", c.name, took)
		}
	}
}
