package netnstest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"golang.org/x/sys/unix"

	"github.com/redirector-mesh/redirector/pkg/identity"
	"github.com/redirector-mesh/redirector/pkg/netns"
)

// procUsage is what a process holds: open file descriptors and resident
// memory.
type procUsage struct {
	FDs int
	RSS int64 // bytes
}

func readProcUsage(pid int) (procUsage, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return procUsage{}, err
	}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return procUsage{}, err
	}
	u := procUsage{FDs: len(ents)}
	for _, line := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			u.RSS = kb << 10
		}
	}
	return u, nil
}

// usageSampler records the peak usage of a process until stopped.
type usageSampler struct {
	mu   sync.Mutex
	peak procUsage
	err  error
	stop chan struct{}
	done chan struct{}
}

func sampleUsage(pid int) *usageSampler {
	s := &usageSampler{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			u, err := readProcUsage(pid)
			s.mu.Lock()
			if err != nil && s.err == nil {
				s.err = err
			}
			s.peak.FDs = max(s.peak.FDs, u.FDs)
			s.peak.RSS = max(s.peak.RSS, u.RSS)
			s.mu.Unlock()
			select {
			case <-tick.C:
			case <-s.stop:
				return
			}
		}
	}()
	return s
}

// Stop ends sampling and returns the peak and the first error (the
// process died).
func (s *usageSampler) Stop() (procUsage, error) {
	close(s.stop)
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.peak, s.err
}

// agentPID is the agent's process id (nsenter execs it in place).
func agentPID(a *Agent) int { return a.cmd.Process.Pid }

// countingApp listens on port in pod p and counts the connections it
// accepts; each is read to its end and closed.
func countingApp(t *testing.T, p *Pod, port int) *atomic.Int64 {
	t.Helper()
	l, err := netns.Listen(context.Background(), p.Path(), "tcp", fmt.Sprintf("[::]:%d", port), netns.SocketOptions{})
	if err != nil {
		t.Fatalf("listen on %s:%d: %v", p.Name, port, err)
	}
	var n atomic.Int64
	var wg sync.WaitGroup
	t.Cleanup(func() { l.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			n.Add(1)
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				var b [512]byte
				for {
					if _, err := c.Read(b[:]); err != nil {
						return
					}
				}
			}()
		}
	}()
	return &n
}

// workloadTLS is a client TLS config with a workload certificate for
// ns/sa minted from the test's file CA: a client the mesh authenticates.
// It does not check the server (an attacker would not care).
func workloadTLS(t *testing.T, caDir, ns, sa string) *tls.Config {
	t.Helper()
	ca, err := identity.LoadCA(caDir)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := ca.Sign(context.Background(), identity.ID{TrustDomain: ca.TrustDomain(), Namespace: ns, ServiceAccount: sa}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Config{Certificates: []tls.Certificate{*cert}, InsecureSkipVerify: true, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13}
}

// floodResult is what a rapid-reset flood achieved.
type floodResult struct {
	Pairs   int // HEADERS+RST_STREAM pairs the server acknowledged reading
	Conns   int // connections it took
	Calmed  int // connections the server closed with GOAWAY ENHANCE_YOUR_CALM
	Refused int // handshakes the server refused (its per-source handshake rate)
}

// rapidReset sends pairs HEADERS(CONNECT target)+RST_STREAM pairs to
// hbone from the namespace at from, as fast as it can write, over as many
// connections as it takes, for at most floodFor: when the server closes one,
// it dials again, and when the server refuses a handshake (once the source's
// early resets spent their budget, every new connection is closed at its
// first reset, and the source soon dials faster than its handshake rate), it
// tries again 10 ms later, as a real attacker would. Everything the server
// sends is read and dropped.
func rapidReset(ctx context.Context, from string, hbone, target netip.AddrPort, conf *tls.Config, pairs int, floodFor time.Duration) (floodResult, error) {
	var res floodResult
	end := time.Now().Add(floodFor)
	for res.Pairs < pairs && ctx.Err() == nil && time.Now().Before(end) {
		raw, err := netns.Dial(ctx, from, "tcp", hbone.String(), netns.SocketOptions{})
		if err != nil {
			return res, fmt.Errorf("dial %v after %d pairs: %w", hbone, res.Pairs, err)
		}
		res.Conns++
		tc := tls.Client(raw, conf)
		if err := tc.HandshakeContext(ctx); err != nil {
			raw.Close()
			if ctx.Err() != nil {
				break
			}
			res.Refused++
			time.Sleep(10 * time.Millisecond)
			continue
		}
		calm := make(chan bool, 1)
		acks := make(chan struct{}, 16)
		go func() { // read (and drop) all the server sends; note its GOAWAY
			fr := http2.NewFramer(nil, tc)
			fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
			got := false
			for {
				f, err := fr.ReadFrame()
				if err != nil {
					close(acks)
					calm <- got
					return
				}
				switch f := f.(type) {
				case *http2.GoAwayFrame:
					got = got || f.ErrCode == http2.ErrCodeEnhanceYourCalm
				case *http2.PingFrame:
					if f.IsAck() {
						acks <- struct{}{}
					}
				}
			}
		}()
		var w bytes.Buffer
		fr := http2.NewFramer(&w, nil)
		var hb bytes.Buffer
		enc := hpack.NewEncoder(&hb)
		w.WriteString(http2.ClientPreface)
		_ = fr.WriteSettings()
		id := uint32(1)
		for alive := true; alive && res.Pairs < pairs; {
			// 32 pairs in one write, as a flood tool would, then a PING:
			// its ack says the server read them, so the count is of pairs
			// the server processed, not of bytes stuck in socket buffers.
			for range 32 {
				hb.Reset()
				_ = enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
				_ = enc.WriteField(hpack.HeaderField{Name: ":authority", Value: target.String()})
				_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hb.Bytes(), EndHeaders: true})
				_ = fr.WriteRSTStream(id, http2.ErrCodeCancel)
				id += 2
			}
			_ = fr.WritePing(false, [8]byte{})
			_ = tc.SetWriteDeadline(time.Now().Add(5 * time.Second))
			if _, err := tc.Write(w.Bytes()); err != nil {
				break
			}
			w.Reset()
			select {
			case _, ok := <-acks:
				if alive = ok; ok {
					res.Pairs += 32
				}
			case <-time.After(5 * time.Second):
				alive = false
			}
		}
		tc.Close()
		if <-calm {
			res.Calmed++
		}
	}
	return res, ctx.Err()
}

