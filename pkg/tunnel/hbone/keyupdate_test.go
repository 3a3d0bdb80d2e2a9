package hbone

import (
	"bufio"
	"bytes"
	"context"
	"crypto"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	_ "crypto/sha256"
	_ "crypto/sha512"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// tls13Writer writes TLS 1.3 records with the traffic secret of one
// direction, as a peer that took its socket over from crypto/tls after the
// handshake: it can send what crypto/tls never would, KeyUpdate messages
// that ask for an update in return.
type tls13Writer struct {
	w      io.Writer
	hash   crypto.Hash
	keyLen int
	secret []byte
	aead   cipher.AEAD
	iv     []byte
	seq    uint64
}

// expandLabel is HKDF-Expand-Label (RFC 8446 §7.1) with an empty context.
func expandLabel(h crypto.Hash, secret []byte, label string, n int) []byte {
	full := "tls13 " + label
	info := []byte{byte(n >> 8), byte(n), byte(len(full))}
	info = append(info, full...)
	info = append(info, 0)
	out, err := hkdf.Expand(h.New, secret, string(info), n)
	if err != nil {
		panic(err)
	}
	return out
}

func newTLS13Writer(w io.Writer, suite uint16, secret []byte) (*tls13Writer, error) {
	tw := &tls13Writer{w: w}
	switch suite {
	case tls.TLS_AES_128_GCM_SHA256:
		tw.hash, tw.keyLen = crypto.SHA256, 16
	case tls.TLS_AES_256_GCM_SHA384:
		tw.hash, tw.keyLen = crypto.SHA384, 32
	default:
		return nil, fmt.Errorf("cipher suite %s not supported by the test", tls.CipherSuiteName(suite))
	}
	tw.setSecret(secret)
	return tw, nil
}

func (tw *tls13Writer) setSecret(secret []byte) {
	tw.secret = secret
	block, err := aes.NewCipher(expandLabel(tw.hash, secret, "key", tw.keyLen))
	if err != nil {
		panic(err)
	}
	tw.aead, _ = cipher.NewGCM(block)
	tw.iv = expandLabel(tw.hash, secret, "iv", 12)
	tw.seq = 0
}

// record encrypts one record of inner content type typ into buf.
func (tw *tls13Writer) record(buf *bytes.Buffer, typ byte, content []byte) {
	plain := append(append([]byte(nil), content...), typ)
	n := len(plain) + tw.aead.Overhead()
	hdr := []byte{23, 3, 3, byte(n >> 8), byte(n)}
	nonce := append([]byte(nil), tw.iv...)
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], tw.seq)
	for i := range seq {
		nonce[4+i] ^= seq[i]
	}
	tw.seq++
	buf.Write(hdr)
	buf.Write(tw.aead.Seal(nil, nonce, plain, hdr))
}

// keyUpdate adds a KeyUpdate record that requests an update in return,
// then moves on to the next traffic secret.
func (tw *tls13Writer) keyUpdate(buf *bytes.Buffer) {
	tw.record(buf, 22, []byte{24, 0, 0, 1, 1})
	tw.setSecret(expandLabel(tw.hash, tw.secret, "traffic upd", tw.hash.Size()))
}

// keyUpdateFlood writes at least n KeyUpdates that ask for one in return to
// w, 15 at a time with a byte of application data between (crypto/tls wants
// some after every 16), until n are sent or a write fails; it returns how
// many were sent.
func (tw *tls13Writer) keyUpdateFlood(w io.Writer, n int) int {
	var rec bytes.Buffer
	sent := 0
	for sent < n {
		rec.Reset()
		for range 15 {
			tw.keyUpdate(&rec)
			sent++
		}
		tw.record(&rec, 23, []byte{0})
		if _, err := w.Write(rec.Bytes()); err != nil {
			break
		}
	}
	return sent
}

// keyLog captures the client's application traffic secret from a
// KeyLogWriter.
type keyLog struct{ secret []byte }

func (k *keyLog) Write(p []byte) (int, error) {
	if f := strings.Fields(string(p)); len(f) == 3 && f[0] == "CLIENT_TRAFFIC_SECRET_0" {
		k.secret, _ = hex.DecodeString(f[2])
	}
	return len(p), nil
}

