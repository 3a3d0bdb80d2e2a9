package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// recordPair is two record layers on either end of a pipe, both directions keyed from one
// secret, as the handshake would leave them.
func recordPair(t *testing.T) (a, b *recordConn) {
	t.Helper()
	x, y := net.Pipe()
	t.Cleanup(func() { x.Close(); y.Close() })
	mk := func(c net.Conn) *recordConn {
		s, _ := suiteOf(tls.TLS_AES_128_GCM_SHA256)
		r := &recordConn{raw: c}
		r.in.suite, r.out.suite = s, s
		secret := bytes.Repeat([]byte{7}, 32)
		if err := r.in.setSecret(secret); err != nil {
			t.Fatal(err)
		}
		if err := r.out.setSecret(secret); err != nil {
			t.Fatal(err)
		}
		return r
	}
	return mk(x), mk(y)
}

// seal is one record from w of content type typ, as bytes for the wire.
func seal(t *testing.T, w *recordConn, typ byte, content []byte) []byte {
	t.Helper()
	b, err := w.sealLocked(nil, typ, content)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRecordLayerHostileInput: every record crypto/tls would refuse after the handshake ends
// the connection with an error naming what was wrong, and nothing before it is lost.
func TestRecordLayerHostileInput(t *testing.T) {
	alert := func(desc byte) []byte { return []byte{2, desc} }
	for _, tc := range []struct {
		name  string
		wire  func(t *testing.T, w *recordConn) []byte
		want  error  // errors.Is
		wantS string // or in the error's text
	}{
		{"unprotected handshake record", func(t *testing.T, w *recordConn) []byte {
			return []byte{recordTypeHandshake, 3, 3, 0, 4, handshakeKeyUpdate, 0, 0, 0}
		}, errUnexpected, ""},
		{"unprotected change_cipher_spec", func(t *testing.T, w *recordConn) []byte {
			return []byte{20, 3, 3, 0, 1, 1}
		}, errUnexpected, ""},
		{"record version", func(t *testing.T, w *recordConn) []byte {
			b := seal(t, w, recordTypeAppData, []byte("x"))
			b[2] = 1
			return b
		}, nil, "record version"},
		{"ciphertext longer than 2^14+256", func(t *testing.T, w *recordConn) []byte {
			return []byte{recordTypeAppData, 3, 3, 0x41, 0x01}
		}, errRecordOverflow, ""},
		{"record too short for a tag", func(t *testing.T, w *recordConn) []byte {
			return append([]byte{recordTypeAppData, 3, 3, 0, 16}, make([]byte, 16)...)
		}, errRecordMAC, ""},
		{"tampered ciphertext", func(t *testing.T, w *recordConn) []byte {
			b := seal(t, w, recordTypeAppData, []byte("hello"))
			b[recordHeaderLen] ^= 1
			return b
		}, errRecordMAC, ""},
		{"tampered header", func(t *testing.T, w *recordConn) []byte {
			b := seal(t, w, recordTypeAppData, []byte("hello"))
			b[0] = recordTypeAppData
			b[4]++ // length one more: the tag is checked over another header and length
			return append(b, 0)
		}, errRecordMAC, ""},
		{"plaintext longer than 2^14", func(t *testing.T, w *recordConn) []byte {
			return seal(t, w, recordTypeAppData, make([]byte, maxPlaintext+1))
		}, errRecordOverflow, ""},
		{"no content type", func(t *testing.T, w *recordConn) []byte {
			return seal(t, w, 0, make([]byte, 10))
		}, errUnexpected, ""},
		{"unknown content type", func(t *testing.T, w *recordConn) []byte {
			return seal(t, w, 99, []byte("x"))
		}, errUnexpected, ""},
		{"a run of empty records", func(t *testing.T, w *recordConn) []byte {
			var b []byte
			for range maxUselessRecords + 1 {
				b = append(b, seal(t, w, recordTypeAppData, nil)...)
			}
			return b
		}, errTooManyUseless, ""},
		{"fatal alert", func(t *testing.T, w *recordConn) []byte {
			return seal(t, w, recordTypeAlert, alert(40))
		}, nil, "peer sent alert 40"},
		{"alert of three bytes", func(t *testing.T, w *recordConn) []byte {
			return seal(t, w, recordTypeAlert, []byte{2, 40, 0})
		}, errUnexpected, ""},
		{"malformed KeyUpdate", func(t *testing.T, w *recordConn) []byte {
			return seal(t, w, recordTypeHandshake, []byte{handshakeKeyUpdate, 0, 0, 1, 2})
		}, errUnexpected, ""},
		{"KeyUpdate not ending its record", func(t *testing.T, w *recordConn) []byte {
			return seal(t, w, recordTypeHandshake, []byte{handshakeKeyUpdate, 0, 0, 1, 0, handshakeNewSessionTicket, 0, 0, 0})
		}, errUnexpected, ""},
		{"post-handshake CertificateRequest", func(t *testing.T, w *recordConn) []byte {
			return seal(t, w, recordTypeHandshake, []byte{13, 0, 0, 0})
		}, errUnexpected, ""},
		{"post-handshake message longer than 64 KiB", func(t *testing.T, w *recordConn) []byte {
			return seal(t, w, recordTypeHandshake, []byte{handshakeNewSessionTicket, 1, 0, 0})
		}, errUnexpected, ""},
		{"data inside a handshake message", func(t *testing.T, w *recordConn) []byte {
			b := seal(t, w, recordTypeHandshake, []byte{handshakeNewSessionTicket, 0, 0, 9, 1})
			return append(b, seal(t, w, recordTypeAppData, []byte("x"))...)
		}, errUnexpected, ""},
		{"connection ends inside a record", func(t *testing.T, w *recordConn) []byte {
			b := seal(t, w, recordTypeAppData, []byte("hello"))
			return b[:len(b)-3]
		}, io.ErrUnexpectedEOF, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, r := recordPair(t)
			good := seal(t, w, recordTypeAppData, []byte("before"))
			wire := append(good, tc.wire(t, w)...)
			go func() {
				_, _ = w.raw.Write(wire)
				_ = w.raw.Close()
			}()
			_ = r.raw.SetReadDeadline(time.Now().Add(5 * time.Second))
			got, err := io.ReadAll(r)
			if string(got) != "before" {
				t.Errorf("read %q before the bad record, want %q", got, "before")
			}
			switch {
			case err == nil:
				t.Fatal("the bad input was accepted")
			case tc.want != nil && !errors.Is(err, tc.want):
				t.Fatalf("error %v, want %v", err, tc.want)
			case tc.wantS != "" && !strings.Contains(err.Error(), tc.wantS):
				t.Fatalf("error %v, want one saying %q", err, tc.wantS)
			}
			if _, again := r.Read(make([]byte, 10)); again == nil {
				t.Fatal("a broken connection read on")
			}
		})
	}
}

