package hbone

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// The TLS 1.3 record layer of an established HBONE connection (RFC 8446 §5).
//
// crypto/tls does the handshake; then recordConn reads and writes the records itself, with
// the traffic secrets crypto/tls logged for this one connection (Config.KeyLogWriter, kept
// in memory). Measured reason: with crypto/tls, every byte the receiving agent relays is
// decrypted into crypto/tls's buffer and copied again into the stream's chunk (10 % of its
// CPU in the profiles), and every byte sent is copied into crypto/tls's record buffer and
// then, for a batch, into the batch buffer. recordConn decrypts a full record straight into
// the reader's buffer and seals a frame's records straight into the buffer that goes to
// write(2), one copy less each way.
//
// It keeps crypto/tls's defences: records longer than the protocol allows, bad record MACs,
// unprotected or unknown record types, content after close_notify, handshake messages that
// span a key change or interleave with data, and runs of empty records end the connection
// with an error; sequence numbers never wrap; a peer's KeyUpdate is followed, and answered
// when it asks; the sending key is updated well before AES-GCM's record limit (§5.5).
// Suites other than AES-GCM (ChaCha20-Poly1305, which peers without AES hardware prefer)
// stay with crypto/tls, as does anything unexpected at the hand-over.

const (
	recordHeaderLen = 5
	maxPlaintext    = 1 << 14            // TLSInnerPlaintext content, §5.1
	maxCiphertext   = maxPlaintext + 256 // §5.2
	gcmTagLen       = 16
	recordOverhead  = recordHeaderLen + 1 + gcmTagLen // header, inner content type, tag

	recordTypeAlert     = 21
	recordTypeHandshake = 22
	recordTypeAppData   = 23

	handshakeNewSessionTicket = 4
	handshakeKeyUpdate        = 24

	// maxUselessRecords bounds consecutive records that carry no data (empty ones, tickets,
	// key updates): each costs a decryption, and crypto/tls allows 16 in a row.
	maxUselessRecords = 16
	// maxPostHandshake bounds a post-handshake message being reassembled.
	maxPostHandshake = 1 << 16
	// rawBufSize is the receive buffer a connection holds while records are arriving: room
	// for several records per read(2), given back to a pool when empty.
	rawBufSize = 128 << 10
)

// keyUpdateAfter is how many records one sending key protects before it is updated: a
// margin under AES-GCM's 2^24.5 (RFC 8446 §5.5). A variable so a test can make it small.
var keyUpdateAfter uint64 = 1 << 24

// keyUpdateRequest is the request_update field of the KeyUpdate we send (0: not
// requested); tests set 1 to make a peer update its own key too.
var keyUpdateRequest byte

var (
	errRecordMAC      = errors.New("tls: bad record MAC")
	errRecordOverflow = errors.New("tls: record too long")
	errUnexpected     = errors.New("tls: unexpected message")
	errTooManyUseless = errors.New("tls: too many records without data")
	errShutdown       = errors.New("tls: protocol is shutdown")
)

var (
	rawBufPool = sync.Pool{New: func() any {
		b := make([]byte, rawBufSize)
		return &b
	}}
	// recordBufPool holds one record's worth: a record's plaintext on the way in, a
	// record on the way out.
	recordBufPool = sync.Pool{New: func() any {
		b := make([]byte, maxCiphertext+recordHeaderLen)
		return &b
	}}
)

// suite is what the record layer needs of a TLS 1.3 cipher suite.
type suite struct {
	hash   func() hash.Hash
	keyLen int
}

func suiteOf(id uint16) (suite, bool) {
	switch id {
	case tls.TLS_AES_128_GCM_SHA256:
		return suite{sha256.New, 16}, true
	case tls.TLS_AES_256_GCM_SHA384:
		return suite{sha512.New384, 32}, true
	}
	return suite{}, false
}

