package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// hostileServer is a mesh peer with a valid certificate that answers a
// Pool's connection with raw HTTP/2 frames, as a compromised node or
// waypoint could.
type hostileServer struct {
	t      testing.TB
	tc     *tls.Conn // for raw bytes
	fr     *http2.Framer
	enc    *hpack.Encoder
	buf    bytes.Buffer
	frames chan http2.Frame // what the pool sent after its preface, copied
}

// dialHostile returns a Dialer whose connection ends in a hostileServer,
// handed to serve once the TLS handshake and the prefaces are done (the
// server's SETTINGS sent).
func dialHostile(t testing.TB, serve func(hs *hostileServer)) Dialer {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		cli, srvSide := net.Pipe()
		t.Cleanup(func() { srvSide.Close() })
		go serveHostile(t, srvSide, serve)
		return cli, nil
	}
}

// listenHostile is dialHostile's server on loopback TCP at addr (ip:0):
// the Dialer returned connects there, whatever address it is given.
func listenHostile(t testing.TB, addr string, serve func(hs *hostileServer)) Dialer {
	return listenTCP(t, addr, func(c net.Conn) {
		t.Cleanup(func() { c.Close() })
		serveHostile(t, c, serve)
	})
}

// listenTCP listens on loopback TCP at addr (ip:0), until the test ends,
// and hands each connection to handle in a goroutine of its own. The
// Dialer returned connects there, whatever address it is given.
func listenTCP(t testing.TB, addr string, handle func(c net.Conn)) Dialer {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go handle(c)
		}
	}()
	return func(ctx context.Context, network, _ string) (net.Conn, error) {
		return tcpDial(ctx, network, l.Addr().String())
	}
}

// serveHostile does the server's TLS handshake and prefaces on srvSide and
// hands the connection to serve.
func serveHostile(t testing.TB, srvSide net.Conn, serve func(hs *hostileServer)) {
	good, _ := pkis()
	tc := tls.Server(srvSide, good.serverTLS())
	if tc.Handshake() != nil {
		return
	}
	var preface [len(http2.ClientPreface)]byte
	if _, err := io.ReadFull(tc, preface[:]); err != nil {
		return
	}
	hs := &hostileServer{t: t, tc: tc, fr: http2.NewFramer(tc, tc), frames: make(chan http2.Frame, 1<<16)}
	hs.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	hs.enc = hpack.NewEncoder(&hs.buf)
	_ = hs.fr.WriteSettings()
	go func() {
		defer close(hs.frames)
		for {
			f, err := hs.fr.ReadFrame()
			if err != nil {
				return
			}
			select {
			case hs.frames <- copyFrame(f):
			default:
			}
		}
	}()
	serve(hs)
}

// copyFrame keeps what the tests look at of a frame the framer will reuse.
func copyFrame(f http2.Frame) http2.Frame {
	switch f := f.(type) {
	case *http2.RSTStreamFrame:
		c := *f
		return &c
	case *http2.GoAwayFrame:
		return &goAwayCopy{GoAwayFrame: http2.GoAwayFrame{FrameHeader: f.FrameHeader, LastStreamID: f.LastStreamID, ErrCode: f.ErrCode}, debug: string(f.DebugData())}
	case *http2.PingFrame:
		c := *f
		return &c
	}
	return &http2.UnknownFrame{FrameHeader: f.Header()}
}

// goAwayCopy is a GOAWAY copied by copyFrame, with its debug data.
type goAwayCopy struct {
	http2.GoAwayFrame
	debug string
}

// awaitRequest waits for the pool's HEADERS opening stream id: an answer
// before it is for an idle stream, a connection error (PROTOCOL_ERROR) that
// tests of other misbehaviour must not provoke (a race seen in CI's race
// runs, where the pool had not sent its request yet).
func (hs *hostileServer) awaitRequest(id uint32) error {
	for f := range hs.frames {
		if f.Header().Type == http2.FrameHeaders && f.Header().StreamID == id {
			return nil
		}
	}
	return fmt.Errorf("connection ended before the request on stream %d", id)
}

// headers writes a header block with fields on stream id.
func (hs *hostileServer) headers(id uint32, end bool, fields ...hpackField) error {
	hs.buf.Reset()
	for _, f := range fields {
		_ = hs.enc.WriteField(f)
	}
	return hs.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hs.buf.Bytes(), EndHeaders: true, EndStream: end})
}