// TestKeyUpdateFlood: TLS 1.3 KeyUpdate messages that request an update in
// return are frames of the TLS layer that cost the server a key derivation
// each way and a record write (a system call), and carry nothing: a client
// that sends them in a flood is closed like one that floods PINGs, and
// counted in ServerStats.ConnsFlood. crypto/tls answers every one, checking
// only that no more than 16 come in a row without application data, and one
// byte of a DATA frame (to a stream already closed, which costs no budget)
// between them is enough. Before the fix the server answered all of them.
func TestKeyUpdateFlood(t *testing.T) {
	good, _ := pkis()
	srv, addr := serveLoopback(t, ServerOptions{TLSConfig: good.serverTLS(), Handler: func(_ context.Context, req *ServerRequest) Response {
		return Response{Status: 403}
	}})
	raw, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	kl := &keyLog{}
	conf := good.clientTLS()
	conf.NextProtos = []string{"h2"}
	conf.KeyLogWriter = kl
	tc := tls.Client(raw, conf)
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	tw, err := newTLS13Writer(raw, tc.ConnectionState().CipherSuite, kl.secret)
	if err != nil {
		t.Skip(err)
	}
	// What the server sends is read and dropped (its records stay
	// encrypted to us): only whether it closes the connection counts.
	closed := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, raw)
		close(closed)
	}()

	// The preface, SETTINGS and a CONNECT that is refused; then a DATA
	// frame on that stream, closed by then, sent a byte at a time.
	var h2 bytes.Buffer
	h2.WriteString(http2.ClientPreface)
	fr := http2.NewFramer(&h2, nil)
	_ = fr.WriteSettings()
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	_ = enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
	_ = enc.WriteField(hpack.HeaderField{Name: ":authority", Value: "127.0.0.1:1"})
	_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
	var rec bytes.Buffer
	tw.record(&rec, 23, h2.Bytes())
	if _, err := raw.Write(rec.Bytes()); err != nil {
		t.Fatal(err)
	}
	waitfor.Until(t, "the CONNECT refused", func() bool { return srv.Stats().StreamsDenied == 1 })
	var dataLen = 1 << 16
	var hdr [frameHeaderLen]byte
	hdr[0], hdr[1], hdr[2], hdr[3], hdr[8] = byte(dataLen>>16), byte(dataLen>>8), byte(dataLen), byte(http2.FrameData), 1
	rec.Reset()
	tw.record(&rec, 23, hdr[:])
	_, _ = raw.Write(rec.Bytes())

	bw := bufio.NewWriterSize(raw, 64<<10)
	sent := tw.keyUpdateFlood(bw, 10*junkBurst)
	_ = bw.Flush()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatalf("the server still serves a connection that sent %d KeyUpdates asking for one in return, want it closed as a flood", sent)
	}
	if st := srv.Stats(); st.ConnsFlood != 1 {
		t.Errorf("ConnsFlood = %d, want 1", st.ConnsFlood)
	}
}

// TestTLSAnswersHonestTraffic: the count behind TestKeyUpdateFlood finds
// nothing crypto/tls wrote of its own accord on connections that only
// carry streams, bulk and small writes of every size both ways: the
// records it writes are exactly what the conn handed it.
func TestTLSAnswersHonestTraffic(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	honestTraffic(t, e, e.connect)
	var conns []*conn
	e.srv.mu.Lock()
	for c := range e.srv.conns {
		conns = append(conns, c)
	}
	e.srv.mu.Unlock()
	e.pool.mu.Lock()
	for _, pe := range e.pool.entries {
		conns = append(conns, pe.conns...)
	}
	e.pool.mu.Unlock()
	if len(conns) < 2 {
		t.Fatalf("%d conns, want the client's and the server's", len(conns))
	}
	for _, c := range conns {
		// A control frame handed over but not yet written counts
		// negative for a moment; what crypto/tls wrote of its own would
		// stay.
		b := c.cfg.batch
		own := func() int64 { return b.written.Load() - b.handed.Load() - c.tlsBase }
		waitfor.Until(t, fmt.Sprintf("client=%v: crypto/tls to have written nothing the conn did not hand it (now %d bytes)", c.cfg.client, own()),
			func() bool { return own() == 0 })
	}
}