// expandLabel is HKDF-Expand-Label with an empty context (RFC 8446 §7.1).
func expandLabel(h func() hash.Hash, secret []byte, label string, length int) ([]byte, error) {
	info := make([]byte, 0, 4+6+len(label))
	info = binary.BigEndian.AppendUint16(info, uint16(length))
	info = append(info, byte(6+len(label)))
	info = append(info, "tls13 "...)
	info = append(info, label...)
	info = append(info, 0)
	return hkdf.Expand(h, secret, string(info), length)
}

// halfConn is one direction's traffic protection.
type halfConn struct {
	suite  suite
	secret []byte
	aead   cipher.AEAD
	iv     [12]byte
	seq    uint64
	nonce  [12]byte
	keys   int // traffic secrets used so far: 1 + KeyUpdates
}

func (h *halfConn) setSecret(secret []byte) error {
	key, err := expandLabel(h.suite.hash, secret, "key", h.suite.keyLen)
	if err != nil {
		return err
	}
	iv, err := expandLabel(h.suite.hash, secret, "iv", len(h.iv))
	if err != nil {
		return err
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return err
	}
	h.secret, h.aead, h.seq = secret, aead, 0
	h.keys++
	copy(h.iv[:], iv)
	return nil
}

// update moves to the next traffic secret (§7.2).
func (h *halfConn) update() error {
	next, err := expandLabel(h.suite.hash, h.secret, "traffic upd", h.suite.hash().Size())
	if err != nil {
		return err
	}
	return h.setSecret(next)
}

// nextNonce is the per-record nonce (§5.3); it fails rather than reuse a sequence number.
func (h *halfConn) nextNonce() ([]byte, error) {
	if h.seq == ^uint64(0) {
		return nil, errors.New("tls: sequence number wraparound")
	}
	h.nonce = h.iv
	for i := range 8 {
		h.nonce[4+i] ^= byte(h.seq >> (56 - 8*i))
	}
	h.seq++
	return h.nonce[:], nil
}

// secretLog is a KeyLogWriter that keeps one connection's application traffic secrets.
type secretLog struct {
	mu             sync.Mutex
	client, server []byte
}

func (l *secretLog) Write(p []byte) (int, error) {
	f := bytes.Fields(p) // LABEL <client random> <secret>
	if len(f) == 3 {
		secret := make([]byte, hex.DecodedLen(len(f[2])))
		if _, err := hex.Decode(secret, f[2]); err == nil {
			l.mu.Lock()
			switch string(f[0]) {
			case "CLIENT_TRAFFIC_SECRET_0":
				l.client = secret
			case "SERVER_TRAFFIC_SECRET_0":
				l.server = secret
			}
			l.mu.Unlock()
		}
	}
	return len(p), nil
}

// withSecretLog returns conf for one connection, logging its secrets to l, also from a
// configuration GetConfigForClient picks.
func withSecretLog(conf *tls.Config, l *secretLog) *tls.Config {
	conf = conf.Clone()
	conf.KeyLogWriter = l
	if pick := conf.GetConfigForClient; pick != nil {
		conf.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			c, err := pick(hello)
			if c != nil {
				c = c.Clone()
				c.KeyLogWriter = l
			}
			return c, err
		}
	}
	return conf
}

// handshakeConn is the socket under crypto/tls during the handshake. It hands crypto/tls
// one record at a time, so when the handshake is over no byte after it sits in crypto/tls's
// buffers: whatever the peer sent next is in raw, where the record layer goes on. Writes go
// through batchConn, which also serves connections that stay with crypto/tls.
type handshakeConn struct {
	*batchConn
	raw     []byte // read from the socket, not yet handed to crypto/tls
	left    int    // bytes of the current record crypto/tls may still read
	through bool   // the handshake is over and crypto/tls keeps the connection
	buf     [4 << 10]byte
}

func (h *handshakeConn) fill() error {
	if len(h.raw) > 0 && &h.raw[0] != &h.buf[0] {
		h.raw = h.buf[:copy(h.buf[:], h.raw)]
	}
	n, err := h.batchConn.Conn.Read(h.buf[len(h.raw):])
	h.raw = h.buf[:len(h.raw)+n]
	if n > 0 {
		return nil
	}
	return err
}