// TestRecordLayerPostHandshake: session tickets (also split across records) are skipped,
// close_notify ends the stream with io.EOF, and a KeyUpdate changes the key the next records
// are read with; when it asks, the next write updates the sending key first.
func TestRecordLayerPostHandshake(t *testing.T) {
	w, r := recordPair(t)
	var wire []byte
	wire = append(wire, seal(t, w, recordTypeAppData, []byte("a"))...)
	ticket := append([]byte{handshakeNewSessionTicket, 0, 0, 20}, make([]byte, 20)...)
	wire = append(wire, seal(t, w, recordTypeHandshake, ticket[:10])...)
	wire = append(wire, seal(t, w, recordTypeHandshake, ticket[10:])...)
	wire = append(wire, seal(t, w, recordTypeHandshake, []byte{handshakeKeyUpdate, 0, 0, 1, 1})...)
	if err := w.out.update(); err != nil {
		t.Fatal(err)
	}
	wire = append(wire, seal(t, w, recordTypeAppData, []byte("b"))...)
	wire = append(wire, seal(t, w, recordTypeAlert, []byte{1, 0})...)
	wire = append(wire, []byte("never read")...)
	go func() { _, _ = w.raw.Write(wire) }()
	_ = r.raw.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(r)
	if err != nil || string(got) != "ab" {
		t.Fatalf("read %q, %v; want %q and a clean EOF", got, err, "ab")
	}
	if !r.updateWanted.Load() {
		t.Fatal("a KeyUpdate asking for ours was not noted")
	}
	seq := r.out.seq
	go func() { _, _ = io.Copy(io.Discard, w.raw) }()
	if _, err := r.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if r.updateWanted.Load() || r.out.seq != 1 || seq == 0 && r.out.seq == seq+2 {
		t.Fatalf("the write did not update the sending key first (seq %d -> %d)", seq, r.out.seq)
	}
}

