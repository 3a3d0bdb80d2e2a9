package dnsproxy

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"time"

	"github.com/redirector-mesh/redirector/pkg/workload"
)

// ServeConn serves DNS over TCP on conn, a connection client opened to
// port 53: queries framed by a two-byte length (RFC 1035 4.2.2), several
// per connection (RFC 7766), answered in order. It returns, closing conn,
// when the client closes it, ctx ends, no next query starts within
// Config.TCPIdleTimeout, a started one is not complete within it, a
// frame is shorter than a header or longer than MaxQueryLen, or an answer
// cannot be written within it: a slow or silent client holds the
// goroutine for one timeout at most. A connection over the
// Config.MaxConns* bounds is closed at once (counted), and one of the pod
// holding the most is closed for another pod's when the node's bound is
// full (see limiter).
func (p *Proxy) ServeConn(ctx context.Context, client *workload.Workload, conn net.Conn, dial Dialer) {
	defer conn.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	h, by, evicted := p.conns.take(podKey(client), cancel)
	if by != "" {
		p.m.refuse("conns_" + by)
		return
	}
	defer h.release()
	if evicted {
		p.m.evict("conns_node")
	}

	var size [2]byte
	query := make([]byte, MaxQueryLen)
	for ctx.Err() == nil {
		if err := conn.SetDeadline(time.Now().Add(p.cfg.TCPIdleTimeout)); err != nil {
			return
		}
		if _, err := io.ReadFull(conn, size[:]); err != nil {
			p.logRead(client, err)
			return
		}
		n := int(binary.BigEndian.Uint16(size[:]))
		switch {
		case n < headerLen:
			p.m.reject("short")
			return
		case n > MaxQueryLen:
			// Not read: closing is the cheapest answer to a frame this size.
			p.m.reject("oversized")
			return
		}
		if _, err := io.ReadFull(conn, query[:n]); err != nil {
			p.logRead(client, err)
			return
		}
		answer := p.Answer(ctx, client, "tcp", query[:n], dial)
		if answer == nil {
			continue
		}
		if err := conn.SetWriteDeadline(time.Now().Add(p.cfg.TCPIdleTimeout)); err != nil {
			return
		}
		frame := binary.BigEndian.AppendUint16(make([]byte, 0, 2+len(answer)), uint16(len(answer)))
		if _, err := conn.Write(append(frame, answer...)); err != nil {
			p.log.Debug("dns: tcp write failed", "client", clientName(client), "error", err)
			return
		}
	}
}

// logRead logs why reading a query ended, unless the client just closed.
func (p *Proxy) logRead(client *workload.Workload, err error) {
	if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
		return
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		p.log.Debug("dns: tcp client idle, closing", "client", clientName(client))
		return
	}
	p.log.Debug("dns: tcp read failed", "client", clientName(client), "error", err)
}

// clientName names client in logs.
func clientName(client *workload.Workload) string {
	if client == nil {
		return "unknown"
	}
	return client.String()
}