// TestTLSAnswersNotCountedOnTLS12: a TLS 1.2 connection (the package takes
// any config it is given) has no KeyUpdates, and records of another size:
// nothing is counted, and bulk traffic is not taken for a flood.
func TestTLSAnswersNotCountedOnTLS12(t *testing.T) {
	good, _ := pkis()
	sconf := good.serverTLS()
	sconf.MinVersion = tls.VersionTLS12
	e := newEnv(t, dialTarget, ServerOptions{TLSConfig: sconf}, PoolOptions{})
	cconf := good.clientTLS()
	cconf.MinVersion, cconf.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
	honestTraffic(t, e, func(ctx context.Context, target netip.AddrPort) (*Stream, error) {
		return e.pool.Connect(ctx, e.key, tcpDial, cconf, Request{Authority: target})
	})
	if st, ps := e.srv.Stats(), e.pool.Stats(); st.ConnsFlood != 0 || ps.FloodCloses != 0 {
		t.Errorf("flood closes: server %d, pool %d; want none", st.ConnsFlood, ps.FloodCloses)
	}
}

// honestTraffic echoes writes of every size, bulk and small, both ways
// over four streams made by connect.
func honestTraffic(t *testing.T, e *testEnv, connect func(context.Context, netip.AddrPort) (*Stream, error)) {
	t.Helper()
	target := startUpstream(t, echo)
	sizes := []int{1, 5, 9, 16380, 16384 - 9 - 5, 65536, 1 << 20, 3<<20 + 7}
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := connect(context.Background(), target)
			if err != nil {
				t.Error(err)
				return
			}
			defer s.Close()
			var want int
			go func() {
				for _, n := range sizes {
					_, _ = s.Write(bytes.Repeat([]byte{byte(i)}, n))
				}
				_ = s.CloseWrite()
			}()
			for _, n := range sizes {
				want += n
			}
			got, err := io.Copy(io.Discard, s)
			if err != nil || got != int64(want) {
				t.Errorf("echoed %d bytes (%v), want %d", got, err, want)
			}
		}()
	}
	wg.Wait()
}

// serverKeyLog captures the server's application traffic secret.
type serverKeyLog struct{ secret chan []byte }

func (k serverKeyLog) Write(p []byte) (int, error) {
	if f := strings.Fields(string(p)); len(f) == 3 && f[0] == "SERVER_TRAFFIC_SECRET_0" {
		b, _ := hex.DecodeString(f[2])
		k.secret <- b
	}
	return len(p), nil
}

// rawH2Server is the server end of a pool's connection: crypto/tls up to the
// handshake, then frames sealed in records of its own (tw), so that it can
// send what crypto/tls would not (a flood of KeyUpdates).
type rawH2Server struct {
	raw net.Conn
	tw  *tls13Writer
	fr  *http2.Framer // reads through crypto/tls, writes into out
	out bytes.Buffer
}

// startRawH2Server makes the handshake on raw with pki's server
// certificate, reads the client preface and sends SETTINGS.
func startRawH2Server(raw net.Conn, pki *testPKI) (*rawH2Server, error) {
	conf := pki.serverTLS()
	conf.SessionTicketsDisabled = true // no ticket ahead of our records
	kl := serverKeyLog{make(chan []byte, 1)}
	conf.KeyLogWriter = kl
	tc := tls.Server(raw, conf)
	if err := tc.Handshake(); err != nil {
		return nil, err
	}
	tw, err := newTLS13Writer(raw, tc.ConnectionState().CipherSuite, <-kl.secret)
	if err != nil {
		return nil, err
	}
	var preface [len(http2.ClientPreface)]byte
	if _, err := io.ReadFull(tc, preface[:]); err != nil {
		return nil, err
	}
	s := &rawH2Server{raw: raw, tw: tw}
	s.fr = http2.NewFramer(&s.out, tc)
	s.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	_ = s.fr.WriteSettings()
	s.flush()
	return s, nil
}

// writeStatus200 frames a 200 response on stream 1 into out.
func (s *rawH2Server) writeStatus200() {
	var hb bytes.Buffer
	_ = hpack.NewEncoder(&hb).WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
	_ = s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
}