// TestRecordLayerDirectDecrypt: a read with room for a whole record gets it decrypted in place
// (no copy); a smaller read gets the rest of the record from the record buffer.
func TestRecordLayerDirectDecrypt(t *testing.T) {
	w, r := recordPair(t)
	msg := bytes.Repeat([]byte("0123456789abcdef"), maxPlaintext/16)
	go func() {
		_, _ = w.Write(msg)
		_, _ = w.Write(msg)
	}()
	big := make([]byte, maxPlaintext+1)
	if n, err := r.Read(big); err != nil || n != len(msg) || !bytes.Equal(big[:n], msg) || r.plainBuf != nil {
		t.Fatalf("read %d, %v, record buffer held %v; want the whole record in place", n, err, r.plainBuf != nil)
	}
	small := make([]byte, 9)
	if n, err := r.Read(small); err != nil || n != 9 || r.plainBuf == nil {
		t.Fatalf("read %d, %v; want 9 bytes with the rest buffered", n, err)
	}
	rest, err := io.ReadAll(io.LimitReader(r, int64(len(msg)-9)))
	if err != nil || !bytes.Equal(append(small, rest...), msg) || r.plainBuf != nil {
		t.Fatalf("read %d bytes, %v: the record came out changed or its buffer was kept", len(rest)+9, err)
	}
}

// TestRecordLayerFrameAlignment: a DATA frame of a 9-byte header and 64 KiB of payload is
// sent as a 9-byte record and four full ones, so the reader copies only the header: the
// payload is decrypted in place into the chunk (its slack byte taking the content type).
func TestRecordLayerFrameAlignment(t *testing.T) {
	w, r := recordPair(t)
	frame := make([]byte, frameHeaderLen+chunkSize)
	_, _ = newPRNGReader(9).Read(frame)
	go func() { _, _ = w.Write(frame) }()
	hdr := make([]byte, frameHeaderLen)
	if _, err := io.ReadFull(r, hdr); err != nil {
		t.Fatal(err)
	}
	bp := chunkPool.Get().(*[]byte)
	defer chunkPool.Put(bp)
	if err := r.readFullSpare((*bp)[:chunkSize]); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(hdr, frame[:frameHeaderLen]) || !bytes.Equal((*bp)[:chunkSize], frame[frameHeaderLen:]) {
		t.Fatal("the frame came out changed")
	}
	if r.copied != frameHeaderLen {
		t.Fatalf("%d bytes copied out of the record buffer, want only the %d of the header", r.copied, frameHeaderLen)
	}
}

// TestRecordLayerTakesOver: both ends of an HBONE connection run on the record layer, and
// with the sending key updated every few records (each update asking the peer to update
// its own), 8 MiB go each way intact.
func TestRecordLayerTakesOver(t *testing.T) {
	defer func(after uint64, req byte) { keyUpdateAfter, keyUpdateRequest = after, req }(keyUpdateAfter, keyUpdateRequest)
	keyUpdateAfter, keyUpdateRequest = 7, 1

	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	app := startUpstream(t, echo)
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, ok := s.c.nc.(*recordConn); !ok {
		t.Fatalf("the client connection is a %T, not on the record layer", s.c.nc)
	}
	e.srv.mu.Lock()
	for c := range e.srv.conns {
		if _, ok := c.nc.(*recordConn); !ok {
			t.Errorf("a server connection is a %T, not on the record layer", c.nc)
		}
	}
	e.srv.mu.Unlock()
	echoed(t, s, 8<<20)
	rc := s.c.nc.(*recordConn)
	if rc.out.keys < 50 || rc.in.keys < 50 {
		t.Errorf("keys not updated: %d sending keys, %d receiving keys for 8 MiB each way", rc.out.keys, rc.in.keys)
	}
}