func (h *handshakeConn) Read(p []byte) (int, error) {
	if h.through {
		if len(h.raw) == 0 {
			return h.batchConn.Conn.Read(p)
		}
		n := copy(p, h.raw)
		h.raw = h.raw[n:]
		return n, nil
	}
	if h.left == 0 {
		for len(h.raw) < recordHeaderLen {
			if err := h.fill(); err != nil {
				return 0, err
			}
		}
		h.left = recordHeaderLen + int(binary.BigEndian.Uint16(h.raw[3:5]))
	}
	for len(h.raw) == 0 {
		if err := h.fill(); err != nil {
			return 0, err
		}
	}
	n := copy(p[:min(len(p), h.left)], h.raw)
	h.raw, h.left = h.raw[n:], h.left-n
	return n, nil
}

// takeOver returns the record layer for a connection tc finished handshaking over h, or nil
// when the connection stays with crypto/tls (another suite, a missing secret, a hand-over
// not at a record boundary).
func takeOver(tc *tls.Conn, h *handshakeConn, secrets *secretLog, client bool) *recordConn {
	r := newRecordConn(tc, h, secrets, client)
	if r == nil {
		h.through = true // crypto/tls reads the socket as it likes from here
	}
	return r
}

func newRecordConn(tc *tls.Conn, h *handshakeConn, secrets *secretLog, client bool) *recordConn {
	st := tc.ConnectionState()
	s, ok := suiteOf(st.CipherSuite)
	if !ok || st.Version != tls.VersionTLS13 || h.left != 0 {
		return nil
	}
	secrets.mu.Lock()
	in, out := secrets.client, secrets.server
	secrets.mu.Unlock()
	if client {
		in, out = out, in
	}
	if in == nil || out == nil {
		return nil
	}
	r := &recordConn{raw: h.batchConn.Conn}
	r.in.suite, r.out.suite = s, s
	if r.in.setSecret(in) != nil || r.out.setSecret(out) != nil {
		return nil
	}
	if len(h.raw) > 0 {
		r.takeRaw()
		r.rw = copy(*r.rawBuf, h.raw)
	}
	return r
}

// recordConn is an established TLS 1.3 connection whose records it reads and writes itself.
// Read is for one goroutine (the connection's reader); writes are serialized.
type recordConn struct {
	raw net.Conn

	// Read side, reader-owned.
	in       halfConn
	rawBuf   *[]byte // received bytes in (*rawBuf)[rr:rw]; nil while empty
	rr, rw   int
	plainBuf *[]byte // a record decrypted here when the reader's buffer was too small
	plain    []byte  // its bytes not yet read
	hs       []byte  // a post-handshake message being reassembled
	useless  int     // consecutive records without data
	copied   int64   // bytes read out of plainBuf rather than decrypted in place
	rerr     error   // sticky: the stream of records ended or broke

	// Write side.
	wmu          sync.Mutex
	out          halfConn
	werr         error // sticky, under wmu
	shut         bool  // close_notify sent, under wmu
	closed       atomic.Bool
	updateWanted atomic.Bool // the peer asked for our KeyUpdate
}

func (r *recordConn) takeRaw() {
	r.rawBuf = rawBufPool.Get().(*[]byte)
	r.rr, r.rw = 0, 0
}

// Read returns application data, decrypting a record straight into p when p has room for it.
func (r *recordConn) Read(p []byte) (int, error) { return r.read(p, false) }

// readFullSpare fills p, and may use p's spare capacity (a receive chunk's slack byte) as
// scratch: a record whose data exactly fills the rest of p is then decrypted in place too,
// its content type byte landing in the slack.
func (r *recordConn) readFullSpare(p []byte) error {
	for got := 0; got < len(p); {
		n, err := r.read(p[got:], true)
		got += n
		if err != nil {
			if err == io.EOF && got > 0 {
				err = io.ErrUnexpectedEOF
			}
			return err
		}
	}
	return nil
}