// answerAfter reports the first frame the pool sent that match accepts,
// or nil when the pool acked a PING sent now first (it kept going) or the
// connection ended.
func (hs *hostileServer) answerAfter(match func(http2.Frame) bool) http2.Frame {
	end := [8]byte{'e', 'n', 'd'}
	_ = hs.fr.WritePing(false, end)
	timeout := time.After(5 * time.Second)
	for {
		select {
		case f, ok := <-hs.frames:
			if !ok {
				return nil
			}
			if p, isPing := f.(*http2.PingFrame); isPing && p.IsAck() && p.Data == end {
				return nil
			}
			if match(f) {
				return f
			}
		case <-timeout:
			hs.t.Error("timed out waiting for the pool's answer")
			return nil
		}
	}
}

func hostileKey() PoolKey {
	return PoolKey{Src: "pod", SrcIdentity: "a", DstIdentity: "b", DstAddr: netip.MustParseAddrPort("10.0.0.2:15008")}
}

// connectHostile opens a stream through pool to the hostile server dial
// reaches, under hostileKey.
func connectHostile(ctx context.Context, pool *Pool, dial Dialer) (*Stream, error) {
	good, _ := pkis()
	return pool.Connect(ctx, hostileKey(), dial, good.clientTLS(), Request{Authority: netip.MustParseAddrPort("10.0.0.3:80")})
}

// connectAndClose is connectHostile for a test that wants only its error:
// a stream that did open is closed at once.
func connectAndClose(ctx context.Context, pool *Pool, dial Dialer) error {
	s, err := connectHostile(ctx, pool, dial)
	if s != nil {
		s.Close()
	}
	return err
}

// hostilePool is a Pool with the default options, closed when the test
// ends.
func hostilePool(t testing.TB) *Pool {
	pool := NewPool(PoolOptions{})
	t.Cleanup(func() { _ = pool.Close() })
	return pool
}

// stream1ResetOrGoAway matches the pool's answer to a server's stream
// error on stream 1: its RST_STREAM, or a GOAWAY if it took it for the
// connection's.
func stream1ResetOrGoAway(f http2.Frame) bool {
	_, rst := f.(*http2.RSTStreamFrame)
	_, ga := f.(*goAwayCopy)
	return (rst && f.Header().StreamID == 1) || ga
}

// dialSendAfterRequest returns a Dialer whose hostile server, once the
// pool's request on stream 1 came, does send, and a channel that gets the
// pool's first answer that match accepts (nil if there was none, or the
// request or send failed).
func dialSendAfterRequest(t testing.TB, send func(hs *hostileServer) error, match func(http2.Frame) bool) (Dialer, <-chan http2.Frame) {
	result := make(chan http2.Frame, 1)
	dial := dialHostile(t, func(hs *hostileServer) {
		if hs.awaitRequest(1) != nil || send(hs) != nil {
			result <- nil
			return
		}
		result <- hs.answerAfter(match)
	})
	return dial, result
}

// isGoAway matches the pool's GOAWAY.
func isGoAway(f http2.Frame) bool {
	_, ga := f.(*goAwayCopy)
	return ga
}

// TestClientInterimResponseFlood: a server that answers a CONNECT with
// informational (1xx) responses, one after another, gets the stream reset
// with PROTOCOL_ERROR after a few, as net/http's client does (5), and the
// Connect fails at once. Before the fix the client read any number of them
// (each an HPACK decode, answered by nothing) until its connect timeout.
func TestClientInterimResponseFlood(t *testing.T) {
	interims := func(hs *hostileServer) error {
		for range 1000 {
			if hs.headers(1, false, hpackField{Name: ":status", Value: "100"}) != nil {
				break
			}
		}
		return nil // as far as the pool let it: the answer tells
	}
	dial, result := dialSendAfterRequest(t, interims, stream1ResetOrGoAway)
	pool := hostilePool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	connected := make(chan error, 1)
	go func() { connected <- connectAndClose(ctx, pool, dial) }()
	f := <-result
	rst, ok := f.(*http2.RSTStreamFrame)
	if !ok || rst.ErrCode != http2.ErrCodeProtocol {
		t.Fatalf("the pool answered 1000 interim responses with %#v, want RST_STREAM PROTOCOL_ERROR on stream 1", f)
	}
	if err := <-connected; err == nil {
		t.Error("Connect succeeded")
	}
}