// flush sends what out holds in one record.
func (s *rawH2Server) flush() {
	var rec bytes.Buffer
	s.tw.record(&rec, 23, s.out.Bytes())
	s.out.Reset()
	_, _ = s.raw.Write(rec.Bytes())
}

// TestClientKeyUpdateFlood: the pool charges a server's KeyUpdate requests
// to the same budget as a server's PINGs: a hostile server (a compromised
// node) that sends them in a flood gets GOAWAY ENHANCE_YOUR_CALM, counted
// in PoolStats.FloodCloses. Before the fix the pool answered every one.
func TestClientKeyUpdateFlood(t *testing.T) {
	good, _ := pkis()
	done := make(chan int, 1)
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		cli, srvSide := net.Pipe()
		t.Cleanup(func() { srvSide.Close() })
		go func() {
			hs, err := startRawH2Server(srvSide, good)
			if err != nil {
				done <- -1
				return
			}
			fr := hs.fr
			for {
				f, err := fr.ReadFrame()
				if err != nil {
					done <- -1
					return
				}
				if f.Header().Type == http2.FrameHeaders && f.Header().StreamID == 1 {
					break
				}
			}
			// The pool's answers, read raw: crypto/tls would take 16
			// KeyUpdates in a row, which they are, for a flood.
			go func() { _, _ = io.Copy(io.Discard, srvSide) }()
			// A 200, then a DATA frame on the tunnel a byte at a time,
			// with KeyUpdates between.
			hs.writeStatus200()
			dataLen := 1 << 16
			hs.out.Write([]byte{byte(dataLen >> 16), byte(dataLen >> 8), byte(dataLen), byte(http2.FrameData), 0, 0, 0, 0, 1})
			hs.flush()
			done <- hs.tw.keyUpdateFlood(srvSide, 10*junkBurst)
		}()
		return cli, nil
	}
	pool := NewPool(PoolOptions{})
	t.Cleanup(func() { _ = pool.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := connectHostile(ctx, pool, dial)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	sent := <-done
	if sent < 0 {
		t.Fatal("the hostile server failed before its flood")
	}
	waitfor.Until(t, "the pool to close the flooding connection", func() bool { return pool.Stats().FloodCloses == 1 && pool.Stats().Conns == 0 })
}

// TestKeepaliveCloseWithReaderStuckInTLSWrite: a pooled connection whose
// server went silent is closed by the keepalive and its streams fail at
// once, even when the reader is stuck inside crypto/tls answering a
// KeyUpdate the server sent before it stopped reading: that answer holds
// crypto/tls's write lock, and tls.Conn.Close, with no Write of ours in
// flight, waited for that lock to send close_notify. Before the fix the
// streams of such a connection hung until TCP gave up on the socket (here,
// a pipe, for good).
func TestKeepaliveCloseWithReaderStuckInTLSWrite(t *testing.T) {
	good, _ := pkis()
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		cli, srvSide := net.Pipe()
		t.Cleanup(func() { srvSide.Close() })
		go func() {
			hs, err := startRawH2Server(srvSide, good)
			if err != nil {
				return
			}
			for { // the request, then the pool's keepalive PING
				f, err := hs.fr.ReadFrame()
				if err != nil {
					return
				}
				if f.Header().Type == http2.FrameHeaders && f.Header().StreamID == 1 {
					hs.writeStatus200()
					hs.flush()
				}
				if p, ok := f.(*http2.PingFrame); ok && !p.IsAck() {
					break
				}
			}
			// A KeyUpdate asking for one in return, and then nothing:
			// the pool's answer waits for a reader that never comes.
			var rec bytes.Buffer
			hs.tw.keyUpdate(&rec)
			_, _ = srvSide.Write(rec.Bytes())
		}()
		return cli, nil
	}
	pool := NewPool(PoolOptions{PingInterval: 100 * time.Millisecond, PingTimeout: 300 * time.Millisecond})
	t.Cleanup(func() { _ = pool.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := connectHostile(ctx, pool, dial)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	failed := make(chan error, 1)
	go func() {
		_, err := s.Read(make([]byte, 1))
		failed <- err
	}()
	select {
	case err := <-failed:
		if err == nil {
			t.Fatal("Read succeeded")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the stream of a connection the keepalive closed still waits 5 s later")
	}
}