func (r *recordConn) read(p []byte, spare bool) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for {
		if len(r.plain) > 0 {
			n := copy(p, r.plain)
			r.plain = r.plain[n:]
			r.copied += int64(n)
			if len(r.plain) == 0 {
				recordBufPool.Put(r.plainBuf)
				r.plainBuf, r.plain = nil, nil
			}
			return n, nil
		}
		if r.rerr != nil {
			return 0, r.rerr
		}
		n, err := r.readRecord(p, spare)
		if err != nil {
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() {
				r.rerr = err
			}
			return 0, err
		}
		if n > 0 {
			return n, nil
		}
	}
}

// fill reads more of the socket, at least until need bytes are buffered.
func (r *recordConn) fill(need int) error {
	if r.rawBuf == nil {
		r.takeRaw()
	}
	b := *r.rawBuf
	if r.rr+need > len(b) {
		r.rw = copy(b, b[r.rr:r.rw])
		r.rr = 0
	}
	for r.rw-r.rr < need {
		n, err := r.raw.Read(b[r.rw:])
		r.rw += n
		if err != nil && r.rw-r.rr < need {
			if err == io.EOF && r.rw > r.rr {
				err = io.ErrUnexpectedEOF // the peer stopped inside a record
			}
			return err
		}
	}
	return nil
}

// readRecord reads and decrypts one record. It returns how many bytes of application data
// it put in p (0 for a record that carried none, or whose data waits in r.plain). With spare,
// it may write into p's capacity past len(p).
func (r *recordConn) readRecord(p []byte, spare bool) (int, error) {
	if r.rawBuf == nil || r.rw-r.rr < recordHeaderLen {
		if err := r.fill(recordHeaderLen); err != nil {
			return 0, err
		}
	}
	hdr := (*r.rawBuf)[r.rr : r.rr+recordHeaderLen]
	n := int(binary.BigEndian.Uint16(hdr[3:5]))
	switch {
	case hdr[0] != recordTypeAppData:
		return 0, fmt.Errorf("%w: unprotected record of type %d", errUnexpected, hdr[0])
	case hdr[1] != 3 || hdr[2] != 3:
		return 0, fmt.Errorf("tls: record version %#x", binary.BigEndian.Uint16(hdr[1:3]))
	case n > maxCiphertext:
		return 0, errRecordOverflow
	case n < 1+gcmTagLen:
		return 0, errRecordMAC
	}
	if r.rw-r.rr < recordHeaderLen+n {
		if err := r.fill(recordHeaderLen + n); err != nil {
			return 0, err
		}
		hdr = (*r.rawBuf)[r.rr : r.rr+recordHeaderLen]
	}
	ciphertext := (*r.rawBuf)[r.rr+recordHeaderLen : r.rr+recordHeaderLen+n]
	var dst []byte
	// The plaintext (content, content type, any padding) is n-gcmTagLen bytes; the content
	// alone at most one less.
	direct := len(p) >= n-gcmTagLen || spare && len(p) >= n-gcmTagLen-1 && cap(p) >= n-gcmTagLen
	if direct {
		dst = p[:0] // Read may use all of p as scratch space
	} else {
		r.plainBuf = recordBufPool.Get().(*[]byte)
		dst = (*r.plainBuf)[:0]
	}
	nonce, err := r.in.nextNonce()
	if err != nil {
		return 0, err
	}
	out, err := r.in.aead.Open(dst, nonce, ciphertext, hdr)
	r.rr += recordHeaderLen + n
	if r.rr == r.rw {
		rawBufPool.Put(r.rawBuf)
		r.rawBuf = nil
	}
	if err != nil {
		r.dropPlain()
		return 0, errRecordMAC
	}
	if len(out) > maxPlaintext+1 {
		r.dropPlain()
		return 0, errRecordOverflow
	}
	i := len(out) - 1
	for i >= 0 && out[i] == 0 {
		i--
	}
	if i < 0 {
		r.dropPlain()
		return 0, fmt.Errorf("%w: record without a content type", errUnexpected)
	}
	typ, content := out[i], out[:i]
	if typ == recordTypeAppData && len(content) > 0 {
		if len(r.hs) > 0 {
			r.dropPlain()
			return 0, fmt.Errorf("%w: data inside a handshake message", errUnexpected)
		}
		r.useless = 0
		if direct {
			return len(content), nil
		}
		r.plain = content
		return 0, nil
	}
	defer r.dropPlain() // after content is used: the buffer goes back to a shared pool
	if r.useless++; r.useless > maxUselessRecords {
		return 0, errTooManyUseless
	}
	switch typ {
	case recordTypeAppData: // empty: allowed (§5.4), counted above
		return 0, nil
	case recordTypeAlert:
		if len(content) != 2 {
			return 0, fmt.Errorf("%w: alert of %d bytes", errUnexpected, len(content))
		}
		if content[1] == 0 { // close_notify
			return 0, io.EOF
		}
		return 0, fmt.Errorf("tls: peer sent alert %d", content[1])
	case recordTypeHandshake:
		return 0, r.postHandshake(content)
	}
	return 0, fmt.Errorf("%w: record of content type %d", errUnexpected, typ)
}