// TestClientHeadersOnClosedStreamsFlood: HEADERS for a stream the client
// gave up on (here: reset after a 403) are dropped within the junk
// budget, and a flood of them closes the connection with GOAWAY
// ENHANCE_YOUR_CALM, counted in PoolStats.FloodCloses. Before the fix they
// were dropped for free, any number of them, as was a flood of PINGs'
// cost, unseen: the client counted no flood.
func TestClientHeadersOnClosedStreamsFlood(t *testing.T) {
	good, _ := pkis()
	result := make(chan http2.Frame, 1)
	dial := dialHostile(t, func(hs *hostileServer) {
		if err := hs.awaitRequest(1); err != nil {
			result <- nil
			return
		}
		_ = hs.headers(1, true, hpackField{Name: ":status", Value: "403"})
		// The client resets the stream it is done with: from then on it
		// has forgotten it.
		for f := range hs.frames {
			if _, rst := f.(*http2.RSTStreamFrame); rst && f.Header().StreamID == 1 {
				break
			}
		}
		for range 3 * junkBurst {
			if hs.headers(1, true, hpackField{Name: ":status", Value: "200"}) != nil {
				break
			}
		}
		result <- hs.answerAfter(isGoAway)
	})
	pool := hostilePool(t)
	_, err := pool.Connect(context.Background(), hostileKey(), dial, good.clientTLS(), Request{Authority: netip.MustParseAddrPort("10.0.0.3:80")})
	if err == nil {
		t.Fatal("Connect succeeded on a 403")
	}
	f := <-result
	ga, ok := f.(*goAwayCopy)
	if !ok || ga.ErrCode != http2.ErrCodeEnhanceYourCalm {
		t.Fatalf("the pool answered %d HEADERS on a closed stream with %#v, want GOAWAY ENHANCE_YOUR_CALM", 3*junkBurst, f)
	}
	if st := pool.Stats(); st.FloodCloses != 1 {
		t.Errorf("FloodCloses = %d, want 1", st.FloodCloses)
	}
}

// TestClientRefusesServerPush: a server that sets SETTINGS_ENABLE_PUSH to
// 1 breaks the protocol (RFC 9113 §6.5.2: a connection error
// PROTOCOL_ERROR). Before the fix the client ignored it.
func TestClientRefusesServerPush(t *testing.T) {
	result := make(chan http2.Frame, 1)
	dial := dialHostile(t, func(hs *hostileServer) {
		_ = hs.fr.WriteSettings(http2.Setting{ID: http2.SettingEnablePush, Val: 1})
		result <- hs.answerAfter(isGoAway)
	})
	pool := hostilePool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	go func() { _ = connectAndClose(ctx, pool, dial) }()
	f := <-result
	if ga, ok := f.(*goAwayCopy); !ok || ga.ErrCode != http2.ErrCodeProtocol {
		t.Fatalf("the pool answered ENABLE_PUSH 1 with %#v, want GOAWAY PROTOCOL_ERROR", f)
	}
}

// TestClientZeroStreamLimitConnsDrain: a server that sets
// SETTINGS_MAX_CONCURRENT_STREAMS to 0 can never be given another stream
// on that connection, so the pool drains it: it closes once its streams
// ended, counted in PoolStats.ZeroStreamLimitDrains. Before the fix such a
// connection stayed pooled, idle and useless, until the idle timeout (30 s),
// and every Connect to that server dialled one more: a server (a
// compromised node or waypoint) answering each stream so made the pool
// hold a connection, two goroutines and a share of the source pod's
// receive-window budget per request of the last 30 s.
func TestClientZeroStreamLimitConnsDrain(t *testing.T) {
	dial := dialHostile(t, func(hs *hostileServer) {
		_ = hs.fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 0})
		if hs.awaitRequest(1) != nil {
			return
		}
		_ = hs.headers(1, true, hpackField{Name: ":status", Value: "403"})
		for range hs.frames { // hold the connection until the pool closes it
		}
	})
	pool := hostilePool(t)
	const n = 20
	for range n {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := connectHostile(ctx, pool, dial)
		cancel()
		// The 403, or, when the SETTINGS came before the request went
		// out, a connection going away each of the three tries.
		if err == nil {
			t.Fatal("Connect succeeded")
		}
	}
	waitfor.Until(t, "no connection to a server that takes no stream left in the pool", func() bool { return pool.Stats().Conns == 0 })
	if st := pool.Stats(); st.ZeroStreamLimitDrains != st.DialsTotal || st.DialsTotal < n {
		t.Errorf("ZeroStreamLimitDrains = %d, DialsTotal = %d, want both the same and at least %d", st.ZeroStreamLimitDrains, st.DialsTotal, n)
	}
}

