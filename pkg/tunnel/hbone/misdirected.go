package hbone

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"time"

	"golang.org/x/net/http2"
)

// A client that reaches the HBONE port speaking something else than HBONE
// (plaintext HTTP/1 or HTTP/2, or TLS without ALPN h2) is told so in HTTP, which is what
// such a client reads: closing without a word left it with "empty reply
// from server", and a TLS alert can only say bad_certificate, which sends
// the operator after a certificate that was fine. The answers are fixed
// texts, so they tell an unauthenticated peer nothing it could not read in
// this file; the ALPN one is written only after the client's certificate
// verified.

// misdirectedTimeout bounds writing an answer and waiting for the client to
// read it: the connection holds its handshake slot meanwhile.
const misdirectedTimeout = time.Second

// misdirectedDrain is the most read (and dropped) from such a client after
// the answer, so that closing with its request unread does not reset the
// connection before it read the answer.
const misdirectedDrain = 16 << 10

// The answers: the reason in ReasonHeader as in the refusals of CONNECT
// streams (a client reports a CONNECT's headers, not its body), and in the body.
var (
	plaintextAnswer = misdirectedAnswer("400 Bad Request", "HTTP/1.0",
		"this port speaks HBONE: HTTP/2 CONNECT over mutual TLS 1.3 (ALPN h2), not plaintext HTTP")
	noH2Answer = misdirectedAnswer("505 HTTP Version Not Supported", "HTTP/1.1",
		"this port speaks HBONE: HTTP/2 CONNECT only, offer ALPN h2")
)

func misdirectedAnswer(status, version, reason string) string {
	return version + " " + status + "\r\n" + ReasonHeader + ": " + reason + "\r\n" +
		"Content-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n" + reason + "\n"
}

// looksLikeHTTP reports whether the first bytes a client sent, where a TLS
// record header was expected, are those of an HTTP/1 request.
func looksLikeHTTP(hdr [5]byte) bool {
	switch string(hdr[:]) {
	case "GET /", "HEAD ", "POST ", "PUT /", "OPTIO", "CONNE", "DELET", "PATCH", "TRACE":
		return true
	}
	return false
}

// h2cAnswer is what a plaintext HTTP/2 client (prior knowledge, h2c) gets:
// our (empty) SETTINGS, which it expects first, and GOAWAY
// INADEQUATE_SECURITY ("the transport does not meet minimum security
// requirements") with the reason as its debug data.
var h2cAnswer = func() string {
	var b bytes.Buffer
	fr := http2.NewFramer(&b, nil)
	_ = fr.WriteSettings()
	_ = fr.WriteGoAway(0, http2.ErrCodeInadequateSecurity,
		[]byte("this port speaks HBONE: HTTP/2 CONNECT over mutual TLS 1.3 (ALPN h2), not plaintext HTTP/2"))
	return b.String()
}()

// answerPlaintext answers, on its socket raw, a client whose handshake
// failed with err because it spoke plaintext HTTP/1 or HTTP/2, and reports
// whether it did.
func answerPlaintext(err error, raw net.Conn) bool {
	var rhe tls.RecordHeaderError
	if !errors.As(err, &rhe) || rhe.Conn == nil {
		return false
	}
	switch {
	case string(rhe.RecordHeader[:]) == http2.ClientPreface[:5]: // "PRI *"
		answerAndLinger(raw, raw, h2cAnswer)
	case looksLikeHTTP(rhe.RecordHeader):
		answerAndLinger(raw, raw, plaintextAnswer)
	default:
		return false
	}
	return true
}

// answerNoH2 answers a client that completed the handshake on tc (its
// certificate verified) without negotiating h2; raw is tc's socket.
func answerNoH2(tc *tls.Conn, raw net.Conn) {
	answerAndLinger(tc, raw, noH2Answer)
}

// answerAndLinger writes answer to w, ends raw's sending side and reads what
// the client still sends, within misdirectedTimeout and misdirectedDrain.
// The caller closes the connection.
func answerAndLinger(w io.Writer, raw net.Conn, answer string) {
	_ = raw.SetDeadline(time.Now().Add(misdirectedTimeout))
	if _, err := io.WriteString(w, answer); err != nil {
		return
	}
	if tc, ok := w.(*tls.Conn); ok {
		_ = tc.CloseWrite() // close_notify: the answer is complete
	}
	if cw, ok := raw.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(raw, misdirectedDrain))
}
