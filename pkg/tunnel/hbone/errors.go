package hbone

import (
	"errors"
	"fmt"
	"net/http"

	"golang.org/x/net/http2"
)

// Sentinel errors of the package.
var (
	// ErrPoolClosed is returned by Pool.Connect after Pool.Close.
	ErrPoolClosed = errors.New("hbone pool closed")
	// ErrServerClosed is returned by Server.Serve after Server.Shutdown or Close.
	ErrServerClosed = errors.New("hbone server closed")
	// ErrConnClosed means the TLS connection under a stream went away.
	ErrConnClosed = errors.New("hbone connection closed")
	// ErrEvicted is returned by Pool.Connect when Pool.Evict removed its
	// key meanwhile (the source went away): a failure of the source, not
	// of the destination.
	ErrEvicted = fmt.Errorf("%w: source evicted", ErrConnClosed)
	// errRetry marks a stream the peer never processed (REFUSED_STREAM or
	// beyond a GOAWAY), so Pool.Connect may open it again on another
	// connection.
	errRetry = errors.New("stream not processed by peer")
	// errInvalidWrite is a Write that returned a count outside [0, len]
	// (io's own errInvalidWrite, which it does not export).
	errInvalidWrite = errors.New("invalid write result")
)

// ReasonHeader is the response header in which a Server explains a non-200
// status. The same text is sent as the response body, for tools that only
// show bodies.
const ReasonHeader = "hbone-reason"

// StatusError is returned by Pool.Connect when the peer answered the
// CONNECT with a status other than 200.
type StatusError struct {
	Status int
	// Reason is the peer's explanation, from ReasonHeader or the body.
	Reason string
}

func (e *StatusError) Error() string {
	if e.Reason == "" {
		return fmt.Sprintf("hbone connect refused: %d %s", e.Status, http.StatusText(e.Status))
	}
	return fmt.Sprintf("hbone connect refused: %d %s: %s", e.Status, http.StatusText(e.Status), e.Reason)
}

// ResetError reports that a stream was reset (RST_STREAM), by the peer when
// Remote is true, or locally because the peer broke the protocol.
type ResetError struct {
	Code   http2.ErrCode
	Remote bool
	// Reason says what the peer sent that made us reset the stream (local
	// resets only), so that a failed Connect names what was wrong with the
	// server's answer, not only an error code.
	Reason string
}

func (e *ResetError) Error() string {
	switch {
	case e.Remote:
		return fmt.Sprintf("hbone stream reset by peer: %v", e.Code)
	case e.Reason != "":
		return fmt.Sprintf("hbone stream reset: %v: %s", e.Code, e.Reason)
	}
	return fmt.Sprintf("hbone stream reset: %v", e.Code)
}

// GoAwayError reports that the peer closed the connection with GOAWAY and an
// error code other than NO_ERROR.
type GoAwayError struct {
	Code  http2.ErrCode
	Debug string
}

func (e *GoAwayError) Error() string {
	if e.Debug == "" {
		return fmt.Sprintf("hbone connection closed by peer: GOAWAY %v", e.Code)
	}
	return fmt.Sprintf("hbone connection closed by peer: GOAWAY %v: %s", e.Code, e.Debug)
}
