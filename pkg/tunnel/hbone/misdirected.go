package hbone

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"time"
)

// A client that reaches the HBONE port speaking something else than HBONE
// (plaintext HTTP, or TLS without ALPN h2) is told so in HTTP, which is what
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

// answerPlaintext answers, on its socket raw, a client whose handshake
// failed with err because it spoke plaintext HTTP, and reports whether it
// did.
func answerPlaintext(err error, raw net.Conn) bool {
	var rhe tls.RecordHeaderError
	if !errors.As(err, &rhe) || rhe.Conn == nil || !looksLikeHTTP(rhe.RecordHeader) {
		return false
	}
	answerAndLinger(raw, raw, plaintextAnswer)
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