func (r *recordConn) dropPlain() {
	if r.plainBuf != nil {
		recordBufPool.Put(r.plainBuf)
		r.plainBuf, r.plain = nil, nil
	}
}

// postHandshake takes a record's worth of post-handshake messages (§4.6): session tickets are
// ignored (the pool does not resume), a KeyUpdate moves the receiving key on and, when asked,
// has the next write update the sending key.
func (r *recordConn) postHandshake(b []byte) error {
	if len(r.hs)+len(b) > maxPostHandshake {
		return fmt.Errorf("%w: post-handshake message too long", errUnexpected)
	}
	r.hs = append(r.hs, b...)
	for len(r.hs) >= 4 {
		typ, n := r.hs[0], int(r.hs[1])<<16|int(r.hs[2])<<8|int(r.hs[3])
		if 4+n > maxPostHandshake {
			return fmt.Errorf("%w: post-handshake message too long", errUnexpected)
		}
		if len(r.hs) < 4+n {
			return nil
		}
		body := r.hs[4 : 4+n]
		r.hs = r.hs[4+n:]
		switch typ {
		case handshakeNewSessionTicket:
		case handshakeKeyUpdate:
			if n != 1 || body[0] > 1 {
				return fmt.Errorf("%w: malformed KeyUpdate", errUnexpected)
			}
			if len(r.hs) > 0 { // a key change must end its record (§5.1)
				return fmt.Errorf("%w: KeyUpdate not at the end of its record", errUnexpected)
			}
			if err := r.in.update(); err != nil {
				return err
			}
			if body[0] == 1 {
				r.updateWanted.Store(true)
			}
		default:
			return fmt.Errorf("%w: post-handshake message of type %d", errUnexpected, typ)
		}
	}
	if len(r.hs) == 0 {
		r.hs = nil
	}
	return nil
}

// Write sends p as application data records, sealed into one buffer and written with one
// write(2) per batch buffer (one for a bulk frame).
func (r *recordConn) Write(p []byte) (int, error) {
	r.wmu.Lock()
	defer r.wmu.Unlock()
	switch {
	case r.closed.Load():
		return 0, net.ErrClosed
	case r.shut:
		return 0, errShutdown
	case r.werr != nil:
		return 0, r.werr
	}
	var (
		bp    *[]byte
		batch bool
	)
	if len(p) > 2*maxPlaintext {
		bp = batchBuffer.get()
		batch = bp != nil
	}
	if bp == nil {
		bp = recordBufPool.Get().(*[]byte)
	}
	defer func() {
		if batch {
			batchBuffer.put(bp)
		} else {
			recordBufPool.Put(bp)
		}
	}()
	// The short record goes first: a 256 KiB DATA frame is its 9-byte header in one record and
	// the payload in 16 full ones, so the peer's reader finds whole records where its chunks
	// begin and decrypts them in place.
	k := len(p) % maxPlaintext
	if k == 0 || len(p) < maxPlaintext {
		k = min(len(p), maxPlaintext)
	}
	written := 0
	for written < len(p) {
		b := (*bp)[:0]
		sent := written
		for written < len(p) && cap(b)-len(b) >= recordOverhead+k {
			var err error
			if b, err = r.sealLocked(b, recordTypeAppData, p[written:written+k]); err != nil {
				return sent, r.failLocked(err)
			}
			written += k
			k = min(len(p)-written, maxPlaintext)
		}
		if _, err := r.raw.Write(b); err != nil {
			return sent, r.failLocked(err) // how much of b went is unknown: the connection is done
		}
	}
	return written, nil
}