// TestClientStreamErrorCountsUntilResetWritten: a stream the client resets
// for a stream error of the server's (here a malformed :status) counts
// toward the server's limit until its RST_STREAM is written, as one reset
// by Close does (TestClientCountsStreamUntilEndOrResetWritten). Before, the
// reader's reset freed the slot at once: the next Connect's HEADERS could
// reach a server with a limit of 1 before that RST_STREAM, one stream too
// many there.
func TestClientStreamErrorCountsUntilResetWritten(t *testing.T) {
	const n = 300
	type result struct{ early, checked int }
	done := make(chan result, 1)
	dial := dialHostile(t, func(hs *hostileServer) {
		_ = hs.fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 1})
		acks := 0
		open := map[uint32]bool{} // streams answered and not yet reset by the client
		var r result
		defer func() { done <- r }()
		for f := range hs.frames {
			h := f.Header()
			switch h.Type {
			case http2.FrameSettings:
				if h.Flags.Has(http2.FlagSettingsAck) {
					acks++
				}
			case http2.FrameRSTStream:
				delete(open, h.StreamID)
			case http2.FrameHeaders:
				if acks >= 2 { // the client knows the limit of 1
					r.checked++
					if len(open) > 0 {
						r.early++
					}
				}
				open[h.StreamID] = true
				if hs.headers(h.StreamID, false, hpackField{Name: ":status", Value: "abc"}) != nil || r.checked == n {
					return
				}
			}
		}
	})
	pool := NewPool(PoolOptions{ConnsPerKey: 1})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(stop)
	defer pool.Close()
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			s, err := connectHostile(ctx, pool, dial)
			cancel()
			if s != nil {
				s.Close()
			}
			if err == nil {
				t.Error("Connect succeeded on a malformed response")
				return
			}
		}
	}()
	var r result
	select {
	case r = <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("timed out")
	}
	if r.checked < n {
		t.Fatalf("the server saw %d requests, want %d", r.checked, n)
	}
	if r.early != 0 {
		t.Errorf("%d of %d requests reached a server with a limit of 1 before the reset of the stream before them", r.early, r.checked)
	}
}

// TestClientMalformedResponsesRefusedWithReason: a server's answer that
// breaks the protocol fails the Connect with an error that names what was
// wrong, and the stream is reset with PROTOCOL_ERROR. Before the fix the
// error said only "hbone stream reset: PROTOCOL_ERROR", and a response
// whose header list was over our SETTINGS_MAX_HEADER_LIST_SIZE (x/net's
// framer drops the fields past it, marking the frame truncated) was taken
// as the server's answer: a 200 with a dropped reason header, or with
// any field the agent would read from it gone, established the tunnel.
func TestClientMalformedResponsesRefusedWithReason(t *testing.T) {
	big := make([]hpackField, 0, 40)
	for i := range 40 {
		big = append(big, hpackField{Name: fmt.Sprintf("x-big-%d", i), Value: string(bytes.Repeat([]byte{'a'}, 1000))})
	}
	for _, tc := range []struct {
		name   string
		send   func(hs *hostileServer) error
		naming string
	}{
		{"header list over the limit", func(hs *hostileServer) error {
			return hs.headers(1, false, append([]hpackField{{Name: ":status", Value: "200"}}, big...)...)
		}, "SETTINGS_MAX_HEADER_LIST_SIZE"},
		{"status not a number", func(hs *hostileServer) error {
			return hs.headers(1, false, hpackField{Name: ":status", Value: "abc"})
		}, `:status "abc"`},
		{"status with a sign", func(hs *hostileServer) error {
			return hs.headers(1, false, hpackField{Name: ":status", Value: "+200"})
		}, `:status "+200"`},
		{"interim response ending the stream", func(hs *hostileServer) error {
			return hs.headers(1, true, hpackField{Name: ":status", Value: "103"})
		}, "informational (103) response ends the stream"},
		{"DATA before the response", func(hs *hostileServer) error {
			return hs.fr.WriteData(1, false, []byte("x"))
		}, "DATA before the response"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dial, result := dialSendAfterRequest(t, tc.send, stream1ResetOrGoAway)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			err := connectAndClose(ctx, hostilePool(t), dial)
			var rerr *ResetError
			if !errors.As(err, &rerr) || rerr.Remote || rerr.Code != http2.ErrCodeProtocol {
				t.Fatalf("Connect = %v, want a local reset with PROTOCOL_ERROR", err)
			}
			if !strings.Contains(err.Error(), tc.naming) {
				t.Errorf("Connect error %q does not name what was wrong (%q)", err, tc.naming)
			}
			f := <-result
			if rst, ok := f.(*http2.RSTStreamFrame); !ok || rst.ErrCode != http2.ErrCodeProtocol {
				t.Errorf("the pool answered with %#v, want RST_STREAM PROTOCOL_ERROR on stream 1", f)
			}
		})
	}
}