// timedCurl fetches url from pod p and returns how long it took.
func timedCurl(p *Pod, url string) (time.Duration, string, error) {
	start := time.Now()
	out, err := Curl(p, url)
	return time.Since(start), out, err
}

// The idle-connection flood needs more sockets than one process may open
// (RLIMIT_NOFILE is 20000 here and cannot be raised without
// CAP_SYS_RESOURCE), so it runs in helper processes: this test binary
// again, started inside the source pod's namespace with envIdleFlood set,
// which opens the connections, prints how many, and holds them until its
// stdin closes.
const envIdleFlood = "REDIRECTOR_TEST_IDLE_FLOOD" // "<dst ip:port> <count>"

func init() {
	if v := os.Getenv(envIdleFlood); v != "" {
		os.Exit(idleFloodMain(v))
	}
}

func idleFloodMain(arg string) int {
	var dst string
	var n int
	if _, err := fmt.Sscan(arg, &dst, &n); err != nil {
		fmt.Fprintln(os.Stderr, "bad", envIdleFlood, arg, err)
		return 2
	}
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err == nil {
		lim.Cur = lim.Max
		_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)
	}
	const workers = 32
	var (
		mu     sync.Mutex
		conns  []net.Conn
		failed int
		wg     sync.WaitGroup
		next   atomic.Int64
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d := net.Dialer{Timeout: 3 * time.Second}
			for next.Add(1) <= int64(n) {
				c, err := d.Dial("tcp", dst)
				mu.Lock()
				if err != nil {
					failed++
				} else {
					conns = append(conns, c)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	fmt.Printf("opened %d failed %d\n", len(conns), failed)
	_, _ = io.Copy(io.Discard, os.Stdin) // hold them until told
	return 0
}

// idleFlood is a running idle-connection flood.
type idleFlood struct {
	procs  []*exec.Cmd
	stdins []io.WriteCloser
}

// startIdleFlood opens n idle TCP connections from the namespace at from
// to dst, over helper processes of at most 10000 each, and returns once all
// are open (or failed) with the counts. Stop ends it, also after an error.
func startIdleFlood(from string, dst netip.AddrPort, n int) (f *idleFlood, opened, failed int, err error) {
	f = &idleFlood{}
	var outs []*bufio.Reader
	for left := n; left > 0; left -= 10000 {
		cmd := Command(context.Background(), from, os.Args[0])
		cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %d", envIdleFlood, dst, min(left, 10000)))
		in, err := cmd.StdinPipe()
		if err != nil {
			return f, 0, 0, err
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			return f, 0, 0, err
		}
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			return f, 0, 0, err
		}
		f.procs = append(f.procs, cmd)
		f.stdins = append(f.stdins, in)
		outs = append(outs, bufio.NewReader(out))
	}
	for _, r := range outs {
		line, err := r.ReadString('\n')
		if err != nil {
			return f, opened, failed, fmt.Errorf("idle flood helper: %w", err)
		}
		var o, fl int
		if _, err := fmt.Sscanf(line, "opened %d failed %d", &o, &fl); err != nil {
			return f, opened, failed, fmt.Errorf("idle flood helper said %q: %w", line, err)
		}
		opened, failed = opened+o, failed+fl
	}
	return f, opened, failed, nil
}

// Stop closes the helpers' connections and waits for them to exit.
func (f *idleFlood) Stop() {
	for _, in := range f.stdins {
		_ = in.Close()
	}
	for _, p := range f.procs {
		_ = p.Wait()
	}
	f.procs, f.stdins = nil, nil
}
