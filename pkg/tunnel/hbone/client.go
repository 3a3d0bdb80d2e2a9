package hbone

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Request describes one CONNECT.
type Request struct {
	// Authority is the original destination, ip:port; it becomes :authority.
	Authority netip.AddrPort
	// Forwarded is the Forwarded header value, e.g. `for="10.0.0.1"` or
	// `for="[fd00::1]";host=name.ns.svc.cluster.local`. Empty: not sent.
	Forwarded string
	// Header holds extra request headers (baggage, traceparent, ...).
	Header http.Header
	// EarlyData is sent on the stream right behind the request, in the
	// same TLS record, when both flow-control windows have room for it at
	// once, so the destination has the first bytes as soon as its tunnel
	// is up instead of one round trip later. Stream.EarlyDataSent says
	// whether it went; if not, the caller still owns it. At most
	// MaxEarlyData.
	EarlyData []byte
}

// MaxEarlyData bounds Request.EarlyData: one DATA frame of the smallest
// frame size a peer may advertise.
const MaxEarlyData = defaultMaxFrame

// connectionSpecific reports a field HTTP/2 forbids (RFC 9113 §8.2.2); a
// request carrying one is malformed.
func connectionSpecific(name, value string) bool {
	switch name {
	case "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade":
		return true
	case "te":
		return value != "trailers"
	}
	return false
}

// fields builds the request header block, rejecting what a peer would
// reject as malformed.
func (r *Request) fields() ([]hpack.HeaderField, error) {
	if !r.Authority.IsValid() || r.Authority.Port() == 0 {
		return nil, fmt.Errorf("invalid hbone authority %v: want ip:port", r.Authority)
	}
	fields := make([]hpack.HeaderField, 0, 3+len(r.Header))
	fields = append(fields,
		hpack.HeaderField{Name: ":method", Value: "CONNECT"},
		hpack.HeaderField{Name: ":authority", Value: r.Authority.String()})
	if r.Forwarded != "" {
		if !httpguts.ValidHeaderFieldValue(r.Forwarded) {
			return nil, fmt.Errorf("invalid forwarded header value %q", r.Forwarded)
		}
		fields = append(fields, hpack.HeaderField{Name: "forwarded", Value: r.Forwarded})
	}
	for k, vs := range r.Header {
		name := strings.ToLower(k)
		if !httpguts.ValidHeaderFieldName(name) || name == "host" || name == "forwarded" {
			return nil, fmt.Errorf("invalid hbone request header %q", k)
		}
		for _, v := range vs {
			if !httpguts.ValidHeaderFieldValue(v) || connectionSpecific(name, v) {
				return nil, fmt.Errorf("invalid value for hbone request header %q", k)
			}
			fields = append(fields, hpack.HeaderField{Name: name, Value: v})
		}
	}
	return fields, nil
}

// openStream sends the CONNECT headers on a stream slot the caller reserved
// (tryReserve), followed by early if both send windows have room for it now;
// sentEarly says whether they had. Stream ids must reach the wire in
// increasing order, so the id is taken under the write lock. If ctx ends
// before the write lock is free (a write blocked on a peer that reads
// nothing of ours), the slot is given back and the conn drained, so that
// new streams go to a new connection.
func (c *conn) openStream(ctx context.Context, fields []hpack.HeaderField, early []byte) (s *Stream, sentEarly bool, err error) {
	if err := c.lockWriteCtx(ctx); err != nil {
		c.mu.Lock()
		closeNow := c.releaseLocked(nil)
		c.mu.Unlock()
		if closeNow {
			c.closeDrained()
		}
		if errors.Is(err, context.DeadlineExceeded) {
			// Its whole time went waiting on a write: the peer reads
			// nothing. A caller that gave up says nothing of the conn.
			c.drain()
		}
		return nil, false, err
	}
	c.mu.Lock()
	if c.err != nil || c.goAway || c.nextID > maxStreamID {
		c.goAway = true
		closeNow := c.releaseLocked(nil)
		cerr := c.err
		c.mu.Unlock()
		c.unlockWrite()
		if closeNow {
			c.closeDrained()
		}
		if errors.Is(cerr, errEvicted) || errors.Is(cerr, ErrPoolClosed) {
			// Evicted (its pod went away) or the pool closed since the
			// slot was reserved: a retry would dial anew from a source
			// that may send nothing more.
			return nil, false, cerr
		}
		return nil, false, fmt.Errorf("%w: connection going away", errRetry)
	}
	s = newStream(c, c.nextID)
	c.nextID += 2
	s.sendWindow = c.peerInitWindow
	c.streams[s.id] = s
	n := int64(len(early))
	sentEarly = n > 0 && n <= s.sendWindow && n <= c.sendWindow
	if sentEarly {
		s.sendWindow -= n
		c.sendWindow -= n
	}
	c.mu.Unlock()
	err = c.writeHeadersLocked(s.id, fields, false)
	if err == nil && sentEarly {
		err = c.fr.WriteData(s.id, false, early)
	}
	if err == nil {
		err = c.bw.Flush()
	}
	c.unlockWrite()
	if err != nil {
		c.close(http2.ErrCodeNo, fmt.Errorf("write request: %w", err), false)
		return nil, false, fmt.Errorf("%w: %w", ErrConnClosed, err)
	}
	return s, sentEarly, nil
}

// roundTrip opens a stream, with early data if the windows have room for
// it now, and waits for the 200 that establishes the tunnel.
func (c *conn) roundTrip(ctx context.Context, fields []hpack.HeaderField, early []byte) (*Stream, error) {
	opened := time.Now().UnixNano()
	s, sentEarly, err := c.openStream(ctx, fields, early)
	if err != nil {
		return nil, err
	}
	select {
	case <-s.respc:
	case <-ctx.Done():
		s.Close()
		if errors.Is(ctx.Err(), context.DeadlineExceeded) && c.lastFrame.Load() < opened {
			// No answer in time and no stream frame since: the peer may
			// be gone without a word (a black hole never resets). New streams
			// go to a new connection; this one closes once its streams are
			// done. A peer still sending frames is only slow to answer
			// this stream (its app is), and keeps the connection.
			c.drain()
		}
		// Named: a dial or a handshake that timed out says so, and this
		// is the peer that took the CONNECT and never answered it.
		return nil, fmt.Errorf("no response to the CONNECT: %w", ctx.Err())
	}
	s.mu.Lock()
	got, status, reason, serr := s.gotResponse, s.status, s.reason, s.err
	s.mu.Unlock()
	if !got {
		s.Close()
		if serr == nil {
			serr = errors.New("stream closed before response")
		}
		return nil, serr
	}
	if status != http.StatusOK {
		if reason == "" {
			reason = s.readReason(ctx)
		}
		s.Close()
		return nil, &StatusError{Status: status, Reason: reason}
	}
	s.earlySent = sentEarly
	return s, nil
}

// EarlyDataSent reports whether the request's EarlyData went out with it.
func (s *Stream) EarlyDataSent() bool { return s.earlySent }

// readReason reads a short error body, bounded in size and time: it is only
// there to make the StatusError say why.
func (s *Stream) readReason(ctx context.Context) string {
	deadline := time.Now().Add(time.Second)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = s.SetReadDeadline(deadline)
	b, _ := io.ReadAll(io.LimitReader(s, 1<<10))
	return strings.TrimSpace(string(b))
}