// TestClientWindowShareOfOneServerBounded: a server that takes one stream
// per connection (SETTINGS_MAX_CONCURRENT_STREAMS 1) and holds its streams
// open makes the source pod open a connection per stream, and each reserved
// a full receive window from the pod's share of the window budget. Before
// the fix eight such streams spent the whole share, and every connection
// the pod opened afterwards, to any other server, got HTTP/2's initial
// 64 KiB window for its life (slow on any path with some latency). Now the
// connections of one source to one server reserve at most half the
// source's share.
func TestClientWindowShareOfOneServerBounded(t *testing.T) {
	saved := windows
	windows = newWindowBudget(maxReservedWindow, maxPeerWindow)
	windows.perRemote = maxRemoteWindow
	t.Cleanup(func() { windows = saved })

	env := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	upstream := startUpstream(t, echo)
	hostile := listenHostile(t, "127.0.0.2:0", func(hs *hostileServer) {
		_ = hs.fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 1})
		for f := range hs.frames {
			if f.Header().Type == http2.FrameHeaders {
				// Answered, and held open for good.
				_ = hs.headers(f.Header().StreamID, false, hpackField{Name: ":status", Value: "200"})
			}
		}
	})
	good, _ := pkis()
	key := PoolKey{SrcIdentity: "a", DstIdentity: "b", DstAddr: netip.MustParseAddrPort("127.0.0.2:15008")}
	const held = 12
	for i := range held {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		s, err := env.pool.Connect(ctx, key, hostile, good.clientTLS(), Request{Authority: netip.MustParseAddrPort("10.0.0.3:80")})
		cancel()
		if err != nil {
			t.Fatalf("stream %d to the server that takes one stream per connection: %v", i, err)
		}
		t.Cleanup(func() { s.Close() })
	}
	if st := env.pool.Stats(); st.Conns != held {
		t.Fatalf("%d connections to the server, want one per stream (%d)", st.Conns, held)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := env.connect(ctx, upstream)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.c.mu.Lock()
	got := s.c.recvTarget
	s.c.mu.Unlock()
	if got != connWindow {
		t.Errorf("a connection to another server, opened after %d streams held by one that takes one per connection, has a receive window of %d, want %d", held, got, connWindow)
	}
}

// TestClientUnansweredConnectBounded: a server that takes the CONNECT and
// never answers, nor sends anything else, holds the Connect only until its
// deadline, which fails naming what it waited for, and the connection,
// drained, leaves the pool once the stream's reset went out: nothing of the
// client's stays with it. Before, the error was a bare "context deadline
// exceeded", the same as a dial or a TLS handshake that timed out.
func TestClientUnansweredConnectBounded(t *testing.T) {
	reset := make(chan bool, 1)
	dial := dialHostile(t, func(hs *hostileServer) {
		if hs.awaitRequest(1) != nil {
			reset <- false
			return
		}
		for f := range hs.frames {
			if f.Header().Type == http2.FrameRSTStream && f.Header().StreamID == 1 {
				reset <- true
				for range hs.frames {
				}
				return
			}
		}
		reset <- false
	})
	pool := hostilePool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := connectHostile(ctx, pool, dial)
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("Connect returned after %v, its deadline was 300ms", took)
	}
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "no response to the CONNECT") {
		t.Errorf("Connect = %v, want a deadline error naming the unanswered CONNECT", err)
	}
	if !<-reset {
		t.Error("the unanswered stream was not reset")
	}
	waitfor.Until(t, "the connection to a server that answers nothing left the pool", func() bool {
		st := pool.Stats()
		return st.Conns == 0 && st.ActiveStreams == 0
	})
}