// sealLocked appends one record of type typ holding content to b, first updating the sending
// key when the peer asked or this key has protected enough records.
func (r *recordConn) sealLocked(b []byte, typ byte, content []byte) ([]byte, error) {
	if typ == recordTypeAppData && (r.updateWanted.Load() || r.out.seq >= keyUpdateAfter) {
		var err error
		if b, err = r.sealLocked(b, recordTypeHandshake, []byte{handshakeKeyUpdate, 0, 0, 1, keyUpdateRequest}); err != nil {
			return b, err
		}
		r.updateWanted.Store(false)
		if err := r.out.update(); err != nil {
			return b, err
		}
	}
	nonce, err := r.out.nextNonce()
	if err != nil {
		return b, err
	}
	n := len(content) + 1 + gcmTagLen
	start := len(b)
	b = append(b, recordTypeAppData, 3, 3, byte(n>>8), byte(n))
	b = append(b, content...)
	b = append(b, typ)
	hdr := b[start : start+recordHeaderLen]
	return r.out.aead.Seal(b[:start+recordHeaderLen], nonce, b[start+recordHeaderLen:], hdr), nil
}

func (r *recordConn) failLocked(err error) error {
	r.werr = err
	return err
}

// closeNotifyLocked sends close_notify, bounded so a peer that stopped reading cannot hold us.
func (r *recordConn) closeNotifyLocked() error {
	if r.shut || r.werr != nil {
		return r.werr
	}
	r.shut = true
	_ = r.raw.SetWriteDeadline(time.Now().Add(5 * time.Second))
	bp := recordBufPool.Get().(*[]byte)
	defer recordBufPool.Put(bp)
	b, err := r.sealLocked((*bp)[:0], recordTypeAlert, []byte{1, 0})
	if err == nil {
		_, err = r.raw.Write(b)
	}
	_ = r.raw.SetWriteDeadline(time.Now())
	return err
}

// CloseWrite sends close_notify and writes nothing more; the peer may still send.
func (r *recordConn) CloseWrite() error {
	r.wmu.Lock()
	defer r.wmu.Unlock()
	return r.closeNotifyLocked()
}

// Close sends close_notify unless a write is under way, then closes the socket. A write
// blocked on a peer that stopped reading is ended by the socket's close, as crypto/tls does
// for its own writes.
func (r *recordConn) Close() error {
	if r.closed.Swap(true) {
		return net.ErrClosed
	}
	var alertErr error
	if r.wmu.TryLock() {
		alertErr = r.closeNotifyLocked()
		r.wmu.Unlock()
	}
	if err := r.raw.Close(); err != nil {
		return err
	}
	return alertErr
}

func (r *recordConn) LocalAddr() net.Addr                { return r.raw.LocalAddr() }
func (r *recordConn) RemoteAddr() net.Addr               { return r.raw.RemoteAddr() }
func (r *recordConn) SetDeadline(t time.Time) error      { return r.raw.SetDeadline(t) }
func (r *recordConn) SetReadDeadline(t time.Time) error  { return r.raw.SetReadDeadline(t) }
func (r *recordConn) SetWriteDeadline(t time.Time) error { return r.raw.SetWriteDeadline(t) }