// echoed sends size bytes through s to an echoing app and checks they come back intact.
func echoed(t *testing.T, s *Stream, size int64) {
	t.Helper()
	want := sha256.New()
	_, _ = io.Copy(want, io.LimitReader(newPRNGReader(5), size))
	go func() {
		_, _ = s.ReadFrom(io.LimitReader(newPRNGReader(5), size))
		_ = s.CloseWrite()
	}()
	h := sha256.New()
	_ = s.SetReadDeadline(time.Now().Add(30 * time.Second))
	if n, err := io.Copy(h, s); err != nil || n != size {
		t.Fatalf("echoed %d of %d bytes: %v", n, size, err)
	}
	if !bytes.Equal(h.Sum(nil), want.Sum(nil)) {
		t.Fatal("the bytes came back changed")
	}
}

// TestRecordLayerKeyUpdateWithCryptoTLS: against x/net's server on crypto/tls, our client
// updates its sending key every few records and asks for the peer's update each time;
// crypto/tls follows and answers, and our reader follows its updates.
func TestRecordLayerKeyUpdateWithCryptoTLS(t *testing.T) {
	defer func(after uint64, req byte) { keyUpdateAfter, keyUpdateRequest = after, req }(keyUpdateAfter, keyUpdateRequest)
	keyUpdateAfter, keyUpdateRequest = 5, 1
	checkGoroutines(t)
	addr := startXNetServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		buf := make([]byte, 64<<10)
		for {
			n, err := r.Body.Read(buf)
			if n > 0 {
				_, _ = w.Write(buf[:n])
				w.(http.Flusher).Flush()
			}
			if err != nil {
				return
			}
		}
	})
	p := NewPool(PoolOptions{})
	defer p.Close()
	s, err := p.Connect(context.Background(), PoolKey{DstAddr: addr}, tcpDial, mustClientTLS(), Request{Authority: netip.MustParseAddrPort("10.0.0.1:80")})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rc, ok := s.c.nc.(*recordConn)
	if !ok {
		t.Fatalf("the client connection is a %T, not on the record layer", s.c.nc)
	}
	echoed(t, s, 4<<20)
	if rc.out.keys < 50 || rc.in.keys < 2 {
		t.Errorf("keys: %d sending, %d receiving; want ours updated every 5 records and crypto/tls's after ours", rc.out.keys, rc.in.keys)
	}
	t.Logf("sending keys %d, receiving keys %d", rc.out.keys, rc.in.keys)
}

// wireConn is a net.Conn whose reads come from a byte slice (the rest of net.Conn is unused
// by recordConn.Read).
type wireConn struct {
	net.Conn
	r io.Reader
}

func (w wireConn) Read(p []byte) (int, error) { return w.r.Read(p) }

// FuzzRecordLayer feeds the reader records sealed with the right key whose content types
// and contents come from the fuzzer (so it gets past the MAC to the parsing behind it),
// with the wire cut short where the fuzzer says. The reader must neither panic nor hand out
// more than the records held, nor accept a record after an error.
func FuzzRecordLayer(f *testing.F) {
	f.Add([]byte{recordTypeAppData, 0, 5, 'h', 'e', 'l', 'l', 'o'}, uint16(0))
	f.Add([]byte{recordTypeHandshake, 0, 5, handshakeKeyUpdate, 0, 0, 1, 1, recordTypeAppData, 0, 1, 'x'}, uint16(0))
	f.Add([]byte{recordTypeHandshake, 0, 4, handshakeNewSessionTicket, 0, 0, 2, recordTypeHandshake, 0, 2, 0, 0}, uint16(30))
	f.Add([]byte{recordTypeAlert, 0, 2, 1, 0}, uint16(0))
	f.Fuzz(func(t *testing.T, spec []byte, cut uint16) {
		w, _ := recordPair(t)
		var wire []byte
		data := 0
		for len(spec) >= 3 {
			typ, n := spec[0], int(spec[1])<<8|int(spec[2])
			spec = spec[3:]
			n = min(n, len(spec))
			data += n // a record of any type whose content ends in 23 reads as data with padding
			wire = append(wire, seal(t, w, typ, spec[:n])...)
			spec = spec[n:]
		}
		if cut > 0 && int(cut) < len(wire) {
			wire = wire[:cut]
		}
		_, r := recordPair(t)
		r.raw = wireConn{r: bytes.NewReader(wire)}
		got, err := io.ReadAll(r)
		if len(got) > data {
			t.Fatalf("read %d bytes from records holding %d", len(got), data)
		}
		if err != nil {
			if n, again := r.Read(make([]byte, 64)); n > 0 || again == nil {
				t.Fatalf("read on after %v", err)
			}
		}
	})
}