// TestClientBoundsServerHandshake: a server whose TLS handshake carries
// hundreds of certificates fails the dial once it sent more than
// maxServerHandshake, before crypto/tls parsed them all, with an error
// that says so. Before, the client read all of a Certificate message of up
// to 256 KiB and parsed every certificate in it (here about 600), on every
// dial to that server, before the chain could be refused for its length.
func TestClientBoundsServerHandshake(t *testing.T) {
	good, _ := pkis()
	leaf := good.leaf.Certificate[0]
	chain := [][]byte{leaf}
	for len(chain) < 600 {
		chain = append(chain, leaf)
	}
	conf := good.serverTLS()
	conf.Certificates = []tls.Certificate{{Certificate: chain, PrivateKey: good.leaf.PrivateKey}}
	// TCP, not a pipe: the client writes while the server writes its
	// flight, as crypto/tls does (its ChangeCipherSpec).
	dial := listenTCP(t, "127.0.0.1:0", func(c net.Conn) {
		defer c.Close()
		_ = tls.Server(c, conf).Handshake()
		_, _ = io.Copy(io.Discard, c)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := connectHostile(ctx, hostilePool(t), dial)
	if !errors.Is(err, errServerHandshakeTooLarge) {
		t.Fatalf("Connect to a server sending %d certificates = %v, want %v", len(chain), err, errServerHandshakeTooLarge)
	}
}

// TestClientConnectionErrorsExplained: a server that breaks the protocol in
// a way only a server can is told why in our GOAWAY's debug data, and the
// Connect's error says the same. Before, both said only PROTOCOL_ERROR.
func TestClientConnectionErrorsExplained(t *testing.T) {
	for _, tc := range []struct {
		name, naming string
		send         func(hs *hostileServer) error
	}{
		{"push promise", "PUSH_PROMISE", func(hs *hostileServer) error {
			hs.buf.Reset()
			_ = hs.enc.WriteField(hpackField{Name: ":method", Value: "GET"})
			return hs.fr.WritePushPromise(http2.PushPromiseParam{StreamID: 1, PromiseID: 2, BlockFragment: hs.buf.Bytes(), EndHeaders: true})
		}},
		{"enable push", "SETTINGS_ENABLE_PUSH", func(hs *hostileServer) error {
			return hs.fr.WriteSettings(http2.Setting{ID: http2.SettingEnablePush, Val: 1})
		}},
		{"response on a stream never opened", "never opened", func(hs *hostileServer) error {
			return hs.headers(3, true, hpackField{Name: ":status", Value: "200"})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dial, result := dialSendAfterRequest(t, tc.send, isGoAway)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			pool := hostilePool(t)
			err := connectAndClose(ctx, pool, dial)
			if err == nil || !strings.Contains(err.Error(), tc.naming) {
				t.Errorf("Connect = %v, want an error naming %q", err, tc.naming)
			}
			ga, ok := (<-result).(*goAwayCopy)
			if !ok || ga.ErrCode != http2.ErrCodeProtocol || !strings.Contains(ga.debug, tc.naming) {
				t.Errorf("the pool answered with %#v, want GOAWAY PROTOCOL_ERROR naming %q", ga, tc.naming)
			}
			// Counted as such (redirector_hbone_pool_protocol_error_closes_total).
			if st := pool.Stats(); st.ProtocolErrorCloses != 1 || st.FloodCloses != 0 {
				t.Errorf("ProtocolErrorCloses = %d, FloodCloses = %d, want 1 and 0", st.ProtocolErrorCloses, st.FloodCloses)
			}
		})
	}
}
